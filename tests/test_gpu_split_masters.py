"""GPU tests of ``split_masters=True`` ([split-masters] in odcfsdp/sharding/groups/split_master.py): the nvshmem
transport's training against plain PyTorch's mixed precision, and the device bytes a minibatch frees. Marked
``gpu``: skipped without CUDA."""

from __future__ import annotations

import functools

import pytest
import torch

from odcfsdp.launch import spawn
from parity import Run, mixed_precision_reference, sharded_run
from test_gpu import BF16_TOL, compare, record

pytestmark = pytest.mark.gpu
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@one_gpu
@pytest.mark.parametrize("world, micro_batches", [(1, [2]), pytest.param(2, [1, 2], marks=two_gpus)])
def test_split_masters_nvshmem(world, micro_batches):
    """split_masters=True: each master held as its bf16 row (on the heap) plus 16 low bits inside the minibatch,
    whole for the fused step ([split-masters]); against the same mixed-precision reference as the default."""
    run = Run(world, micro_batches=micro_batches)
    results = spawn(functools.partial(sharded_run, split_masters=True), world, run, torch.float32, 4096, True,
                    "nvshmem", "cuda", backend="nccl", timeout=240)
    compare(f"split_masters[{world},{micro_batches}]", run, results, mixed_precision_reference(run, "cuda"), BF16_TOL)


def _split_masters_device_bytes() -> dict:
    from odcfsdp import ODCShard
    from odcfsdp.models import Llama, LlamaConfig

    out = {}
    for split in (False, True):
        torch.manual_seed(0)
        model = ODCShard(Llama(LlamaConfig()).cuda(), split_masters=split)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        tokens = torch.randint(0, LlamaConfig().vocab_size, (2, 64), device="cuda")
        seen = []
        for step in range(4):  # step 0 unrecorded: cuBLAS's workspace (32 MiB) is allocated at the process's first
            for _ in range(2):  # matmul, which would fall in the first setting's first forward only
                before = torch.cuda.memory_allocated()
                loss = model(tokens).float().mean()
                if step:
                    seen.append(torch.cuda.memory_allocated() - before)
                loss.backward()
            opt.step()
            opt.zero_grad()
        out[split] = {"forward_bytes": seen, "loss": loss.item(),
                      "master_numel": sum(g.master.numel() for g in model.groups if g.master is not g.row)}
        model.close()
    return out


@one_gpu
def test_split_masters_free_two_bytes_a_parameter_in_a_minibatch_on_a_gpu():
    """One GPU: a minibatch's first forward frees each fp32 master and holds 2 bytes of low bits a parameter
    instead (the allocator's count falls by 2 bytes a parameter, to its 512-byte rounding per group); the forwards
    after it in the minibatch allocate as the default's; the last loss is the default's."""
    (out,) = spawn(_split_masters_device_bytes, 1, backend="nccl", timeout=180)
    record("split_masters_device_bytes", [], {}, **{str(k): v for k, v in out.items()})
    default, split = out[False], out[True]
    saved = 2 * split["master_numel"]
    for i, (a, b) in enumerate(zip(default["forward_bytes"], split["forward_bytes"])):
        assert abs((a - b) - (saved if i % 2 == 0 else 0)) <= 512 * 64, (i, a, b, saved)
    assert split["loss"] == pytest.approx(default["loss"], rel=1e-3)


@one_gpu
@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
def test_the_kernels_on_a_gpu_make_the_chunked_operators_bits(monkeypatch, wide):
    """``kernels/split_bits.py`` compiled for the device (not the interpreter): the low bits and the joined masters
    of every kind of fp32 value (``every_kind_of_fp32``) equal the CPU's chunked operators' to the bit, with int32
    and with int64 offsets, over full blocks and a partial last one; a row that is not its master's rounding sets
    the flag from a full block and from the last."""
    from odcfsdp.kernels import split_bits as kernels_module
    from odcfsdp.sharding.groups.split_master import join_low_bits, split_low_bits
    from test_split_masters import every_kind_of_fp32

    if wide:
        monkeypatch.setattr(kernels_module, "WIDE_FROM", 0)
    x = every_kind_of_fp32(1 << 20)
    row = x.to(torch.bfloat16)
    cpu_stale = torch.zeros((), dtype=torch.int32)
    cpu_low = split_low_bits(x, row, cpu_stale)
    cpu_back = torch.empty_like(x)
    join_low_bits(row, cpu_low, cpu_back)
    stale = torch.zeros((), dtype=torch.int32, device="cuda")
    low = split_low_bits(x.cuda(), row.cuda(), stale)
    back = torch.empty_like(x, device="cuda")
    join_low_bits(row.cuda(), low, back)
    assert int(stale) == 0 and int(cpu_stale) == 0
    assert torch.equal(low.cpu(), cpu_low)
    assert torch.equal(back.cpu().view(torch.int32), cpu_back.view(torch.int32))
    for where in (5000, len(x) - 3):
        changed, flag = x.clone(), torch.zeros((), dtype=torch.int32, device="cuda")
        changed[where] = 3.0 if abs(float(row[where])) != 3.0 else 5.0
        split_low_bits(changed.cuda(), row.cuda(), flag)
        assert int(flag) == 1, where
