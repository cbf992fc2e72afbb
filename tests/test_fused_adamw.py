"""The fused AdamW kernel against the unfused update (Triton's interpreter on CPU, real kernels on GPUs)."""

from __future__ import annotations

import copy

import pytest
import torch

from odcfsdp import ODCShard, optim
from odcfsdp.kernels.adamw import decay_runs, fused_adamw_
from odcfsdp.kernels.split_master import join_master, split_master_

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


def test_kernel_on_a_split_master_matches_the_fp32_one():
    """The bf16 row + low bits give the fp32 master the same update, and are stored back exactly."""
    g = torch.Generator().manual_seed(0)
    n = 300
    p, m, grad = (torch.randn(n, generator=g).to(DEVICE) for _ in range(3))
    v = torch.rand(n, generator=g).to(DEVICE)
    row, lo = torch.empty(n, dtype=torch.bfloat16, device=DEVICE), torch.empty(n, dtype=torch.int16, device=DEVICE)
    split_master_(p, row, lo)
    assert torch.equal(join_master(row, lo), p)
    runs = decay_runs(n, [(16, 160)], block=64, device=DEVICE)
    args = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=3, block=64)
    m2, v2, grad2 = m.clone(), v.clone(), grad.clone()
    coef = torch.tensor(0.5, device=DEVICE)
    fused_adamw_(p, m, v, grad, None, runs, coef, **args)
    fused_adamw_(None, m2, v2, grad2, row, runs, coef, master_lo=lo, **args)
    assert torch.equal(join_master(row, lo), p) and torch.equal(m2, m) and torch.equal(v2, v)
    want_row, want_lo = torch.empty_like(row), torch.empty_like(lo)
    split_master_(p, want_row, want_lo)
    assert torch.equal(row.view(torch.int16), want_row.view(torch.int16)) and torch.equal(lo, want_lo)
    assert (grad2 == 0).all()


class _Mlp(torch.nn.Module):
    """Dense layers only, so that both runs see bitwise equal gradients on GPUs too.

    The first version of this test trained a Llama and failed on 2x H200 at its embedding (the
    first parameter compared; the size of the difference was not recorded), while the kernel-level
    test passed; the suspect is the embedding's backward, which need not add repeated tokens in
    the same order twice, and Adam turns last-bit gradient differences near zero into visible
    parameter differences. A dense model keeps the test about the optimizer.
    """

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(24, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.fc2 = torch.nn.Linear(48, 24)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])  # bf16: split masters
def test_fused_optimizer_tracks_the_unfused_one(param_dtype):
    torch.manual_seed(0)
    base = _Mlp().to(DEVICE)
    runs = []
    for fused in (False, True):
        model = ODCShard(copy.deepcopy(base), 4096, param_dtype=param_dtype)
        opt = optim.AdamW(model, lr=1e-2, weight_decay=0.1, eps=1e-6, no_decay=["*norm*"], fused=fused)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(8, 24, generator=g).to(DEVICE, param_dtype)
            model(x).float().pow(2).mean().backward()
            opt.step(max_norm=0.05)  # clipping active
        runs.append(model.full_state_dict())
        model.close()
    moved = max((runs[0][k] - base.state_dict()[k]).abs().max().item() for k in runs[0])
    assert moved > 1e-3  # the steps did something
    for k in runs[0]:
        err = (runs[1][k] - runs[0][k]).abs().max().item()
        torch.testing.assert_close(runs[1][k], runs[0][k], rtol=1e-5, atol=1e-6, msg=f"{k}: max abs diff {err:.2e}")


def test_fused_refuses_float64_masters():
    model = ODCShard(torch.nn.Linear(3, 3).double())
    with pytest.raises(ValueError, match="fused AdamW needs fp32 master rows"):
        optim.AdamW(model, fused=True)
