"""Gradient reduction as FSDP2's ([lifecycle] 8): ``.grad`` is the sum over ranks divided by the gradient divide
factor, by default the number of data-parallel ranks (HSDP replicas included); ``set_gradient_divide_factor(1.0)``
keeps the sum. With a per-rank mean loss, ODCShard's gradients and ``clip_grad_norm_`` equal torch's ``fully_shard``'s
on 2 CPU ranks (gloo), and a one-process reference's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from odcfsdp import ODCShard
from odcfsdp.launch import spawn


def _model() -> nn.Module:
    torch.manual_seed(0)  # every rank the same initial model
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # 7 and 3 rows: uneven shards on 2 ranks


def _batches(rank: int, n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _loss(model, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)  # a per-rank mean, as Hugging Face models return


def _reference(world: int, micro_batches: int = 1) -> dict:
    """One process: the mean over ranks of each rank's gradient (summed over its micro-batches), and its norm."""
    model = _model()
    for r in range(world):
        for x, y in _batches(r, micro_batches):
            (_loss(model, x, y) / world).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])).item()
    return {"grads": grads, "norm": norm}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train_one_step(how: str, factor: float | None = None, replicas: int = 1, micro_batches: int = 1) -> dict:
    """This rank's micro-batches, then every gradient (full) and clip_grad_norm_'s norm, under ``how``."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = (init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
            if replicas > 1 else init_device_mesh("cpu", (world,)))
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(_model(), mesh=mesh)
        if factor is not None:
            model.set_gradient_divide_factor(factor)
            model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: FSDP2 sums, then divides
    else:
        model = ODCShard(_model(), comm=how, mesh=mesh)
        if factor is not None:
            model.set_gradient_divide_factor(factor)
    for x, y in _batches(rank, micro_batches):
        _loss(model, x, y).backward()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    norm = float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
    if isinstance(model, ODCShard):
        model.close()
    return {"grads": grads, "norm": norm}


def _read_then_more(micro_batches: int) -> dict:
    """Collective transport: read .grad after each micro-batch (no step), so the gradients read go back to
    accumulating; what the last read sees is the mean over ranks of the whole sum, divided once."""
    model = ODCShard(_model(), comm="collective")
    for x, y in _batches(dist.get_rank(), micro_batches):
        _loss(model, x, y).backward()
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    model.close()
    return {"grads": grads}


def _assert_close(got: dict, want: dict, scale: float = 1.0) -> None:
    assert got["grads"].keys() == want["grads"].keys()
    for n, g in want["grads"].items():
        torch.testing.assert_close(got["grads"][n], g * scale, rtol=1e-6, atol=1e-6, msg=lambda m: f"{n}: {m}")
    if "norm" in got:
        assert got["norm"] == pytest.approx(want["norm"] * scale, rel=1e-6, abs=1e-6)


def test_default_is_fsdp2s_mean_over_ranks():
    """2 ranks, a per-rank mean loss: ODCShard's gradients and clip norm equal fully_shard's (gloo, CPU) and the
    one-process mean, to 1e-6; before this they were twice FSDP2's."""
    want = _reference(2)
    odc = spawn(_train_one_step, 2, "shm", timeout=120)
    for rank_out in odc:
        _assert_close(rank_out, want)
    fsdp2 = spawn(_train_one_step, 2, "fsdp2", timeout=120)  # torch's fully_shard runs on CPU (gloo)
    for ours, theirs in zip(odc, fsdp2):
        _assert_close(theirs, want)
        _assert_close(ours, theirs)


def test_custom_factor_matches_fsdp2s():
    """``set_gradient_divide_factor(f)`` means what FSDP2's does: the sum over ranks divided by f."""
    want = _reference(2)
    odc = spawn(_train_one_step, 2, "shm", 4.0, timeout=120)
    for ours, theirs in zip(odc, spawn(_train_one_step, 2, "fsdp2", 4.0, timeout=120)):
        _assert_close(ours, want, scale=2 / 4)
        _assert_close(ours, theirs)


@pytest.mark.parametrize("comm", ["shm", "collective"])
def test_factor_one_gives_the_sum(comm):
    want = _reference(2)
    for rank_out in spawn(_train_one_step, 2, comm, 1.0, timeout=120):
        _assert_close(rank_out, want, scale=2.0)


def test_hsdp_replicas_are_averaged_too():
    """HSDP 2 replicas x 1 shard: the replicas' all-reduce sums, then the default factor (2) divides, as fully_shard's
    HSDP does."""
    want = _reference(2, micro_batches=2)
    odc = spawn(_train_one_step, 2, "shm", None, 2, 2, timeout=180)
    for ours, theirs in zip(odc, spawn(_train_one_step, 2, "fsdp2", None, 2, 2, timeout=180)):
        _assert_close(ours, want)
        _assert_close(ours, theirs)
    for rank_out in spawn(_train_one_step, 2, "shm", 1.0, 2, 2, timeout=180):
        _assert_close(rank_out, want, scale=2.0)


def test_gradients_read_then_accumulated_again_are_divided_once():
    """The collective transport lets a forward follow a .grad read without a step ([grad-protocol]): the division
    of the read is undone, and the next read divides the whole sum once."""
    want = _reference(2, micro_batches=3)
    for rank_out in spawn(_read_then_more, 2, 3, timeout=120):
        _assert_close(rank_out, want)


def test_one_rank_divides_by_nothing_and_bad_factors_are_refused():
    model = ODCShard(_model())
    assert model.gradient_divide_factor == 1.0
    x, y = _batches(0)[0]
    _loss(model, x, y).backward()
    plain = _model()
    _loss(plain, x, y).backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    for bad in (0.0, -2.0, math.nan, math.inf, True, "2"):
        with pytest.raises(ValueError, match="gradient divide factor must be a finite number > 0") as e:
            model.set_gradient_divide_factor(bad)
        assert "\n" not in str(e.value)
    model.set_gradient_divide_factor(3)
    assert model.gradient_divide_factor == 3.0
    model.close()
