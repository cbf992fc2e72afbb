"""The one-sided protocol under the plain PyTorch loop: where ranks meet, and where they do not.

Every collective that torch.distributed issues (including the functional ones DTensor
uses for the norm) is counted per phase of a minibatch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from odcfsdp import ODCShard, param_groups
from odcfsdp.launch import spawn
from parity import ParityModel, Run, causal_lm_loss

COLLECTIVES = [
    "all_reduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_object",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
]
FUNCTIONAL = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"]


@contextlib.contextmanager
def counting(calls: list[str]):
    """Record the name of every collective called inside (torch.distributed's and the functional ones)."""
    patched = [(dist, n) for n in COLLECTIVES if hasattr(dist, n)] + [(funcol, n) for n in FUNCTIONAL
                                                                     if hasattr(funcol, n)]
    originals = [(mod, n, getattr(mod, n)) for mod, n in patched]

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    for mod, n, fn in originals:
        setattr(mod, n, wrap(f"{'funcol.' if mod is funcol else ''}{n}", fn))
    try:
        yield
    finally:
        for mod, n, fn in originals:
            setattr(mod, n, fn)


def _count_by_phase(comm: str, micro_batches: list[int]) -> list[dict[str, list[str]]]:
    rank = dist.get_rank()
    run = Run(len(micro_batches), micro_batches)
    model = ODCShard(ParityModel(), 4096, comm=comm)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    per_step = []
    for step in range(2):
        phases: dict[str, list[str]] = {}
        with counting(phases.setdefault("micro-batches", [])):
            for x, y in run.data[step][rank]:
                causal_lm_loss(model(x), y, run.tokens(step)).backward()
        with counting(phases.setdefault("clip", [])):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with counting(phases.setdefault("step", [])):
            opt.step()
            opt.zero_grad()
        per_step.append(phases)
    with counting(per_step[-1].setdefault("next forward", [])):
        model(run.data[0][0][0][0][:1, :2])
    model.close()
    return per_step


@pytest.mark.parametrize("micro_batches", [[3, 1], [2, 0]])
def test_one_sided_ranks_meet_only_at_the_gradient_read(micro_batches):
    """No collective during the micro-batches; clip_grad_norm_ is one meeting (the sync) plus the norm's one
    all-reduce; the optimizer step and zero_grad none; the next minibatch's first forward one (the finish).
    A rank without micro-batches does the finish at its clip_grad_norm_ instead of at a forward."""
    for rank, per_step in enumerate(spawn(_count_by_phase, 2, "shm", micro_batches)):
        first, second = per_step
        assert first["micro-batches"] == [] and first["step"] == []
        assert sorted(first["clip"]) == ["all_gather_single", "funcol.all_reduce"]
        idle = micro_batches[rank] == 0
        # the second minibatch starts by finishing the first: at its first forward, or where a rank without
        # micro-batches first reads .grad
        assert second["micro-batches"] == ([] if idle else ["all_gather_single"])
        assert sorted(second["clip"]) == sorted(["all_gather_single", "funcol.all_reduce"]
                                                + (["all_gather_single"] if idle else []))
        assert second["step"] == [] and second["next forward"] == ["all_gather_single"]


def test_collective_transport_is_detected_by_the_same_check():
    """The counter is not blind: the collective transport calls collectives in every micro-batch."""
    for per_step in spawn(_count_by_phase, 2, "collective", [2, 2]):
        assert all(len(phases["micro-batches"]) > 2 for phases in per_step)


def _read_grad_mid_minibatch(micro_batches: list[int]) -> str:
    rank = dist.get_rank()
    run = Run(len(micro_batches), micro_batches)
    model = ODCShard(ParityModel(), 4096, comm="shm")
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    try:
        for x, y in run.data[0][rank]:
            causal_lm_loss(model(x), y, run.tokens(0)).backward()
            if rank == 0:
                next(model.parameters()).grad  # noqa: B018 - a read in the middle of rank 0's micro-batches
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    finally:
        model.close()
    return "no error"


def test_grad_read_in_the_middle_of_a_minibatch_is_refused():
    """A .grad read is where one-sided ranks meet: a rank that reads it and then runs another micro-batch is
    stopped with a clear error at that forward (the other rank took the read for the end of the minibatch)."""
    with pytest.raises(RuntimeError, match="rank 0 failed(.|\n)*a forward pass after gradients were read"):
        spawn(_read_grad_mid_minibatch, 2, [2, 1], timeout=120)
