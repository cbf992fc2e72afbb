"""The explicit minibatch path ([implicit-events]): ``end_minibatch`` / ``finish_minibatch``, with and without torch's
implicit events, against plain PyTorch on the union of every rank's micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from odcfsdp import ODCShard
from odcfsdp.launch import spawn
from odcfsdp.sharding import fully_shard, sharded

STEPS, LR, CLIP = 3, 0.1, 0.5


def _tiny() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(micro_batches: list[int]) -> list[list[list[torch.Tensor]]]:
    """data[step][rank] = that rank's micro-batches."""
    g = torch.Generator().manual_seed(1)
    return [[[torch.randn(4, 8, generator=g) for _ in range(n)] for n in micro_batches] for _ in range(STEPS)]


def _hand_sgd(params) -> None:
    """An update outside ``torch.optim.Optimizer.step``: no optimizer hook sees it."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(LR * p.grad)


def _reference(micro_batches: list[int]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _tiny()
    norms = []
    for step in _data(micro_batches):
        for x in (x for per_rank in step for x in per_rank):
            model(x).pow(2).sum().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        _hand_sgd(model.parameters())
        model.zero_grad()
    return norms, model.state_dict()


def _train(model, micro, implicit: bool, optimizer: str) -> tuple[list[float], list[list[str]], bool]:
    """The explicit loop; returns the clip norms, each step's meetings, and whether ``.grad`` stayed None until
    ``end_minibatch`` (implicit events off: a read after backward does not sync)."""
    model.set_gradient_divide_factor(1.0)  # sum: the reference sums over ranks (one loss over the union)
    model.set_implicit_minibatch(implicit)
    meetings: list[str] = []
    meet = model.minibatch.meet
    model.minibatch.meet = lambda kind: meetings.append(kind.name) or meet(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR) if optimizer == "torch" else None
    norms, per_step, none_before_end = [], [], True
    for step in micro:
        for x in step:
            model(x).pow(2).sum().backward()
        if not implicit:
            none_before_end &= all(p.grad is None for p in model.parameters())
        model.end_minibatch()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step() if opt is not None else _hand_sgd(model.parameters())
        model.finish_minibatch()
        if opt is not None:
            opt.zero_grad()
        per_step.append(meetings[:])
        meetings.clear()
    return norms, per_step, none_before_end


def _on_ranks(micro_batches: list[int]):
    rank = dist.get_rank()
    micro = [per_rank[rank] for per_rank in _data(micro_batches)]
    out = {}
    for implicit, optimizer in ((False, "hand"), (True, "hand"), (True, "torch")):
        model = ODCShard(_tiny(), comm="shm")
        norms, per_step, none_before_end = _train(model, micro, implicit, optimizer)
        out[implicit, optimizer] = norms, per_step, none_before_end, model.full_state_dict()
        model.close()
    return out


def test_the_explicit_path_trains_as_plain_pytorch_on_uneven_ranks():
    """Two ranks, two micro-batches against none: with implicit events off, ``.grad`` stays None until
    ``end_minibatch`` and an update outside ``torch.optim`` is published by ``finish_minibatch``; with them on the
    explicit calls compose with the inferred points (a hand-written update, which no hook sees, or ``opt.step()``,
    whose hook finishes first). Every way equals plain PyTorch on the union and costs two meetings a minibatch."""
    ref_norms, ref_state = _reference([2, 0])
    for out in spawn(_on_ranks, 2, [2, 0], timeout=120):
        for (implicit, optimizer), (norms, per_step, none_before_end, state) in out.items():
            where = f"implicit={implicit}, {optimizer}"
            assert none_before_end, where
            assert per_step == [["SYNC", "FINISH"]] * STEPS, where
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
            for name, want in ref_state.items():
                torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{where} {name}: {m}")


@pytest.mark.parametrize("front", ["ODCShard", "fully_shard"])
def test_the_explicit_path_in_one_process(front):
    """Both front doors have the explicit methods (a ``fully_shard`` unit acts on its model's one minibatch), and
    with implicit events off a torch optimizer's step is not the finish: ``finish_minibatch`` is."""
    model = _tiny()
    if front == "fully_shard":
        fully_shard(model[0])
        fully_shard(model)
        unit = model[0]
    else:
        model = ODCShard(model)
        unit = model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    unit.set_implicit_minibatch(False)
    ref_norms, ref_state = _reference([2])
    norms = []
    for (micro,) in _data([2]):
        for x in micro:
            model(x).pow(2).sum().backward()
        unit.end_minibatch()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        with pytest.raises(RuntimeError, match="after end_minibatch.*call finish_minibatch"):
            model(micro[0])  # stepped, not finished: the rows are not the masters yet
        model.finish_minibatch()
        opt.zero_grad()
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
    state = sharded(model).full_state_dict()  # on the GPU where there is one (fully_shard's default device)
    for name, want in ref_state.items():
        torch.testing.assert_close(state[name].cpu(), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    sharded(model).engine.close()  # its rows (an NVSHMEM heap on a GPU) are freed now, not at the interpreter's exit


def test_explicit_calls_in_the_wrong_place_are_refused():
    model = ODCShard(_tiny())
    with pytest.raises(ValueError, match="True or False"):
        model.set_implicit_minibatch(1)
    model.set_implicit_minibatch(False)
    with pytest.raises(RuntimeError, match="before this minibatch's gradients were synced"):
        model.finish_minibatch()  # a rank without micro-batches refuses it as one with them does: no rank meets
    model.end_minibatch()  # nothing pushed anywhere: synced, no gradients
    with pytest.raises(RuntimeError, match="inside a minibatch"):
        model.set_implicit_minibatch(True)  # ended, not finished: as on a rank that ran micro-batches
    model.finish_minibatch()
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="inside a minibatch"):
        model.set_implicit_minibatch(True)
    with pytest.raises(RuntimeError, match="before this minibatch's gradients were synced"):
        model.finish_minibatch()
    model.end_minibatch()
    model.end_minibatch()  # once synced, again is a no-op
    assert all(p.grad is not None for p in model.parameters())
    model.finish_minibatch()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="before this minibatch's gradients were synced"):
        model.finish_minibatch()  # implicit events off: the next minibatch has synced nothing (no hook finished it)
    model.close()
    with pytest.raises(RuntimeError, match="closed model"):
        model.end_minibatch()
