"""The fused AdamW kernel (a benchmark candidate) against the element-wise formula in float64 (Triton's
interpreter on CPU, real kernels on GPUs)."""

from __future__ import annotations

import pytest
import torch

from odcfsdp.kernels.adamw import decay_runs, fused_adamw_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_decay_runs_cover_the_row_once():
    runs = decay_runs(100, [(8, 40), (64, 72)], block=16, device="cpu")
    flags = torch.full((100,), -1)
    for start, n, decay in runs.tolist():
        assert 0 < n <= 16 and (flags[start : start + n] == -1).all()
        flags[start : start + n] = decay
    assert flags.tolist() == [0] * 8 + [1] * 32 + [0] * 24 + [1] * 8 + [0] * 28


@pytest.mark.parametrize("with_row", [False, True])
def test_kernel_matches_the_elementwise_formula(with_row):
    g = torch.Generator().manual_seed(0)
    n = 300
    p, m, grad = (torch.randn(n, generator=g) for _ in range(3))
    v = torch.rand(n, generator=g)
    ref = [t.double().clone() for t in (p, m, v, grad)]
    p, m, v, grad = (t.to(DEVICE) for t in (p, m, v, grad))
    row = torch.empty(n, dtype=torch.bfloat16, device=DEVICE) if with_row else None
    runs = decay_runs(n, [(16, 160)], block=64, device=DEVICE)
    coef = torch.tensor(0.5, device=DEVICE)
    lr, b1, b2, eps, wd, step = 1e-2, 0.9, 0.95, 1e-8, 0.1, 3
    fused_adamw_(p, m, v, grad, row, runs, coef, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step,
                 block=64)
    rp, rm, rv, rg = ref
    rg = rg * 0.5
    rp[16:160] *= 1 - lr * wd
    rm = rm + (1 - b1) * (rg - rm)
    rv = b2 * rv + (1 - b2) * rg * rg
    rp = rp - lr / (1 - b1**step) * rm / (rv.sqrt() / (1 - b2**step) ** 0.5 + eps)
    for got, want in ((p, rp), (m, rm), (v, rv)):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-6)
    assert (grad == 0).all()
    if with_row:
        want_row = p.to(torch.bfloat16)
        if DEVICE == "cuda":
            assert torch.equal(row, want_row)  # round to nearest even, as torch does
        else:
            # Triton's CPU interpreter cannot round fp32 to bf16 to nearest (numpy has no bf16): allow one ulp.
            ulp = (want_row.float().abs() * 2**-7).clamp_min(1e-30)
            assert ((row.float() - want_row.float()).abs() <= ulp).all()
