"""The flat group layout: plain metadata that says where every parameter value lives.

Design note [layout]
--------------------
A *group* holds consecutive parameters p_1..p_k that share a dtype, a
``requires_grad`` flag and a unit (a ``units`` or ``fully_shard`` module): all of a
unit's (one group per unit, FSDP2's one param group per ``fully_shard`` module), and
outside units up to ``group_bytes`` of unsharded communication bytes (a single larger
parameter forms its own group). Parameters are sharded on dim 0, as
FSDP2 shards them, so that a rank's piece of a parameter is a tensor of the
parameter's own shape with fewer rows (its ``Shard(0)`` DTensor shard). With N ranks
and parameter i of shape ``(d_i, ...)`` with ``w_i`` elements per dim-0 row:

1. Shard ``s_i = ceil(d_i / N) * w_i`` elements: rank r holds rows
   ``[r*ceil(d_i/N), min((r+1)*ceil(d_i/N), d_i))`` (``torch.chunk``'s split: the last
   ranks may hold fewer rows, or none).
2. Segment length ``c_i = s_i`` rounded up to a multiple of ``align`` elements, so
   that every segment starts 16-byte aligned in the row; row offset
   ``off_i = c_1 + ... + c_{i-1}``; row length ``C = sum_i c_i``.
3. Rank r's row ``R_r = concat_i pad_{c_i}(p_i.flatten()[r*s_i : (r+1)*s_i])``;
   padding is zero. This row is the only copy of those values that rank r keeps
   between uses, and its first ``local numel`` elements of segment i, viewed with
   the local shape, are rank r's shard of p_i.
4. The unsharded buffer ``U`` (length ``N*C``) is *parameter-major*: p_i lives
   contiguously at ``U[N*off_i : N*off_i + numel_i]``, so each parameter is a plain
   contiguous view, and ``U[N*off_i : N*off_i + N*s_i]`` viewed as ``(N, s_i)`` has
   row r = rank r's shard (the rest of p_i's ``N*c_i`` elements is unused). Gather is
   ``U_i[r, :] = R_r[off_i : off_i + s_i]`` for all r and i; scatter-accumulate is
   its transpose, ``A_r[off_i : off_i + s_i] += G_i[r, :]``.

When every ``s_i`` is a multiple of ``align`` (every weight matrix of an LLM; vectors
whose length N divides into aligned pieces) ``c_i = s_i`` and the kernels move
16-byte vectors on both sides; otherwise they fall back to narrower accesses on the
unsharded side (``ChunkTable.dst_align``). With N = 1 the unsharded buffer and the
row coincide element for element. 0-dimensional parameters cannot be sharded on
dim 0 (FSDP2 refuses them too): make them shape ``(1,)``.
Everything here is metadata plus reference (torch) pack/unpack used by the
collective transport and by tests; the one-sided transports fuse the same index
map into their kernels.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

ALIGN_BYTES = 16


def align_elems(dtype: torch.dtype) -> int:
    """Number of ``dtype`` elements in one 16-byte alignment unit (at least 1)."""
    return max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def shard_sizes(shape: Sequence[int], world_size: int, dtypes: Sequence[torch.dtype]) -> tuple[int, int]:
    """(shard ``s_i``, segment ``c_i``) in elements of a parameter of ``shape`` (see [layout])."""
    if not shape:
        raise ValueError("0-dimensional parameters cannot be sharded on dim 0")
    rows = math.ceil(shape[0] / world_size)
    shard = rows * math.prod(shape[1:])
    align = max(align_elems(d) for d in dtypes)
    return shard, _round_up(max(1, shard), align)


def shard_range(numel: int, shard: int, rank: int) -> tuple[int, int]:
    """Flattened elements ``[lo, hi)`` of a parameter of ``numel`` elements that ``rank`` holds when each rank
    holds ``shard`` of them (step 1 of [layout]; ``lo == hi``: none)."""
    lo = min(rank * shard, numel)
    return lo, min(lo + shard, numel)


def overlapping_shards(lo: int, hi: int, numel: int, shard: int, world_size: int) -> Iterator[tuple[int, int, int]]:
    """Where elements ``[lo, hi)`` of a parameter lie under another plan (``shard`` elements on each of
    ``world_size`` ranks): ``(rank q, a, b)`` for every rank holding some, ``[a, b)`` being the elements it holds
    of them; ``a - shard_range(numel, shard, q)[0]`` is where they start in q's shard. For resharding loads."""
    if hi <= lo:
        return
    for q in range(lo // shard, min(world_size, -(-hi // shard))):
        qlo, qhi = shard_range(numel, shard, q)
        a, b = max(lo, qlo), min(hi, qhi)
        if a < b:
            yield q, a, b


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its group.

    Attributes:
        name: fully qualified parameter name (the first one if it is shared).
        shape: the parameter's shape.
        offset: start of the parameter's segment in every row (elements).
        seg: segment length ``c_i`` in elements (>= ``shard``, aligned).
        shard: elements of a full shard ``s_i`` (``ceil(dim0 / N)`` rows): rank q holds
            flattened elements ``[q * shard, min((q + 1) * shard, numel))``.
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    seg: int
    shard: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements of one dim-0 row."""
        return math.prod(self.shape[1:])

    def local_range(self, rank: int) -> tuple[int, int]:
        """Flattened elements ``[lo, hi)`` of the parameter that ``rank`` holds (``lo == hi``: none)."""
        return shard_range(self.numel, self.shard, rank)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s shard: the parameter's shape with fewer dim-0 rows (maybe none)."""
        lo, hi = self.local_range(rank)
        return ((hi - lo) // self.row_numel if self.row_numel else 0, *self.shape[1:])


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
        row_dtype: the dtype of its rows where a row format of its own sets it (``plan_groups``' ``own_rows``, e.g.
            float8 rows, [row-format]); None: the communicated dtype.
    """

    index: int
    world_size: int
    dtype: torch.dtype
    requires_grad: bool
    slots: tuple[ParamSlot, ...]
    row_len: int
    row_dtype: torch.dtype | None = None

    @functools.cached_property
    def padded(self) -> bool:
        """Whether some segment is longer than its shard (zero padding inside the rows)."""
        return any(s.seg != s.shard for s in self.slots)

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
        """Per-parameter ``(N, s_i)`` views of a parameter-major buffer (row r: rank r's shard)."""
        n = self.world_size
        return [unsharded[n * s.offset : n * s.offset + n * s.shard].view(n, s.shard) for s in self.slots]

    def row_segments(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter ``(N, s_i)`` views of a rank-major ``(N, C)`` row matrix."""
        rows = rows.view(self.world_size, self.row_len)
        return [rows[:, s.offset : s.offset + s.shard] for s in self.slots]

    def local_view(self, row: torch.Tensor, i: int, rank: int) -> torch.Tensor:
        """Parameter ``i``'s shard of ``rank``, as a view of that rank's row (any row-shaped tensor)."""
        s = self.slots[i]
        lo, hi = s.local_range(rank)
        return row[s.offset : s.offset + hi - lo].view(s.local_shape(rank))

    def segment(self, row: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s whole segment of a row (its shard, then zero padding up to ``c_i``)."""
        s = self.slots[i]
        return row[s.offset : s.offset + s.seg]

    def unpack(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rank-major rows ``(N, C)`` -> parameter-major buffer (the gather copy-out)."""
        if out is None:
            out = torch.empty(self.unsharded_numel, dtype=rows.dtype, device=rows.device)
        torch._foreach_copy_(self.unsharded_segments(out), self.row_segments(rows))
        return out

    def pack(self, unsharded: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter-major buffer -> rank-major rows ``(N, C)`` (the scatter copy-in).

        ``out`` may have another dtype (gradients are packed into fp32); its padding is zeroed.
        """
        if out is None:
            out = torch.empty(self.world_size, self.row_len, dtype=unsharded.dtype, device=unsharded.device)
        if self.padded:
            out.zero_()
        torch._foreach_copy_(self.row_segments(out), self.unsharded_segments(unsharded))
        return out.view(self.world_size, self.row_len)

    def shard_row(self, params: Sequence[torch.Tensor], rank: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s row built from full parameter values (zero padded)."""
        row = torch.zeros(self.row_len, dtype=dtype, device=params[0].device)
        for s, p in zip(self.slots, params, strict=True):
            lo, hi = s.local_range(rank)
            row[s.offset : s.offset + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])
        return row


def plan_groups(
    named_params: Sequence[tuple[str, torch.Tensor]],
    world_size: int,
    group_bytes: int,
    comm_dtype: torch.dtype | None = None,
    owner_of: Callable[[str], object] | None = None,
    own_rows: dict[str, torch.dtype] | None = None,
) -> list[GroupLayout]:
    """Plan flat groups over parameters in order.

    A group closes when the next parameter has another dtype or ``requires_grad`` flag, or another unit
    (``owner_of``), or, outside units, when adding it would pass ``group_bytes`` (counted as unsharded bytes
    in ``comm_dtype``, padding included; a parameter larger than ``group_bytes`` forms its own group). Inside a
    unit there is no byte budget: the unit's site gathers all of it at once anyway, so one group per unit (and
    dtype and flag) is one gather and one push launch per site, as FSDP2's one all-gather per ``fully_shard``
    module. 0-dimensional parameters are refused.

    Args:
        named_params: (name, tensor) pairs, each parameter once, in order.
        world_size: number of ranks N (>= 1).
        group_bytes: byte budget per group (> 0).
        comm_dtype: dtype moved between ranks; defaults to each parameter's dtype.
        owner_of: a parameter's unit (a ``units`` module or a ``fully_shard`` one; None outside units); a group
            also closes where the unit changes, so no group spans two units and each unit gathers only its own
            groups, and ``group_bytes`` applies only outside units.
        own_rows: parameters whose rows hold a dtype of their own, by name (a row format's, e.g. float8 rows,
            [row-format]): groups of their own, counted at that dtype's bytes.
    """
    if not isinstance(group_bytes, int) or isinstance(group_bytes, bool) or group_bytes <= 0:
        raise ValueError(f"group_bytes must be a positive int (bytes per group), got {group_bytes!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for name, p in named_params:
        if p.dim() == 0:
            raise ValueError(f"parameter {name!r} is 0-dimensional; parameters are sharded on dim 0 (as FSDP2 "
                             "shards them): make it shape (1,)")

    own_rows = own_rows or {}
    groups: list[GroupLayout] = []
    pending: list[tuple[str, torch.Tensor]] = []

    def close() -> None:
        if not pending:
            return
        dtype = pending[0][1].dtype
        own = own_rows.get(pending[0][0])
        dtypes = (dtype, own or comm_dtype or dtype)
        slots, off = [], 0
        for name, p in pending:
            shard, seg = shard_sizes(p.shape, world_size, dtypes)
            slots.append(ParamSlot(name, tuple(p.shape), off, seg, shard))
            off += seg
        groups.append(GroupLayout(len(groups), world_size, dtype, pending[0][1].requires_grad, tuple(slots), off,
                                  own))
        pending.clear()

    used = 0
    for name, p in named_params:
        cdt = own_rows.get(name) or comm_dtype or p.dtype
        itemsize = torch.empty((), dtype=cdt).element_size()
        nbytes = world_size * shard_sizes(p.shape, world_size, (p.dtype, cdt))[1] * itemsize
        if pending:
            head = pending[0][1]
            other_owner = owner_of is not None and owner_of(pending[0][0]) != owner_of(name)
            in_unit = owner_of is not None and owner_of(name) is not None
            other_rows = own_rows.get(pending[0][0]) != own_rows.get(name)
            if (head.dtype != p.dtype or head.requires_grad != p.requires_grad or other_owner or other_rows
                    or (used + nbytes > group_bytes and not in_unit)):
                close()
                used = 0
        pending.append((name, p))
        used += nbytes
    close()
    return groups
