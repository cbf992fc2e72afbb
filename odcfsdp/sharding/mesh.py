"""The ranks a model is sharded over and the collectives they meet with.

Design note [mesh]
------------------
Everything of odcfsdp's own that makes ranks *meet* (the step protocol's meetings,
barriers, set-up exchanges, whole-model gathers for checkpoints) goes through one
``ShardMesh`` (the gradient norm's all-reduce is DTensor's, in ``clip_grad_norm_``); transports only
move rows one-sidedly or, for ``collective``, through the same process group. Today a
mesh is one flat process group (the default one, a given ``process_group``, or a 1-D
``DeviceMesh``); a 2-D replicate x shard mesh (HSDP) extends this class, not its
callers. Without ``torch.distributed`` initialised it is a single rank and every
collective is the identity.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


class ShardMesh:
    """Rank, world size, device and the meeting operations of the ranks a model is sharded over.

    Args:
        device: where this rank's rows and buffers live.
        process_group: the ranks to shard over (None: the default group, or one process
            if torch.distributed is not initialised).
        device_mesh: a 1-D ``DeviceMesh`` to shard over instead of ``process_group``.
        timeout_s: how long ``arrive`` waits for the other ranks before naming the missing ones.
    """

    def __init__(self, device: torch.device, process_group: dist.ProcessGroup | None = None, device_mesh=None,
                 timeout_s: float = 300.0):
        if device_mesh is not None:
            if process_group is not None:
                raise ValueError("pass either process_group= or mesh=, not both")
            if device_mesh.ndim != 1:
                raise ValueError(f"mesh must be 1-D (the ranks to shard over), got a {device_mesh.ndim}-D mesh; "
                                 "hybrid sharding over a 2-D mesh is not supported yet")
            process_group = device_mesh.get_group()
        self.device = device
        self.group = process_group
        self.distributed = process_group is not None or dist.is_initialized()
        if self.distributed:
            self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        else:
            self.rank, self.world_size = 0, 1
        self._device_mesh = device_mesh
        self.timeout_s = timeout_s
        self._arrivals = 0  # arrive() calls so far (the same sequence on every rank)
        self._store = None
        self._prefix = f"odcfsdp/arrive/{id(self)}"
        if self.world_size > 1:
            # One key prefix per mesh, agreed on by all ranks (ids differ between processes).
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
            n = self._store.add("odcfsdp/meshes", 1 if self.rank == 0 else 0)
            token = [f"odcfsdp/arrive/{n}"] if self.rank == 0 else [None]
            dist.broadcast_object_list(token, src=self.global_rank(0), group=self.group)
            self._prefix = token[0]

    @property
    def device_mesh(self):
        """The ``DeviceMesh`` parameters are DTensors on (None without torch.distributed)."""
        if self._device_mesh is None and self.distributed:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_mesh = DeviceMesh.from_group(self.group or dist.group.WORLD, self.device.type)
        return self._device_mesh

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this mesh's ``rank``."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    # -- the watchdog ------------------------------------------------------------------------------
    def arrive(self, what: str) -> None:
        """Wait until every rank has arrived here; after ``timeout_s`` raise naming the ranks that did not.

        Design note [watchdog]: a rank that stops (a hang, SIGSTOP, a dead GPU) would leave the
        others waiting forever in the next collective or one-sided wait. Before each meeting every
        rank registers its arrival in the process group's key-value store (one key per rank and
        meeting, a counter per meeting) and polls the counter; the survivors of a stopped rank all
        time out at the same meeting and raise the same error, naming the missing ranks and
        ``what`` they were expected at. Costs a few store round trips per meeting.
        """
        if self._store is None:
            return
        seq = self._arrivals
        self._arrivals += 1
        key = f"{self._prefix}/{seq}"
        self._store.set(f"{key}/{self.rank}", "1")
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        arrived = self._store.add(key, 1)
        while arrived < self.world_size:
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if not self._store.check([f"{key}/{r}"])]
                raise RuntimeError(
                    f"rank(s) {missing} did not reach {what} within {self.timeout_s:g} s (run.timeout_s / "
                    f"ODCShard(timeout=)); rank {self.rank} stops here")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
            arrived = self._store.add(key, 0)
        if seq >= 2:  # every rank is past meeting seq - 1, so nobody reads seq - 2's keys again
            old = f"{self._prefix}/{seq - 2}"
            if self.rank == 0:
                self._store.delete_key(old)
            self._store.delete_key(f"{old}/{self.rank}")

    # -- meeting operations: rare (set-up, the step, checkpoints) ------------------------------------
    def barrier(self) -> None:
        """Wait for all ranks."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over ranks (in place) and return it."""
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


# torch >= 2.13 renamed the tensor collectives; keep working on older releases. Looked up at
# call time so that wrappers installed on torch.distributed (profilers, tests) see every call.
def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``all_gather_into_tensor`` under whichever name this torch has."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``reduce_scatter_tensor`` (sum) under whichever name this torch has."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, group=group)
