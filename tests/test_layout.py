"""The flat group layout against its closed form and torch.chunks dim-0 split (see [layout] in
odcfsdp/sharding/placement/layout.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from odcfsdp.sharding.placement.layout import ALIGN_BYTES, plan_groups

DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


def random_params(rng: random.Random, dtype: torch.dtype, count: int = 7) -> list[tuple[str, torch.Tensor]]:
    shapes = [(1,), (3,), (5, 7), (2, 3, 4), (17,), (64, 33), (1, 1), (9, 1, 2)]
    out = []
    for i in range(count):
        shape = rng.choice(shapes) if i else (1,)  # always include a 1-element parameter
        out.append((f"p{i}", torch.randn(shape).to(dtype)))
    return out


def closed_form_row(params: list[torch.Tensor], off: list[int], rank: int, row_len: int, world: int) -> torch.Tensor:
    """Row r, element by element: offset off_i + k holds p_i.flatten()[r * s_i + k] for k < s_i, where
    s_i = ceil(dim0 / N) * (elements per dim-0 row), or 0 past the parameter's end and in the padding."""
    row = torch.zeros(row_len, dtype=torch.float64)
    for p, o in zip(params, off):
        flat = p.double().flatten()
        shard = math.ceil(p.shape[0] / world) * math.prod(p.shape[1:])
        for k in range(shard):
            j = rank * shard + k
            if j < flat.numel():
                row[o + k] = flat[j]
    return row


@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("dtype, comm_dtype", DTYPE_PAIRS)
def test_rows_roundtrip_exactly(world_size, dtype, comm_dtype):
    rng = random.Random(world_size * 101 + hash((str(dtype), str(comm_dtype))) % 97)
    named = random_params(rng, dtype)
    (layout,) = plan_groups(named, world_size, 1 << 40, comm_dtype)
    params = [p for _, p in named]

    rows = torch.stack([layout.shard_row(params, r, dtype) for r in range(world_size)])
    off = [s.offset for s in layout.slots]
    for r in range(world_size):
        assert torch.equal(rows[r].double(), closed_form_row(params, off, r, layout.row_len, world_size))
        for i, p in enumerate(params):  # a rank's piece is torch.chunk's dim-0 piece (DTensor's Shard(0) shard)
            chunks = torch.chunk(p, world_size, dim=0)
            want = chunks[r] if r < len(chunks) else p[:0]
            assert torch.equal(layout.local_view(rows[r], i, r), want)
            assert layout.slots[i].local_shape(r) == tuple(want.shape)

    unsharded = layout.unpack(rows)  # the gather copy-out
    for i, p in enumerate(params):
        assert torch.equal(layout.param_view(unsharded, i), p)  # each parameter: a contiguous view
        assert layout.param_view(unsharded, i).is_contiguous()
    assert torch.equal(layout.pack(unsharded), rows)  # the scatter copy-in undoes it exactly


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype, comm_dtype", DTYPE_PAIRS)
def test_segments_aligned_and_cover(world_size, dtype, comm_dtype):
    named = random_params(random.Random(world_size), dtype, count=12)
    (layout,) = plan_groups(named, world_size, 1 << 40, comm_dtype)
    dtypes = {dtype, comm_dtype, torch.float32}  # fp32 accumulators and masters too
    off = 0
    for s, (_, p) in zip(layout.slots, named):
        assert s.offset == off
        assert s.shard == math.ceil(p.shape[0] / world_size) * math.prod(p.shape[1:])
        assert s.seg >= s.shard and s.shard * world_size >= p.numel()
        for d in dtypes:
            size = torch.empty((), dtype=d).element_size()
            assert (s.offset * size) % ALIGN_BYTES == 0
            assert (s.seg * size) % ALIGN_BYTES == 0
        off += s.seg
    assert layout.row_len == off
    assert layout.unsharded_numel == world_size * off


def test_plan_respects_budget_order_and_kind():
    def param(n, dtype=torch.float32, trained=True):
        return torch.zeros(n, dtype=dtype, requires_grad=trained)

    named = [
        ("a", param(100)),
        ("b", param(100)),
        ("big", param(5000)),
        ("c", param(10)),
        ("frozen", param(10, trained=False)),
        ("d", param(10, torch.float64)),
        ("e", param(10)),
    ]
    layouts = plan_groups(named, 2, group_bytes=1024)
    assert [[s.name for s in lay.slots] for lay in layouts] == [["a", "b"], ["big"], ["c"], ["frozen"], ["d"], ["e"]]
    assert [lay.requires_grad for lay in layouts] == [True, True, True, False, True, True]
    assert [lay.dtype for lay in layouts][4] == torch.float64
    for lay in layouts:
        nbytes = lay.unsharded_numel * torch.empty((), dtype=lay.dtype).element_size()
        assert nbytes <= 1024 or len(lay.slots) == 1


def test_a_unit_is_one_group_and_the_budget_holds_outside_units():
    """[layout]: inside a unit (``owner_of`` not None) no byte budget, so a unit is one group per dtype and flag (one
    gather and one push launch per site, FSDP2's one param group per fully_shard module); groups never span two
    units; outside units ``group_bytes`` holds as before."""
    def param(n, trained=True):
        return torch.zeros(n, requires_grad=trained)

    named = [("embed", param(600)), ("head", param(600)),  # outside units: 2 x 4 x 600 bytes > 1024 each
             ("u0.a", param(600)), ("u0.b", param(600)), ("u0.frozen", param(8, trained=False)), ("u0.c", param(8)),
             ("u1.a", param(600)), ("u1.b", param(600)), ("norm", param(8)), ("out", param(8))]
    unit = {"u0": "unit0", "u1": "unit1"}
    layouts = plan_groups(named, 2, group_bytes=1024, owner_of=lambda n: unit.get(n.split(".")[0]))
    assert [[s.name for s in lay.slots] for lay in layouts] == [
        ["embed"], ["head"], ["u0.a", "u0.b"], ["u0.frozen"], ["u0.c"], ["u1.a", "u1.b"], ["norm", "out"]]
    assert [[s.name for s in lay.slots] for lay in plan_groups(named, 2, group_bytes=1024)][2:4] == [["u0.a"], ["u0.b"]]


def test_odcshard_units_are_whole_groups():
    """``ODCShard(units=...)``: each decoder layer is one group whatever ``group_bytes`` (at this budget it was 9, one
    per parameter, and at a larger one a group could span two layers); the embedding and the head keep the budget."""
    from odcfsdp import ODCShard
    from odcfsdp.models import Llama
    from odcfsdp.models.llama import DecoderLayer, llama_config

    cfg = llama_config("tiny", 256)
    model = ODCShard(Llama(cfg), 1 << 12, units=(DecoderLayer,), comm="shm")
    try:
        layer_groups = [g for g in model.groups if g.layout.slots[0].name.startswith("layers.")]
        assert len(layer_groups) == cfg.n_layers
        assert all(len({s.name.split(".")[1] for s in g.layout.slots}) == 1 for g in layer_groups)
        assert all(len(g.layout.slots) == 9 for g in layer_groups)  # every parameter of the layer
        outside = [g for g in model.groups if g not in layer_groups]
        assert all(g.layout.unsharded_numel * 4 <= 1 << 12 or len(g.layout.slots) == 1 for g in outside)
    finally:
        model.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "32M", True, None])
def test_plan_rejects_bad_group_bytes(bad):
    with pytest.raises(ValueError, match="group_bytes"):
        plan_groups([("a", torch.zeros(3))], 2, bad)


def test_zero_dimensional_parameters_are_refused():
    with pytest.raises(ValueError, match="'scale' is 0-dimensional.*make it shape \\(1,\\)"):
        plan_groups([("w", torch.zeros(3)), ("scale", torch.zeros(()))], 2, 1 << 20)
