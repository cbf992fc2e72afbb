"""The ranks a model is sharded over and the collectives they meet with.

Design note [mesh]
------------------
Everything of odcfsdp's own that makes ranks *meet* (the step protocol's meetings,
barriers, set-up exchanges, whole-model gathers for checkpoints) goes through one
``ShardMesh`` (the gradient norm's all-reduce is DTensor's, in ``clip_grad_norm_``); transports only
move rows one-sidedly or, for ``collective``, through the same process group. A mesh is
one flat process group (the default one, a given ``process_group``, or a 1-D
``DeviceMesh``), or a 2-D replicate x shard ``DeviceMesh`` (HSDP, [hsdp]): then ``rank``,
``world_size`` and the collectives are the shard group's, ``replicate`` the group of this
shard's copies and ``everyone`` all ranks (the watchdog, checkpoints). Without ``torch.distributed`` initialised it is a single rank and every
collective is the identity.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

_fatal_handler: Callable[[str], None] | None = None


def set_fatal_handler(handler: Callable[[str], None] | None) -> None:
    """Route the watchdog's fatal report (one line) through ``handler`` instead of stderr.

    The watchdog ends the process with ``os._exit(1)`` after calling it (the main thread may be
    blocked inside a collective that no Python exception can interrupt); a launcher uses this to
    hand the line to its parent first.
    """
    global _fatal_handler
    _fatal_handler = handler


def _die(message: str) -> None:
    try:
        if _fatal_handler is not None:
            _fatal_handler(message)
        else:
            sys.stderr.write(f"\nerror: {message}\n")
            sys.stderr.flush()
    finally:
        os._exit(1)


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
        from datetime import timedelta

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
            try:
                self._store.add(self._keys[self._rank], 1)
                values = [int(v) for v in self._store.multi_get(self._keys)]
                unreachable_since = None
            except Exception as e:  # noqa: BLE001 - a store hiccup is retried; a store gone for good ends the run
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since > self._timeout_s and not self._stop.is_set():
                    self._give_up(f"the process group's store did not answer for {self._timeout_s:g} s "
                                  f"({type(e).__name__})")
                continue
            now = time.monotonic()
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
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if host == socket.gethostname() and state in ("T", "t"):
                    os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError, RuntimeError):
                pass

    def stop(self) -> None:
        """Stop beating; the thread then tells the peers not to watch this rank any more (-1)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


class RankGroup:
    """Rank, size and the rare collectives (set-up, the step, checkpoints) of one process group.

    Args:
        group: the process group (None: the default group, or one process if
            torch.distributed is not initialised).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.distributed = group is not None or dist.is_initialized()
        if self.distributed:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's ``rank``."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def barrier(self) -> None:
        """Wait for all ranks."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ranks (in place) and return it."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Stack every rank's copy of ``row`` into ``(N, len)``; for rare, whole-model work."""
        out = torch.empty(self.world_size * row.numel(), dtype=row.dtype, device=row.device)
        if self.world_size == 1:
            out.copy_(row.reshape(-1))
        else:
            all_gather_tensor(out, row.contiguous(), group=self.group)
        return out.view(self.world_size, -1)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]


class ShardMesh(RankGroup):
    """The ranks a model is sharded over (``rank``, ``world_size``, their collectives), its device,
    the replicas of hybrid sharding and the watchdog.

    Design note [hsdp]: a 2-D ``DeviceMesh`` ``(replicate, shard)`` shards parameters within each
    shard group (mesh dim 1: the one-sided transport, meetings, checkpoint shards) and replicates
    them across groups (mesh dim 0). Shard groups run the ODC protocol on their own; replicas
    exchange data in the sync ([step-protocol] 1) only: after the shard group's meeting, one small
    all-gather of each group's (meeting, minibatch, pushes, problem) across replicas, so that they
    agree on the minibatch and stop together if one group found a problem, then each trained
    group's fp32 accumulator row is summed over the replicas (one all-reduce per group), so every
    replica holds the same reduced gradient shards and takes the same step. A ``zero_grad`` pass
    that syncs and finds nothing costs only the small all-gather. Nothing crosses replicas
    between the first forward and that sync, and ranks may run different numbers of
    micro-batches in any replica; the watchdog's arrival at each meeting spans all ranks. Parameters are DTensors
    ``(Replicate(), Shard(0))`` on the 2-D mesh, as FSDP2's HSDP.

    Across nodes HSDP is the layout to run, not only the one that exists: one-sided gets and
    pushes move a copy of every remote shard per *rank*, g (GPUs per node) times the
    inter-node bytes of a NCCL ring, which enters each node once. For 8B on 2 x 8 GPUs over
    400 Gb/s per GPU (``benchmarks/multinode_cost_model.py``, ``results/cost_model/``) full
    sharding over such a path takes 0.71 s of InfiniBand per micro-batch against 0.31 s of
    compute for 2K tokens; HSDP moves nothing across nodes per micro-batch and 4 GiB per rank
    per minibatch (0.10 s at the step), for twice the sharded state (16.8 vs 8.4 GiB per GPU).

    Args:
        device: where this rank's rows and buffers live.
        process_group: the ranks to shard over (None: the default group, or one process
            if torch.distributed is not initialised).
        device_mesh: a ``DeviceMesh`` instead of ``process_group``: 1-D (full sharding over its
            ranks) or 2-D ``(replicate, shard)`` spanning the default group (hybrid sharding).
        timeout_s: how long a rank waits for the others: ``arrive`` names the ranks missing at a
            meeting after it, and the heartbeat ends the process naming a rank silent for it
            (0 or inf: no watchdog).
    """

    def __init__(self, device: torch.device, process_group: dist.ProcessGroup | None = None, device_mesh=None,
                 timeout_s: float = 300.0):
        replicate_group = None
        if device_mesh is not None:
            if process_group is not None:
                raise ValueError("pass either process_group= or mesh=, not both")
            if device_mesh.ndim == 1:
                process_group = device_mesh.get_group()
            elif device_mesh.ndim == 2:
                world = dist.get_world_size()
                if device_mesh.mesh.flatten().tolist() != list(range(world)):
                    raise ValueError(f"a 2-D mesh must be (replicate, shard) over ranks 0..{world - 1} in order "
                                     f"(init_device_mesh(device, (replicas, {world} // replicas))), got "
                                     f"{device_mesh.mesh.tolist()}")
                replicate_group, process_group = device_mesh.get_group(0), device_mesh.get_group(1)
            else:
                raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got a {device_mesh.ndim}-D mesh")
        super().__init__(process_group)
        self.device = device
        self.replicate = RankGroup(replicate_group) if replicate_group is not None else None
        self.replicas = self.replicate.world_size if self.replicate else 1  # copies of every shard
        self.replica = self.replicate.rank if self.replicate else 0  # which copy this rank holds
        self.everyone = RankGroup(None) if self.replicate else self  # every rank of the mesh
        self._device_mesh = device_mesh
        self.timeout_s = timeout_s
        self._arrivals = 0  # arrive() calls so far (the same sequence on every rank)
        self._store = None
        self._prefix = f"odcfsdp/arrive/{id(self)}"
        self._at = "before the first meeting"  # where this rank is, for the watchdog's report
        self._heartbeat: _Heartbeat | None = None
        who = self.everyone
        if who.world_size > 1:
            # One key prefix per mesh, agreed on by all its ranks (ids differ between processes).
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
            n = self._store.add("odcfsdp/meshes", 1 if who.rank == 0 else 0)
            self._prefix = who.broadcast_object(f"odcfsdp/arrive/{n}" if who.rank == 0 else None)
            if 0 < timeout_s < float("inf"):
                me = weakref.ref(self)
                self._heartbeat = _Heartbeat(self._store, self._prefix, who.rank, who.world_size, timeout_s,
                                             lambda: (me()._at if me() is not None else "closing"))
                self._stop_heartbeat = weakref.finalize(self, self._heartbeat.stop)

    def close(self) -> None:
        """Stop this rank's watchdog (the peers stop watching it); meetings after this are unguarded."""
        if self._heartbeat is not None:
            self._stop_heartbeat()
            self._heartbeat = None

    @property
    def device_mesh(self):
        """The ``DeviceMesh`` parameters are DTensors on (None without torch.distributed)."""
        if self._device_mesh is None and self.distributed:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_mesh = DeviceMesh.from_group(self.group or dist.group.WORLD, self.device.type)
        return self._device_mesh

    # -- the watchdog ------------------------------------------------------------------------------
    def arrive(self, what: str) -> None:
        """Wait until every rank has arrived here; after ``timeout_s`` raise naming the ranks that did not.

        Design note [watchdog]: a rank that stops (a hang, SIGSTOP, a dead GPU) would leave the
        others waiting forever in the next collective or one-sided wait. Two guards, both through
        the process group's key-value store (hosted by the launcher: torchrun's agent, or
        ``spawn``'s parent, so no rank's fate takes it down; under launchers whose rank 0 hosts
        it, a stopped rank 0 makes the store unreachable, which ends the others after
        ``timeout_s`` too, naming the store):

        1. Arrival: before each meeting every rank registers its arrival (one key per rank and
           meeting, a counter per meeting) and polls the counter; the survivors of a rank that is
           alive but never comes (stuck in a kernel, a loop) all time out at the same meeting and
           raise the same error, naming the missing ranks and ``what`` they were expected at.
           Costs a few store round trips per meeting.
        2. Liveness (``_Heartbeat``): a thread per rank beats once a second and watches the
           peers' beats; a peer silent for ``timeout_s`` is stopped, and the rank may then be
           blocked where no exception reaches (inside a collective, a one-sided wait), so the
           thread reports one line (``set_fatal_handler``) and ends the process, as NCCL's
           watchdog does. A rank paused longer than ``timeout_s`` (a breakpoint included) ends the run.
        """
        if self._store is None:
            return
        self._at = f"waiting at {what}"
        who = self.everyone  # HSDP: every replica's ranks (global ranks)
        seq = self._arrivals
        self._arrivals += 1
        key = f"{self._prefix}/{seq}"
        self._store.set(f"{key}/{who.rank}", "1")
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        arrived = self._store.add(key, 1)
        while arrived < who.world_size:
            if time.monotonic() > deadline:
                missing = [r for r in range(who.world_size) if not self._store.check([f"{key}/{r}"])]
                raise RuntimeError(
                    f"rank(s) {missing} did not reach {what} within {self.timeout_s:g} s (run.timeout_s / "
                    f"ODCShard(timeout=)); rank {who.rank} stops here")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
            arrived = self._store.add(key, 0)
        if seq >= 2:  # every rank is past meeting seq - 1, so nobody reads seq - 2's keys again
            old = f"{self._prefix}/{seq - 2}"
            if who.rank == 0:
                self._store.delete_key(old)
            self._store.delete_key(f"{old}/{who.rank}")
        self._at = f"past {what}"


def hybrid_mesh(replicas: int | None, device_type: str, one_sided: bool = True):
    """The ``DeviceMesh`` for ``replicas`` copies of the model ([hsdp]); None for full sharding or one process.

    ``replicas=None`` puts one shard group on each node (torchrun's ``LOCAL_WORLD_SIZE``).
    A shard group wider than a node needs a transport that reaches other hosts, which the
    one-sided ones (``shm``: one host's memory, ``nvshmem``: peer pointers) do not yet.
    """
    if not dist.is_initialized():
        return None
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    replicas = replicas or max(1, world // local)
    if world % replicas:
        raise ValueError(f"shard.replicas={replicas} must divide the world size {world}")
    shard = world // replicas
    if one_sided and shard > local:
        raise ValueError(
            f"a shard group of {shard} ranks spans nodes of {local}, and the one-sided transports reach only their "
            f"own node: use shard.replicas={world // local} (HSDP, one shard group per node) or shard.comm=collective")
    if replicas == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (replicas, shard), mesh_dim_names=("replicate", "shard"))


# torch >= 2.13 renamed the tensor collectives; keep working on older releases. Looked up at
# call time so that wrappers installed on torch.distributed (profilers, tests) see every call.
def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``all_gather_into_tensor`` under whichever name this torch has."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``reduce_scatter_tensor`` (sum) under whichever name this torch has."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, group=group)
