"""Sharded training matches a plain single-process PyTorch run (CPU, gloo, spawned ranks)."""

from __future__ import annotations

import pytest
import torch

from odcfsdp.launch import spawn
from parity import FROZEN, Run, reference_run, sharded_run

# fp32: rtol 1e-5; the absolute floor (1e-4 of one Adam step, lr = 1e-2) covers entries near
# zero, where a relative bound is below one ulp. float64 shows the algorithm itself is exact.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-14)}


def check_against_reference(run: Run, results: list[dict], dtype: torch.dtype) -> None:
    ref = reference_run(run, dtype)
    tol = TOL[dtype]
    for step in range(run.steps):
        flat, start = ref["losses"][step], 0
        for rank, res in enumerate(results):
            got = res["losses"][step]
            want = flat[start : start + len(got)]
            start += len(got)
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), **tol,
                                       msg=lambda m: f"step {step} rank {rank} losses: {m}")
        for res in results:
            torch.testing.assert_close(res["norms"][step], ref["norms"][step], **tol)
    assert max(ref["norms"]) > run.max_norm, "clipping was never active; the test would not cover it"
    for res in results:
        assert set(res["params"]) >= set(ref["params"])
        for name, want in ref["params"].items():
            torch.testing.assert_close(res["params"][name], want, **tol, msg=lambda m: f"{name}: {m}")
    assert torch.equal(results[0]["params"][FROZEN], ref["params"][FROZEN])


@pytest.mark.parametrize(
    "world_size, reshard, group_bytes, dtype",
    [
        (2, True, 4096, torch.float32),
        (2, False, 32 << 20, torch.float32),
        (3, True, 16384, torch.float32),
        (3, False, 4096, torch.float32),
        (3, True, 4096, torch.float64),
    ],
)
def test_parity_collective(world_size, reshard, group_bytes, dtype):
    run = Run(world_size, micro_batches=[2] * world_size)
    results = spawn(sharded_run, world_size, run, dtype, group_bytes, reshard)
    if group_bytes == 4096:
        assert results[0]["groups"] > 5  # many small groups, parameters bigger than a group
    check_against_reference(run, results, dtype)


def test_parity_single_process():
    """N = 1 without torch.distributed: no communication at all."""
    run = Run(1, micro_batches=[3])
    check_against_reference(run, [sharded_run(run, torch.float32, 4096, True)], torch.float32)
