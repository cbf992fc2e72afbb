"""A rank's one report to the launcher, whichever of its threads sends it ([one-report]).

Design note [one-report]
------------------------
A rank sends ``spawn`` one report (``RankReport``), its result or its failure, from whichever thread is first: when a
peer stops, its main thread (an arrival wait) and its watchdog's heartbeat (``report_fatal``, then ``os._exit(1)``)
fail at the same moment. Two threads on one ``multiprocessing`` queue lose reports: a ``put`` racing the other's
``close()`` lands after the feeder thread's sentinel and is dropped; and ``join_thread()`` consumes the queue's exit
finalizer, so the main thread's exit (code 0) no longer waits for the feeder and ends the process before it wrote
("rank 1 exited with code 0 without a result"). So the report is sent under a lock and flushed (the feeder joined)
before the lock is let go; the watchdog keeps it until its ``os._exit(1)``, so a failed main thread cannot exit 0
meanwhile. A failure is first written to a file beside the rank's stacks (``report_path``): ``spawn`` names a rank
that died without delivering by it, as it does when its wait ended just before the report came.
"""

from __future__ import annotations

import threading

from .rank_outcomes import report_path


class RankReport:
    """This rank's one report to ``spawn``, from whichever thread sends first ([one-report]).

    Args:
        results: the queue ``spawn`` reads; ``rank``: this rank; ``stack_path``: its stack file (the report file
            goes beside it; None: none written).
    """

    def __init__(self, results, rank: int, stack_path: str | None):
        self._results, self._rank, self._stack_path = results, rank, stack_path
        self._lock, self._sent = threading.Lock(), False

    def __call__(self, ok: bool, payload, last: bool = False) -> None:
        """Send ``(rank, ok, payload)`` unless a report went already, and flush it; ``last``: the process ends next
        (the watchdog's ``os._exit(1)``), the lock is kept so that no other thread goes on to report or exit 0."""
        self._lock.acquire()
        try:
            if self._sent:
                return
            self._sent = True
            if not ok and self._stack_path is not None:  # before the queue: read by spawn if the queue loses it
                try:
                    with open(report_path(self._stack_path), "w") as f:
                        f.write(payload)
                except OSError:
                    pass
            self._results.put((self._rank, ok, payload))
            self._results.close()  # nothing follows this report
            self._results.join_thread()  # written to the pipe before any thread can end the process
        finally:
            if not last:
                self._lock.release()


__all__ = ["RankReport"]
