"""Bad input gives clear errors (single process unless stated)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from odcfsdp import ODCShard, param_groups
from odcfsdp.launch import spawn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


@pytest.mark.parametrize("bad", [0, -4, 2.5, "32MiB", None, False])
def test_invalid_group_bytes(bad):
    with pytest.raises(ValueError, match="group_bytes must be a positive int"):
        ODCShard(mlp(), bad)


def test_mixed_dtypes_need_param_dtype():
    model = mlp()
    model[2].double()
    with pytest.raises(ValueError, match="mixed dtypes.*param_dtype"):
        ODCShard(model)
    # With one compute dtype it works: groups split by storage dtype, masters keep each dtype's precision.
    sharded = ODCShard(model, param_dtype=torch.float32)
    assert {g.layout.dtype for g in sharded.groups} == {torch.float32, torch.float64}
    assert sharded(torch.randn(2, 5)).shape == (2, 3)


def test_integer_parameter_rejected():
    model = mlp()
    model.register_parameter("count", nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
    with pytest.raises(ValueError, match="'count' has dtype torch.int64"):
        ODCShard(model)


def test_wrapping_twice_and_empty_module():
    with pytest.raises(TypeError, match="once"):
        ODCShard(ODCShard(mlp()))
    with pytest.raises(ValueError, match="no parameters"):
        ODCShard(nn.ReLU())


def test_step_without_backward_changes_nothing():
    """As in plain PyTorch: an optimizer step with no backward on any rank sees no gradients and does nothing,
    weight decay included."""
    model = ODCShard(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    before = model.full_state_dict()
    opt.step()
    assert all(torch.equal(v, model.full_state_dict()[k]) for k, v in before.items())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    opt.zero_grad()
    after = model.full_state_dict()
    opt.step()  # the gradients were consumed by the first step
    assert all(torch.equal(v, model.full_state_dict()[k]) for k, v in after.items())


def _step_without_backward_on_all_ranks():
    model = ODCShard(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    before = model.full_state_dict()
    opt.step()
    same = all(torch.equal(v, model.full_state_dict()[k]) for k, v in before.items())
    model.close()
    return same


def test_step_without_backward_two_ranks():
    assert spawn(_step_without_backward_on_all_ranks, 2) == [True, True]


def test_parameter_replaced_after_wrapping():
    inner = mlp()
    model = ODCShard(inner)
    inner[0].weight = nn.Parameter(torch.zeros(7, 5))
    with pytest.raises(RuntimeError, match=r"'0.weight' was replaced after ODCShard wrapped"):
        model(torch.randn(2, 5))


def test_parameter_added_after_wrapping():
    inner = mlp()
    model = ODCShard(inner)
    inner.append(nn.Linear(3, 3))
    with pytest.raises(RuntimeError, match="must not be added or removed after wrapping"):
        model(torch.randn(2, 5))


def test_parameter_data_reassigned_or_unfrozen_after_wrapping():
    inner = mlp()
    model = ODCShard(inner)
    inner[2].bias.data = torch.zeros(4)
    with pytest.raises(RuntimeError, match="'2.bias' had its data reassigned"):
        model(torch.randn(2, 5))
    inner = mlp()
    inner[0].bias.requires_grad_(False)
    model = ODCShard(inner)
    inner[0].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match="'0.bias' was frozen when the model was sharded"):
        model(torch.randn(2, 5))


def test_param_groups_argument_errors():
    with pytest.raises(TypeError, match="list of names"):
        param_groups(ODCShard(mlp()), no_decay="*.bias")


def test_load_full_state_dict_mismatch():
    model = ODCShard(mlp())
    state = model.full_state_dict()
    with pytest.raises(KeyError, match=r"missing \['0.bias'\]"):
        model.load_full_state_dict({k: v for k, v in state.items() if k != "0.bias"})
    with pytest.raises(ValueError, match=r"'2.weight': shape \(3, 6\)"):
        model.load_full_state_dict({**state, "2.weight": torch.zeros(3, 6)})


def test_unknown_comm():
    with pytest.raises(ValueError, match="comm='carrier-pigeon' is not a known transport"):
        ODCShard(mlp(), comm="carrier-pigeon")


def test_not_initialised_means_single_process():
    assert not dist.is_initialized()
    model = ODCShard(mlp())
    assert (model.rank, model.world_size) == (0, 1)


def test_moving_or_casting_after_wrapping_is_refused():
    model = ODCShard(mlp())
    for move in (lambda m: m.to(torch.float64), lambda m: m.double(), lambda m: m.to("cpu"),
                 lambda m: m.module.double(), lambda m: m.module[2].half(), lambda m: m.module.to("cpu")):
        with pytest.raises(RuntimeError, match="before wrapping"):
            move(model)
    model.train()
    model.eval()  # mode switches stay allowed
    assert model(torch.randn(2, 5)).dtype == torch.float32
