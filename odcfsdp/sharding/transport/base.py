"""The interface every transport implements: where rows live and how they move.

Design note [transport]
-----------------------
A transport owns, per group, this rank's *row* (what peers read: in the compute
dtype, or the fp32 master itself, [gather-masters] in ``group.py``) and, for trained
groups, this rank's *accumulator* row (fp32 by default, what peers add gradients
into). It moves data in exactly two shapes:

* ``gather(g, out)``: fill the parameter-major unsharded buffer ``out`` from the N
  rows of group ``g`` (see [layout] in ``layout.py``), cast to ``out``'s dtype where
  the rows are wider (rounding to nearest even, as publishing a row does).
* ``scatter_accumulate(g, grad)``: add each owner's segments of the parameter-major
  gradient buffer ``grad`` into that owner's accumulator row.

Collective transports need every rank to call these in the same order, so ranks
must run equal numbers of micro-batches; one-sided transports do not
(``TransportCaps.uneven_micro_batches``), and then the step protocol
([step-protocol]) is the only meeting point per minibatch. Meetings themselves go
through the ``ShardMesh`` ([mesh]), never through a transport.

A transport class states what it can do as data, its ``caps`` (``TransportCaps``),
and nothing else branches on which transport it is: the registry in
``transport/__init__.py`` derives the config choices, the ``auto`` choice, device
checks and the README table from them, the step protocol its rule on micro-batch
counts, and the HSDP policy whether a shard group may span hosts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from ..placement.layout import GroupLayout
from ..placement.mesh import ShardMesh


def moved_as_bytes(dtype: torch.dtype) -> bool:
    """Whether rows of ``dtype`` move as raw bytes: one-byte floating dtypes (a row format's, e.g. float8 rows,
    [row-format]), which gloo and the row kernels do not take; moving bytes needs no cast."""
    return dtype.is_floating_point and dtype.itemsize == 1


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte floating tensor viewed as ``uint8`` (the same bytes, ``moved_as_bytes``); any other as it is."""
    return t.view(torch.uint8) if moved_as_bytes(t.dtype) else t


@dataclass(frozen=True)
class TransportCaps:
    """What a transport can do (see [transport]); read by the registry, the step protocol and the HSDP policy.

    Attributes:
        devices: device types whose tensors it moves.
        uneven_micro_batches: ranks may run different numbers of gathers and pushes per
            minibatch (one-sided: nobody waits for a peer's call).
        spans_hosts: a shard group may span hosts (the one-sided transports reach one
            host's memory or NVLink peers only).
        remote_pushes: a push writes into the owners' accumulators itself (one-sided), so an
            owner's zeroing must come before every peer's next push ([streams] 5 in ``streams.py``);
            False where each owner adds its own reduced share.
        where: where it works (one line, for the docs).
        how: how it moves data (one line, for the docs).
    """

    devices: tuple[str, ...]
    uneven_micro_batches: bool
    spans_hosts: bool
    remote_pushes: bool
    where: str
    how: str


class Transport(ABC):
    """Storage for rows/accumulators plus the two data movements of a group."""

    #: short name used in configs and error messages.
    name: str = "abstract"
    #: what it can do; ``auto`` prefers, for each device type, the first registered one with uneven micro-batches.
    caps: TransportCaps

    def __init__(self, mesh: ShardMesh):
        self.mesh = mesh
        self.rank = mesh.rank
        self.world_size = mesh.world_size
        self.device = mesh.device
        self.layouts: list[GroupLayout] = []
        self.rows: list[torch.Tensor] = []
        self.accumulators: list[torch.Tensor | None] = []

    def setup(
        self, layouts: Sequence[GroupLayout], row_dtypes: torch.dtype | Sequence[torch.dtype],
        accum_dtypes: Sequence[torch.dtype], gather_dtype: torch.dtype | None = None
    ) -> None:
        """Allocate every group's row (in its ``row_dtypes`` entry, or all in one dtype) and accumulator (in its
        ``accum_dtypes`` entry, if trained); zeroed. ``gather_dtype``: the dtype gathers unpack into (when known,
        a transport that cannot cast rows into it refuses here rather than at the first gather)."""
        self.layouts = list(layouts)
        self.gather_dtype = gather_dtype
        self.row_dtypes = ([row_dtypes] * len(self.layouts) if isinstance(row_dtypes, torch.dtype)
                           else list(row_dtypes))
        self.accum_dtypes = list(accum_dtypes)
        self.rows, self.accumulators = self._allocate(self.layouts)

    @abstractmethod
    def _allocate(self, layouts: list[GroupLayout]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Return (rows, accumulators) for ``layouts``; accumulators are None for frozen groups."""

    @abstractmethod
    def gather(self, g: int, out: torch.Tensor) -> None:
        """Fill parameter-major ``out`` (length N*C) with group ``g``'s full values, cast to ``out``'s dtype."""

    @abstractmethod
    def scatter_accumulate(self, g: int, grad: torch.Tensor) -> None:
        """Add parameter-major ``grad`` (length N*C) into the owners' accumulator rows of group ``g``."""

    def quiesce(self) -> None:
        """Make every write this rank issued (pushes, row updates) complete and visible to its peers; the caller has
        ordered them all on the current stream (``CommStreams.pushes_done`` / ``rows_published``), and only that
        stream is waited for."""

    def close(self) -> None:
        """Release rows, accumulators and any shared resources."""
        self.rows, self.accumulators = [], []
