"""``from odcfsdp import fully_shard`` ([fully-shard]): a torchtitan-style script (per-block ``fully_shard``, then the
root; two micro-batches with gradient sync off on the first; ``clip_grad_norm_``, AdamW, an LR scheduler; DCP save
and load) runs through torch's ``fully_shard`` and through ours on 2 CPU ranks with the same per-step loss and
gradient norm, and with uneven micro-batch counts (which FSDP2 cannot run) it matches one plain process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from odcfsdp.launch import spawn
from odcfsdp.models import Llama, LlamaConfig, causal_lm_loss

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
STEPS, SAVE_AT, SEQ = 4, 2, 12


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)  # every rank the same initial model
    return Llama(CFG).to(device)


def _micro_batches(step: int, rank: int, n: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank)
    return [torch.randint(0, CFG.vocab_size, (2, SEQ), generator=g).to(device) for _ in range(n)]


def _optimizer(model: nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))


def _step(model, opt, sched, batches: list[torch.Tensor], sync_toggle: bool) -> tuple[float, float]:
    """One optimizer step over this rank's micro-batches: the loss is each micro-batch's token mean / their number
    (a per-rank mean, as a torchtitan script's), sync off but on the last micro-batch."""
    total = 0.0
    for i, x in enumerate(batches):
        if sync_toggle:
            model.set_requires_gradient_sync(i == len(batches) - 1)
        loss = causal_lm_loss(model(x), x, x.numel()) / len(batches)
        loss.backward()
        total += loss.item()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    opt.step()
    sched.step()
    opt.zero_grad()
    return total, norm


def _build(impl: str, mesh, device: str = "cpu"):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from odcfsdp import fully_shard
    model = _model(device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _script(impl: str, counts: list[int], path: str, device: str = "cpu") -> dict:
    """The torchtitan-style script: STEPS steps, a DCP save after SAVE_AT, then a fresh model loads it and runs the
    remaining steps again. Returns (loss, norm) per step, and those of the run from the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model = _build(impl, mesh, device)
    opt, sched = _optimizer(model)
    steps = []
    for step in range(STEPS):
        if step == SAVE_AT:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict()}, checkpoint_id=path)
        steps.append(_step(model, opt, sched, _micro_batches(step, rank, counts[rank], device), True))
    fresh = _build(impl, mesh, device)
    with torch.no_grad():  # other values, all overwritten by the load (before any forward: nothing gathered yet)
        for p in fresh.parameters():
            p.to_local().mul_(-3.0)
    fresh_opt, fresh_sched = _optimizer(fresh)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd, "sched": fresh_sched.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fresh_sched.load_state_dict(state["sched"])
    resumed = [_step(fresh, fresh_opt, fresh_sched, _micro_batches(step, rank, counts[rank], device), False)
               for step in range(SAVE_AT, STEPS)]
    return {"steps": steps, "resumed": resumed, "classes": sorted({type(m).__name__ for m in model.modules()})}


def _reference(counts: list[int], device: str = "cpu") -> list[tuple[list[float], float]]:
    """One plain process: each step's gradient is the mean over ranks of each rank's (its micro-batches' losses
    over their number), then the same clip, AdamW and scheduler. Per step: each rank's loss, and the norm."""
    model = _model(device)
    opt, sched = _optimizer(model)
    out = []
    for step in range(STEPS):
        losses = []
        for rank, n in enumerate(counts):
            total = 0.0
            for x in _micro_batches(step, rank, n, device):
                loss = causal_lm_loss(model(x), x, x.numel()) / n
                (loss / len(counts)).backward()
                total += loss.item()
            losses.append(total)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        sched.step()
        opt.zero_grad()
        out.append((losses, norm))
    return out


def _close(a: list[tuple[float, float]], b: list[tuple[float, float]], tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for (la, na), (lb, nb) in zip(a, b):
        assert la == pytest.approx(lb, rel=tol, abs=tol) and na == pytest.approx(nb, rel=tol, abs=tol), (a, b)


def test_a_torchtitan_script_runs_alike_through_torch_fully_shard_and_ours(tmp_path):
    """Even counts (2 and 2): per-step loss and gradient norm equal torch's fully_shard's to 1e-5 (fp32), before
    and after a DCP round trip, and the modules' classes are ODC<Class>."""
    ours = spawn(_script, 2, "odc", [2, 2], str(tmp_path / "odc"))
    theirs = spawn(_script, 2, "torch", [2, 2], str(tmp_path / "torch"))
    for rank in range(2):
        _close(ours[rank]["steps"], theirs[rank]["steps"])
        _close(ours[rank]["resumed"], ours[rank]["steps"][SAVE_AT:])
        _close(theirs[rank]["resumed"], theirs[rank]["steps"][SAVE_AT:])
    assert "ODCLlama" in ours[0]["classes"] and "ODCDecoderLayer" in ours[0]["classes"]
    assert ours[0]["steps"][-1][0] < ours[0]["steps"][0][0]  # it trains


def test_uneven_micro_batch_counts_match_one_process(tmp_path):
    """Counts 3 and 1 per rank (FSDP2 would hang on them): ours matches one plain process on the union of the
    data, step by step, and again after the DCP round trip."""
    counts = [3, 1]
    ours = spawn(_script, 2, "odc", counts, str(tmp_path / "odc"))
    want = _reference(counts)
    for rank in range(2):
        _close(ours[rank]["steps"], [(losses[rank], norm) for losses, norm in want])
        _close(ours[rank]["resumed"], [(losses[rank], norm) for losses, norm in want[SAVE_AT:]])


# -- FSDPModule's methods, one engine, refusals -------------------------------------------------------------
def _methods() -> dict:
    from torch.distributed.tensor import DTensor

    from odcfsdp import ODCModule, fully_shard

    rank = dist.get_rank()
    plain = _model()
    model = _build("odc", None)
    out = {"engines": len({id(m._odc_engine) for m in model.modules() if isinstance(m, ODCModule)})}
    owners = {}
    for g in model._odc_engine.groups:
        owners.setdefault(id(g.owner), set()).update(s.name.split(".")[:2] == ["layers", "0"] for s in g.layout.slots)
    out["groups_within_units"] = all(len(v) == 1 for v in owners.values())
    layer0, layer1 = model.layers
    # unshard / reshard: the full values, then this rank's shard again
    layer0.unshard()
    out["unsharded"] = all(not isinstance(p, DTensor) and torch.equal(p, q)
                           for p, q in zip(layer0.parameters(), plain.layers[0].parameters()))
    layer0.reshard()
    out["resharded"] = all(isinstance(p, DTensor) for p in layer0.parameters())
    handle = layer1.unshard(async_op=True)
    handle.wait()
    out["async"] = all(torch.equal(p, q) for p, q in zip(layer1.parameters(), plain.layers[1].parameters()))
    layer1.reshard()
    # explicit forward prefetch: layer 1 is gathered while layer 0 runs
    seen = []
    layer0.register_forward_hook(lambda *_: seen.append(not isinstance(layer1.input_layernorm.weight, DTensor)))
    layer0.set_modules_to_forward_prefetch([layer1])
    # reshard_after_forward False on layer 1: still gathered once forward is over; after backward, resharded
    layer1.set_reshard_after_forward(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = _micro_batches(0, rank, 1)[0]
    loss = causal_lm_loss(model(x), x, x.numel())
    out["prefetched"] = seen == [True]
    out["kept_after_forward"] = not isinstance(layer1.input_layernorm.weight, DTensor)
    out["root_kept"] = not isinstance(model.norm.weight, DTensor)  # the root's own groups: FSDP2's default
    out["layer0_freed"] = isinstance(layer0.input_layernorm.weight, DTensor)
    # reshard_after_backward False on layer 0: kept gathered until the step's finish
    layer0.set_reshard_after_backward(False)
    loss.backward()
    out["kept_after_backward"] = not isinstance(layer0.input_layernorm.weight, DTensor)
    out["freed_after_backward"] = isinstance(layer1.input_layernorm.weight, DTensor)
    model.set_gradient_divide_factor(1.0)  # the sum over ranks
    out["grad"] = model.lm_head.weight.grad.full_tensor()
    opt.step()
    out["freed_at_step"] = isinstance(layer0.input_layernorm.weight, DTensor)
    # refusals, one line each
    errors = {}
    for what, call in {
        "again": lambda: fully_shard(layer0),
        "placement": lambda: fully_shard(_model(), shard_placement_fn=lambda p: None),
        "int": lambda: fully_shard(_model(), reshard_after_forward=2),
        "odcshard": lambda: __import__("odcfsdp").ODCShard(model),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            errors[what] = str(e)
    mixed = _model()
    fully_shard(mixed.layers[0], mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    try:
        fully_shard(mixed)
    except ValueError as e:
        errors["mixed"] = str(e)
    out["errors"] = errors
    return out


def _reference_sum_grad() -> torch.Tensor:
    model = _model()
    for rank in range(2):
        x = _micro_batches(0, rank, 1)[0]
        causal_lm_loss(model(x), x, x.numel()).backward()
    return model.lm_head.weight.grad


def test_fsdp_module_methods_and_refusals():
    """One engine for the model, groups within units; unshard/reshard (sync and async), explicit prefetch,
    reshard_after_forward/_backward per unit (the root's kept after forward, as FSDP2's default), the divide
    factor; and one-line refusals of what has no ODC meaning."""
    for out in spawn(_methods, 2):
        assert out["engines"] == 1 and out["groups_within_units"]
        for key in ("unsharded", "resharded", "async", "prefetched", "kept_after_forward", "root_kept",
                    "layer0_freed", "kept_after_backward", "freed_after_backward", "freed_at_step"):
            assert out[key], key
        torch.testing.assert_close(out["grad"], _reference_sum_grad(), rtol=1e-5, atol=1e-6)
        errors = out["errors"]
        assert "called on this ODCDecoderLayer already" in errors["again"]
        assert "shard_placement_fn is not supported" in errors["placement"]
        assert "reshard_after_forward=2" in errors["int"]
        assert "wrapped already" in errors["odcshard"]
        assert "must share mp_policy" in errors["mixed"]
        assert all("\n" not in e for e in errors.values())


def test_ignored_params_stay_plain_and_train_as_in_one_process():
    """One process (no torch.distributed): ``ignored_params`` stay plain parameters (not sharded), the rest are
    shards, and a step of the whole model equals the plain model's."""
    from torch.distributed.tensor import DTensor

    from odcfsdp import fully_shard

    plain, model = _model(), _model()
    head = model.lm_head.weight
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model, ignored_params={head})
    assert model.lm_head.weight is head and getattr(head, "_odc", None) is None
    assert all(getattr(p, "_odc", None) is not None for n, p in model.named_parameters() if n != "lm_head.weight")
    for m in (plain, model):
        opt, _ = _optimizer(m)
        x = _micro_batches(0, 0, 1)[0]
        causal_lm_loss(m(x), x, x.numel()).backward()
        opt.step()
    got = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    for n, p in plain.named_parameters():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=n)
