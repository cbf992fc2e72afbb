"""Hybrid sharding (HSDP): how a 2-D ``(replicate, shard)`` ``DeviceMesh`` lays the ranks out, and which one to build.

Design note [hsdp]
------------------
A 2-D ``DeviceMesh`` ``(replicate, shard)`` shards parameters within each
shard group (mesh dim 1: the one-sided transport, meetings, checkpoint shards) and replicates
them across groups (mesh dim 0). Shard groups run the ODC protocol on their own; replicas
exchange data in the sync ([step-protocol] 1) only: after the shard group's meeting, one small
all-gather of each group's (meeting, minibatch, pushes, problem) across replicas, so that they
agree on the minibatch and stop together if one group found a problem, then each trained
group's fp32 accumulator row is summed over the replicas (one all-reduce per group), then divided
by the gradient divide factor ([lifecycle] 8: by default shard ranks x replicas, FSDP2's mean), so every
replica holds the same reduced gradient shards and takes the same step. A ``zero_grad`` pass
that syncs and finds nothing costs only the small all-gather. Nothing crosses replicas
between the first forward and that sync, and ranks may run different numbers of
micro-batches in any replica; the watchdog's arrival at each meeting spans all ranks. Parameters are DTensors
``(Replicate(), Shard(0))`` on the 2-D mesh, as FSDP2's HSDP.

Across nodes HSDP is the layout to run, not only the one that exists: one-sided gets and
pushes move a copy of every remote shard per *rank*, g (GPUs per node) times the
inter-node bytes of a NCCL ring, which enters each node once, and each micro-batch pays them.
HSDP moves nothing across nodes per micro-batch and one gradient all-reduce per minibatch, for
twice the sharded state. The cost model's figures for 8B on 2 x 8 GPUs are in docs/design.md
(Hybrid sharding; ``benchmarks/multinode_cost_model.py``, ``results/cost_model/``).
"""

from __future__ import annotations

import os

import torch.distributed as dist


class MeshError(ValueError, AssertionError):
    """A mesh ODC cannot shard over. Also an ``AssertionError``, the type FSDP2 raises for a 2-D mesh without
    dimension names, so code written against FSDP2's contract catches it alike."""


def mesh_groups(device_mesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """The shard group and the replicate group (None for a 1-D mesh: full sharding) of ``device_mesh``.

    A 2-D mesh must be ``(replicate, shard)`` over the default group's ranks in order.
    """
    if device_mesh.ndim == 1:
        return device_mesh.get_group(), None
    if device_mesh.ndim == 2:
        if device_mesh.mesh_dim_names is None:  # FSDP2 asserts the same (its error type too: see MeshError)
            raise MeshError("a 2-D mesh (HSDP) needs mesh_dim_names, as FSDP2's: init_device_mesh(device, (replicas, "
                            "shards), mesh_dim_names=('replicate', 'shard'))")
        world = dist.get_world_size()
        if device_mesh.mesh.flatten().tolist() != list(range(world)):
            raise ValueError(f"a 2-D mesh must be (replicate, shard) over ranks 0..{world - 1} in order "
                             f"(init_device_mesh(device, (replicas, {world} // replicas))), got "
                             f"{device_mesh.mesh.tolist()}")
        return device_mesh.get_group(1), device_mesh.get_group(0)
    raise ValueError(f"mesh must be 1-D (shard) or 2-D (replicate, shard), got a {device_mesh.ndim}-D mesh")


def hybrid_mesh(replicas: int | None, device_type: str, *, spans_hosts: bool = False):
    """The ``DeviceMesh`` for ``replicas`` copies of the model ([hsdp]); None for full sharding or one process.

    ``replicas=None`` puts one shard group on each node (torchrun's ``LOCAL_WORLD_SIZE``).
    A shard group wider than a node needs a transport that reaches other hosts
    (``spans_hosts``, its ``TransportCaps``), which the one-sided ones (``shm``: one host's
    memory, ``nvshmem``: peer pointers) do not yet.
    """
    if not dist.is_initialized():
        return None
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    replicas = replicas or max(1, world // local)
    if world % replicas:
        raise ValueError(f"shard.replicas={replicas} must divide the world size {world}")
    shard = world // replicas
    if not spans_hosts and shard > local:
        raise ValueError(
            f"a shard group of {shard} ranks spans nodes of {local}, and the one-sided transports reach only their "
            f"own node: use shard.replicas={world // local} (HSDP, one shard group per node) or shard.comm=collective")
    if replicas == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (replicas, shard), mesh_dim_names=("replicate", "shard"))
