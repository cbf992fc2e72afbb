"""The flat group layout: plain metadata that says where every parameter value lives.

Design note [layout]
--------------------
A *group* holds consecutive parameters p_1..p_k that share a dtype and a
``requires_grad`` flag, up to ``group_bytes`` of unsharded communication bytes (a
single larger parameter forms its own group). With N ranks:

1. Segment length ``c_i = ceil(numel_i / N)``, rounded up to a multiple of
   ``align`` elements so that every segment starts 16-byte aligned.
2. Row offset ``off_i = c_1 + ... + c_{i-1}``; row length ``C = sum_i c_i``.
3. Rank r's row ``R_r = concat_i pad(p_i.flatten())[r*c_i : (r+1)*c_i]``; padding is
   zero. This row is the only copy of those values that rank r keeps between uses.
4. The unsharded buffer ``U`` (length ``N*C``) is *parameter-major*: p_i lives
   contiguously at ``U[N*off_i : N*off_i + numel_i]``, so each parameter is a plain
   contiguous view, and that slice viewed as ``(N, c_i)`` has row r = rank r's
   segment. Gather is ``U_i[r, :] = R_r[off_i : off_i + c_i]`` for all r and i;
   scatter-accumulate is its transpose, ``A_r[off_i : off_i + c_i] += G_i[r, :]``.

With N = 1 the unsharded buffer and the row coincide element for element.
Everything here is metadata plus reference (torch) pack/unpack used by the
collective transport and by tests; the one-sided transports fuse the same index
map into their kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

ALIGN_BYTES = 16


def align_elems(dtype: torch.dtype) -> int:
    """Number of ``dtype`` elements in one 16-byte alignment unit (at least 1)."""
    return max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def segment_len(numel: int, world_size: int, dtypes: Sequence[torch.dtype]) -> int:
    """Segment length c_i: ceil(numel / N) rounded so a segment is 16-byte aligned in every dtype."""
    align = max(align_elems(d) for d in dtypes)
    return _round_up(max(1, math.ceil(numel / world_size)), align)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its group.

    Attributes:
        name: fully qualified parameter name (the first one if it is shared).
        shape: the parameter's shape.
        offset: start of the parameter's segment in every row (elements).
        seg: segment length ``c_i`` in elements (>= ceil(numel / N), aligned).
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    seg: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GroupLayout:
    """Metadata of one flat parameter group sharded over ``world_size`` ranks.

    Attributes:
        index: position of the group in the plan.
        world_size: number of ranks N.
        dtype: dtype of the original parameters.
        requires_grad: whether the group's parameters are trained.
        slots: the parameters, in row order.
        row_len: row length C in elements (a multiple of the alignment unit).
    """

    index: int
    world_size: int
    dtype: torch.dtype
    requires_grad: bool
    slots: tuple[ParamSlot, ...]
    row_len: int

    @property
    def unsharded_numel(self) -> int:
        """Length of the parameter-major unsharded buffer (N * C)."""
        return self.world_size * self.row_len

    def unsharded_range(self, i: int) -> tuple[int, int]:
        """[start, end) of parameter ``i``'s values in the unsharded buffer."""
        s = self.slots[i]
        start = self.world_size * s.offset
        return start, start + s.numel

    def param_view(self, unsharded: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i`` as a contiguous view into a parameter-major buffer."""
        start, end = self.unsharded_range(i)
        return unsharded[start:end].view(self.slots[i].shape)

    def unsharded_segments(self, unsharded: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter ``(N, c_i)`` views of a parameter-major buffer."""
        n = self.world_size
        return [unsharded[n * s.offset : n * (s.offset + s.seg)].view(n, s.seg) for s in self.slots]

    def row_segments(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter ``(N, c_i)`` views of a rank-major ``(N, C)`` row matrix."""
        rows = rows.view(self.world_size, self.row_len)
        return [rows[:, s.offset : s.offset + s.seg] for s in self.slots]

    def unpack(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank-major rows ``(N, C)`` -> parameter-major buffer (the gather copy-out)."""
        if out is None:
            out = torch.empty(self.unsharded_numel, dtype=rows.dtype, device=rows.device)
        torch._foreach_copy_(self.unsharded_segments(out), self.row_segments(rows))
        return out

    def pack(self, unsharded: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter-major buffer -> rank-major rows ``(N, C)`` (the scatter copy-in).

        ``out`` may have another dtype (gradients are packed into fp32).
        """
        if out is None:
            out = torch.empty(self.world_size, self.row_len, dtype=unsharded.dtype, device=unsharded.device)
        torch._foreach_copy_(self.row_segments(out), self.unsharded_segments(unsharded))
        return out.view(self.world_size, self.row_len)

    def shard_row(self, params: Sequence[torch.Tensor], rank: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s row built from full parameter values (zero padded)."""
        row = torch.zeros(self.row_len, dtype=dtype, device=params[0].device)
        for s, p in zip(self.slots, params, strict=True):
            flat = p.detach().reshape(-1)
            lo = min(rank * s.seg, s.numel)
            hi = min(lo + s.seg, s.numel)
            row[s.offset : s.offset + hi - lo].copy_(flat[lo:hi])
        return row


def plan_groups(
    named_params: Sequence[tuple[str, torch.Tensor]],
    world_size: int,
    group_bytes: int,
    comm_dtype: torch.dtype | None = None,
) -> list[GroupLayout]:
    """Plan flat groups over parameters in order.

    A group closes when adding the next parameter would pass ``group_bytes``
    (counted as unsharded bytes in ``comm_dtype``, padding included) or when the
    next parameter has another dtype or ``requires_grad`` flag. A parameter larger
    than ``group_bytes`` forms its own group.

    Args:
        named_params: (name, tensor) pairs, each parameter once, in order.
        world_size: number of ranks N (>= 1).
        group_bytes: byte budget per group (> 0).
        comm_dtype: dtype moved between ranks; defaults to each parameter's dtype.
    """
    if not isinstance(group_bytes, int) or isinstance(group_bytes, bool) or group_bytes <= 0:
        raise ValueError(f"group_bytes must be a positive int (bytes per group), got {group_bytes!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")

    groups: list[GroupLayout] = []
    pending: list[tuple[str, torch.Tensor]] = []

    def close() -> None:
        if not pending:
            return
        dtype = pending[0][1].dtype
        dtypes = (dtype, comm_dtype or dtype)
        slots, off = [], 0
        for name, p in pending:
            seg = segment_len(p.numel(), world_size, dtypes)
            slots.append(ParamSlot(name, tuple(p.shape), off, seg))
            off += seg
        groups.append(GroupLayout(len(groups), world_size, dtype, pending[0][1].requires_grad, tuple(slots), off))
        pending.clear()

    used = 0
    for name, p in named_params:
        cdt = comm_dtype or p.dtype
        itemsize = torch.empty((), dtype=cdt).element_size()
        nbytes = world_size * segment_len(p.numel(), world_size, (p.dtype, cdt)) * itemsize
        if pending:
            head = pending[0][1]
            if head.dtype != p.dtype or head.requires_grad != p.requires_grad or used + nbytes > group_bytes:
                close()
                used = 0
        pending.append((name, p))
        used += nbytes
    close()
    return groups
