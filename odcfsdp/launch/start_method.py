"""How ``spawn``'s workers are started ([bounded-spawn] in ``processes.py``).

CPU (gloo) workers are forked from a fork server (``multiprocessing``'s "forkserver",
Python 3.14's default on Linux) that imported torch and odcfsdp once per calling process:
a call then costs a fork instead of a rank's imports of torch and odcfsdp (most of a
multi-process test's time). A worker starts with the caller's current environment,
working directory and ``sys.path``, and imports ``fn``'s module (and a script's main
module) itself, as a spawned one does. NCCL workers are spawned: a process forked after
CUDA's driver was initialised (``torch.cuda.is_available()`` in a module the server would
import) cannot use CUDA, so nothing of the caller's is imported before their fork.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import threading
from typing import Callable


def worker_context(backend: str, fn: Callable):
    """The multiprocessing context for workers: a fork server that preloads odcfsdp for gloo, else spawn.

    The server also preloads ``fn``'s module when it is odcfsdp's (for ``python -m odcfsdp.train``, the
    odcfsdp modules that the caller imported): a worker then starts in a fraction of a second, the
    window in which a signal would end it with multiprocessing's bootstrap traceback.
    """
    if backend != "gloo" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # read when the server starts (the first call in this process); `import odcfsdp` alone imports nothing heavy
    name = fn.__module__
    if name == "__main__":  # `python -m odcfsdp.train`: workers run that module again (as __mp_main__), and
        # runpy warns if it is loaded already: preload what it imported of odcfsdp instead
        main = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", None)
        own = sorted(m for m in sys.modules if m.startswith("odcfsdp.") and m != main)
    else:
        own = [name] if name.startswith("odcfsdp.") else []
    ctx.set_forkserver_preload(["odcfsdp.sharding", "odcfsdp.optim", *own])
    return ctx


def start_helpers(ctx) -> None:
    """multiprocessing's resource tracker and fork server, started with SIGHUP ignored (the ranks reset it): a closed
    terminal signals the launcher's whole process group, and a server it ended would take the ranks with it
    ([launcher-link] 1) before the launcher passed the signal on. A SIGHUP in their few ms of start is lost."""
    from multiprocessing import forkserver, resource_tracker

    if threading.current_thread() is not threading.main_thread():  # no handler there, nothing forwarded (install)
        return
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        resource_tracker.ensure_running()
        if ctx.get_start_method() == "forkserver":
            forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous or signal.SIG_DFL)
