"""What ``spawn`` says about ranks that did not deliver a result, and how it ends them ([bounded-spawn] 3-5 in
``processes.py``): the rank that died, named first (by its own report where its queue lost it, [one-report]); every
pending rank's Python stack; the bounded stop."""

from __future__ import annotations

import os
import signal
import time
import warnings
from pathlib import Path

#: seconds a rank gets to write its stack, and a killed rank to exit ([bounded-spawn] 3-4).
DUMP_WAIT_S, KILL_WAIT_S = 3.0, 10.0


def died(procs, dead: list[int]) -> str:
    """The error's first words for ranks that ended without a result: each one's signal or exit code."""
    how = []
    for r in dead:
        code = procs[r].exitcode
        how.append(f"rank {r} was killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   and -code in signal.valid_signals() else f"rank {r} exited with code {code}")
    return ", ".join(how) + " without a result"


def dead_peers(procs, delivered: dict, failed: int, wait_s: float = 1.0) -> list[int]:
    """Ranks other than ``failed`` that ended without delivering. A rank's death closes its connections before its
    exit can be seen here, so its peers' "connection closed" errors may arrive first: wait up to ``wait_s`` for a
    death before blaming the rank that reported."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [r for r, p in enumerate(procs) if r != failed and r not in delivered and p.exitcode is not None
                and p.exitcode != 0]
        if dead or time.monotonic() > deadline or all(p.exitcode is not None for p in procs):
            return dead
        time.sleep(0.05)


def report_path(stack_path: str) -> str:
    """Where a rank writes its failure report before queueing it, beside its stack file ([one-report])."""
    return f"{stack_path}.report"


def written_report(stack_path: str) -> str:
    """The failure report a rank wrote (``report_path``), or "" where it wrote none."""
    try:
        return Path(report_path(stack_path)).read_text(errors="replace")
    except OSError:
        return ""


def failure_report(trace: str, interrupted: bool) -> str:
    """A rank's failure as it goes to the launcher: its traceback, and where a forwarded SIGINT had already raised
    KeyboardInterrupt in it (``interrupted``) while another error ends the trace, a last line saying so. An
    interrupt that strikes inside a library's own clean-up can be replaced by the error that clean-up raises
    (OmegaConf building a config: an AttributeError on a half-built node, its cause dropped): the rank still ended
    because of the signal, and ``ended_by_signal`` reads it so."""
    if interrupted and not ended_by_signal(trace):
        trace += "KeyboardInterrupt (a forwarded SIGINT, replaced by the error above while it unwound)\n"
    return trace


def ended_by_signal(payload: str) -> bool:
    """Whether a rank's failure traceback ends in the interrupt a forwarded signal raises, not in an error."""
    last = payload.strip().splitlines()[-1] if payload.strip() else ""
    return last.startswith(("KeyboardInterrupt", "odcfsdp.interrupts.Interrupted", "Interrupted"))


def stopped_by_signal(procs, dead: list[int], sent: dict[int, set[int]]) -> bool:
    """Whether the ranks in ``dead`` (some, all exited) all ended by a signal the launcher forwarded to them
    (``sent``: rank -> the signals it got, SIGTERM in place of SIGINT or SIGHUP for a rank still in its bootstrap)."""
    return bool(dead) and all(-procs[r].exitcode in sent.get(r, ()) for r in dead)


def collect_stacks(procs, paths: list[str], delivered: dict) -> str:
    """Every rank that has not delivered a result: its Python stack, asked for with SIGUSR1 where it still
    runs, read from its stack file ([bounded-spawn] 3). Empty when there is nothing to show."""
    pending = [r for r in range(len(procs)) if r not in delivered and procs[r].pid is not None]
    asked = [r for r in pending if procs[r].is_alive()]
    for r in asked:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if asked:
        time.sleep(DUMP_WAIT_S)
    parts = []
    for r in pending:
        text = Path(paths[r]).read_text(errors="replace").strip() if Path(paths[r]).exists() else ""
        state = "still running" if procs[r].is_alive() else f"exited with code {procs[r].exitcode}"
        parts.append(f"--- rank {r} ({state}): Python stacks ---\n{text or '(none written)'}")
    return "\n".join(parts)


def stop_ranks(procs, delivered: dict, world_size: int, paths: list[str]) -> None:
    """Join the workers; kill those still alive, then join with a bound ([bounded-spawn] 4)."""
    for r, p in enumerate(procs):
        if p.pid is None:  # never started
            continue
        p.join(timeout=KILL_WAIT_S if len(delivered) == world_size else 0.5)
        if p.is_alive() and len(delivered) == world_size:  # returned its result, then stuck on its way out
            warnings.warn(f"rank {r} delivered its result but did not exit in {KILL_WAIT_S:g} s; killed. "
                          f"{collect_stacks(procs, paths, {})}", RuntimeWarning, stacklevel=3)
        if p.is_alive():
            p.kill()
            p.join(timeout=KILL_WAIT_S)
        if p.is_alive():
            warnings.warn(f"rank {r} (pid {p.pid}) is still alive {KILL_WAIT_S:g} s after SIGKILL (stuck in a "
                          "driver call?); left behind", RuntimeWarning, stacklevel=3)


__all__ = ["DUMP_WAIT_S", "KILL_WAIT_S", "collect_stacks", "dead_peers", "died", "ended_by_signal", "report_path",
           "stop_ranks", "stopped_by_signal", "written_report"]
