"""Gather and scatter-accumulate kernels over load/store-reachable rows.

Each rank's row (and fp32 accumulator row) of a group is reachable by address:
on GPUs of one NVLink node through NVSHMEM peer pointers, on CPU (interpreter)
through shared memory. The kernels take the N rows as offsets from one base row, so
one launch touches every rank's row:

* ``gather_rows``: out[param-major] <- rows of all ranks: fetch and unpack in one
  pass (no rank-major staging buffer, no second copy). Rows are given as element
  offsets from the caller's own row, which is passed as a pointer argument: Triton
  then knows every address is 16-byte aligned and issues 16-byte vector loads
  (an address loaded from a table and cast to a pointer has unknown alignment, and
  the loads it gets are narrow, so a gather moves fewer bytes a second: ``benchmarks/comm_bench.py``);
* ``scatter_accumulate_rows``: acc_r[row order] += grad[param-major], for every
  owner r, with relaxed atomic adds: owners do no work and pushers never wait for
  each other.

Both also run under ``TRITON_INTERPRET=1`` on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunks import CHUNK_FIELDS, ChunkTable

# uint8: float8 rows, gathered as bytes ([float8-gather] in sharding/groups/float8.py): the kernels load and store
# by dtype
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float64: tl.float64, torch.uint8: tl.uint8}


@triton.jit
def _this_chunk(
    chunks,  # *int64 [num_chunks, 4]: (row_start, length, out_base, shard), see chunks.py
    world_size,  # N
    first,  # rank served by program 0
    ALIGN: tl.constexpr,  # row-side starts are multiples of ALIGN elements (16 bytes)
    DST_ALIGN: tl.constexpr,  # unsharded-side starts are multiples of DST_ALIGN elements (ChunkTable.dst_align)
):
    """Decode this program's work: (rank r, chunk start in r's row, length, start in the param-major buffer)."""
    # One flat axis (no 65535 limit of a second axis), ranks varying fastest so local copies
    # interleave with NVLink reads and neighbouring programs read different peers (one rank at a time, or all remote
    # chunks first, crowd one link at a time: both slower in benchmarks/comm_bench.py).
    pid = tl.program_id(0)
    c = pid // world_size
    r = (pid + first) % world_size
    row_start = tl.multiple_of(tl.load(chunks + c * 4), ALIGN)
    length = tl.load(chunks + c * 4 + 1)
    out_base = tl.load(chunks + c * 4 + 2)
    shard = tl.load(chunks + c * 4 + 3)
    return r, row_start, length, tl.multiple_of(out_base + r * shard, DST_ALIGN)


@triton.jit
def _gather_rows_kernel(
    base,  # *R: the caller's own row (any 16-byte aligned address of the heap works)
    row_offsets,  # *int64 [N]: rank r's row starts at base + row_offsets[r] (elements, may be negative)
    out,  # *T [N*C]: parameter-major unsharded buffer (R wider than T: rows are cast, to nearest even)
    chunks,  # *int64 [num_chunks, 4]: (row_start, length, out_base, shard), see chunks.py
    world_size,  # N
    first,  # rank served by program 0: the caller's next rank, so remote reads start first
    ALIGN: tl.constexpr,  # every row_start is a multiple of ALIGN elements (16 bytes)
    DST_ALIGN: tl.constexpr,  # every out offset is a multiple of DST_ALIGN elements
    BLOCK: tl.constexpr,  # elements per chunk (upper bound)
):
    r, row_start, length, dst = _this_chunk(chunks, world_size, first, ALIGN, DST_ALIGN)
    src = tl.multiple_of(tl.load(row_offsets + r) + row_start, ALIGN)
    offs = tl.arange(0, BLOCK)
    mask = offs < length
    value = tl.load(base + src + offs, mask=mask)
    tl.store(out + dst + offs, value.to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _scatter_accumulate_kernel(
    acc_base,  # *ACC: the caller's own accumulator row
    acc_offsets,  # *int64 [N]: owner r's accumulator row starts at acc_base + acc_offsets[r] (elements)
    grad,  # *T [N*C]: parameter-major gradient buffer
    chunks,  # *int64 [num_chunks, 4]: as for the gather
    world_size,  # N
    first,  # owner served by program 0 (the caller's next rank): pushers start at different owners
    ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr,  # every gradient-buffer offset is a multiple of DST_ALIGN elements
    BLOCK: tl.constexpr,
):
    r, row_start, length, src = _this_chunk(chunks, world_size, first, ALIGN, DST_ALIGN)
    # No alignment hint on the destination: with one, Triton vectorises the fp32 atomics, and vector
    # atomics over NVLink run several times slower than scalar ones (benchmarks/comm_bench.py).
    dst = tl.load(acc_offsets + r) + row_start
    offs = tl.arange(0, BLOCK)
    mask = offs < length
    g = tl.load(grad + src + offs, mask=mask).to(acc_base.dtype.element_ty)
    # System scope: the owner's GPU adds into the same row concurrently; "gpu" scope is atomic only
    # among one GPU's threads, and peers' adds into the same row are lost (benchmarks/comm_bench.py checks the sums).
    tl.atomic_add(acc_base + dst + offs, g, mask=mask, sem="relaxed", scope="sys")


def _check(table: torch.Tensor, buf: torch.Tensor, chunks: ChunkTable, world_size: int) -> None:
    if table.dtype != torch.int64 or table.numel() != world_size:
        raise ValueError(f"offset table must be int64 with {world_size} entries, got {table.dtype} x {table.numel()}")
    t = chunks.table
    if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != CHUNK_FIELDS:
        raise ValueError(f"chunk table must be int64 of shape (n, {CHUNK_FIELDS}), got {tuple(t.shape)}")
    if not buf.is_contiguous():
        raise ValueError("the parameter-major buffer must be contiguous")
    if buf.dtype not in _TL_DTYPES:
        raise ValueError(f"unsupported dtype {buf.dtype}")
    if not (table.device == buf.device == t.device):
        raise ValueError(f"tensors on different devices: {table.device}, {buf.device}, {t.device}")
    _check_block(chunks.block, buf.dtype)


def _check_block(block: int, dtype: torch.dtype) -> None:
    # Chunks start at segment offset + k * block; the alignment hints hold only if block is aligned too.
    if block % _align(dtype):
        raise ValueError(f"block={block} must be a multiple of {_align(dtype)} elements for {dtype}")


def _align(dtype: torch.dtype) -> int:
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def row_offsets(base: torch.Tensor, rows: list[torch.Tensor]) -> torch.Tensor:
    """Element offsets of ``rows`` from ``base`` (int64, on base's device), for ``gather_rows``."""
    size = base.element_size()
    deltas = [r.data_ptr() - base.data_ptr() for r in rows]
    if any(d % 16 for d in deltas) or base.data_ptr() % 16:
        raise ValueError("rows must start 16-byte aligned")
    return torch.tensor([d // size for d in deltas], dtype=torch.int64, device=base.device)


def gather_rows(
    base: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    chunks: ChunkTable,
    world_size: int,
    num_warps: int = 4,
    rank: int = 0,
) -> None:
    """Fill parameter-major ``out`` from the N rows at ``base + offsets[r]`` (see ``row_offsets``).

    Rows wider than ``out`` (fp32 masters into a bf16 buffer) are cast as they are stored.
    ``rank`` (the caller's) only orders the work so that remote rows are fetched first.
    """
    _check(offsets, out, chunks, world_size)
    if base.dtype not in _TL_DTYPES or base.device != out.device:
        raise ValueError(f"base row ({base.dtype}, {base.device}) does not fit out ({out.dtype}, {out.device})")
    if chunks.num_chunks:
        _gather_rows_kernel[(chunks.num_chunks * world_size,)](
            base, offsets, out, chunks.table, world_size, (rank + 1) % world_size,
            ALIGN=_align(base.dtype), DST_ALIGN=chunks.dst_align(_align(out.dtype)), BLOCK=chunks.block,
            num_warps=num_warps,
        )


def scatter_accumulate_rows(
    acc_base: torch.Tensor,
    acc_offsets: torch.Tensor,
    grad: torch.Tensor,
    chunks: ChunkTable,
    world_size: int,
    num_warps: int = 4,
    rank: int = 0,
) -> None:
    """Atomically add each owner's segments of parameter-major ``grad`` into its accumulator row.

    Owner r's row is at ``acc_base + acc_offsets[r]`` (see ``row_offsets``).
    """
    _check(acc_offsets, grad, chunks, world_size)
    if acc_base.dtype not in _TL_DTYPES or acc_base.device != grad.device:
        raise ValueError(f"accumulator {acc_base.dtype} on {acc_base.device} does not fit gradients on {grad.device}")
    if chunks.num_chunks:
        _scatter_accumulate_kernel[(chunks.num_chunks * world_size,)](
            acc_base, acc_offsets, grad, chunks.table, world_size, (rank + 1) % world_size,
            ALIGN=_align(grad.dtype), DST_ALIGN=chunks.dst_align(_align(grad.dtype)), BLOCK=chunks.block,
            num_warps=num_warps,
        )
