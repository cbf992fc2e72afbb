"""Collective transport: all-gather / reduce-scatter through torch.distributed.

Works on any backend (gloo on CPU, NCCL on GPU) and is the baseline the one-sided
transports are measured against. Every rank must issue the same gathers and
pushes in the same order, so ranks must run equal numbers of micro-batches.
"""

from __future__ import annotations

import torch

from ..placement.layout import GroupLayout
from ..placement.collectives import all_gather_tensor, reduce_scatter_tensor
from .base import Transport, TransportCaps, as_bytes


class CollectiveTransport(Transport):
    """Rows in private memory; gather = all-gather + copy-out, push = copy-in + reduce-scatter."""

    name = "collective"
    caps = TransportCaps(devices=("cuda", "cpu"), uneven_micro_batches=False, spans_hosts=True, remote_pushes=False,
                         where="any torch.distributed backend (NCCL, gloo)",
                         how="all-gather + copy-out / copy-in + reduce-scatter in the accumulators' dtype (fp32)")

    def _allocate(self, layouts: list[GroupLayout]):
        rows = [torch.zeros(lay.row_len, dtype=dtype, device=self.device)
                for lay, dtype in zip(layouts, self.row_dtypes)]
        accs = [
            torch.zeros(lay.row_len, dtype=dtype, device=self.device) if lay.requires_grad else None
            for lay, dtype in zip(layouts, self.accum_dtypes)
        ]
        return rows, accs

    def gather(self, g: int, out: torch.Tensor) -> None:
        lay, row = self.layouts[g], self.rows[g]
        if self.world_size == 1:
            out.copy_(row)  # with N = 1 the layouts coincide
            return
        row = row.to(out.dtype)  # rows wider than the compute dtype (masters) cross the wire already cast
        # float8 rows cross as bytes: gloo has no float8 dtype, and bytes need no cast ([float8-gather])
        row, out = as_bytes(row), as_bytes(out)
        staging = torch.empty(lay.unsharded_numel, dtype=row.dtype, device=row.device)
        all_gather_tensor(staging, row, group=self.mesh.group)
        lay.unpack(staging, out=out)

    def scatter_accumulate(self, g: int, grad: torch.Tensor) -> None:
        lay, acc = self.layouts[g], self.accumulators[g]
        if acc is None:
            raise RuntimeError(f"group {g} holds frozen parameters and has no gradient accumulator")
        if self.world_size == 1:
            acc.add_(grad.to(acc.dtype))  # rounded to the accumulator's dtype first, as every other push is
            return
        # Reduce in the accumulators' dtype (fp32, or a reduce_dtype [precision]), as FSDP2's reduce_dtype does.
        staging = lay.pack(grad, out=torch.empty(lay.unsharded_numel, dtype=acc.dtype, device=acc.device))
        own = torch.empty_like(acc)
        reduce_scatter_tensor(own, staging.view(-1), group=self.mesh.group)
        acc.add_(own)
