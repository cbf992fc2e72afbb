"""The FSDP2 contract on ODCShard, beyond training parity (tests/test_parity.py): parameters are DTensor shards
outside forward with the reduced gradient shard as ``.grad``, ``torch.distributed.checkpoint`` saves and restores
model and optimizer, ``torch.compile`` works per layer and on the whole model, and the wrapper passes through what
users of the wrapped model expect (its names, ``config``, ``generate``, buffers in state dicts)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from odcfsdp import ODCShard, param_groups
from odcfsdp.launch import spawn
from odcfsdp.models import Llama, LlamaConfig, causal_lm_loss
from odcfsdp.models.llama import DecoderLayer
from parity import ParityModel, Run

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


# -- parameters and gradients -----------------------------------------------------------------------
def _shards_and_grads(micro_batches: list[int]) -> dict:
    rank = dist.get_rank()
    run = Run(len(micro_batches), micro_batches)
    model = ODCShard(ParityModel(), 4096, comm="shm")
    model.set_gradient_divide_factor(1.0)  # sum: the reference sums over ranks (losses / the global token count)
    before = {n: (type(p), p.placements, tuple(p.shape), p.to_local().clone()) for n, p in model.named_parameters()}
    for x, y in run.data[0][rank]:
        causal_lm_loss(model(x), y, run.tokens(0)).backward()
    grads = {n: (type(p.grad), p.grad.placements, p.grad.to_local().clone()) for n, p in model.named_parameters()
             if p.requires_grad}
    model.close()
    return {"params": before, "grads": grads}


def test_parameters_are_dtensor_shards_and_grads_the_reduced_shards():
    """Outside forward each parameter is a DTensor (global shape, Shard(0)) whose local tensor is torch.chunk's
    piece of the value; after the micro-batches (2 on one rank, 0 on the other) .grad is the piece of the
    gradient of the whole minibatch, the sum over every rank's data."""
    run = Run(2, [2, 0])
    plain = ParityModel()
    want_params = {n: p.detach().clone() for n, p in plain.named_parameters()}
    for x, y in run.data[0][0]:
        causal_lm_loss(plain(x), y, run.tokens(0)).backward()
    for rank, got in enumerate(spawn(_shards_and_grads, 2, [2, 0])):
        for name, (cls, placements, shape, local) in got["params"].items():
            assert issubclass(cls, DTensor) and placements == (Shard(0),) and shape == tuple(want_params[name].shape)
            chunks = torch.chunk(want_params[name], 2, dim=0)
            assert torch.equal(local, chunks[rank] if rank < len(chunks) else want_params[name][:0]), name
        assert set(got["grads"]) == {n for n, p in plain.named_parameters() if p.requires_grad}
        for name, (cls, placements, local) in got["grads"].items():
            assert issubclass(cls, DTensor) and placements == (Shard(0),)
            chunks = torch.chunk(plain.get_parameter(name).grad, 2, dim=0)
            want = chunks[rank] if rank < len(chunks) else plain.get_parameter(name).grad[:0]
            torch.testing.assert_close(local, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_grad_is_none_until_something_was_accumulated():
    """As in plain PyTorch: no gradient before a backward or after zero_grad; the gradient after one."""
    torch.manual_seed(0)
    model = ODCShard(nn.Linear(3, 2))
    assert all(p.grad is None for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    assert torch.equal(model.module.bias.grad, torch.full((2,), 4.0))
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# -- torch.distributed.checkpoint ---------------------------------------------------------------------
def _steps(model, opt, run, steps, rank):
    losses = []
    for step in steps:
        for x, y in run.data[step][rank]:
            loss = causal_lm_loss(model(x), y, run.tokens(step))
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_norm)
        opt.step()
        opt.zero_grad()
    return losses


def _full_optimizer_state(opt) -> dict:
    return {p._odc.name: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in opt.state[p].items()}
            for g in opt.param_groups for p in g["params"]}


def _dcp_round_trip(path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = dist.get_rank()
    # Uneven, and every accumulator element gets its adds in one order: rank 0's two pushes, one after the other
    # (with [2, 1] rank 1's push may land before, between or after them, and fp32 sums of three depend on the order).
    run = Run(2, [2, 0], steps=4)
    model = ODCShard(ParityModel(), 4096, comm="shm")
    opt = torch.optim.AdamW(param_groups(model), lr=run.lr, weight_decay=run.weight_decay, eps=run.eps)
    _steps(model, opt, run, range(2), rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = {"params": model.full_state_dict(), "opt": _full_optimizer_state(opt)}
    then = _steps(model, opt, run, range(2, 4), rank)

    fresh = ODCShard(ParityModel(), 4096, comm="shm")
    with fresh.changing_parameters(), torch.no_grad():  # other values, all of them overwritten by the load
        for p in fresh.parameters():
            p.mul_(-3.0)
    fresh_opt = torch.optim.AdamW(param_groups(fresh), lr=run.lr, weight_decay=run.weight_decay, eps=run.eps)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = {"params": fresh.full_state_dict(), "opt": _full_optimizer_state(fresh_opt)}
    again = _steps(fresh, fresh_opt, run, range(2, 4), rank)
    model.close()
    fresh.close()
    return {"saved": saved, "loaded": loaded, "then": then, "again": again}


def test_dcp_get_and_set_state_dict_round_trip(tmp_path):
    """torch.distributed.checkpoint's get_state_dict / dcp.save / dcp.load / set_state_dict restore model and
    optimizer exactly (uneven micro-batches), and training continues exactly as without the round trip."""
    for rank, out in enumerate(spawn(_dcp_round_trip, 2, str(tmp_path / "dcp"))):
        for name, value in out["saved"]["params"].items():
            assert torch.equal(out["loaded"]["params"][name], value), name
        assert out["saved"]["opt"].keys() == out["loaded"]["opt"].keys()
        for name, state in out["saved"]["opt"].items():
            assert {"step", "exp_avg", "exp_avg_sq"} <= state.keys()
            for key, value in state.items():
                assert torch.equal(out["loaded"]["opt"][name][key], value), (name, key)
        assert out["again"] == out["then"] and len(out["then"]) == [2, 0][rank] * 2


# -- torch.compile ----------------------------------------------------------------------------------
def _compiled_run(how: str, backend: str, device: str = "cpu") -> list[float]:
    """Losses of 3 steps of a tiny Llama (one rank, fp32), plain or ODCShard, compiled ``how``."""
    torch.manual_seed(0)
    model = Llama(CFG).to(device)
    if how.startswith("odc"):
        model = ODCShard(model, 4096, units=(DecoderLayer,), param_dtype=torch.float32)
    inner = model.module if isinstance(model, ODCShard) else model
    if how.endswith("layers"):
        for layer in inner.layers:
            layer.compile(backend=backend)
    else:
        model.compile(backend=backend)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, CFG.vocab_size, (2, 12), generator=g).to(device)
        loss = causal_lm_loss(model(x), x, x.numel())
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("target, backend", [("layers", "inductor"), ("model", "aot_eager")])
def test_compile_under_odcshard_matches_the_compiled_plain_model(target, backend):
    """layer.compile() per block (CPU inductor) and model.compile() on the wrapper train like the same compile of
    the plain model: ODCShard's hooks are graph breaks, run eagerly, outside the compiled code."""
    torch._dynamo.reset()
    want = _compiled_run(f"plain-{target}", backend)
    torch._dynamo.reset()
    got = _compiled_run(f"odc-{target}", backend)
    assert want[-1] < want[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


# -- what the wrapper passes through ------------------------------------------------------------------
class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.lin(x))


def test_state_dict_is_nn_module_compatible_and_keeps_buffers():
    torch.manual_seed(0)
    plain = WithBatchNorm()
    model = ODCShard(copy.deepcopy(plain))
    x = torch.randn(8, 4)
    model(x).sum().backward()  # training mode: running statistics move
    plain(x)
    sd = model.state_dict()
    assert list(sd) == list(plain.state_dict())  # the wrapped model's names, no "module." prefix
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        torch.testing.assert_close(sd[name], plain.state_dict()[name])
    assert set(model.state_dict(prefix="net.", keep_vars=True)) == {f"net.{k}" for k in sd}
    assert model.state_dict(keep_vars=True)["lin.weight"] is model.module.lin.weight

    other = ODCShard(WithBatchNorm())
    other.load_state_dict(sd)  # shards of the same layout
    assert all(torch.equal(a, b) for a, b in zip(other.full_state_dict().values(), model.full_state_dict().values()))
    assert torch.equal(other.module.bn.running_mean, model.module.bn.running_mean)
    full = {k: v.clone() + 1 for k, v in plain.state_dict().items()}
    other.load_state_dict(full)  # full tensors: each rank takes its rows
    assert torch.equal(other.full_state_dict()["lin.weight"], full["lin.weight"])
    missing, unexpected = other.load_state_dict({"lin.weight": full["lin.weight"], "extra": torch.zeros(1)},
                                                strict=False)
    assert "lin.bias" in missing and unexpected == ["extra"]
    with pytest.raises(RuntimeError, match=r"missing keys \['bn.bias'"):
        other.load_state_dict({k: v for k, v in full.items() if k != "bn.bias"})
    with pytest.raises(RuntimeError, match="size mismatch for lin.weight"):
        other.load_state_dict({**full, "lin.weight": torch.zeros(3, 3)})


def test_attributes_and_generate_pass_through_to_the_wrapped_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg).eval()
    model = ODCShard(copy.deepcopy(plain)).eval()
    assert model.config is model.module.config and model.config.hidden_size == 32
    prompt = torch.randint(0, 64, (2, 5))
    want = plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert all(g.state.name == "SHARDED" for g in model.groups)  # every generation step freed what it gathered
