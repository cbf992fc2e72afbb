"""Start N local worker processes with torch.distributed initialised (tests, CPU runs).

``spawn(fn, world_size, *args)`` runs ``fn(*args)`` on every rank and returns the
ranks' results in rank order. A worker's exception is re-raised in the parent with
the worker's traceback, a worker that dies or hangs past ``timeout`` fails the call,
and the other workers are stopped either way, so a broken test never hangs pytest.

Design note [bounded-spawn]
---------------------------
A hang must cost one call, never a whole run of tests, and must say where every rank stood:

1. ``timeout`` bounds the call (default ``ODC_SPAWN_TIMEOUT_S``, else 90 s for NCCL ranks and
   300 s for CPU ranks, which share two cores in CI);
2. inside it, each rank's own guards fire first, at ``GUARD_FRACTION`` of it: the cap on every
   ``ODCShard`` watchdog (``set_wait_cap``: the meeting guard and the heartbeat), the process
   group's timeout (NCCL's watchdog) and the store's (these two at most ``PROCESS_GROUP_TIMEOUT_S``,
   as before there was a bound), each of which names where it stood;
3. a rank that has not delivered when the call fails (time out, a peer's error or death) is asked
   for its Python stack, every thread's (``faulthandler`` on SIGUSR1, into a file per rank; a rank
   killed by a fatal signal writes its own there), and the stacks are added to the error;
4. then it is killed, and joined with a bound: a process stuck in the GPU driver past SIGKILL is
   reported and left, not waited for;
5. the error names the rank that died first: a killed rank's peers fail at once at the closed
   connection, often before its death can be seen here, so a rank's failure waits up to a second
   for a peer's death and then names the dead rank and its signal before the survivor's error.
Workers die with the parent, however it dies, at once and quietly ([launcher-link] in
``launcher_link.py``): killing a ``python -m odcfsdp.train`` leaves no rank running.

Design note [private-store]
---------------------------
The ranks' key-value store (hosted here, see ``spawn``) is written by the ranks alone:

1. it listens on 127.0.0.1 only (a socket bound there is handed to ``TCPStore``; given a host name
   alone, its server would listen on every interface), since every rank ``spawn`` starts is local;
2. every key the ranks use lies under a per-call secret prefix (``PrefixStore``), 128 random bits
   that reach the ranks through ``multiprocessing``'s pipe, never a command line or the
   environment: another local process that connects cannot read, forge or delete the ranks' keys
   (the watchdog's arrivals and heartbeats, NCCL's bootstrap);
3. the watchdog signals only a sibling: a process with its own rank's parent (the launcher,
   ``spawn``'s fork server or ``torchrun``'s agent), never another pid read from a store
   (``_Heartbeat._kill_stopped`` in ``sharding/placement/watchdog.py``).
4. the ranks' own sockets listen on loopback too: gloo's and NCCL's bootstrap pick their interface
   from the host name, which on a cloud host resolves to the NIC, so every rank would accept
   connections there for the whole run. ``spawn`` sets ``GLOO_SOCKET_IFNAME`` and
   ``NCCL_SOCKET_IFNAME`` to the loopback interface in each rank (all its ranks are local).
Under ``torchrun`` the store is the agent's (its ``--rdzv-*`` settings decide where it listens).

How workers are started (a fork server for CPU ranks, spawn for NCCL ones) is ``start_method.py``.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import secrets
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..interrupts import Interrupted, install, restore
from .link import die_with_parent, watch_launcher
from .one_report import RankReport
from .tempdir import pin_multiprocessing_tempdir
from .start_method import start_helpers, worker_context
from .rank_outcomes import (collect_stacks, dead_peers, died, ended_by_signal, failure_report, stop_ranks,
                            stopped_by_signal, written_report)



#: the process group's backends on GPUs: NCCL for CUDA tensors, gloo for CPU ones (host gradients under offload).
CUDA_BACKENDS = "cuda:nccl,cpu:gloo"
#: the ranks' own guards fire at this fraction of spawn's timeout ([bounded-spawn] 2), the process group's and the
#: store's at most after PROCESS_GROUP_TIMEOUT_S (a long run's collectives are watched by ODCShard's watchdog).
GUARD_FRACTION, PROCESS_GROUP_TIMEOUT_S = 0.7, 120.0
#: a -W option for multiprocessing's resource tracker: a killed launcher's queue is cleaned up without a warning
TRACKER_QUIET = "ignore:resource_tracker:UserWarning"
_stack_file = None  # a worker's open stack file (faulthandler writes to its descriptor)


def default_spawn_timeout(backend: str) -> float:
    """``spawn``'s bound when none is given ([bounded-spawn] 1)."""
    preset = os.environ.get("ODC_SPAWN_TIMEOUT_S")
    if preset:
        return float(preset)
    return 90.0 if backend == "nccl" else 300.0


def init_torchrun(use_cuda: bool | None = None) -> torch.device:
    """Initialise torch.distributed in a process started by ``torchrun``; return this rank's device.

    CUDA (NCCL, one GPU per local rank) when available unless ``use_cuda`` is False;
    otherwise the CPU with gloo. On CUDA, CPU tensors have gloo (``cuda:nccl,cpu:gloo``, as
    FSDP2's CPU offload needs: ``clip_grad_norm_`` reduces host gradients, [offload]).
    """
    cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group(CUDA_BACKENDS, device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def loopback_interface() -> str | None:
    """The loopback network interface's name (``lo`` on Linux), or None where there is none."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo")), None)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forward_signals(signals: tuple[int, ...], procs, received: list[int], started: set[int],
                     sent: dict[int, set[int]]) -> list:
    """Pass ``signals`` on to ``procs`` while they run, appending each to ``received`` and what each rank got to
    ``sent``; a second SIGINT raises ``Interrupted(again=True)`` instead. A worker not yet ``started`` (still in
    multiprocessing's bootstrap, where a KeyboardInterrupt prints a traceback) gets SIGTERM, which ends it
    silently. Returns the (signal, previous handler) pairs to restore."""
    if not signals:
        return []

    def forward(sig, _frame):
        received.append(sig)
        if sig == signal.SIGINT and received.count(sig) > 1:  # Ctrl-C twice: end now (spawn kills the ranks)
            raise Interrupted(sig, again=True)
        for r, p in enumerate(procs):  # (a SIGHUP too: a starting worker may still ignore it, see start_helpers)
            if p.is_alive() and p.pid is not None:
                to = sig if r in started or sig not in (signal.SIGINT, signal.SIGHUP) else signal.SIGTERM
                sent.setdefault(r, set()).add(to)
                os.kill(p.pid, to)

    return install(forward, signals)


def _record_stacks(path: str | None) -> None:
    """Write every thread's Python stack to ``path`` on SIGUSR1 and on a fatal signal ([bounded-spawn] 3)."""
    global _stack_file
    if path is None:
        return
    _stack_file = open(path, "w")  # kept open for the process's life: faulthandler writes to its descriptor
    faulthandler.enable(file=_stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True, chain=False)


def loopback_store(world_size: int) -> dist.TCPStore:
    """The launcher's key-value store, listening on 127.0.0.1 only ([private-store] 1)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, 2 * world_size))
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())  # the store owns the descriptor from here


def _worker(fn, args, rank, world_size, port, backend, threads, results, parent_pid=None, env=None,
            own_group=False, guard_s=120.0, stack_path=None, secret="", link=None) -> None:
    if parent_pid is not None:
        die_with_parent(parent_pid)
    if link is not None:
        watch_launcher(link)
    _record_stacks(stack_path)
    report = RankReport(results, rank, stack_path)
    interrupted: list[int] = []  # a forwarded SIGINT while this rank's own handler is in place (start-up)
    if own_group:  # a terminal's Ctrl-C reaches the parent only, which passes it on once (see spawn)
        os.setpgid(0, 0)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the fork server's ignored SIGHUP (start_helpers) is not ours

        def on_sigint(sig, _frame):  # Python's own behaviour, remembered: see failure_report
            interrupted.append(sig)
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_sigint)
    try:
        if own_group:  # from here on a forwarded SIGINT is a KeyboardInterrupt reported below, not a traceback
            results.put((rank, None, b""))
        if env is not None:  # the caller's environment now, not the fork server's at its start
            os.environ.clear()
            os.environ.update(env)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                          ODCFSDP_STORE_HOST=f"the launcher (pid {parent_pid or os.getppid()})")
        os.environ["LOCAL_RANK"] = str(rank)
        loopback = loopback_interface()
        if loopback:  # every rank is local: nothing listens on the NIC ([private-store] 4)
            os.environ.update(GLOO_SOCKET_IFNAME=loopback, NCCL_SOCKET_IFNAME=loopback)
        torch.set_num_threads(threads)
        from ..sharding.placement.watchdog import set_fatal_handler, set_wait_cap

        set_wait_cap(guard_s)  # every ODCShard's watchdog fires before spawn's bound ([bounded-spawn] 2)

        def report_fatal(message: str) -> None:  # the watchdog's line, handed over before the process ends
            report(False, f"RuntimeError: {message}", last=True)

        set_fatal_handler(report_fatal)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # The parent hosts the store (see spawn): a stopped rank 0 must not take it down.
        waits = timedelta(seconds=min(guard_s, PROCESS_GROUP_TIMEOUT_S))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=waits)
        store = dist.PrefixStore(f"odcfsdp-{secret}", store)  # [private-store] 2
        dist.init_process_group(CUDA_BACKENDS if backend == "nccl" else backend, store=store, rank=rank,
                                world_size=world_size, timeout=waits)
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: no shared-memory handles outliving the worker
        report(True, buf.getvalue())
    except BaseException:  # noqa: BLE001 - report everything to the parent
        report(False, failure_report(traceback.format_exc(), bool(interrupted)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float | None = None,
    forward: tuple[int, ...] = (),
    received: list[int] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes; return results by rank.

    ``fn`` must be importable by name (a module-level function). Each worker uses
    ``max(1, cpus // world_size)`` intra-op threads so ranks do not oversubscribe.
    ``timeout`` bounds the call ([bounded-spawn]; None: ``default_spawn_timeout``); the ranks' own
    guards fire before it, and a failed call's error carries the Python stacks of the ranks that had
    not delivered.
    Signals in ``forward`` (e.g. SIGTERM, SIGHUP) received by this process while it waits are
    passed on to every worker instead of ending this process (called from the main thread; with
    SIGHUP, the fork server and resource tracker outlive a closed terminal: ``start_method.start_helpers``).
    With SIGINT among them the workers get their own process group, so that a terminal's Ctrl-C
    reaches them once, through this process, and a second Ctrl-C raises ``Interrupted`` here
    (the workers are killed). A worker that the forwarded signal ended (it was stopped before it could finish a
    step), or that failed only because such a worker went away, raises ``Interrupted`` too, not ``RuntimeError``.
    The signals forwarded are appended to ``received`` when the caller passes a list.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    timeout = default_spawn_timeout(backend) if timeout is None else timeout
    ctx = worker_context(backend, fn)
    pin_multiprocessing_tempdir()  # where the fork server's socket goes: a deep $TMPDIR is too long a path for it
    # The queue's semaphores are named ones, which multiprocessing's resource tracker removes if this process is
    # killed: it does, and warns about "leaked" semaphores; it starts with this process's -W options.
    if TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(TRACKER_QUIET)
    if signal.SIGHUP in forward:  # after the -W option: the tracker it starts takes it
        start_helpers(ctx)
    results = ctx.Queue()
    # The key-value store lives here, not in rank 0: the watchdog ([watchdog] in sharding/placement/watchdog.py)
    # keeps working whichever rank stops, as under torchrun, whose agent hosts it.
    store = loopback_store(world_size)
    port, secret = store.port, secrets.token_hex(16)  # [private-store]
    threads = max(1, (os.cpu_count() or 1) // world_size)
    stacks_dir = tempfile.TemporaryDirectory(prefix="odcfsdp-stacks-")
    link, link_end = ctx.Pipe(duplex=False)  # [launcher-link] 2: the ranks read link; only this process holds the end
    paths = [os.path.join(stacks_dir.name, f"rank{r}.txt") for r in range(world_size)]
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(fn, args, r, world_size, port, backend, threads, results, os.getpid(), dict(os.environ),
                          signal.SIGINT in forward, GUARD_FRACTION * timeout, paths[r], secret, link))
        for r in range(world_size)
    ]
    received = [] if received is None else received
    started: set[int] = set()  # workers past their bootstrap (own_group workers say so first)
    sent: dict[int, set[int]] = {}  # rank -> the signals forwarded to it
    forwarded = _forward_signals(forward, procs, received, started, sent)  # before starting: no window without it
    out: dict[int, Any] = {}
    try:
        for p in procs:
            if received:  # stopped while starting: start no more (the started ones got the signal)
                raise Interrupted(received[0])
            p.start()
        link.close()  # the ranks hold their copies
        deadline = time.monotonic() + timeout
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                # A rank's report is flushed before its process exits ([one-report]), so an exited rank with
                # nothing delivered after a full second of silence has died without a result...
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
                if dead and not results.empty():  # ...unless it wrote as that second ended: read that first
                    continue
                lost = next(((r, text) for r in dead if (text := written_report(paths[r]))), None)
                if lost is None:
                    if stopped_by_signal(procs, dead, sent):
                        raise Interrupted(received[0])
                    if dead:
                        raise RuntimeError(died(procs, dead))
                    if time.monotonic() > deadline:
                        late = sorted(set(range(world_size)) - set(out))
                        raise TimeoutError(f"ranks {late} did not finish in {timeout}s")
                    continue
                (rank, payload), ok = lost, False  # its failure, written before its queue lost it ([one-report])
            if ok is None:
                started.add(rank)
                continue
            if not ok and received and ended_by_signal(payload):
                raise Interrupted(received[0])
            if not ok:  # a real failure, even after a signal (e.g. the checkpoint a signal asks for could not be saved)
                after = f" after {signal.Signals(received[0]).name}" if received else ""
                dead = dead_peers(procs, out, rank)
                # a peer that died first is the cause: this rank only lost its connection to it
                report = f"{died(procs, dead) + '; then ' if dead else ''}rank {rank} failed{after}:\n{payload}"
                if stopped_by_signal(procs, dead, sent):  # and the forwarded signal ended that peer as it started
                    # (this rank was inside a C++ call, gloo's connect, where its own handler could not run first):
                    # an interrupt, with the report as a note
                    interrupted = Interrupted(received[0])
                    interrupted.add_note(report)
                    raise interrupted
                raise RuntimeError(report)
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    except (RuntimeError, TimeoutError) as e:  # [bounded-spawn] 3: where the others stood, before the kill
        stacks = collect_stacks(procs, paths, out)
        if stacks:  # a note on the error (pytest shows it; the CLI writes it to error.log), never the terminal
            e.add_note(stacks)
        raise
    finally:
        try:  # still forwarding while the workers exit: a second Ctrl-C here ends the wait (they die with us)
            stop_ranks(procs, out, world_size, paths)
        finally:
            restore(forwarded)
            stacks_dir.cleanup()
            link.close()  # a no-op where the ranks started; else a rank may still be sending for it
            link_end.close()  # every rank has exited (or was left for dead)
    return [out[r] for r in range(world_size)]


__all__ = ["default_spawn_timeout", "free_port", "init_torchrun", "spawn"]
