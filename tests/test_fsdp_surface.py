"""[fsdp-surface]: a ``fully_shard`` module is torch's ``FSDPModule``, and each of ``FSDPModule``'s methods in the
installed torch behaves as FSDP2's (by ODC's means), is accepted where its setting is moot, or is refused in one line
before anything changes. One process; the 2-rank behaviours are in tests/test_fully_shard*.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from odcfsdp import fully_shard
from odcfsdp.models import Llama, LlamaConfig, causal_lm_loss
from odcfsdp.sharding.api.fsdp_surface import FSDP_METHODS, FSDPSurface
from odcfsdp.sharding.api.odc_module import ODCModule

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


def _sharded() -> torch.nn.Module:
    torch.manual_seed(0)
    model = Llama(CFG)
    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _methods() -> list[str]:
    return [n for n, f in vars(FSDPModule).items() if callable(f) and not n.startswith("__")]


def test_a_fully_shard_module_is_an_fsdp_module_and_answers_every_method_itself():
    """isinstance holds (what accelerate and trainers test), and no FSDPModule method of this torch runs FSDP2's own
    code on our modules: each is defined by ODCModule or FSDPSurface and listed, with its kind, in FSDP_METHODS (a
    torch that adds a method fails here until it is answered)."""
    model = _sharded()
    try:
        assert isinstance(model, FSDPModule) and isinstance(model.layers[0], FSDPModule)
        assert type(model).__mro__[type(model)._orig_cls_mro_index] is Llama
        for name in _methods():
            owner = next(c for c in type(model).__mro__ if name in vars(c))
            assert owner in (ODCModule, FSDPSurface), f"{name} would run FSDPModule's own code"
            assert FSDP_METHODS[name][0] in ("same", "moot", "refused"), name
        assert set(FSDP_METHODS) >= set(_methods())
    finally:
        model._odc_engine.close()


def test_refused_methods_say_why_in_one_line_and_change_nothing():
    model = _sharded()
    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        calls = {"set_custom_all_gather": (None,), "set_custom_reduce_scatter": (None,),
                 "set_all_reduce_hook": (lambda t: None,), "set_unshard_in_backward": (False,)}
        assert set(calls) | {"_apply"} == {n for n, (k, _) in FSDP_METHODS.items() if k == "refused"}
        for name, args in calls.items():
            with pytest.raises(NotImplementedError, match=rf"^{name} is not supported by odcfsdp: [^\n]+$"):
                getattr(model, name)(*args)
        with pytest.raises(RuntimeError, match="move or cast the model before"):
            model.float()
        model.set_unshard_in_backward(True)  # the default is accepted
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), before[n]), n
    finally:
        model._odc_engine.close()


def test_moot_settings_are_accepted_and_checked():
    model = _sharded()
    try:
        moot = [n for n, (k, _) in FSDP_METHODS.items() if k == "moot" and n != "set_symm_mem_for_comm"]
        for name in moot:
            getattr(model, name)(True)
            getattr(model, name)(False)
            with pytest.raises(ValueError, match="True or False"):
                getattr(model, name)(1)
        model.set_symm_mem_for_comm()
        with pytest.raises(ValueError, match="backend='NCCL'"):
            model.set_symm_mem_for_comm("GLOO")
    finally:
        model._odc_engine.close()


def test_same_methods_act_as_fsdp2s():
    """The divide factor's old name, the bound on buffers in flight ([streams] 2), the post-optimizer event."""
    model = _sharded()
    try:
        model.set_reduce_scatter_divide_factor(4.0)
        assert model._odc_engine.minibatch.divide_factor == 4.0
        model.set_reduce_scatter_max_input_buffers(3)
        assert model._odc_engine.comm.pushes_in_flight == 3
        for bad in (0, True, 1.5):
            with pytest.raises(ValueError, match="max_input_buffers"):
                model.set_reduce_scatter_max_input_buffers(bad)
        model.set_post_optim_event(torch.Event("cpu") if hasattr(torch, "Event") else None)  # CPU: nothing to order
    finally:
        model._odc_engine.close()


def _grads_after(model, fail_first: bool) -> dict[str, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    if fail_first:  # backward raises in the middle: the first layer's gradient hook throws once
        handle = model.layers[0].register_full_backward_pre_hook(lambda *_: (_ for _ in ()).throw(ValueError("x")))
        with pytest.raises(ValueError):
            causal_lm_loss(model(x), x).backward()
        handle.remove()
        model.reset_iter_state()
        torch.optim.SGD(model.parameters(), lr=0.0).zero_grad()  # FSDP2's recovery: drops what the pass pushed
    causal_lm_loss(model(x), x).backward()
    return {n: getattr(p.grad, "full_tensor", p.grad.clone)().clone() for n, p in model.named_parameters()}


def test_reset_iter_state_after_a_failed_backward_trains_as_if_it_had_not_happened():
    """An exception mid-backward leaves a pass half pushed; reset_iter_state and zero_grad, then the next backward
    gives the gradients a fresh model gives (without the reset: the next test)."""
    want = _grads_after(_sharded(), fail_first=False)
    model = _sharded()
    got = _grads_after(model, fail_first=True)
    assert model._odc_engine.lifecycle.phase.name == "IDLE"
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=0, atol=0, msg=n)


def test_design_table_of_fsdp_methods_is_the_generated_one():
    """docs/design.md's table is ``fsdp_methods_table()`` verbatim (regenerate it when FSDP_METHODS changes)."""
    from pathlib import Path

    from odcfsdp.sharding.api.fsdp_surface import fsdp_methods_table

    assert fsdp_methods_table() in (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()


def test_fully_shard_takes_the_engines_settings_in_one_object():
    """``fully_shard(..., settings=EngineSettings(...))``: ODCShard's own arguments reach the one engine; every call of
    a model passes equal ones (refused in one line otherwise, before anything changes), and bad values are refused
    where the object is made."""
    from odcfsdp import EngineSettings, sharded

    ours = EngineSettings(group_bytes=1 << 12, prefetch=2, timeout=30.0, overlap_push=False)
    torch.manual_seed(0)
    model = Llama(CFG)
    for layer in model.layers:
        fully_shard(layer, settings=ours)
    with pytest.raises(ValueError, match="must share engine"):
        fully_shard(model)  # the default settings differ from the blocks'
    fully_shard(model, settings=ours)
    engine = sharded(model).engine
    try:
        assert engine.lifecycle.prefetch.depth == 2 and engine.mesh.timeout_s == 30.0
        assert engine.comm.push_stream is None  # overlap_push=False
        outside = [g for g in engine.groups if not g.layout.slots[0].name.startswith("layers.")]
        assert [len(g.layout.slots) for g in outside] == [1, 1, 1]  # 4 KiB: embedding, norm, head apart
    finally:
        engine.close()
    for bad in (dict(group_bytes=0), dict(prefetch=-1), dict(timeout=0), dict(gather_masters=1)):
        with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
            EngineSettings(**bad)
    with pytest.raises(TypeError, match="settings must be an odcfsdp.EngineSettings"):
        fully_shard(Llama(CFG), settings={"prefetch": 2})


FORWARD_AFTER_A_FAILED_BACKWARD = """
import torch
from odcfsdp import fully_shard
from odcfsdp.models import Llama, LlamaConfig, causal_lm_loss

model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
for layer in model.layers:
    fully_shard(layer)
fully_shard(model)
x = torch.randint(0, 64, (2, 8))
handle = model.layers[0].register_full_backward_pre_hook(lambda *_: (_ for _ in ()).throw(ValueError("x")))
try:
    causal_lm_loss(model(x), x).backward()
except ValueError:
    pass
handle.remove()
model(x)  # no reset_iter_state
"""


def test_a_forward_after_a_failed_backward_is_one_error_not_a_crash():
    """In a process of its own (it used to end in a segmentation fault): the forward after a backward that raised,
    without ``reset_iter_state``, exits with code 1 and one line that names FSDP2's recovery."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", FORWARD_AFTER_A_FAILED_BACKWARD], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: a backward pass raised before it ended") and \
        "call model.reset_iter_state() and then opt.zero_grad()" in last, last


def _introspect() -> dict:
    """On a rank: torch's ``fully_shard.state`` over the same model sharded by torch's fully_shard and by ours (the
    embedding and head as FSDP2's list form), and each unit's managed parameters."""
    import torch.distributed.fsdp as torch_fsdp

    import odcfsdp

    def shard(api) -> torch.nn.Module:
        torch.manual_seed(0)
        model = Llama(CFG)
        for layer in model.layers:
            api(layer)
        api([model.embed_tokens, model.norm])
        return api(model)

    out = {}
    for name, api in (("torch", torch_fsdp.fully_shard), ("odc", odcfsdp.fully_shard)):
        model = shard(api)
        units, managed = [], {}
        for mod_name, m in model.named_modules():
            state = torch_fsdp.fully_shard.state(m)
            if state is None:
                continue
            assert api.state(m) is state  # each front door's own lookup agrees with torch's
            units.append(mod_name)
            names = {id(p): n for n, p in model.named_parameters()}
            if name == "torch":
                params = [fp._module_info.module._parameters[fp._module_info.param_name]
                          for fp in state._fsdp_param_group.fsdp_params]
            else:
                params = state.managed_params()
            managed[mod_name] = sorted(names[id(p)] for p in params)
        out[name] = (units, managed)
        try:  # torch's fully_shard refuses a second call on a unit of either
            torch_fsdp.fully_shard(model.layers[0])
            out[name + "_again"] = "accepted"
        except AssertionError as e:
            out[name + "_again"] = "already been applied" in str(e)
    return out


def test_torchs_fully_shard_state_sees_our_units_as_fsdp2s():
    """FSDP2's public introspection on both: torch's ``fully_shard.state(m)`` is set on the same modules, a list
    form's modules share one state, each unit manages the same parameters (FSDP2's walk stops at units below), and
    torch's ``fully_shard`` refuses a second call on a unit of either."""
    from odcfsdp.launch import spawn

    for out in spawn(_introspect, 2):
        assert out["odc"] == out["torch"]
        units, managed = out["odc"]
        assert units == ["", "embed_tokens", "layers.0", "layers.1", "norm"]
        assert managed[""] == ["lm_head.weight"]
        assert managed["embed_tokens"] == managed["norm"] == ["embed_tokens.weight", "norm.weight"]
        assert all(n.startswith("layers.0.") for n in managed["layers.0"]) and len(managed["layers.0"]) > 3
        assert out["odc_again"] is True and out["torch_again"] is True


class _WithMethod(Llama):
    """A model with a method other than ``forward`` that reads its root unit's parameters directly, as Hugging
    Face's ``generate`` reads the embedding."""

    def last_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Reads the root's weights directly, after a forward of the whole model (as ``generate`` does between
        tokens): the forward without grad must not free what the method still reads."""
        self(ids)
        return self.embed_tokens.weight[ids[:, -1]] @ self.lm_head.weight.T


def _registered_method() -> dict:
    from torch.distributed.fsdp import register_fsdp_forward_method

    torch.manual_seed(0)
    plain = _WithMethod(CFG)
    torch.manual_seed(0)
    model = _WithMethod(CFG)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    try:
        with torch.no_grad():  # as generate runs: its forwards free the root's groups
            unregistered = f"read {tuple(model.last_logits(ids).shape)}"
    except Exception as e:  # noqa: BLE001 - what the unregistered method meets
        unregistered = type(e).__name__
    register_fsdp_forward_method(model, "last_logits")  # torch's own, as Hugging Face's Trainer calls it
    with torch.no_grad():
        got = model.last_logits(ids)
    loss = causal_lm_loss(model(ids), ids)  # a training forward and backward after it: the groups as before
    loss.backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    plain_loss = causal_lm_loss(plain(ids), ids)
    plain_loss.backward()
    with torch.no_grad():
        want = plain.last_logits(ids)
    state = fully_shard.state(model)
    try:
        state._fsdp_param_group
        internals = "reachable"
    except AttributeError as e:
        internals = str(e)
    return {"unregistered": unregistered, "got": got, "want": want, "loss": loss.detach(),
            "plain_loss": plain_loss.detach(), "grads": grads,
            "plain_grads": {n: p.grad for n, p in plain.named_parameters()}, "internals": internals}


def test_torchs_register_fsdp_forward_method_gathers_the_unit_around_the_method():
    """Without registration the method reads this rank's shards and fails; with torch's
    ``register_fsdp_forward_method`` (what Hugging Face's Trainer does for ``generate``) it reads the full values,
    equal to the plain model's, on 2 ranks."""
    from odcfsdp.launch import spawn

    for out in spawn(_registered_method, 2):
        assert not out["unregistered"].startswith("read"), out["unregistered"]
        torch.testing.assert_close(out["got"], out["want"])
        torch.testing.assert_close(out["loss"], out["plain_loss"])
        for name, grad in out["plain_grads"].items():  # the held groups train as before (the mean over 2 ranks)
            torch.testing.assert_close(out["grads"][name], grad, rtol=1e-5, atol=1e-6)
        assert out["internals"].startswith("odcfsdp's UnitState has no '_fsdp_param_group': it is not FSDP2's")
