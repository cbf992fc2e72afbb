"""SIGINT / SIGTERM as exceptions and one-line exits (no torch: ``python -m odcfsdp.train`` installs these first).

``Interrupted`` is raised where a signal ends something that cannot stop cleanly after a
step: the command line before its ranks train, spawned ranks that died from it, a second
Ctrl-C. ``exit_during_imports`` is the handler of the few seconds in which the command line
imports torch and Hydra: nothing has started, so it prints its line and exits.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


class Interrupted(BaseException):
    """SIGINT / SIGTERM stopped a run before its ranks could finish a step (start-up), or a second Ctrl-C.

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
    """``stop``'s line on stderr, then end the process with its exit code at once."""
    print(stop.message(), file=sys.stderr, flush=True)
    os._exit(stop.exit_code)


def install(handler, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
            keep_ignored: bool = False) -> list[tuple[int, object]]:
    """``handler`` for ``signals``; returns the (signal, previous handler) pairs ``restore`` takes. With
    ``keep_ignored`` a signal this process ignores stays ignored (and is not in the pairs). Off the main thread,
    where Python cannot install handlers, nothing is installed and the pairs are empty."""
    if threading.current_thread() is not threading.main_thread():
        return []
    previous = []
    for sig in signals:
        if not (keep_ignored and signal.getsignal(sig) is signal.SIG_IGN):
            previous.append((sig, signal.signal(sig, handler)))
    return previous


def restore(previous: list[tuple[int, object]]) -> None:
    """Put back the handlers ``install`` replaced."""
    for sig, handler in previous:
        signal.signal(sig, handler)
