"""Transports: where rows live and how they move between ranks (see [transport])."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Transport
from .collective import CollectiveTransport

COMM_CHOICES = ("collective",)


def make_transport(
    comm: str, rank: int, world_size: int, device: torch.device, group: dist.ProcessGroup | None
) -> Transport:
    """Build the transport named ``comm`` (one of ``COMM_CHOICES``)."""
    if comm == "collective":
        return CollectiveTransport(rank, world_size, device, group)
    raise ValueError(f"comm={comm!r} is not a known transport; choose one of {COMM_CHOICES}")


__all__ = ["COMM_CHOICES", "CollectiveTransport", "Transport", "make_transport"]
