"""The watchdog: what ends a run, naming the rank, when a rank stops instead of leaving the others waiting forever.

Design note [watchdog]
----------------------
A rank that stops (a hang, SIGSTOP, a dead GPU) would leave the
others waiting forever in the next collective or one-sided wait. Two guards, both through
the process group's key-value store (hosted by the launcher: torchrun's agent, or
``spawn``'s parent, so no rank's fate takes it down; under launchers whose rank 0 hosts
it, a stopped rank 0 makes the store unreachable, which ends the others after
``timeout_s`` too, naming the store):

1. Arrival (``Watchdog.arrive``, called by ``ShardMesh.arrive``): before each meeting every
   rank registers its arrival (one key per rank and meeting, a counter per meeting); the rank
   whose count completes the meeting sets its ``all`` key, which the others wait for in the
   store (``Store.wait``: the store answers them the moment it is set, so nobody sleeps past the last
   arrival, which a poll with back-off did, by up to its 10 ms pause, every minibatch: ranks with uneven work
   arrive at the sync milliseconds apart). That wait runs on a thread and a store connection of its own, the
   rank's main thread on an event: signal handlers (Ctrl-C) run at once, and the process's store connection,
   which NCCL's watchdog also uses, is never held for a long-tailed rank's seconds. The survivors of a rank that is
   alive but never comes (stuck in a kernel, a loop) all time out at the same meeting and
   raise the same error, naming the missing ranks and ``what`` they were expected at.
   Costs two or three store round trips per meeting, and two or three deletions of an older meeting's keys
   (about 20 us each on one host), and a thread's start where the rank waits.
2. Liveness (``_Heartbeat``): a thread per rank beats once a second and watches the
   peers' beats; a peer silent for ``timeout_s`` is stopped, and the rank may then be
   blocked where no exception reaches (inside a collective, a one-sided wait), so the
   thread reports one line (``set_fatal_handler``) and ends the process, as NCCL's
   watchdog does. A rank paused longer than ``timeout_s`` (a breakpoint included) ends the run.
   A peer found stopped (SIGSTOP) is SIGKILLed first, since it acts on no other signal and its
   launcher would wait out a grace period, but only a sibling: a process of this rank's own
   parent (``stopped_sibling``), never any other pid a store names.
3. The store itself: a store call that fails, or answers only after ``timeout_s`` (its host, the
   launcher, was stopped), ends the rank naming the store's host (``store_host``), not as a rank
   missing at a meeting. A meeting whose ranks all set their keys is whole even if the store was
   too slow to count them before the deadline.

Each ``ShardMesh`` owns one ``Watchdog``, over all its ranks (with HSDP every replica's).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...torch_private import default_store

if TYPE_CHECKING:
    from .collectives import RankGroup

_fatal_handler: Callable[[str], None] | None = None
_wait_cap_s = float("inf")  # set by a launcher that bounds its ranks (set_wait_cap)
_FOREVER_S = 1e7  # an arrival wait with no bound (timeout_s inf), in the store's timedelta: 116 days


def set_fatal_handler(handler: Callable[[str], None] | None) -> None:
    """Route the watchdog's fatal report (one line) through ``handler`` instead of stderr.

    The watchdog ends the process with ``os._exit(1)`` after calling it (the main thread may be
    blocked inside a collective that no Python exception can interrupt); a launcher uses this to
    hand the line to its parent first.
    """
    global _fatal_handler
    _fatal_handler = handler


def set_wait_cap(seconds: float) -> None:
    """Bound every watchdog of this process to ``seconds``, whatever ``timeout_s`` it is given.

    A launcher that kills its ranks after some time (``odcfsdp.launch.spawn``) sets a cap below it, so that a
    rank stuck at a meeting raises, or its heartbeat ends it, naming where it stood, before the launcher's kill.
    """
    global _wait_cap_s
    _wait_cap_s = seconds


def _die(message: str) -> None:
    try:
        if _fatal_handler is not None:
            _fatal_handler(message)
        else:
            sys.stderr.write(f"\nerror: {message}\n")
            sys.stderr.flush()
    finally:
        os._exit(1)


def stopped_sibling(pid: int) -> bool:
    """Whether ``pid`` is a stopped process started by this process's own parent (the launcher): the only kind
    the watchdog may signal, whatever pid a store names ([private-store] 3 in ``odcfsdp/launch/processes.py``)."""
    if pid == os.getpid() or pid <= 1:
        return False
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] in ("T", "t") and int(fields[1]) == os.getppid()


def store_host() -> str:
    """Who hosts this process's store, for a report that it went silent: the launcher that said so
    (``ODCFSDP_STORE_HOST``, set by ``odcfsdp.launch.spawn``), torchrun's agent, or the address."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("ODCFSDP_STORE_HOST"):
        return os.environ["ODCFSDP_STORE_HOST"]
    return f"torchrun's agent ({where})" if "TORCHELASTIC_RUN_ID" in os.environ else f"the process serving {where}"


def store_silent(seconds: float, where: str) -> str:
    """The line for a store that did not answer for ``seconds``: the launcher hosting it is stopped or gone."""
    return (f"the process group's store did not answer for {seconds:.0f} s {where}: it lives in {store_host()}, "
            "which is stopped or gone")


class _Heartbeat:
    """A daemon thread that beats for this rank and ends the process when a peer's beat stops.

    See [watchdog]. Each period (at most 1 s) it adds 1 to this rank's counter in the store and
    reads every peer's; a counter unchanged for ``timeout_s`` means that rank is stopped (SIGSTOP,
    a dead host, a GIL held forever), wherever this rank's main thread waits for it. A rank that
    closes its mesh writes -1 and is no longer watched.
    """

    def __init__(self, store, prefix: str, rank: int, world_size: int, timeout_s: float,
                 where: Callable[[], str]):
        self._store = store.clone()  # its own connection: the main thread's calls may block
        self._keys = [f"{prefix}/beat/{r}" for r in range(world_size)]
        self._rank, self._timeout_s, self._where = rank, timeout_s, where
        self._prefix = prefix
        self._stop = threading.Event()
        self._store.set(f"{prefix}/pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self._store.add(self._keys[rank], 1)
        self._thread = threading.Thread(target=self._run, name="odcfsdp-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        period = min(1.0, self._timeout_s / 4)
        try:
            self._store.wait(self._keys, timedelta(seconds=self._timeout_s))
        except Exception:  # noqa: BLE001 - a rank that never beat: named below by its missing key
            if self._stop.is_set():
                return
            missing = [r for r, k in enumerate(self._keys) if not self._store.check([k])]
            self._give_up(f"rank(s) {missing} never started their watchdog within {self._timeout_s:g} s "
                          "(run.timeout_s / ODCShard(timeout=))")
        seen = {r: (None, time.monotonic()) for r in range(len(self._keys)) if r != self._rank}
        unreachable_since = None
        while not self._stop.wait(period):
            asked = time.monotonic()
            try:
                self._store.add(self._keys[self._rank], 1)
                values = [int(v) for v in self._store.multi_get(self._keys)]
                unreachable_since = None
            except Exception:  # noqa: BLE001 - a store hiccup is retried; a store gone for good ends the run
                unreachable_since = unreachable_since or asked
                if time.monotonic() - unreachable_since > self._timeout_s and not self._stop.is_set():
                    self._give_up(store_silent(time.monotonic() - unreachable_since, "to the heartbeat"))
                continue
            now = time.monotonic()
            if now - asked > self._timeout_s and not self._stop.is_set():  # it answered, after a stall (SIGSTOP)
                self._give_up(store_silent(now - asked, "to the heartbeat"))
            for r, (last, _) in list(seen.items()):
                if values[r] < 0:
                    del seen[r]  # closed its mesh
                elif values[r] != last:
                    seen[r] = (values[r], now)
            stale = sorted(r for r, (_, since) in seen.items() if now - since > self._timeout_s)
            if stale and not self._stop.is_set():
                self._kill_stopped(stale)
                self._give_up(f"rank(s) {stale} stopped responding (no sign of life for {self._timeout_s:g} s; "
                              "run.timeout_s / ODCShard(timeout=))")
        try:  # written here, after the last beat, so that no beat can turn it back into a count
            self._store.set(self._keys[self._rank], "-1")
        except Exception:  # noqa: BLE001 - the store may already be gone at exit
            pass

    def _give_up(self, problem: str) -> None:
        """Report ``problem`` in one line, with where this rank was, and end the process."""
        _die(f"{problem}; rank {self._rank} stops here, {self._where()}")

    def _kill_stopped(self, ranks: list[int]) -> None:
        """SIGKILL those of ``ranks`` that are stopped processes on this host.

        A stopped process acts on no signal but SIGKILL, so a launcher's SIGTERM would wait out its
        grace period (torchrun: 30 s) before the run ends; a peer on another host is left to its launcher.
        """
        for r in ranks:
            try:
                host, pid = self._store.get(f"{self._prefix}/pid/{r}").decode().split()
                if host == socket.gethostname() and stopped_sibling(int(pid)):
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError, RuntimeError):
                pass

    def stop(self) -> None:
        """Stop beating; the thread then tells the peers not to watch this rank any more (-1)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class Watchdog:
    """Both guards of [watchdog] for one mesh: the arrival barrier before each meeting and the heartbeat.

    Args:
        everyone: every rank of the mesh (with HSDP every replica's); its ranks agree here, collectively,
            on the store keys of this watchdog.
        timeout_s: how long a rank waits for the others: ``arrive`` names the ranks missing at a
            meeting after it, and the heartbeat ends the process naming a rank silent for it
            (0 or inf: no heartbeat); at most the process's cap (``set_wait_cap``).

    With one rank there is nothing to guard and ``arrive`` returns at once.
    """

    def __init__(self, everyone: RankGroup, timeout_s: float):
        self.timeout_s = timeout_s = min(timeout_s, _wait_cap_s)
        self._rank, self._world_size = everyone.rank, everyone.world_size  # global ranks
        self._arrivals = 0  # arrive() calls so far (the same sequence on every rank)
        self._store = None
        self._prefix = f"odcfsdp/arrive/{id(self)}"
        self._at = "before the first meeting"  # where this rank is, for the heartbeat's report
        self._heartbeat: _Heartbeat | None = None
        if everyone.world_size > 1:
            # One key prefix per mesh, agreed on by all its ranks (ids differ between processes).
            self._store = default_store()
            self._waiter = self._store.clone()  # the arrival wait's own connection (_wait_for_all)
            n = self._store.add("odcfsdp/meshes", 1 if everyone.rank == 0 else 0)
            self._prefix = everyone.broadcast_object(f"odcfsdp/arrive/{n}" if everyone.rank == 0 else None)
            if 0 < timeout_s < float("inf"):
                me = weakref.ref(self)
                self._heartbeat = _Heartbeat(self._store, self._prefix, everyone.rank, everyone.world_size,
                                             timeout_s, lambda: (me()._at if me() is not None else "closing"))
                self._stop_heartbeat = weakref.finalize(self, self._heartbeat.stop)

    def close(self) -> None:
        """Stop this rank's heartbeat (the peers stop watching it); meetings after this are unguarded."""
        if self._heartbeat is not None:
            self._stop_heartbeat()
            self._heartbeat = None

    def _wait_for_all(self, key: str, what: str) -> None:
        """Wait for meeting ``key``'s ``all`` key (set by the last rank to come), at most ``timeout_s``; then raise
        naming the ranks that did not come, or the store, if it failed or went silent rather than the ranks.

        The store's wait blocks inside C++, where no signal handler runs, and holds its connection: so it runs on a
        thread of its own, on a connection of its own (NCCL's watchdog and the rest of the process keep the
        default one), and this thread waits on an event, which Ctrl-C interrupts at once."""
        outcome: list[BaseException] = []
        done = threading.Event()

        def wait() -> None:
            try:
                self._waiter.wait([f"{key}/all"], timedelta(seconds=min(self.timeout_s, _FOREVER_S)))
            except Exception as e:  # noqa: BLE001 - c10d's DistStoreError: reported by the main thread
                outcome.append(e)
            finally:
                done.set()

        asked = time.monotonic()
        threading.Thread(target=wait, name="odcfsdp-arrival", daemon=True).start()
        if done.wait(None if self.timeout_s == float("inf") else self.timeout_s) and not outcome:
            return
        if outcome and time.monotonic() - asked < 0.9 * self.timeout_s:  # not a time-out: a closed socket, a store gone
            raise RuntimeError(f"{store_silent(time.monotonic() - asked, f'at {what}')}; rank {self._rank} "
                               f"stops here ({type(outcome[0]).__name__})")
        # timed out: the ranks that did not come, by their keys; a store gone silent raises here instead (ask)
        ask = self._asker(what)
        missing = [r for r in range(self._world_size) if not ask(self._store.check, [f"{key}/{r}"])]
        if missing:  # else all came, while the store was slow to count them: the meeting is whole
            raise RuntimeError(f"rank(s) {missing} did not reach {what} within {self.timeout_s:g} s "
                               f"(run.timeout_s / ODCShard(timeout=)); rank {self._rank} stops here")

    def _asker(self, what: str) -> Callable:
        """``ask(fn, *args)``: a store call that raises naming the store's host when the store fails, or answers
        only after ``timeout_s`` (its host was stopped), rather than as a missing rank or a C++ stack."""

        def ask(fn, *args):
            asked = time.monotonic()
            try:
                out = fn(*args)
            except RuntimeError as e:  # c10d's DistStoreError / DistNetworkError: its own timeout, a closed socket
                raise RuntimeError(f"{store_silent(time.monotonic() - asked, f'at {what}')}; rank {self._rank} "
                                   f"stops here ({type(e).__name__})") from None
            if time.monotonic() - asked > self.timeout_s:
                raise RuntimeError(f"{store_silent(time.monotonic() - asked, f'at {what}')}; rank {self._rank} "
                                   "stops here")
            return out

        return ask

    def arrive(self, what: str) -> None:
        """Wait until every rank has arrived here; after ``timeout_s`` raise naming the ranks that did not.

        The arrival guard of [watchdog]: one key per rank and meeting, a counter per meeting.
        """
        if self._store is None:
            return
        self._at = f"waiting at {what}"
        seq = self._arrivals
        self._arrivals += 1
        key = f"{self._prefix}/{seq}"
        ask = self._asker(what)
        ask(self._store.set, f"{key}/{self._rank}", "1")
        if ask(self._store.add, key, 1) == self._world_size:  # the last to come lets the others go
            ask(self._store.set, f"{key}/all", "1")
        else:
            self._wait_for_all(key, what)
        if seq >= 2:  # every rank is past meeting seq - 1, so nobody reads seq - 2's keys again
            old = f"{self._prefix}/{seq - 2}"
            if self._rank == 0:
                self._store.delete_key(old)
                self._store.delete_key(f"{old}/all")
            self._store.delete_key(f"{old}/{self._rank}")
        self._at = f"past {what}"
