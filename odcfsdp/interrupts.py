"""SIGINT / SIGTERM / SIGHUP as exceptions and one-line exits (no torch: ``python -m odcfsdp.train`` installs these
first).

``Interrupted`` is raised where a signal ends something that cannot stop cleanly after a
step: the command line before its ranks train, spawned ranks that died from it, a second
Ctrl-C. ``exit_during_imports`` is the handler of the few seconds in which the command line
imports torch and Hydra: nothing has started, so it prints its line and exits.

SIGHUP (the terminal closed) stops a run as SIGTERM does (``STOP_SIGNALS``), except where the
process ignores it (``nohup``): then it stays ignored, and the launcher does not pass it on
(``stop_signals``). A terminal that hung up refuses every write (EIO), which would turn the
checkpoint the hang-up asks for into an error: ``leave_hung_up_terminal`` points stdout and
stderr at /dev/null first.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

#: the signals that stop a run: a scheduler's SIGTERM, Ctrl-C, a closed terminal's SIGHUP
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: what ``exit_now`` runs before ``os._exit`` (which skips ``finally`` and ``atexit``): a run's lock release
_before_exit_now: list = []


class Interrupted(BaseException):
    """SIGINT / SIGTERM / SIGHUP stopped a run before its ranks could finish a step (start-up), or a second Ctrl-C.

    A ``BaseException``, as ``KeyboardInterrupt`` is: nothing on the way (Hydra's job runner
    included) mistakes it for an error. ``exit_code`` is ``128 + signum``, as a shell reports a
    process that such a signal ended.
    """

    def __init__(self, signum: int, again: bool = False):
        super().__init__(signum, again)
        self.signum, self.again = signum, again
        self.exit_code = 128 + signum

    def __str__(self) -> str:
        return f"{'interrupted again' if self.again else 'interrupted'} ({signal.Signals(self.signum).name})"

    def message(self) -> str:
        """The one line the command line ends with."""
        return f"{self}: " + ("stopped at once: steps after the last checkpoint are lost (continue with "
                              "checkpoint.resume=auto)" if self.again else "during start-up, before training: "
                              "nothing to save")


def raise_interrupted(signum: int, _frame) -> None:
    """A signal handler: raise ``Interrupted`` in the main thread."""
    if signum == signal.SIGHUP:  # the line that follows must not fail on a closed terminal
        leave_hung_up_terminal()
    raise Interrupted(signum)


def exit_during_imports(signum: int, _frame) -> None:
    """A signal handler for while modules load: ``Interrupted``'s line on stderr, exit 128 + signum at once.

    ``os._exit``, not ``sys.exit``: nothing has started that needs cleaning up, and a library's bare
    ``except:`` around an import would swallow ``SystemExit`` (the run would go on).
    """
    exit_now(Interrupted(signum))


def exit_after_stop(signum: int, _frame) -> None:
    """A signal handler for a second signal after the ranks stopped and saved: nothing is left to clean up, so end
    here (even in the interpreter's exit handlers, where an exception would print a traceback)."""
    exit_now(Interrupted(signum, again=True))


def exit_now(stop: "Interrupted") -> None:
    """``stop``'s line on stderr, then end the process with its exit code at once (after the ``before_exit_now``
    callables: a run's lock is released, not left for the next run to take over)."""
    if stop.signum == signal.SIGHUP:
        leave_hung_up_terminal()
    for fn in list(_before_exit_now):
        try:
            fn()
        except Exception:  # noqa: BLE001 - exiting regardless: the next run takes a lock left behind over
            pass
    print(stop.message(), file=sys.stderr, flush=True)
    os._exit(stop.exit_code)


def before_exit_now(fn, add: bool = True) -> None:
    """Have ``exit_now`` call ``fn()`` before it ends the process (``add=False``: no longer)."""
    if add:
        _before_exit_now.append(fn)
    elif fn in _before_exit_now:
        _before_exit_now.remove(fn)


def leave_hung_up_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal that hung up: every write there fails (EIO),
    and a failed progress line must not fail the checkpoint that SIGHUP asks for. A zero-byte write tells: it
    succeeds on a live terminal, a pipe or a file, which keep their output."""
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError as e:
            if e.errno == errno.EIO:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


def stop_signals() -> tuple[int, ...]:
    """The ``STOP_SIGNALS`` a launcher passes on to its ranks: SIGHUP only where this process does not ignore it
    (under ``nohup`` the user asked the run to outlive its terminal)."""
    return tuple(s for s in STOP_SIGNALS if not (s == signal.SIGHUP and signal.getsignal(s) is signal.SIG_IGN))


def install(handler, signals: tuple[int, ...] = STOP_SIGNALS, keep_ignored: bool = False) -> list[tuple[int, object]]:
    """``handler`` for ``signals``; returns the (signal, previous handler) pairs ``restore`` takes. With
    ``keep_ignored`` a signal this process ignores stays ignored (and is not in the pairs); an ignored SIGHUP
    always does (``nohup``). Off the main thread, where Python cannot install handlers, nothing is installed and
    the pairs are empty."""
    if threading.current_thread() is not threading.main_thread():
        return []
    previous = []
    for sig in signals:
        ignored = signal.getsignal(sig) is signal.SIG_IGN
        if not (ignored and (keep_ignored or sig == signal.SIGHUP)):
            previous.append((sig, signal.signal(sig, handler)))
    return previous


def restore(previous: list[tuple[int, object]]) -> None:
    """Put back the handlers ``install`` replaced."""
    for sig, handler in previous:
        signal.signal(sig, handler)
