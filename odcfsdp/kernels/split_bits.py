"""The two passes of ``split_masters`` on the device ([split-masters] in ``sharding/groups/split_master.py``), each a
Triton launch over a group's full blocks of flat bits and, where the length is not a whole number of blocks, one
more program for the rest.

* ``split_bits``: ``low = clamp(m - (h << 16), -32768, 32767)`` as int16, and a flag set where a difference was out
  of range (the row was not its master's rounding); a NaN row (its exponent all ones, mantissa non-zero) gives 0;
* ``join_bits``: ``out = (h << 16) + low`` as int32, the master's bits.

``m`` and ``out`` are an fp32 master's bits (int32), ``h`` its bf16 row's (int16, sign-extended, so ``h << 16`` wraps
to the row's bits as int32 arithmetic does), ``low`` the 16 low bits. Each pass reads and writes 8 bytes an element.

Why Triton rather than ``torch.compile`` of the same operators (the CUDA path before 2026-11-30): inductor computed
the split's flag in a reduction kernel of its own, which read the master and the row a second time (14 bytes an
element): on one H200 at 8B's shards of 2 ranks (33 groups, 3.62B elements) the compiled split took 14.5 ms and the
join 7.9, these kernels 7.0 and 7.2, 95-97% of a copy's bandwidth (``results/optim/n1_split_kernels_54c0737/``).
The flag is one atomic per block that found a bad element (none in training). Full blocks run without masks, so
that their loads and stores are vectors, and one more program takes the tail: a masked block's loads are narrow
wherever the length is not known to be a multiple of the vector (8B's groups are not), which made a
masked-everywhere version of the split 2.4x slower on the device. Also on CPU tensors under ``TRITON_INTERPRET=1``,
as CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements a program (4 warps): the fastest of 1K-8K on one H200 (results/optim/n1_split_kernels_54c0737)
WARPS = 4
WIDE_FROM = 1 << 31  # elements from which offsets are int64 (tests lower it to run that path on small tensors)


@triton.jit
def _split_kernel(m_ptr, h_ptr, low_ptr, flag_ptr, start, n, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                  WIDE: tl.constexpr):
    if WIDE:  # WIDE_FROM elements or more: int64 offsets
        offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:  # a full block: no mask, vector loads and stores
        m = tl.load(m_ptr + offs, eviction_policy="evict_first")
        h = tl.load(h_ptr + offs, eviction_policy="evict_first").to(tl.int32)
    else:
        mask = offs < n
        m = tl.load(m_ptr + offs, mask=mask, other=0)
        h = tl.load(h_ptr + offs, mask=mask, other=0).to(tl.int32)
    d = tl.where((h & 0x7FFF) > 0x7F80, 0, m - (h << 16))  # a NaN row: its own NaN comes back
    bad = tl.max(((d > 32768) | (d < -32768)).to(tl.int32), axis=0)
    low = tl.minimum(tl.maximum(d, -32768), 32767).to(tl.int16)
    if EVEN:
        tl.store(low_ptr + offs, low)
    else:
        tl.store(low_ptr + offs, low, mask=mask)
    if bad > 0:  # never in training: one atomic per block that found a stale row
        tl.atomic_or(flag_ptr, 1)


@triton.jit
def _join_kernel(h_ptr, low_ptr, out_ptr, start, n, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                 WIDE: tl.constexpr):
    if WIDE:  # WIDE_FROM elements or more: int64 offsets
        offs = start + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        h = tl.load(h_ptr + offs, eviction_policy="evict_first").to(tl.int32)
        d = tl.load(low_ptr + offs, eviction_policy="evict_first").to(tl.int32)
        tl.store(out_ptr + offs, (h << 16) + d)
    else:
        mask = offs < n
        h = tl.load(h_ptr + offs, mask=mask, other=0).to(tl.int32)
        d = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.int32)
        tl.store(out_ptr + offs, (h << 16) + d, mask=mask)


def _launch(kernel, args: tuple, n: int) -> None:
    """``kernel`` over ``n`` elements: the full blocks without masks, then the tail (if any) in one program."""
    full, wide = n // BLOCK, n + BLOCK >= WIDE_FROM
    if full:
        kernel[(full,)](*args, 0, n, BLOCK=BLOCK, EVEN=True, WIDE=wide, num_warps=WARPS)
    if n > full * BLOCK:
        kernel[(1,)](*args, full * BLOCK, n, BLOCK=BLOCK, EVEN=False, WIDE=wide, num_warps=WARPS)


def _flat(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t.view(dtype).view(-1)


def split_bits(master: torch.Tensor, row: torch.Tensor, low: torch.Tensor, flag: torch.Tensor) -> None:
    """Write into ``low`` (int16, the master's numel) the low bits of ``master`` (fp32) under ``row`` (its bf16
    rounding), and set ``flag`` (an int32 scalar, only ever set to 1) where a difference is out of range."""
    if flag.dtype != torch.int32 or flag.numel() != 1:
        raise ValueError(f"flag must be one int32 element, got {flag.dtype} of {flag.numel()}")
    m, h, lo = _flat(master, torch.int32, "master"), _flat(row, torch.int16, "row"), _flat(low, torch.int16, "low")
    if not m.numel() == h.numel() == lo.numel():
        raise ValueError(f"master, row and low bits differ in size: {m.numel()}, {h.numel()}, {lo.numel()}")
    _launch(_split_kernel, (m, h, lo, flag), m.numel())


def join_bits(row: torch.Tensor, low: torch.Tensor, master: torch.Tensor) -> None:
    """Write into ``master`` (fp32) the bits ``(row's << 16) + low`` (``row`` bf16, ``low`` int16)."""
    h, lo, out = _flat(row, torch.int16, "row"), _flat(low, torch.int16, "low"), _flat(master, torch.int32, "master")
    if not out.numel() == h.numel() == lo.numel():
        raise ValueError(f"master, row and low bits differ in size: {out.numel()}, {h.numel()}, {lo.numel()}")
    _launch(_join_kernel, (h, lo, out), out.numel())


__all__ = ["join_bits", "split_bits"]
