"""Collective transport: all-gather / reduce-scatter through torch.distributed.

Works on any backend (gloo on CPU, NCCL on GPU) and is the baseline the one-sided
transports are measured against. Every rank must issue the same gathers and
pushes in the same order, so ranks must run equal numbers of micro-batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import GroupLayout
from .base import Transport

# torch >= 2.13 renamed the tensor collectives; keep working on older releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveTransport(Transport):
    """Rows in private memory; gather = all-gather + copy-out, push = copy-in + reduce-scatter."""

    name = "collective"
    one_sided = False

    def __init__(self, rank: int, world_size: int, device: torch.device, group: dist.ProcessGroup | None):
        super().__init__(rank, world_size, device)
        self.group = group

    def _allocate(self, layouts: list[GroupLayout]):
        rows = [torch.zeros(lay.row_len, dtype=self.comm_dtype, device=self.device) for lay in layouts]
        accs = [
            torch.zeros(lay.row_len, dtype=self.accum_dtype, device=self.device) if lay.requires_grad else None
            for lay in layouts
        ]
        return rows, accs

    def gather(self, g: int, out: torch.Tensor) -> None:
        lay, row = self.layouts[g], self.rows[g]
        if self.world_size == 1:
            out.copy_(row)  # with N = 1 the layouts coincide
            return
        staging = torch.empty(lay.unsharded_numel, dtype=row.dtype, device=row.device)
        _all_gather(staging, row, group=self.group)
        lay.unpack(staging, out=out)

    def scatter_accumulate(self, g: int, grad: torch.Tensor) -> None:
        lay, acc = self.layouts[g], self.accumulators[g]
        if acc is None:
            raise RuntimeError(f"group {g} holds frozen parameters and has no gradient accumulator")
        if self.world_size == 1:
            acc.add_(grad)
            return
        # Reduce in the accumulator dtype (fp32), as FSDP2's reduce_dtype=float32 does.
        staging = lay.pack(grad, out=torch.empty(lay.unsharded_numel, dtype=acc.dtype, device=acc.device))
        own = torch.empty_like(acc)
        _reduce_scatter(own, staging.view(-1), group=self.group)
        acc.add_(own)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.world_size * row.numel(), dtype=row.dtype, device=row.device)
        if self.world_size == 1:
            out.copy_(row)
        else:
            _all_gather(out, row.contiguous(), group=self.group)
        return out.view(self.world_size, -1)
