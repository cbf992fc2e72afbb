"""Gather and scatter-accumulate kernels against the torch reference layout ops.

On CPU these run in Triton's interpreter (see conftest.py) over CPU tensors; the
address tables point at ordinary tensors standing in for peers' rows.
"""

from __future__ import annotations

import pytest
import torch

from odcfsdp.kernels.chunks import group_chunk_table
from odcfsdp.kernels.rows import gather_rows, row_offsets, scatter_accumulate_rows
from odcfsdp.sharding.placement.layout import plan_groups

SHAPES = [(1,), (37,), (5, 9), (64,), (3, 3, 3), (130,)]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layout_for(world_size: int, dtype: torch.dtype):
    named = [(f"p{i}", torch.empty(s)) for i, s in enumerate(SHAPES)]
    (layout,) = plan_groups(named, world_size, 1 << 40, dtype)
    chunks = lambda block: group_chunk_table(layout, block, DEVICE)  # noqa: E731
    return layout, chunks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [16, 64])
def test_gather_rows_matches_unpack(world_size, dtype, block):
    layout, chunks = layout_for(world_size, dtype)
    rows = [torch.randn(layout.row_len, device=DEVICE).to(dtype) for _ in range(world_size)]
    out = torch.full((layout.unsharded_numel,), float("nan"), device=DEVICE).to(dtype)  # poisoned
    gather_rows(rows[0], row_offsets(rows[0], rows), out, chunks(block), world_size)
    want = layout.unpack(torch.stack(rows))
    for got_seg, want_seg in zip(layout.unsharded_segments(out), layout.unsharded_segments(want)):
        assert torch.equal(got_seg, want_seg)  # every rank's shard of every parameter


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gather_casts_fp32_rows_into_a_bf16_buffer(world_size):
    """gather_masters=True: peers' fp32 masters are gathered into the bf16 buffer, rounded as publishing rounds (on
    GPUs the kernel's cast is round-to-nearest-even, torch's: equal to the bit; Triton's CPU interpreter emulates the
    cast with its own rounding, so there the test allows one bf16 unit in the last place)."""
    layout, chunks = layout_for(world_size, torch.bfloat16)
    rows = [torch.randn(layout.row_len, device=DEVICE) for _ in range(world_size)]
    out = torch.full((layout.unsharded_numel,), float("nan"), device=DEVICE).to(torch.bfloat16)
    gather_rows(rows[0], row_offsets(rows[0], rows), out, chunks(16), world_size)
    want = layout.unpack(torch.stack([r.to(torch.bfloat16) for r in rows]))
    for got_seg, want_seg in zip(layout.unsharded_segments(out), layout.unsharded_segments(want)):
        if DEVICE == "cuda":
            assert torch.equal(got_seg, want_seg)
        else:
            torch.testing.assert_close(got_seg.float(), want_seg.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gather_moves_float8_rows_as_bytes(world_size):
    """[float8-gather]: float8 rows go through the gather kernel as uint8 views (the nvshmem transport's path): the
    float8 buffer ends up holding every rank's bytes as they were, where ``unpack`` puts them."""
    named = [(f"p{i}", torch.empty(s)) for i, s in enumerate(SHAPES)]
    (layout,) = plan_groups(named, world_size, 1 << 40, torch.bfloat16,
                            own_rows=dict.fromkeys((n for n, _ in named), torch.float8_e4m3fn))
    rows = [torch.randn(layout.row_len, device=DEVICE).to(torch.float8_e4m3fn).view(torch.uint8)
            for _ in range(world_size)]
    out = torch.full((layout.unsharded_numel,), 0xFF, dtype=torch.uint8, device=DEVICE)  # poisoned (NaN in e4m3)
    gather_rows(rows[0], row_offsets(rows[0], rows), out, group_chunk_table(layout, 64, DEVICE), world_size)
    want = layout.unpack(torch.stack(rows))
    for got_seg, want_seg in zip(layout.unsharded_segments(out), layout.unsharded_segments(want)):
        assert torch.equal(got_seg, want_seg)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_scatter_accumulate_matches_pack(world_size, grad_dtype):
    block = 32
    layout, chunks = layout_for(world_size, grad_dtype)
    table = chunks(block)
    accs = [torch.randn(layout.row_len, device=DEVICE) for _ in range(world_size)]
    want = [a.double().clone() for a in accs]
    for _ in range(2):  # two pushers adding into the same owners
        grad = torch.randn(layout.unsharded_numel, device=DEVICE).to(grad_dtype)
        packed = layout.pack(grad.double())
        for r in range(world_size):
            want[r] += packed[r]
        scatter_accumulate_rows(accs[0], row_offsets(accs[0], accs), grad, table, world_size)
    for a, w in zip(accs, want):
        torch.testing.assert_close(a.double(), w, rtol=1e-6, atol=1e-6)  # fp32 accumulation of exact inputs


def test_chunk_table_covers_every_shard_once():
    layout, chunks = layout_for(3, torch.float32)
    table = chunks(16)
    assert table.block == 16
    covered = torch.zeros(layout.row_len, dtype=torch.int64)
    for start, length, _, _ in table.table.cpu().tolist():
        assert 0 < length <= 16
        covered[start : start + length] += 1
    want = torch.zeros_like(covered)  # every shard once, the padding after it never
    for s in layout.slots:
        want[s.offset : s.offset + s.shard] = 1
    assert torch.equal(covered, want)
    # (37,) over 3 ranks: shards of 13 elements, so unsharded-side starts are not 16-byte aligned
    assert table.dst_align(4) == 1 and group_chunk_table(plan_groups([("a", torch.empty(64))], 2, 1 << 40,
                                                                     torch.float32)[0], 16).dst_align(4) == 4


def test_kernel_argument_checks():
    layout, chunks = layout_for(2, torch.bfloat16)
    out = torch.empty(layout.unsharded_numel, dtype=torch.bfloat16, device=DEVICE)
    rows = [torch.zeros(layout.row_len, dtype=torch.bfloat16, device=DEVICE)] * 2
    with pytest.raises(ValueError, match="2 entries"):
        gather_rows(rows[0], row_offsets(rows[0], rows[:1]), out, chunks(16), 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        gather_rows(rows[0], row_offsets(rows[0], rows), out, chunks(12), 2)
    with pytest.raises(ValueError, match="16-byte aligned"):
        row_offsets(rows[0], [rows[0], rows[0][1:]])
    with pytest.raises(ValueError, match="does not fit"):
        scatter_accumulate_rows(rows[0].cpu() if DEVICE == "cuda" else rows[0].to("meta"),
                                row_offsets(rows[0], rows), out, chunks(16), 2)


def _float8_cast_case(device):
    """A row of four segments (one weight's scale each, 4x to 1000x apart) over values from 1e-6 to 1e3, past the
    float8 range once scaled; the scale of each element, as a reference expands it."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5000, 1, 12000, 3999]
    n = sum(lengths)
    src = (torch.randn(n, generator=gen) * torch.logspace(-6, 3, n)[torch.randperm(n, generator=gen)]).to(device)
    scales = torch.tensor([9.0, 0.25, 1000.0, 2.0, 40.0], device=device)  # every float8 weight's of the model
    numbers = torch.tensor([3, 0, 4, 2], device=device)  # the segments' weights
    ends = torch.tensor(lengths, device=device).cumsum(0)
    per_element = torch.cat([scales[k].expand(m) for m, k in zip(lengths, numbers.tolist())])
    return src, ends, numbers, scales, per_element


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_float8_cast_gives_each_segment_its_weights_scale(dtype):
    """[float8-gather] step 3's kernel: each element of the row takes its own segment's scale, and values past the
    float8 range saturate at +-448. Into an fp32 row the kernel's scaled, clamped values are exact (on CPU too);
    into a float8 row they equal torch's cast to the bit, checked on GPUs only (Triton's CPU interpreter emulates
    float8 rounding its own way, off by more than one float8 step)."""
    from odcfsdp.kernels.float8_cast import cast_segments_to_float8
    from odcfsdp.sharding.groups.float8_rows import FLOAT8_MAX, to_float8

    if dtype != torch.float32 and DEVICE == "cpu":
        pytest.skip("the interpreter's float8 rounding is not the GPU's; the fp32 case checks the scales here")
    src, ends, numbers, scales, per_element = _float8_cast_case(DEVICE)
    out = torch.full((src.numel(),), float("nan"), device=DEVICE).to(dtype)  # a skipped element shows
    cast_segments_to_float8(src, out, ends, numbers, scales)
    want = (src * per_element).clamp(-FLOAT8_MAX, FLOAT8_MAX)
    assert want.abs().max() == FLOAT8_MAX  # the case reaches past the float8 range
    if dtype == torch.float32:
        assert torch.equal(out, want)
    else:
        assert torch.equal(out.view(torch.uint8), to_float8(src, per_element).view(torch.uint8))
