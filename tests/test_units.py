"""Whole-module hook sites (``units=``): what is gathered when, and compiled layers under ODCShard."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from odcfsdp import ODCShard
from odcfsdp.models import Llama, LlamaConfig, causal_lm_loss
from odcfsdp.models.llama import DecoderLayer
from odcfsdp.sharding import GroupState

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2)


def layer_groups(model: ODCShard, layer: nn.Module) -> set:
    ids = {id(p) for p in layer.parameters()}  # the sharded form outside forward
    return {g for g in model.groups if any(id(sp.sharded) in ids or id(sp.unsharded) in ids for sp in g.params)}


def test_next_layer_is_in_hand_when_it_starts():
    """With prefetch=1 each layer's group was gathered ahead (while the previous site ran); a unit is one group
    whatever the budget ([layout])."""
    torch.manual_seed(0)
    model = ODCShard(Llama(CFG), group_bytes=2 << 10, units=(DecoderLayer,), prefetch=1)
    layers = model.module.layers
    assert all(len(layer_groups(model, layer)) == 1 for layer in layers)
    missing = []
    for i, layer in enumerate(layers):  # runs before ODCShard's own pre-hook
        layer.register_forward_pre_hook(
            lambda _m, _a, i=i: missing.append(
                (i, sum(g.state is GroupState.SHARDED for g in layer_groups(model, layers[i])))),
            prepend=True)
    x = torch.randint(0, 64, (2, 8))
    model(x).float().sum().backward()  # the first forward records the order: nothing prefetched yet
    assert [m for _, m in missing] == [len(layer_groups(model, layer)) for layer in layers]
    missing.clear()
    model(x).float().sum().backward()
    assert missing == [(i, 0) for i in range(len(layers))]


def test_units_hook_fewer_sites_and_match_module_hooks():
    torch.manual_seed(0)
    ref = Llama(CFG)
    state = ref.state_dict()
    x = torch.randint(0, 64, (2, 8))
    grads = []
    for units in ((), (DecoderLayer,)):
        inner = Llama(CFG)
        inner.load_state_dict(state)
        model = ODCShard(inner, group_bytes=2 << 10, units=units)
        causal_lm_loss(model(x), x).backward()
        grads.append(grads_by_name(model))
        # embedding, final norm and head each a site; the layers one site each or 9 modules each;
        # two hooks per site and none per parameter (see [grad-buffers])
        assert model.engine.driver.sites == 3 + CFG.n_layers * (1 if units else 9)
        assert len(model.engine.driver.handles) == 2 * model.engine.driver.sites + 2  # and the root's two
        model.close()
    assert grads[0].keys() == grads[1].keys()
    for name, a in grads[0].items():
        torch.testing.assert_close(a, grads[1][name], rtol=0, atol=0, msg=name)


def grads_by_name(model: ODCShard) -> dict[str, torch.Tensor]:
    """Each parameter's summed gradient, read from its group's accumulator (one process: the row is the whole
    parameter), so that models grouped differently compare parameter by parameter."""
    out = {}
    for g in model.groups:
        for slot in g.layout.slots:
            numel = torch.Size(slot.shape).numel()
            out[slot.name] = g.accumulator[slot.offset:slot.offset + numel].clone()
    return out


def test_bad_units_are_refused():
    with pytest.raises(TypeError, match="nn.Module subclasses"):
        ODCShard(nn.Linear(4, 4), units=("DecoderLayer",))
    with pytest.raises(ValueError, match="no module of the model"):
        ODCShard(nn.Linear(4, 4), units=(DecoderLayer,))


def test_compiled_layers_share_one_graph_per_part():
    """Every layer runs the same two compiled parts (no graph per layer, no breaks, no recompiles)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**CFG.__dict__, "compile": True, "compile_backend": "aot_eager"})
    model = ODCShard(Llama(cfg), group_bytes=2 << 10, units=(DecoderLayer,))
    for seq in (10, 10, 13):  # a new length must not recompile: lengths are dynamic
        x = torch.randint(0, 64, (1, seq))
        causal_lm_loss(model(x, doc_lengths=[3, seq - 3]), x).backward()
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    model.close()


def test_compiled_layers_with_per_module_hooks_say_what_to_do():
    cfg = LlamaConfig(**{**CFG.__dict__, "compile": True, "compile_backend": "aot_eager"})
    model = ODCShard(Llama(cfg), group_bytes=2 << 10)
    with pytest.raises(RuntimeError, match=r"units=\(DecoderLayer,\)"):
        model(torch.randint(0, 64, (1, 6)))
    model.close()
