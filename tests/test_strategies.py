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
