"""The optimizer's state parked on the host between steps ([parking]) trains, saves and loads exactly as resident
state does: against the same run without parking, bit for bit, on one CPU process (ODCShard's collective path)."""

from __future__ import annotations

import copy

import pytest
import torch

from odcfsdp.checkpoint import load_checkpoint, save_checkpoint
from odcfsdp.optim import ParkedOptimizerState, parking_of, prefetch_parked, settle_parked, unparked
from odcfsdp.optim.parking import Where
from odcfsdp.torch_private import local_of

from checkpoint_state import CFG, assert_same_state, build, full_state


def _state_tensors(opt) -> list[torch.Tensor]:
    return [local_of(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]


def _state_bytes(opt) -> int:
    return sum(t.nbytes for t in _state_tensors(opt))


def parked_steps(model, opt, steps: int, seed: int = 1, prefetch: bool = True, skip: tuple[int, ...] = (),
                 micro: int = 2, shape: tuple[int, int] = (2, 9)) -> list[float]:
    """``micro`` micro-batches a step on the model's device; parked state prefetched once the last backward is
    queued, as ``train_step`` does; the steps in ``skip`` are skipped as for a non-finite norm."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        for _ in range(micro):
            x = torch.randint(0, CFG.vocab_size, shape, generator=g).to(device)
            loss = model(x).float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        if prefetch:
            prefetch_parked(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step in skip:
            settle_parked(opt)
        else:
            opt.step()
        opt.zero_grad()
    return [x.item() for x in losses]


def _full(model, opt) -> dict:
    with unparked(opt):
        return full_state(model, opt)


@pytest.mark.parametrize("prefetch", [True, False])
def test_parked_state_trains_like_resident_state(prefetch):
    """Losses and final state to the bit; between steps the device storage is empty and the host holds it all."""
    model, opt = build()
    ref_model, ref_opt = build()
    parking = ParkedOptimizerState(opt)
    assert parking_of(opt) is parking
    losses = parked_steps(model, opt, 4, prefetch=prefetch, skip=(2,))
    assert losses == parked_steps(ref_model, ref_opt, 4, skip=(2,))
    assert parking.where is Where.PARKED
    assert parking.parked_bytes == _state_bytes(ref_opt) > 0
    assert all(t.untyped_storage().nbytes() == 0 for t in _state_tensors(opt))
    assert_same_state(_full(model, opt), full_state(ref_model, ref_opt))
    assert parking.where is Where.PARKED  # unparked() parks it again


def test_a_share_of_the_state_parks_and_the_rest_stays():
    """``fraction=0.5``: the first state tensors up to half the bytes are parked, the others keep their storage,
    and training is the resident run's to the bit; a bad share is refused."""
    model, opt = build()
    ref_model, ref_opt = build()
    parking = ParkedOptimizerState(opt, fraction=0.5)
    losses = parked_steps(model, opt, 3, skip=(1,))
    assert losses == parked_steps(ref_model, ref_opt, 3, skip=(1,))
    total = _state_bytes(ref_opt)
    sizes = [t.nbytes for t in _state_tensors(opt)]
    emptied = [t.untyped_storage().nbytes() == 0 for t in _state_tensors(opt)]
    assert emptied == sorted(emptied, reverse=True) and any(emptied) and not all(emptied)  # a prefix is parked
    assert parking.parked_bytes == sum(n for n, e in zip(sizes, emptied) if e)
    assert total / 2 <= parking.parked_bytes < total / 2 + max(sizes)
    assert_same_state(_full(model, opt), full_state(ref_model, ref_opt))
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        ParkedOptimizerState(build()[1], fraction=0.0)


def test_park_fraction_without_park_state_is_reported_not_used():
    from odcfsdp.app.config import config_from
    from odcfsdp.app.validation import unused_key

    assert unused_key(config_from({"optim": {"park_state": False, "park_fraction": 0.5}}), "optim.park_fraction") == (
        "only optim.park_state=true reads it", False)
    assert unused_key(config_from({"optim": {"park_state": True, "park_fraction": 0.5}}), "optim.park_fraction") is None


def test_a_skipped_step_frees_its_prefetch():
    model, opt = build()
    parking = ParkedOptimizerState(opt)
    parked_steps(model, opt, 1)
    prefetch_parked(opt)
    assert parking.where is Where.ARRIVING and parking.parked_bytes == 0
    settle_parked(opt)
    assert parking.where is Where.PARKED and parking.parked_bytes > 0


def test_state_dict_and_load_state_dict_see_the_parked_state():
    """``state_dict()`` while parked holds the values and leaves the state parked; the dict keeps them across later
    steps (copies, not the parked tensors); ``load_state_dict`` parks what it loaded, and training goes on as from
    the resident run."""
    model, opt = build()
    ref_model, ref_opt = build()
    ParkedOptimizerState(opt)
    parked_steps(model, opt, 2)
    parked_steps(ref_model, ref_opt, 2)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert parking_of(opt).where is Where.PARKED
    kept = copy.deepcopy(ref_sd)
    parked_steps(model, opt, 1, seed=11)  # parks the state again: the dict's tensors must not be the parked ones
    for i, state in kept["state"].items():  # (torch's `step` scalars are the optimizer's own, as without parking)
        for key, value in state.items():
            assert value.dim() == 0 or torch.equal(sd["state"][i][key], value), (i, key)
    parked_steps(ref_model, ref_opt, 1, seed=11)
    ref_sd = ref_opt.state_dict()
    model2, opt2 = build()
    parking2 = ParkedOptimizerState(opt2)
    parked_steps(model2, opt2, 1, seed=5)  # state to replace
    model2.load_state_dict(ref_model.state_dict())
    handed = copy.deepcopy(ref_sd)  # torch would share the `step` tensors of ref_opt's own dict
    opt2.load_state_dict(handed)
    assert parking2.where is Where.PARKED
    for i, state in ref_sd["state"].items():  # torch kept the handed tensors: parking copied them, not emptied them
        assert all(torch.equal(handed["state"][i][k], v) for k, v in state.items())
    parked_steps(model2, opt2, 2, seed=3)
    parked_steps(ref_model, ref_opt, 2, seed=3)
    assert_same_state(_full(model2, opt2), full_state(ref_model, ref_opt))


def test_checkpoints_of_parked_state_resume_exactly(tmp_path):
    """A checkpoint saved from parked state holds the resident run's values; loaded into a parked optimizer,
    the run continues exactly as the uninterrupted resident one."""
    model, opt = build()
    ref_model, ref_opt = build()
    ParkedOptimizerState(opt)
    parked_steps(model, opt, 2)
    parked_steps(ref_model, ref_opt, 2)
    save_checkpoint(tmp_path / "parked", model, opt, step=2)
    assert parking_of(opt).where is Where.PARKED
    save_checkpoint(tmp_path / "resident", ref_model, ref_opt, step=2)
    from safetensors.torch import load_file
    a = load_file(tmp_path / "parked" / "step_00000002" / "rank00000.safetensors")
    b = load_file(tmp_path / "resident" / "step_00000002" / "rank00000.safetensors")
    assert a.keys() == b.keys() and any(k.endswith("/exp_avg_sq") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("__rng__"))
    model2, opt2 = build(seed=7)
    parking2 = ParkedOptimizerState(opt2)
    load_checkpoint(tmp_path / "parked" / "step_00000002", model2, opt2)
    assert parking2.where is Where.PARKED
    parked_steps(model2, opt2, 2, seed=3)
    parked_steps(ref_model, ref_opt, 2, seed=3)
    assert_same_state(_full(model2, opt2), full_state(ref_model, ref_opt))


def test_a_parked_optimizer_is_freed_with_its_host_buffers():
    """Nothing global holds a parked optimizer: dropped, it and its parking are collected."""
    import gc
    import weakref

    model, opt = build()
    parking = weakref.ref(ParkedOptimizerState(opt))
    parked_steps(model, opt, 1)
    assert parking() is parking_of(opt) and parking().parked_bytes > 0
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None and parking() is None


def test_state_sharing_a_parameters_storage_stays_resident():
    """A state tensor that is a parameter's storage (an optimizer keeping it as its own) is not emptied with the
    state: the parameter keeps its values, the other state tensors are parked."""
    model, opt = build()
    parking = ParkedOptimizerState(opt)
    parked_steps(model, opt, 1)
    p = next(iter(opt.state))
    with unparked(opt):
        opt.state[p]["alias"] = p.detach()
    parked_steps(model, opt, 1, seed=2)
    assert local_of(p).untyped_storage().nbytes() == local_of(p).nbytes
    assert parking.where is Where.PARKED and parking.parked_bytes > 0
    assert all(torch.equal(local_of(p), local_of(v)) for v in [opt.state[p]["alias"]])


def test_one_parking_per_optimizer_and_close_restores():
    model, opt = build()
    parking = ParkedOptimizerState(opt)
    with pytest.raises(ValueError, match="already parked"):
        ParkedOptimizerState(opt)
    parked_steps(model, opt, 1)
    parking.close()
    assert parking_of(opt) is None and _state_bytes(opt) > 0
    ref_model, ref_opt = build()
    parked_steps(ref_model, ref_opt, 1)
    parked_steps(model, opt, 1, seed=2)
    parked_steps(ref_model, ref_opt, 1, seed=2)
    assert_same_state(full_state(model, opt), full_state(ref_model, ref_opt))


def test_the_cli_key_parks_the_optimizers_state():
    """``optim.park_state=true`` gives the trainer's optimizer a parking, ``false`` none."""
    from odcfsdp.app.builders import build_optimizer
    from odcfsdp.app.config import config_from

    model, _ = build()
    for park in (True, False):
        opt, _ = build_optimizer(config_from({"optim": {"park_state": park}}), model, torch.device("cpu"))
        assert (parking_of(opt) is not None) == park


def test_cli_runs_with_parked_state_resume_like_the_resident_run(tmp_path):
    """``optim.park_state=true`` on 2 ranks (DTensor state, sharded checkpoints): stopped after step 2 and resumed,
    its losses and gradient norms equal the resident run's, and its final checkpoint holds the same shards."""
    from safetensors.torch import load_file
    from test_train import run_ranks

    base = {"run": {"steps": 4, "seed": 3}, "balance": {"kind": "lb_micro"}, "shard": {"comm": "collective"},
            "data": {"batch_size": 4, "micro_batch_tokens": 128, "lengths": {"max_len": 100}},
            "checkpoint": {"interval": 2}}
    resident = run_ranks(base, tmp_path / "resident")
    parked = {**base, "optim": {"park_state": True, "park_fraction": 1.0}}  # all of it (the default fits: none)
    run_ranks({**parked, "run": {**base["run"], "stop_after": 2}}, tmp_path / "parked")
    rest = run_ranks({**parked, "checkpoint": {"interval": 2, "resume": "auto"}}, tmp_path / "parked")
    assert [(r["loss"], r["grad_norm"]) for r in rest] == [(r["loss"], r["grad_norm"]) for r in resident[2:]]
    for rank in range(2):
        a = load_file(tmp_path / "resident" / "checkpoints" / "step_00000004" / f"rank{rank:05d}.safetensors")
        b = load_file(tmp_path / "parked" / "checkpoints" / "step_00000004" / f"rank{rank:05d}.safetensors")
        assert a.keys() == b.keys() and any(k.endswith("/exp_avg") for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("__rng__"))


def test_trickle_chunks_cover_each_tensor_once_in_bounded_pieces():
    """[park-trickle]'s pieces: a contiguous pair cut into views of at most ``CHUNK_BYTES`` that tile it in order
    (ceil(bytes / CHUNK_BYTES) of them), a non-contiguous pair one piece; an exit handler's trickle is held weakly,
    so a dropped one is collected (nothing global holds a parking, as above)."""
    import gc
    import weakref

    from odcfsdp.optim import copy_trickle
    from odcfsdp.optim.copy_trickle import CHUNK_BYTES, CopyTrickle, _chunks

    n = CHUNK_BYTES // 4 * 2 + 5  # two whole fp32 chunks and 5 elements
    local, host = torch.arange(n, dtype=torch.float32), torch.zeros(n)
    pieces = _chunks(local.view(-1, 1), host.view(-1, 1))
    assert [src.nbytes for src, _ in pieces] == [CHUNK_BYTES, CHUNK_BYTES, 20]
    for src, dst in pieces:
        dst.copy_(src)
    assert torch.equal(host, local)
    wide = torch.zeros(4, 6)[:, :3]
    assert [(s.shape, d.shape) for s, d in _chunks(wide, torch.ones(4, 3).t().t())] == [((4, 3), (4, 3))]
    trickle = CopyTrickle(torch.device("cpu"), None)
    assert trickle in copy_trickle._RUNNING
    gone = weakref.ref(trickle)
    del trickle
    gc.collect()
    assert gone() is None and len(copy_trickle._RUNNING) == 0


def test_a_failed_copy_out_is_raised_at_every_later_join_and_nothing_new_starts(monkeypatch):
    """[park-trickle] 3: an error on the helper thread (here a host copy of the wrong shape, as a failed copy) is
    raised on the caller's thread at the next ``join``, chained to the thread's, and again at every later one; a
    ``start`` after it raises before it queues anything over the lost state, and ``close`` raises too. The CUDA
    calls around the copies are stand-ins (no GPU here); the copies and the thread are real."""
    import contextlib
    import types

    from odcfsdp.optim import copy_trickle
    from odcfsdp.optim.copy_trickle import CopyTrickle

    stream = types.SimpleNamespace(record_event=lambda: None, wait_event=lambda event: None)
    monkeypatch.setattr(copy_trickle.torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(copy_trickle.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(copy_trickle.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    entry = types.SimpleNamespace(local=torch.ones(8), host=torch.zeros(3))  # cannot be copied: the thread fails
    trickle = CopyTrickle(torch.device("cpu"), stream)
    trickle.start([entry])
    for _ in range(2):
        with pytest.raises(RuntimeError, match="restart from a checkpoint") as raised:
            trickle.join()
        assert isinstance(raised.value.__cause__, RuntimeError) and raised.value.__cause__ is not raised.value
    later = types.SimpleNamespace(local=torch.ones(3), host=torch.zeros(3))
    with pytest.raises(RuntimeError, match="restart from a checkpoint"):
        trickle.start([later])
    assert torch.equal(later.host, torch.zeros(3)) and trickle._thread is None  # nothing was queued
    with pytest.raises(RuntimeError, match="restart from a checkpoint"):
        trickle.close()
    assert trickle not in copy_trickle._RUNNING
