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

Queued a piece at a time instead, each once the last is done, the copies leave a small read at most one piece to
wait for. A helper thread does the waiting, so the host goes on with the finish and the next forward, and the
copies run under them:

1. **Hand over** (``start``, at the step's end). An event on the current stream after the step; the pieces are
   the entries cut into chunks of at most ``CHUNK_BYTES``.
2. **Trickle** (the thread). The side stream waits for the event; for each chunk: copy it on the side stream,
   record an event and wait for it (the thread waits, not the host); once an entry's last chunk is queued its
   device storage is freed (``record_stream``: the block is reused once its copies are done).
3. **Join** (``join``). Whatever reads the host copies or touches the entries again (``host_copy``, the copies
   back, a load, ``close``) waits for the thread first; an error in the thread is raised there.

The price: one thread wake-up between chunks (tens of microseconds against a chunk's milliseconds), and device
memory freed a tensor at a time as the copies go, not all at the step's end: torch counts the state's blocks as
allocated until the thread reaches them, into the next forward, so a fitted share ([park-fit]), which reads that
count, is refused with it for now.
"""

from __future__ import annotations

import atexit
import threading
from typing import Sequence

import torch

CHUNK_BYTES = 64 << 20  # a small read waits at most one such chunk's copy (about a millisecond over PCIe)


class CopyTrickle:
    """One device's copies out, a chunk at a time, on a helper thread ([park-trickle])."""

    def __init__(self, device: torch.device, side: torch.cuda.Stream):
        self.device, self.side = device, side
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        # a process that ends right after a step lets the copies finish before the interpreter goes (its daemon
        # threads are stopped after the exit handlers, wherever they are)
        atexit.register(self._finish_at_exit)

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
                for e in entries:
                    whole = not (e.local.is_contiguous() and e.host.is_contiguous())  # one copy: no flat views
                    src, dst = (e.local, e.host) if whole else (e.local.view(-1), e.host.view(-1))
                    step = src.numel() if whole else max(1, CHUNK_BYTES // max(1, src.element_size()))
                    for start in range(0, src.numel(), step):
                        dst[start:start + step].copy_(src[start:start + step], non_blocking=True)
                        if start + step < src.numel():  # the entry's last chunk is waited for after its free
                            self.side.record_event().synchronize()
                    e.local.record_stream(self.side)  # its block is reused once its copies are done
                    e.local.untyped_storage().resize_(0)
                    self.side.record_event().synchronize()
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread at join()
            self._error = exc

    def _finish_at_exit(self) -> None:
        if self._thread is not None:
            self._thread.join()

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
        """Join and drop the exit handler (the parking is closed)."""
        atexit.unregister(self._finish_at_exit)
        self.join()
