"""A parked optimizer state's copies out, issued a piece at a time by a helper thread ([park-trickle]).

Design note [park-trickle]
--------------------------
A GPU moves device-to-host copies through its copy engine in the order they were queued, whichever stream queued
them. The parked state's copies out ([parking] 1), queued all at once after the step, S_p bytes taking S_p / B
seconds, then put every later device-to-host copy behind them: the finish's meeting reads its table back to the
host, a loop reads its loss and statistics, and each of those small reads waits until the whole state is out. The
host waits with it, and with the host the next forward's launches: the copies are added to the step, not hidden.
That is what a parked step's cost says (about both directions' copies where one was expected); ``park_bench``'s
read after the step measures the wait itself.

Queued a piece at a time instead, with at most ``IN_FLIGHT_BYTES`` queued and not yet done, the copies leave a small
read at most that much to wait for. A helper thread does the waiting, so the host goes on with the finish and the
next forward, and the copies run under them:

1. **Hand over** (``start``, at the step's end). An event on the current stream after the step; the pieces are
   the entries cut into chunks of at most ``CHUNK_BYTES`` (a non-contiguous entry is one piece, however large:
   AdamW's state is contiguous).
2. **Trickle** (the thread). The side stream waits for the event; each chunk is copied on the side stream and an
   event recorded after it; before the next is queued, the thread waits for the oldest events until what is in
   flight fits in ``IN_FLIGHT_BYTES`` (the thread waits, not the host; blocking events: it sleeps, it does not
   spin on a core the host's thread may need). Once an entry's last chunk is queued its device storage is freed
   (``record_stream``: the block is reused once its copies are done). Last, it waits for the last chunk.
3. **Join** (``join``). Whatever reads the host copies or touches the entries again (``host_copy``, the copies
   back, a load, ``close``, the fitted share's reading) waits for the thread first; an error in the thread is
   raised there.

Why several chunks in flight. The thread needs the interpreter's lock to queue a chunk, and the host's own
thread, busy queuing the next forward, hands it over only every switch interval (5 ms by default). One chunk in
flight (a millisecond over PCIe) left the link idle most of that time: on a 3B step (22 GiB of state) the peak
rose by 8 GiB, the state's blocks still held when the next forward's activations came. With the link busy
through the thread's waits the copies take about S_p / B, as when they were queued all at once (the peak was
parked-at-once's again), and a small read waits at most ``IN_FLIGHT_BYTES`` / B, about 5 ms.

The price: device memory freed a tensor at a time as the copies go, not all at the step's end: torch counts the
state's blocks as allocated until the thread reaches them (queued at once, ``record_stream`` hid them from that
count, not from the device). A fitted share ([park-fit]) reads them as part of its window's peak where they
coincide with it: they are device memory then, and its share must cover them.
"""

from __future__ import annotations

import atexit
import collections
import threading
import weakref
from typing import Sequence

import torch

CHUNK_BYTES = 64 << 20  # one copy; its event is the thread's unit of waiting
IN_FLIGHT_BYTES = 256 << 20  # what a small read may wait behind: about 5 ms over PCIe, a switch interval's copies


class CopyTrickle:
    """One device's copies out, a chunk at a time, on a helper thread ([park-trickle])."""

    def __init__(self, device: torch.device, side: torch.cuda.Stream):
        self.device, self.side = device, side
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        _RUNNING.add(self)

    def start(self, entries: Sequence) -> None:
        """Step 1: copy each entry's ``local`` into its ``host`` after the work queued so far on the current stream,
        then free the local storage; returns at once."""
        self.join()
        after = torch.cuda.current_stream(self.device).record_event()
        self._thread = threading.Thread(target=self._run, args=(list(entries), after), daemon=True,
                                        name="odcfsdp-park-copies")
        self._thread.start()

    def _run(self, entries: list, after: torch.cuda.Event) -> None:
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self.side):
                self.side.wait_event(after)
                flight: collections.deque[tuple[torch.cuda.Event, int]] = collections.deque()
                for e in entries:
                    for src, dst in _chunks(e.local, e.host):
                        while flight and sum(n for _, n in flight) + src.nbytes > IN_FLIGHT_BYTES:
                            flight.popleft()[0].synchronize()  # step 2: room for this chunk
                        dst.copy_(src, non_blocking=True)
                        flight.append((self._event(), src.nbytes))
                    e.local.record_stream(self.side)  # its block is reused once its copies are done
                    e.local.untyped_storage().resize_(0)
                self._event().synchronize()  # the last chunk
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread at join()
            self._error = exc

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(blocking=True)  # waited for asleep, not spinning
        event.record(self.side)
        return event

    def join(self) -> None:
        """Step 3: the copies are all issued and done; raises what the thread raised, at this call and every later
        one (the host copies are incomplete: the state is lost, the run must stop)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise RuntimeError("a parked optimizer state's copies to the host failed: its host copies are "
                               "incomplete; restart from a checkpoint") from self._error

    def close(self) -> None:
        """Join; nothing is left for the exit handler."""
        _RUNNING.discard(self)
        self.join()


# a process that ends right after a step lets the copies finish before the interpreter goes (its daemon threads are
# stopped after the exit handlers, wherever they are); held weakly: a dropped parking's trickle goes with it
_RUNNING: weakref.WeakSet[CopyTrickle] = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    for trickle in list(_RUNNING):
        if trickle._thread is not None:
            trickle._thread.join()


def _chunks(local: torch.Tensor, host: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) pieces of at most ``CHUNK_BYTES``; a non-contiguous pair is one piece (no flat
    views of it)."""
    if not (local.is_contiguous() and host.is_contiguous()):
        return [(local, host)]
    step = max(1, CHUNK_BYTES // max(1, local.element_size()))
    return list(zip(local.view(-1).split(step), host.view(-1).split(step)))
