"""A spawned rank's link to the launcher that started it: the rank ends the moment the launcher does.

Design note [launcher-link]
---------------------------
A launcher killed with SIGKILL can clean nothing up, so its ranks must notice by themselves, at
once and quietly (else a rank runs on, may write a checkpoint no launcher will see, and prints
a C++ stack of the store it lost):

1. the kernel kills the rank when its parent dies (``PR_SET_PDEATHSIG``). Under
   ``multiprocessing``'s fork server the parent is the server, which outlives the launcher by a
   moment (it notices the launcher's pipe close), so that alone is late;
2. the launcher holds the only write end of a pipe whose read end every rank holds; nothing is
   ever written. A daemon thread of the rank blocks reading it: the read returns only when the
   launcher's end closes, which the kernel does as the launcher dies, however it dies;
3. the thread then ends its own process with SIGKILL: no handler, no exit hook, no traceback.
   The launcher closes its end itself only after every rank has exited (``spawn``'s last step).
"""

from __future__ import annotations

import os
import signal
import threading


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process when its parent dies, however it dies ([launcher-link] 1).

    Under a fork server the kernel's parent is the server, which exits as soon as the process
    that started it is gone (its end of a pipe closes): the chain holds.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's own cleanup is all there is
        return
    if os.getppid() == parent_pid:
        return
    try:  # forked by a server: the process that called spawn must still be there
        os.kill(parent_pid, 0)
    except ProcessLookupError:  # it died before the request took effect
        os._exit(1)


def watch_launcher(link) -> None:
    """Start the thread that ends this process at once when the launcher's end of ``link`` (a read-only
    ``multiprocessing`` connection, [launcher-link] 2) closes."""

    def watch() -> None:
        try:
            link.recv_bytes()  # the launcher never sends: this returns (or raises) only at its end
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGKILL)  # [launcher-link] 3

    threading.Thread(target=watch, name="odcfsdp-launcher-link", daemon=True).start()


__all__ = ["die_with_parent", "watch_launcher"]
