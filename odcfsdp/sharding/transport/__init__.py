"""Transports: where rows live and how they move between ranks (see [transport])."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Transport
from .collective import CollectiveTransport
from .one_sided import OneSidedTransport
from .shm import ShmTransport

COMM_CHOICES = ("auto", "collective", "shm", "nvshmem")


def resolve_comm(comm: str, device: torch.device) -> str:
    """``auto`` -> ``nvshmem`` on CUDA, ``shm`` on CPU; other names are checked and returned."""
    if comm not in COMM_CHOICES:
        raise ValueError(f"comm={comm!r} is not a known transport; choose one of {COMM_CHOICES}")
    if comm == "auto":
        return "nvshmem" if device.type == "cuda" else "shm"
    return comm


def make_transport(
    comm: str, rank: int, world_size: int, device: torch.device, group: dist.ProcessGroup | None
) -> Transport:
    """Build the transport named ``comm`` (one of ``COMM_CHOICES``) for ``device``."""
    comm = resolve_comm(comm, device)
    if comm == "collective":
        return CollectiveTransport(rank, world_size, device, group)
    if comm == "shm":
        return ShmTransport(rank, world_size, device, group)
    from .nvshmem import NvshmemTransport  # CUDA-only dependencies load on demand

    return NvshmemTransport(rank, world_size, device, group)


__all__ = [
    "COMM_CHOICES", "CollectiveTransport", "OneSidedTransport", "ShmTransport", "Transport",
    "make_transport", "resolve_comm",
]
