"""``ODCShard(mp_policy=MixedPrecisionPolicy(...))``: FSDP2's mixed-precision policy, against plain PyTorch with the
same semantics ([precision] in odcfsdp/sharding/groups/precision.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from odcfsdp import ODCShard
from odcfsdp.launch import spawn
from odcfsdp.app.shard_config import ShardConfig, shard_arguments
from parity import Run, mixed_precision_reference, sharded_run

BF16_REDUCE = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def test_bf16_reduce_equals_plain_pytorch_summing_gradients_in_bf16():
    """One process, two micro-batches per step: every gradient is rounded to bf16 and summed in bf16, then the fp32
    masters take the step, exactly as the reference does it; and that is not what fp32 accumulation gives."""
    run = Run(world_size=1, micro_batches=[2], steps=3)
    ref = mixed_precision_reference(run, "cpu", compute_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    got = sharded_run(run, torch.float32, 4096, reshard=True, mp_policy=BF16_REDUCE)
    fp32 = sharded_run(run, torch.float32, 4096, reshard=True)
    for k, v in ref["params"].items():
        torch.testing.assert_close(got["params"][k], v, rtol=1e-6, atol=1e-7, msg=k)
    assert sum(got["losses"], []) == pytest.approx(sum(ref["losses"], []), rel=1e-6)
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-6)
    assert _max_diff(fp32["params"], ref["params"]) > 1e-5  # the policy changes the numerics: the test can fail


def _two_ranks(micro_batches: list[int], replicas: int = 1) -> dict:
    return sharded_run(Run(world_size=2, micro_batches=micro_batches, steps=3), torch.float32, 4096, reshard=True,
                       comm="shm", mp_policy=BF16_REDUCE, replicas=replicas)


@pytest.mark.parametrize("micro_batches", [[1, 1], [0, 2]])
def test_bf16_reduce_on_two_ranks_with_uneven_micro_batches(micro_batches):
    """Two ranks push into the owners' bf16 accumulators. With two pushes per element the sum is the same in any
    order (round(round(a) + round(b)) is symmetric); with three, the order the ranks happen to arrive in decides
    roundings that Adam amplifies (bf16 addition is not associative), so no reference could follow it exactly."""
    run = Run(world_size=2, micro_batches=micro_batches, steps=3)
    ref = mixed_precision_reference(run, "cpu", compute_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    fp32 = mixed_precision_reference(run, "cpu", compute_dtype=torch.float32, reduce_dtype=torch.float32)
    got = spawn(_two_ranks, 2, micro_batches, timeout=180)
    for rank_out in got:
        for k, v in ref["params"].items():
            torch.testing.assert_close(rank_out["params"][k], v, rtol=0, atol=3e-4, msg=k)
        assert rank_out["norms"] == pytest.approx(ref["norms"], rel=1e-4)
    assert _max_diff(fp32["params"], ref["params"]) > 3e-3  # fp32 sums are far outside that tolerance


def test_bf16_reduce_across_hsdp_replicas():
    """HSDP 2 x 1: each replica's bf16 accumulator is summed over the replicas in bf16 at the sync ([hsdp])."""
    run = Run(world_size=2, micro_batches=[1, 1], steps=3)
    ref = mixed_precision_reference(run, "cpu", compute_dtype=torch.float32, reduce_dtype=torch.bfloat16)
    for rank_out in spawn(_two_ranks, 2, [1, 1], 2, timeout=180):
        for k, v in ref["params"].items():
            torch.testing.assert_close(rank_out["params"][k], v, rtol=0, atol=3e-4, msg=k)


def test_output_dtype_and_cast_forward_inputs():
    """Floating outputs are cast to output_dtype; floating inputs to param_dtype (a bf16 model takes fp32 inputs)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float64)
    bf16 = ODCShard(_copy(plain), mp_policy=policy)
    x = torch.randn(4, 6)
    out = bf16(x)
    assert out.dtype == torch.float64
    want = _copy(plain).to(torch.bfloat16)(x.to(torch.bfloat16))
    torch.testing.assert_close(out, want.to(torch.float64), rtol=0, atol=0)
    bf16.close()
    no_cast = ODCShard(_copy(plain), param_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):  # without the policy nothing is cast at the boundary: dtypes mismatch
        no_cast(x)
    no_cast.close()


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def test_config_keys_build_the_policy():
    """``shard.mp_policy.*`` (dtype names) becomes FSDP2's MixedPrecisionPolicy; unset keys mean no policy."""
    cfg = ShardConfig()
    built = type("Built", (), {"model": nn.Linear(2, 2)})()
    assert shard_arguments(cfg, built)["mp_policy"] is None
    cfg.mp_policy.reduce_dtype = "bfloat16"
    policy = shard_arguments(cfg, built)["mp_policy"]
    assert isinstance(policy, MixedPrecisionPolicy) and policy.reduce_dtype == torch.bfloat16
    assert policy.param_dtype is None and policy.cast_forward_inputs


def test_casts_reach_dataclass_outputs():
    """output_dtype casts tensors inside dataclass outputs too, as fully_shard's casting does."""
    from dataclasses import dataclass

    @dataclass
    class Out:
        logits: torch.Tensor

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return Out(self.lin(x))

    model = ODCShard(Model(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    assert model(torch.randn(2, 4)).logits.dtype == torch.float32
    model.close()
