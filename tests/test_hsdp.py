"""Hybrid sharding (HSDP, [hsdp] in odcfsdp/sharding/placement/hsdp.py) on CPU: a 2-D (replicate, shard) mesh, shm within
each shard group and gloo across replicas, against one plain process on the union of the data; where replicas meet;
checkpoints across mesh shapes."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from odcfsdp import ODCShard
from odcfsdp.launch import spawn
from odcfsdp.sharding.placement.hsdp import hybrid_mesh
from parity import ParityModel, Run, causal_lm_loss, sharded_run
from checkpoint_state import assert_same_state, build, full_state, train_steps
from test_parity import check_against_reference
from test_protocol import counting


@pytest.mark.parametrize("replicas, micro_batches", [
    (2, [2, 2, 2, 2]),        # 2 x 2, equal counts
    (2, [1, 3, 0, 2]),        # 2 x 2, uneven, a rank without micro-batches
    (2, [1, 0, 2, 3, 1, 1]),  # 2 x 3, uneven
])
def test_hsdp_matches_one_process_on_the_union(replicas, micro_batches):
    """AdamW over two parameter groups, clipping active, 3 steps: losses, norms and parameters equal the plain run's
    (fp32, rtol 1e-5), whatever each rank's share of micro-batches in either replica."""
    world = len(micro_batches)
    run = Run(world, micro_batches=micro_batches)
    results = spawn(sharded_run, world, run, torch.float32, 4096, True, "shm", "cpu", 1, None, (), None, replicas,
                    timeout=300)
    assert [len(r["losses"][0]) for r in results] == micro_batches
    check_against_reference(run, results, torch.float32)


def _count_across_replicas(micro_batches: list[int]) -> list[dict]:
    rank = dist.get_rank()
    run = Run(len(micro_batches), micro_batches)
    model = ODCShard(ParityModel(), 4096, comm="shm", mesh=hybrid_mesh(2, "cpu"))
    across = model.mesh.replicate.group
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_step = []
    for step in range(2):
        phases: dict[str, list] = {}
        with counting(phases.setdefault("micro-batches", []), with_groups=True):
            for x, y in run.data[step][rank]:
                causal_lm_loss(model(x), y, run.tokens(step)).backward()
        with counting(phases.setdefault("clip", []), with_groups=True):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with counting(phases.setdefault("step", []), with_groups=True):
            opt.step()
        with counting(phases.setdefault("zero_grad", []), with_groups=True):
            opt.zero_grad()
        per_step.append(phases)
    trained = sum(g.layout.requires_grad for g in model.groups)
    model.close()
    return [{k: [name for name, group in v if group is across] for k, v in p.items()}
            | {"all": {k: [name for name, _ in v] for k, v in p.items()}, "trained": trained} for p in per_step]


def test_replicas_meet_once_per_minibatch_at_the_sync():
    """Between the first forward and the step nothing runs across replicas; in the sync (the first .grad read, in
    clip_grad_norm_) one small all-gather (each group's meeting and push count) plus one all-reduce per trained
    group; nothing in the step; nothing in zero_grad right after the step either ([zero-grad-pass]: every rank
    skips that pass alike, and the next meeting compares the counts of skipped passes)."""
    for per_step in spawn(_count_across_replicas, 4, [3, 0, 1, 2], timeout=300):
        for p in per_step:
            assert p["micro-batches"] == [] and p["all"]["micro-batches"] == []
            assert p["clip"] == ["all_gather_single"] + ["all_reduce"] * p["trained"]
            assert p["step"] == [] and p["zero_grad"] == []


def _save_hsdp(path: str) -> dict:
    model, opt = build(mesh=hybrid_mesh(2, "cpu"))
    train_steps(model, opt, 2)
    from odcfsdp.checkpoint import save_checkpoint

    save_checkpoint(path, model, opt, step=2)
    return full_state(model, opt)


def _load_mesh(path: str, replicas: int) -> dict:
    from odcfsdp.checkpoint import latest_checkpoint, load_checkpoint

    model, opt = build(group_bytes=2048, seed=123, mesh=hybrid_mesh(replicas, "cpu"))
    manifest = load_checkpoint(latest_checkpoint(path), model, opt)
    out = full_state(model, opt)
    out["step"], out["replicas"] = manifest["step"], manifest["replicas"]
    return out


@pytest.fixture(scope="module")
def hsdp_checkpoint(tmp_path_factory):
    """(directory, full state) of a checkpoint saved under 2 x 2, once for the module."""
    path = tmp_path_factory.mktemp("hsdp")
    written = spawn(_save_hsdp, 4, str(path), timeout=300)
    assert all(w["params"].keys() == written[0]["params"].keys() for w in written)
    assert sorted(f.name for f in next(path.iterdir()).iterdir()) == [
        "manifest.json", "rank00000.safetensors", "rank00001.safetensors", "replica00001-rank00000.safetensors",
        "replica00001-rank00001.safetensors"]
    return path, written[0]


@pytest.mark.parametrize("world, replicas", [(3, 1), (4, 4), (4, 2)])
def test_checkpoint_moves_between_mesh_shapes_exactly(hsdp_checkpoint, world, replicas):
    """Saved under 2 x 2 (replica 0 writes the shards, replica 1 its RNG states), loaded under 1 x 3, 4 x 1 and
    2 x 2 with other groups: master weights and AdamW state bit for bit."""
    path, written = hsdp_checkpoint
    for loaded in spawn(_load_mesh, world, str(path), replicas, timeout=300):
        assert loaded["step"] == 2 and loaded["replicas"] == 2
        assert_same_state(written, loaded)


def _meshes_across_nodes() -> list:
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # as torchrun sets it for 2 nodes of 1 rank
    out = [tuple(hybrid_mesh(None, "cpu").shape)]  # default: one shard group per node
    try:
        hybrid_mesh(1, "cpu", spans_hosts=False)
    except ValueError as e:
        out.append(str(e))
    out.append(hybrid_mesh(1, "cpu", spans_hosts=True))  # the collective transport reaches every host
    return out


def test_the_default_mesh_puts_one_shard_group_on_each_node():
    for shape, error, collective in spawn(_meshes_across_nodes, 2, timeout=120):
        assert shape == (2, 1) and collective is None
        assert "spans nodes of 1" in error and "shard.replicas=2" in error


def test_shard_replicas_through_the_cli(tmp_path):
    """shard.replicas=2 on 2 ranks (2 x 1) trains as full sharding over 2 ranks: same losses."""
    from test_train import run_ranks

    base = {"run": {"steps": 3}}
    hsdp = run_ranks({**base, "shard": {"replicas": 2}}, tmp_path / "hsdp")
    full = run_ranks({**base, "shard": {"replicas": 1}}, tmp_path / "full")
    torch.testing.assert_close([r["loss"] for r in hsdp], [r["loss"] for r in full], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in hsdp], [r["grad_norm"] for r in full], rtol=1e-5, atol=0)


def test_two_torchrun_nodes_default_to_hsdp(tmp_path):
    """Multi-node launch as documented, simulated with two torchrun agents of one rank each on this host
    (--nnodes=2, a static rendezvous): the default mesh is one shard group per node, i.e. HSDP 2 x 1, and the run
    trains as full sharding over 2 spawned ranks does."""
    import json
    import subprocess
    import sys

    from odcfsdp.launch import free_port
    from test_train import run_ranks

    port = free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    args = ["-m", "odcfsdp.train", "run.steps=3", f"run.out_dir={tmp_path / 'nodes'}"]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a stuck process prints its Python stacks on SIGABRT
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common, f"--node-rank={n}", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True) for n in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in nodes]
    except subprocess.TimeoutExpired:  # every agent and rank prints where it is stuck, then ends
        for p in nodes:
            os.killpg(p.pid, signal.SIGABRT)
        outs = [p.communicate(timeout=60)[0] for p in nodes]
        pytest.fail("the two nodes did not finish in 180 s:\n" + outs[0][-4000:] + outs[1][-4000:])
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    assert "hybrid sharding: 2 replicas x 1 ranks" in outs[0]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "nodes" / "metrics.jsonl").read_text().splitlines()]
    full = run_ranks({"run": {"steps": 3}, "shard": {"replicas": 1}}, tmp_path / "full")
    torch.testing.assert_close(losses, [r["loss"] for r in full], rtol=1e-5, atol=0)
