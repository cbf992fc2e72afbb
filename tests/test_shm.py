"""The shm symmetric heap: sharing, locking, and no files left behind (crashes included)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from odcfsdp import ODCShard
from odcfsdp.launch import spawn
from odcfsdp.sharding.placement.mesh import ShardMesh
from odcfsdp.sharding.transport.shm import ShmHeap, shm_dir, sweep_stale_heaps
from parity import ParityModel


def _heap_roundtrip() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    heap = ShmHeap(4096, ShardMesh(torch.device("cpu")))
    heap.view(rank, 0, 4, torch.float32).fill_(rank + 1)
    dist.barrier()
    seen = [heap.view(q, 0, 4, torch.float32).sum().item() for q in range(world)]
    for _ in range(50):  # every rank adds into every owner under the owner's lock
        for q in range(world):
            with heap.locked(q, 0):
                heap.view(q, 64, 1, torch.float32).add_(1.0)
    dist.barrier()
    total = heap.view(rank, 64, 1, torch.float32).item()
    no_files = not any(shm_dir().glob(f"odcfsdp-*-p{os.getpid()}"))
    heap.close()
    return seen + [total, float(no_files)]


def test_heap_regions_are_shared_and_locked_adds_do_not_race():
    for rank, out in enumerate(spawn(_heap_roundtrip, 3)):
        assert out[:3] == [4.0, 8.0, 12.0]  # each rank filled 4 floats with rank + 1
        assert out[3] == 150.0  # 3 ranks x 50 locked adds, none lost
        assert out[4] == 1.0  # files unlinked right after set-up


def _crash_after_setup() -> None:
    model = ODCShard(ParityModel(), 4096, comm="shm")
    x = torch.randint(0, 97, (2, 8))
    model(x).sum().backward()
    if dist.get_rank() == 1:
        os._exit(3)  # die without any clean-up
    model.mesh.barrier()  # rank 0 waits for a peer that is gone


def test_crash_leaves_no_files():
    before = set(shm_dir().glob("odcfsdp-*"))
    with pytest.raises(RuntimeError):
        spawn(_crash_after_setup, 2, timeout=120)
    assert set(shm_dir().glob("odcfsdp-*")) == before


def test_stale_files_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"odcfsdp-abc123-r0-p{int(dead.stdout)}"
    alive = tmp_path / f"odcfsdp-abc123-r1-p{os.getpid()}"
    other = tmp_path / "odcfsdp-notours"
    for f in (stale, alive, other):
        f.write_bytes(b"x")
    assert sweep_stale_heaps(tmp_path) == [stale]
    assert not stale.exists() and alive.exists() and other.exists()


@pytest.mark.gpu
def test_shm_refuses_cuda_models():
    with pytest.raises(ValueError, match="comm='shm' moves cpu tensors, the model is on cuda"):
        ODCShard(torch.nn.Linear(4, 4).cuda(), comm="shm")


def _exit_quietly() -> None:
    if dist.get_rank() == 1:
        os._exit(0)  # exit "successfully" without returning a result


def test_spawn_reports_a_rank_that_exits_without_a_result():
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 exited with code 0 without a result"):
        spawn(_exit_quietly, 2, timeout=120)
    assert time.monotonic() - start < 60
