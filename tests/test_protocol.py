"""The one-sided protocol: no collective between the first forward and the optimizer step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from odcfsdp import ODCShard, optim
from odcfsdp.launch import spawn
from parity import Run, ParityModel, causal_lm_loss

COLLECTIVES = [
    "all_reduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_object",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
]


def _count_collectives_in_minibatch(comm: str, micro_batches: list[int]) -> list[int]:
    rank = dist.get_rank()
    run = Run(len(micro_batches), micro_batches)
    model = ODCShard(ParityModel(), 4096, comm=comm)
    opt = optim.AdamW(model)
    calls = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    per_step = []
    for step in range(2):
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        try:
            for x, y in run.data[step][rank]:
                causal_lm_loss(model(x), y, run.tokens(step)).backward()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        per_step.append(len(calls))
        calls.clear()
        opt.step(max_norm=1.0)
    model.close()
    return per_step


def test_one_sided_minibatch_has_no_collectives():
    for per_step in spawn(_count_collectives_in_minibatch, 2, "shm", [3, 1]):
        assert per_step == [0, 0]


def test_collective_transport_is_detected_by_the_same_check():
    """The counter is not blind: the collective transport calls collectives in every micro-batch."""
    for per_step in spawn(_count_collectives_in_minibatch, 2, "collective", [2, 2]):
        assert all(n > 0 for n in per_step)
