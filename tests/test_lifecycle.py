"""When groups are gathered and freed, and what stays resident (single process and 2 ranks)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

from odcfsdp import ODCShard, param_groups
from odcfsdp.launch import spawn
from odcfsdp.models import Llama, LlamaConfig
from odcfsdp.sharding import GroupState

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2)


def llama() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


class GatherCounter:
    """Wraps a transport's gather to count calls and record the unsharded groups at each one."""

    def __init__(self, model: ODCShard):
        self.calls = 0
        self.max_resident = 0
        self.model = model
        inner = model.transport.gather

        def counted(g, out):
            self.calls += 1
            resident = sum(grp.state is GroupState.UNSHARDED for grp in model.groups)
            self.max_resident = max(self.max_resident, resident)
            inner(g, out)

        model.transport.gather = counted


def unsharded_bytes(model: ODCShard) -> int:
    return sum(g.unsharded.untyped_storage().nbytes() for g in model.groups)


@pytest.mark.parametrize("reshard", [True, False])
def test_gather_and_free_schedule(reshard):
    model = ODCShard(llama(), group_bytes=8 << 10, reshard_after_forward=reshard)
    n = len(model.groups)
    assert n > 10
    assert unsharded_bytes(model) == 0  # nothing resident after wrapping
    counter = GatherCounter(model)
    x = torch.randint(0, 64, (2, 8))

    logits = model(x)
    after_forward = unsharded_bytes(model)
    assert counter.calls == n
    logits.float().pow(2).mean().backward()
    assert unsharded_bytes(model) == 0  # always freed after backward
    assert all(g.grad_buffer is None for g in model.groups)  # gradient buffers pushed and dropped
    assert all(sp.unsharded.grad is None for g in model.groups for sp in g.params)
    if reshard:
        assert after_forward == 0
        assert counter.calls == 2 * n  # every group gathered again for backward
        assert counter.max_resident < n // 2  # only a few layers' groups at a time
    else:
        assert after_forward == sum(g.layout.unsharded_numel * 4 for g in model.groups)
        assert counter.calls == n


def test_no_grad_forward_always_reshards():
    model = ODCShard(llama(), group_bytes=8 << 10, reshard_after_forward=False)
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 4)))
    assert unsharded_bytes(model) == 0


def test_full_values_and_unsharded_context_match_original():
    ref = llama()
    model = ODCShard(copy.deepcopy(ref), group_bytes=4 << 10)
    state = model.full_state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(state[name], p)
    with model.unsharded():
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), name
    assert unsharded_bytes(model) == 0


def test_tied_parameter_reported_under_both_names():
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, tie_embeddings=True)
    model = ODCShard(Llama(cfg), group_bytes=4 << 10)
    state = model.full_state_dict()
    assert model.aliases == {"lm_head.weight": "embed_tokens.weight"}
    assert state["lm_head.weight"] is state["embed_tokens.weight"]


def test_load_full_state_dict_roundtrip():
    model = ODCShard(llama(), group_bytes=4 << 10)
    new = {k: torch.randn_like(v) for k, v in model.full_state_dict().items()}
    model.load_full_state_dict(new)
    got = model.full_state_dict()
    assert all(torch.equal(got[k], new[k]) for k in new)


def _two_rank_memory():
    """Per-rank resident bytes: row + master share one tensor in fp32, so ~P/N per group."""
    model = ODCShard(llama(), group_bytes=8 << 10)
    rows = sum(g.row.numel() for g in model.groups)
    accs = sum(g.accumulator.numel() for g in model.groups if g.accumulator is not None)
    master_is_row = all(g.read_master() is g.row for g in model.groups)
    return rows, accs, master_is_row, CFG.num_params()


def test_two_ranks_hold_half_the_values():
    for rows, accs, master_is_row, total in spawn(_two_rank_memory, 2):
        assert total / 2 <= rows < total / 2 * 1.2  # padding overhead stays small
        assert accs == rows  # every parameter is trained
        assert master_is_row  # fp32 compute: no second copy of the row


def test_frozen_groups_have_no_accumulator_and_do_not_move():
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    inner[0].requires_grad_(False)
    before = copy.deepcopy(inner[0].state_dict())
    model = ODCShard(inner, group_bytes=1 << 20)
    assert [g.layout.requires_grad for g in model.groups] == [False, True]
    assert model.groups[0].accumulator is None
    opt = torch.optim.AdamW(param_groups(model), lr=0.1, weight_decay=0.5)
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    assert model.module[0].weight.grad is None  # frozen: no gradient, ever
    state = model.full_state_dict()
    assert torch.equal(state["0.weight"], before["weight"]) and torch.equal(state["0.bias"], before["bias"])


def test_bf16_compute_keeps_fp32_masters():
    """param_dtype=bf16: compute in bf16, but updates smaller than a bf16 ulp still land in the fp32 masters,
    which are the parameters outside forward (what the optimizer updates and the user reads)."""
    ref = llama()
    model = ODCShard(copy.deepcopy(ref), group_bytes=8 << 10, param_dtype=torch.bfloat16)
    assert all(g.row.dtype == torch.bfloat16 for g in model.groups)
    assert all(g.master.dtype == torch.float32 and g.master is not g.row for g in model.groups)
    assert all(g.accumulator.dtype == torch.float32 for g in model.groups)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        got = model(x)
        want = ref(x).float()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)  # bf16 has an 8-bit mantissa

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)  # Adam moves every entry by ~lr: far
    model(x).float().pow(2).mean().backward()  # below bf16 ulps
    opt.step()
    opt.zero_grad()
    w = "layers.0.mlp.up_proj.weight"
    moved = (model.get_parameter(w).detach() - ref.get_parameter(w)).abs()
    assert 0.5e-5 < moved.max() < 2e-5  # the fp32 master (the parameter) moved by ~lr ...
    with torch.no_grad():
        model(x)  # the next forward publishes the masters (see [step-protocol])
    for g in model.groups:  # ... while the communicated row is the master rounded to bf16 (to nearest, ties even)
        assert torch.equal(g.row, g.master.to(torch.bfloat16))


class Checkpointed(nn.Module):
    """Runs ``inner`` under activation checkpointing (recomputed during backward)."""

    def __init__(self, inner: nn.Module, reentrant: bool):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=self.reentrant)


def grads_by_name(model: ODCShard) -> dict[str, torch.Tensor]:
    """N = 1: accumulator rows hold the full gradients, in the unsharded layout."""
    out = {}
    for g in model.groups:
        acc = g.accumulator
        if acc is not None:
            for i, s in enumerate(g.layout.slots):
                out[s.name] = g.layout.param_view(acc, i).clone()
    return out


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_keeps_memory_bounded_and_gradients_right(reentrant):
    ref = llama()
    inner = copy.deepcopy(ref)
    for i, layer in enumerate(inner.layers):
        inner.layers[i] = Checkpointed(layer, reentrant)
    model = ODCShard(inner, group_bytes=8 << 10, prefetch=1)
    counter = GatherCounter(model)
    x = torch.randint(0, 64, (2, 8))
    model(x).float().pow(2).mean().backward()
    ref(x).float().pow(2).mean().backward()
    got = grads_by_name(model)
    for name, p in ref.named_parameters():
        wrapped = re.sub(r"^layers\.(\d+)\.", r"layers.\1.inner.", name)
        torch.testing.assert_close(got[wrapped], p.grad, rtol=1e-5, atol=1e-7)
    # One layer's groups plus the prefetched one (6 of 18 here); without backward-order prefetch
    # during recomputation it was 8 and grew with depth.
    assert counter.max_resident + 1 <= 6
    assert unsharded_bytes(model) == 0


def test_frozen_backbone_is_freed_during_backward():
    inner = llama()
    for name, p in inner.named_parameters():
        # Only the input embedding trains: gradients must flow back through every frozen layer.
        p.requires_grad_(name.startswith("embed_tokens"))
    model = ODCShard(inner, group_bytes=8 << 10, prefetch=1)
    frozen = sum(not g.layout.requires_grad for g in model.groups)
    assert frozen > 10
    counter = GatherCounter(model)
    model(torch.randint(0, 64, (2, 8))).float().pow(2).mean().backward()
    # Each frozen group is released once backward has passed all its modules (without that: all 18);
    # modules sharing an input (the q/k/v projections) are through together, when its gradient is.
    assert counter.max_resident + 1 <= 4
    assert counter.calls == 2 * len(model.groups)  # once in forward, once in backward: no re-gathers
    assert unsharded_bytes(model) == 0


class Branchy(nn.Module):
    """A branch that only runs when asked: its group is first used after the first forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b=False):
        x = self.a(x)
        if use_b:
            x = self.b(x)
        return self.c(x)


def test_branch_first_used_after_the_first_forward():
    torch.manual_seed(0)
    ref = Branchy()
    model = ODCShard(copy.deepcopy(ref), group_bytes=256, prefetch=2)
    x = torch.randn(3, 8)
    model(x).sum().backward()
    out = model(x, use_b=True)
    torch.testing.assert_close(out, ref(x, use_b=True))
    out.sum().backward()


def test_closed_model_refuses_use():
    model = ODCShard(nn.Linear(4, 4))
    model.close()
    for use in (lambda: model(torch.randn(1, 4)), model.full_state_dict, lambda: model.unsharded().__enter__()):
        with pytest.raises(RuntimeError, match="was closed"):
            use()
    model.close()  # idempotent


class Reused(nn.Module):
    """One linear layer applied twice: its weight's gradient is complete only after both uses' backward."""

    def __init__(self):
        super().__init__()
        self.inner, self.out = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def test_gradients_are_pushed_once_per_group_and_none_is_lost():
    """Autograd accumulates into the group buffers (see [grad-buffers]): one push per trained group in a
    plain model; a module used twice gets its gradient after its first post-backward, which the
    end-of-backward callback pushes as well."""
    torch.manual_seed(0)
    plain = llama()
    model = ODCShard(copy.deepcopy(plain), group_bytes=8 << 10)
    x = torch.randint(0, 64, (2, 8))
    model(x).float().pow(2).mean().backward()
    plain(x).float().pow(2).mean().backward()
    assert model.pending_pushes == sum(g.layout.requires_grad for g in model.groups)
    assert all(sp.unsharded.grad is None for g in model.groups for sp in g.params)
    got = grads_by_name(model)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7)

    ref = Reused()
    model = ODCShard(copy.deepcopy(ref), group_bytes=1 << 20)
    x = torch.randn(4, 8, requires_grad=True)
    model(x * 2).pow(2).sum().backward()  # (an input from another op, as inside a model: not a leaf)
    ref(x * 2).pow(2).sum().backward()
    got = grads_by_name(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-6, atol=1e-7)
    assert model.pending_pushes == 2  # the group's buffer after the site's first post-backward, then the late part
    assert all(sp.unsharded.grad is None for g in model.groups for sp in g.params)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_training_step_leaves_no_cyclic_garbage(checkpointed):
    """odc adds no object that waits for Python's cycle collector, whose full collections over a compiled model's
    millions of objects cost half a second (an odc step on one H200 at 712e730: 0.56 s in GC; torch's
    ``tree_flatten`` made a cycle per hook call). The reference is the same loop on the plain model: it leaves no
    cyclic garbage, and with recomputation what torch's checkpoint leaves (odc's step must leave the same count)."""
    import dataclasses
    import gc

    cfg = dataclasses.replace(CFG, activation_checkpointing=checkpointed)

    def step(model, opt) -> None:
        x = torch.randint(0, cfg.vocab_size, (2, 16))
        for _ in range(2):  # a minibatch of two micro-batches
            model(x).float().mean().backward()
        opt.step()
        opt.zero_grad()

    found = {}
    for name in ("plain", "odc"):
        torch.manual_seed(0)
        model = Llama(cfg)
        if name == "odc":
            model = ODCShard(model, 4096, units=(type(model.layers[0]),))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step(model, opt)  # the first step makes the optimizer's state
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            step(model, opt)
            gc.collect()
            found[name] = len(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        if isinstance(model, ODCShard):
            model.close()
    assert found["odc"] == found["plain"], found
    assert checkpointed or found["plain"] == 0
