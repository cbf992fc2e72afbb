"""The owner's float8 cast of its row: every element of a group's master row scaled by its weight's scale, clamped
to the float8 range and cast to e4m3, in one pass ([float8-gather] in ``sharding/groups/float8.py``, step 3).

A group's row is its weights' segments one after another (``sharding/placement/layout.py``), and each weight has one
scale (tensorwise). ``cast_segments_to_float8`` gives each element its segment's scale by comparing its index with the
segments' ends (a group has a few segments, so the comparison loop is short and the loads are scalar), so nothing
of the row's size is built besides the float8 row itself: the pass reads 4 bytes and writes 1 per element.

Why a kernel: the same cast in torch operators expands the scales to the row's length first
(``repeat_interleave``, an int64 index and an fp32 tensor per element) and then multiplies, clamps and casts in
three more passes: memory traffic of several times the row per element, where the kernel reads 4 bytes and writes 1
(the profile that showed it costing more than a step's matmuls: docs/design.md, Figures behind the design notes).

The arithmetic is torchao's ``hp_tensor_and_scale_to_float8``: fp32 multiply, clamp to +-448, round to nearest
even; the bytes equal ``to_float8`` in ``sharding/groups/float8_rows.py`` (tested on a GPU, to the bit:
``tests/test_kernels.py::test_float8_cast_gives_each_segment_its_weights_scale``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: values past it saturate


@triton.jit
def _cast_segments_kernel(
    src,  # *fp32|bf16 [n]: the master row
    dst,  # *float8e4nv [n]: the float8 row
    ends,  # *int64 [num_segs]: each segment's end in the row (ascending; the last is n)
    numbers,  # *int64 [num_segs]: each segment's index into scales
    scales,  # *fp32: every float8 weight's scale
    num_segs,
    n,
    FLOAT8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seg = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(num_segs - 1):  # the segment of each element: how many segment ends lie at or before it
        seg += (offs >= tl.load(ends + s)).to(tl.int32)
    scale = tl.load(scales + tl.load(numbers + seg, mask=mask, other=0), mask=mask, other=1.0)
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32) * scale
    # NaN stays NaN, as torch's clamp keeps it (tl.minimum/maximum would turn it into +-448)
    x = tl.minimum(tl.maximum(x, -FLOAT8_MAX, propagate_nan=tl.PropagateNan.ALL), FLOAT8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    tl.store(dst + offs, x.to(dst.dtype.element_ty), mask=mask)


def cast_segments_to_float8(src: torch.Tensor, dst: torch.Tensor, ends: torch.Tensor, numbers: torch.Tensor,
                            scales: torch.Tensor) -> None:
    """``dst[j] = float8(clamp(src[j] * scales[numbers[s]]))`` for every ``j`` of segment ``s`` (segment ``s``
    spans ``[ends[s-1], ends[s])``); ``src`` and ``dst`` flat, of one length, on one device. ``dst`` is
    ``float8_e4m3fn`` (an fp32 ``dst`` receives the scaled, clamped values before the cast: how tests check the
    scales where Triton's CPU interpreter rounds float8 its own way)."""
    n = dst.numel()
    assert src.numel() == n and ends.numel() == numbers.numel() > 0, (src.numel(), n, ends.numel(), numbers.numel())
    _cast_segments_kernel[(triton.cdiv(n, BLOCK),)](src, dst, ends, numbers, scales, ends.numel(), n,
                                                   FLOAT8_MAX=E4M3_MAX, BLOCK=BLOCK)


__all__ = ["cast_segments_to_float8"]
