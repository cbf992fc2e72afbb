"""The interface every transport implements: where rows live and how they move.

Design note [transport]
-----------------------
A transport owns, per group, this rank's *row* (``comm_dtype``, what peers read)
and, for trained groups, this rank's *accumulator* row (fp32, what peers add
gradients into). It moves data in exactly two shapes:

* ``gather(g, out)``: fill the parameter-major unsharded buffer ``out`` from the N
  rows of group ``g`` (see [layout] in ``layout.py``).
* ``scatter_accumulate(g, grad)``: add each owner's segments of the parameter-major
  gradient buffer ``grad`` into that owner's accumulator row.

Collective transports need every rank to call these in the same order, so ranks
must run equal numbers of micro-batches; one-sided transports (``one_sided``) do
not, and then ``finish_pushes`` + ``barrier`` at the optimizer step are the only
meeting point per minibatch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch
import torch.distributed as dist

from ..layout import GroupLayout


# torch >= 2.13 renamed the tensor collectives; keep working on older releases. Looked up at
# call time so that wrappers installed on torch.distributed (profilers, tests) see every call.
def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``all_gather_into_tensor`` under whichever name this torch has."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``reduce_scatter_tensor`` (sum) under whichever name this torch has."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, group=group)


class Transport(ABC):
    """Storage for rows/accumulators plus the two data movements of a group."""

    #: short name used in configs and error messages.
    name: str = "abstract"
    #: True if ranks may run different numbers of gathers/pushes per minibatch.
    one_sided: bool = False

    def __init__(self, rank: int, world_size: int, device: torch.device, group: dist.ProcessGroup | None):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.group = group
        self.layouts: list[GroupLayout] = []
        self.rows: list[torch.Tensor] = []
        self.accumulators: list[torch.Tensor | None] = []

    def setup(
        self, layouts: Sequence[GroupLayout], comm_dtype: torch.dtype, accum_dtype: torch.dtype
    ) -> None:
        """Allocate every group's row (and accumulator if trained); rows start zeroed."""
        self.layouts = list(layouts)
        self.comm_dtype = comm_dtype
        self.accum_dtype = accum_dtype
        self.rows, self.accumulators = self._allocate(self.layouts)

    @abstractmethod
    def _allocate(self, layouts: list[GroupLayout]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Return (rows, accumulators) for ``layouts``; accumulators are None for frozen groups."""

    @abstractmethod
    def gather(self, g: int, out: torch.Tensor) -> None:
        """Fill parameter-major ``out`` (length N*C, ``comm_dtype``) with group ``g``'s full values."""

    @abstractmethod
    def scatter_accumulate(self, g: int, grad: torch.Tensor) -> None:
        """Add parameter-major ``grad`` (length N*C) into the owners' accumulator rows of group ``g``."""

    def finish_pushes(self) -> None:
        """Make every push this rank issued complete and visible to its owner."""

    # The meeting operations: rare (set-up, the optimizer step), so torch.distributed serves all transports.
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
            out.copy_(row)
        else:
            all_gather_tensor(out, row.contiguous(), group=self.group)
        return out.view(self.world_size, -1)

    def close(self) -> None:
        """Release rows, accumulators and any shared resources."""
        self.rows, self.accumulators = [], []
