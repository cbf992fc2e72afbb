"""``ODCShard(gather_masters=True)``: peers gather the fp32 masters and cast while unpacking ([gather-masters] in
odcfsdp/sharding/groups/group.py): the same training, to the bit, without the resident bf16 rows."""

from __future__ import annotations

import pytest
import torch

from odcfsdp.launch import spawn
from parity import Run, assert_same_training, sharded_run


def _run(micro_batches: list[int], comm: str, gather_masters: bool) -> dict:
    return sharded_run(Run(world_size=len(micro_batches), micro_batches=micro_batches, steps=3), torch.float32, 4096,
                       True, comm, param_dtype=torch.bfloat16, gather_masters=gather_masters)


# Two pushes per accumulator element at most: fp32 addition of two values is the same in either order, so runs
# are reproducible to the bit (with three, the order ranks arrive in could move a last bit between any two runs).
@pytest.mark.parametrize("comm, micro_batches", [("shm", [1, 1]), ("collective", [1, 1]), ("shm", [0, 2, 0])])
def test_gathering_masters_trains_exactly_as_gathering_published_rows(comm, micro_batches):
    """bf16 compute on CPU: every rank gathers round(master) either way, so losses, norms and masters are equal to
    the bit; the heap then holds fp32 rows (the masters) and no bf16 ones."""
    n = len(micro_batches)
    rows = spawn(_run, n, micro_batches, comm, False, timeout=180)
    masters = spawn(_run, n, micro_batches, comm, True, timeout=180)
    assert_same_training(rows, masters)
    assert all(a["row_dtypes"] == {"bfloat16"} and b["row_dtypes"] == {"float32"} for a, b in zip(rows, masters))
