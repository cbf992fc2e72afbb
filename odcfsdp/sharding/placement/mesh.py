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
shard's copies and ``everyone`` all ranks (the watchdog, checkpoints). Without
``torch.distributed`` initialised it is a single rank and every collective is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import RankGroup
from .hsdp import mesh_groups
from .watchdog import Watchdog


class ShardMesh(RankGroup):
    """The ranks a model is sharded over (``rank``, ``world_size``, their collectives), its device,
    the replicas of hybrid sharding ([hsdp] in ``hsdp.py``) and the watchdog ([watchdog] in ``watchdog.py``).

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
            process_group, replicate_group = mesh_groups(device_mesh)
        super().__init__(process_group)
        self.device = device
        self.replicate = RankGroup(replicate_group) if replicate_group is not None else None
        self.replicas = self.replicate.world_size if self.replicate else 1  # copies of every shard
        self.replica = self.replicate.rank if self.replicate else 0  # which copy this rank holds
        self.everyone = RankGroup(None) if self.replicate else self  # every rank of the mesh
        self._device_mesh = device_mesh
        self.watchdog = Watchdog(self.everyone, timeout_s)  # HSDP: every replica's ranks (global ranks)

    @property
    def timeout_s(self) -> float:
        """How long a rank waits for the others (the watchdog's)."""
        return self.watchdog.timeout_s

    def close(self) -> None:
        """Stop this rank's watchdog (the peers stop watching it); meetings after this are unguarded."""
        self.watchdog.close()

    @property
    def device_mesh(self):
        """The ``DeviceMesh`` parameters are DTensors on (None without torch.distributed)."""
        if self._device_mesh is None and self.distributed:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_mesh = DeviceMesh.from_group(self.group or dist.group.WORLD, self.device.type)
        return self._device_mesh

    def arrive(self, what: str) -> None:
        """Wait until every rank has arrived here; after ``timeout_s`` raise naming the ranks that did not.

        The arrival guard of [watchdog] (``watchdog.py``), over every rank of the mesh; a no-op on one rank.
        """
        self.watchdog.arrive(what)
