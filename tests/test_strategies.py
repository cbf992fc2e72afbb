"""Issue 34 part 4: FSDP1's sharding strategies by FSDP2's means (the mesh and ``reshard_after_forward``), each
trained on CPU ranks with uneven micro-batch counts against one plain process on the union of the data (AdamW over two
parameter groups, clipping active, 3 steps; fp32, ``check_against_reference``). docs/design.md names them."""

from __future__ import annotations

import pytest
import torch

from odcfsdp.launch import spawn
from parity import Run, sharded_run
from test_parity import check_against_reference

#: FSDP1's ShardingStrategy -> (ranks, replicas, reshard_after_forward): ``replicas`` is the first dimension of the
#: 2-D (replicate, shard) DeviceMesh handed to ODCShard(mesh=), as FSDP2 takes it; 1 means a 1-D mesh.
STRATEGIES = {
    "FULL_SHARD": (2, 1, True),      # the default: one shard group of every rank, freed after forward
    "SHARD_GRAD_OP": (2, 1, False),  # reshard_after_forward=False: gathered parameters kept from forward to backward
    "NO_SHARD": (2, 2, True),        # mesh (2, 1): shard groups of one rank, every rank holds the whole model
    "HYBRID_SHARD": (4, 2, True),    # mesh (2, 2): sharded within each replica, replicated across the two
}
MICRO_BATCHES = {2: [1, 2], 4: [2, 0, 1, 3]}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_each_fsdp1_strategy_matches_one_process_on_the_union(strategy):
    world, replicas, reshard = STRATEGIES[strategy]
    run = Run(world, micro_batches=MICRO_BATCHES[world])
    results = spawn(sharded_run, world, run, torch.float32, 4096, reshard, "shm", "cpu", 1, None, (), None, replicas,
                    timeout=300)
    assert [len(r["losses"][0]) for r in results] == MICRO_BATCHES[world]
    check_against_reference(run, results, torch.float32)


@pytest.mark.parametrize("value", [2, 1, None])
def test_an_int_reshard_after_forward_is_refused_in_one_line(value):
    """FSDP2's int (a copy kept within a smaller group after forward) has no ODC meaning yet: refused where the
    wrapper is made, in one line saying why and what to use, never taken as a truthy bool."""
    from odcfsdp import ODCShard

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as e:
        ODCShard(model, reshard_after_forward=value)
    assert str(e.value).startswith(f"reshard_after_forward={value!r}: only True or False; FSDP2's int") \
        and "\n" not in str(e.value)
    assert not hasattr(model.weight, "_odc")  # nothing was wrapped
