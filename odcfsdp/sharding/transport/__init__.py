"""Transports: where rows live and how they move between ranks (see [transport]).

The registry ``TRANSPORTS`` is the one list of transports, and ``capabilities`` the
one place their facts (``TransportCaps``) are read from outside a transport: config
choices (``COMM_CHOICES``), what ``comm="auto"`` picks, device checks, the rule that
some transports need equal micro-batch counts, whether a shard group may span hosts,
and the README's transport table.
"""

from __future__ import annotations

import torch

from ..placement.mesh import ShardMesh
from .base import Transport, TransportCaps
from .collective import CollectiveTransport
from .nvshmem import NvshmemTransport
from .one_sided import OneSidedTransport
from .shm import ShmTransport

#: every transport by name, in the order ``auto`` prefers them (one-sided first).
TRANSPORTS: dict[str, type[Transport]] = {t.name: t for t in (NvshmemTransport, ShmTransport, CollectiveTransport)}
COMM_CHOICES: tuple[str, ...] = ("auto", *TRANSPORTS)


def transport_class(comm: str, device_type: str | None = None) -> type[Transport]:
    """The transport ``comm`` names (``auto``: the first one-sided one for ``device_type``), checked against it."""
    if comm not in COMM_CHOICES:
        raise ValueError(f"comm={comm!r} is not a known transport; choose one of {COMM_CHOICES}")
    if comm == "auto":
        if device_type is None:
            raise ValueError("comm='auto' needs the device type to choose a transport")
        return next(t for t in TRANSPORTS.values() if t.caps.uneven_micro_batches and device_type in t.caps.devices)
    cls = TRANSPORTS[comm]
    if device_type is not None and device_type not in cls.caps.devices:
        fits = [t.name for t in TRANSPORTS.values() if device_type in t.caps.devices]
        raise ValueError(f"comm={comm!r} moves {' or '.join(cls.caps.devices)} tensors, the model is on {device_type}; "
                         f"use comm='auto' or one of {fits}")
    return cls


def resolve_comm(comm: str, device: torch.device) -> str:
    """The name of the transport ``comm`` stands for on ``device`` (``auto`` resolved)."""
    return transport_class(comm, device.type).name


def make_transport(comm: str, mesh: ShardMesh) -> Transport:
    """Build the transport named ``comm`` (one of ``COMM_CHOICES``) for ``mesh``'s device."""
    return transport_class(comm, mesh.device.type)(mesh)


def capabilities(comm: str, device_type: str | None = None) -> TransportCaps:
    """What the transport ``comm`` names can do (``auto``: the one it picks for ``device_type``, or, without a
    device type, the facts every ``auto`` choice shares: uneven micro-batch counts, one host)."""
    if comm == "auto" and device_type is None:
        device_type = "cpu"  # auto picks a one-sided, single-host transport on every device type: their facts agree
    return transport_class(comm, device_type).caps


def transport_table() -> str:
    """The README's table of transports (markdown), generated from the classes' facts."""
    auto = ", ".join(f"`{transport_class('auto', d).name}` on {d.upper()}" for d in ("cuda", "cpu"))
    rows = ["| `comm` | where | how | micro-batches per rank |", "|---|---|---|---|",
            f"| `\"auto\"` (default) | | {auto} | |"]
    for t in TRANSPORTS.values():
        c = t.caps
        rows.append(f"| `\"{t.name}\"` | {c.where} | {c.how} | "
                    f"{'any, zero included' if c.uneven_micro_batches else 'equal on every rank'} |")
    return "\n".join(rows)


__all__ = [
    "COMM_CHOICES", "CollectiveTransport", "NvshmemTransport", "OneSidedTransport", "ShmTransport", "TRANSPORTS",
    "Transport", "TransportCaps", "capabilities", "make_transport", "resolve_comm", "transport_class",
    "transport_table",
]
