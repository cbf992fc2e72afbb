"""``ODCShard(offload_policy=CPUOffloadPolicy())``: fp32 masters, optimizer state and step in host memory ([offload] in
odcfsdp/sharding/groups/group.py). On CPU the masters are a separate host copy (not the rows), gradients are copied into a
host buffer at the sync and masters into the rows at the finish: the same training to the bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy

from odcfsdp import ODCShard
from odcfsdp.launch import spawn
from parity import Run, assert_same_training, sharded_run


def _run(micro_batches: list[int], comm: str, offload: bool) -> dict:
    return sharded_run(Run(world_size=len(micro_batches), micro_batches=micro_batches, steps=3), torch.float32, 4096,
                       True, comm, offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else None)


# Two pushes per accumulator element at most, so runs are reproducible to the bit (test_gather_masters.py says why).
@pytest.mark.parametrize("comm, micro_batches", [("shm", [1, 1]), ("collective", [1, 1]), ("shm", [0, 2])])
def test_offloaded_masters_train_exactly_as_resident_ones(comm, micro_batches):
    n = len(micro_batches)
    resident = spawn(_run, n, micro_batches, comm, False, timeout=180)
    offloaded = spawn(_run, n, micro_batches, comm, True, timeout=180)
    assert_same_training(resident, offloaded)
    assert all(b["master_devices"] == {"cpu"} for b in offloaded)


def test_closing_drops_the_host_gradients():
    """A model closed between the read of .grad and the step keeps no host gradient buffer alive."""
    model = ODCShard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy(pin_memory=False))
    model(torch.randn(2, 4)).sum().backward()
    assert model.module.weight.grad is not None  # the sync: gradients copied to the host buffer
    model.close()
    assert all(g._grad_copy is None and g._grad_host is None for g in model.groups)
