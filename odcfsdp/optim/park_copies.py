"""The copies between a parked optimizer state's device tensors and their host buffers ([parking] 1-3).

One object per parking: a side stream per CUDA device (the copies run there, after the work the current stream has
queued), the helper threads that queue the copies out a chunk at a time ([park-trickle] in ``copy_trickle.py``), and
the event after the last copies out queued at once. ``ParkedOptimizerState`` decides what moves and when; this
moves it. On CPU the copies are plain host copies on the caller's thread.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Protocol, Sequence

import torch

from ..torch_private import phase_range
from .copy_trickle import CopyTrickle


class Entry(Protocol):
    """A parked state tensor's device side (``local``, its storage emptied while parked) and host copy."""

    local: torch.Tensor
    host: torch.Tensor


class ParkCopies:
    """Each entry's copies out (host from device, the device storage freed) and back (device from host, into
    storage the caller allocated), per device.

    Args:
        trickle: on CUDA, a helper thread queues the copies out a chunk at a time ([park-trickle]); False: all at
            once after the work queued so far.
    """

    def __init__(self, trickle: bool = True):
        self.trickle = trickle
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._trickles: dict[torch.device, CopyTrickle] = {}
        self._copying_out: dict[torch.device, torch.cuda.Event] = {}  # after the last copies out, per device

    def out(self, entries: Sequence[Entry]) -> None:
        """Copy each entry's device tensor into its host copy and free its device storage as soon as its copy is
        queued: the allocator reuses each block once its own copy is done."""
        with phase_range("park_copies_out"):
            self._per_device(entries, back=False)

    def back(self, entries: Sequence[Entry]) -> None:
        """Copy each entry's host copy into its device tensor (its storage allocated by the caller, on the current
        stream); ``current_waits`` makes the current stream wait for them."""
        with phase_range("park_copies_back"):
            self._per_device(entries, back=True)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _per_device(self, entries: Sequence[Entry], back: bool) -> None:
        for device in {e.local.device for e in entries}:
            mine = [e for e in entries if e.local.device == device]
            side = self._side_stream(device) if device.type == "cuda" else None
            if side is not None and not back and self.trickle:  # [park-trickle]: a helper thread queues them
                if device not in self._trickles:
                    self._trickles[device] = CopyTrickle(device, side)
                self._trickles[device].start(mine)
                continue
            if side is not None:  # the step's results; the blocks' earlier users
                side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                for e in mine:
                    (e.local if back else e.host).copy_(e.host if back else e.local, non_blocking=side is not None)
                    if not back:
                        if side is not None:
                            e.local.record_stream(side)  # its block is reused once this copy is done
                        e.local.untyped_storage().resize_(0)
                if side is not None and not back:  # what a reader of the host copies waits for (host_ready); the
                    self._copying_out[device] = side.record_event()  # side stream runs in order: the last one

    def wait_out(self) -> None:
        """With ``trickle``: wait until the helper threads have queued the last copies out and those are done, their
        device storage freed ([park-trickle] 3). Without, nothing waits here: ``out`` queued them all and freed the
        storage itself. What touches the entries or their host copies again (the copies back, a reader of the host
        copies) calls it first: every way back to a resident state passes through the copies back."""
        for trickle in self._trickles.values():
            trickle.join()

    def host_ready(self) -> None:
        """The last copies out are done: the host copies hold the device values."""
        self.wait_out()
        while self._copying_out:  # queued at once, they run on the side stream after the step: their host bytes
            self._copying_out.popitem()[1].synchronize()

    def current_waits(self, devices: Iterable[torch.device]) -> None:
        """Each device's current stream waits for the copies queued on its side stream (the copies back)."""
        for device in self._streams.keys() & set(devices):
            torch.cuda.current_stream(device).wait_stream(self._streams[device])

    def synchronize(self, devices: Iterable[torch.device]) -> None:
        """The host waits for the copies queued on each device's side stream."""
        for device in self._streams.keys() & set(devices):
            self._streams[device].synchronize()

    def close(self) -> None:
        """Join the helper threads and drop their exit handler."""
        for trickle in self._trickles.values():
            trickle.close()
