"""fp32 masters kept as a bf16 row plus 16 low bits: exact round trips, the row rounded to nearest."""

from __future__ import annotations

import torch

from odcfsdp import ODCShard
from odcfsdp.kernels.split_master import join_master, split_master_


def values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(50_000, generator=g) * 10.0 ** torch.randint(-38, 38, (50_000,), generator=g).float()
    bits = torch.randint(0, 2**31 - 1, (2_000,), generator=g, dtype=torch.int32)
    ties = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # exactly half-way between two bf16 values
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0, 3.0e38, -3.0e38, float("inf"), float("-inf")])
    x = torch.cat([wide, ties, -ties, special])
    return x[~torch.isnan(x)]


def test_round_trip_is_exact_and_the_row_is_rounded_to_nearest():
    x = values()
    row, lo = torch.empty_like(x, dtype=torch.bfloat16), torch.empty_like(x, dtype=torch.int16)
    split_master_(x, row, lo)
    assert torch.equal(join_master(row, lo).view(torch.int32), x.view(torch.int32))  # bit for bit, -0.0 included
    rne = x.to(torch.bfloat16)
    differs = row.view(torch.int16) != rne.view(torch.int16)
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    assert differs.any() and (differs == (tie & differs)).all()  # only ties differ from torch's rounding ...
    away = row.float().abs() >= x.abs()
    assert away[tie].all()  # ... and they go away from zero


def test_bf16_wrapper_stores_masters_split_and_exact():
    torch.manual_seed(0)
    model = ODCShard(torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 7)), 2048,
                     param_dtype=torch.bfloat16)
    assert all(g.split and g.master_lo is not None for g in model.groups)
    new = {k: torch.randn_like(v) for k, v in model.full_state_dict().items()}
    model.load_full_state_dict(new)
    got = model.full_state_dict()
    assert all(torch.equal(got[k], new[k]) for k in new)  # fp32 values survive, not their bf16 roundings
    with model.unsharded():
        for name, p in model.module.named_parameters():
            err = (p.float() - new[name]).abs() / new[name].abs().clamp_min(1e-30)
            assert err.max() <= 2**-8  # the computed-with copy is the master rounded to bf16
    model.close()
