"""The standard PyTorch loop on ODCShard matches a plain single-process run (CPU, gloo, spawned ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from odcfsdp import ODCShard
from odcfsdp.launch import spawn
from odcfsdp.models.llama import DecoderLayer
from parity import FROZEN, ParityModel, Run, reference_run, sharded_run

# fp32: rtol 1e-5; the absolute floor (1e-3 of one Adam step, lr = 1e-2) covers entries near
# zero: the order in which ranks' pushes are added is not fixed (shm: whoever comes first), so a
# gradient entry whose contributions cancel differs between runs by far more than its ulp, and
# Adam-type optimizers scale that difference up to a fraction of lr (a 1.09e-6 difference was
# seen once in ~10 runs of the 3-rank Adam case). float64 shows the algorithm itself is exact.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-14)}


def check_against_reference(run: Run, results: list[dict], dtype: torch.dtype, compile_backend: str | None = None) -> None:
    ref = reference_run(run, dtype, compile_backend)
    tol = TOL[dtype]
    for step in range(run.steps):
        flat, start = ref["losses"][step], 0
        for rank, res in enumerate(results):
            got = res["losses"][step]
            want = flat[start : start + len(got)]
            start += len(got)
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), **tol,
                                       msg=lambda m: f"step {step} rank {rank} losses: {m}")
        for res in results:
            torch.testing.assert_close(res["norms"][step], ref["norms"][step], **tol)
    assert max(ref["norms"]) > run.max_norm, "clipping was never active; the test would not cover it"
    for res in results:
        assert set(res["params"]) >= set(ref["params"])
        for name, want in ref["params"].items():
            torch.testing.assert_close(res["params"][name], want, **tol, msg=lambda m: f"{name}: {m}")
    assert torch.equal(results[0]["params"][FROZEN], ref["params"][FROZEN])


@pytest.mark.parametrize(
    "world_size, reshard, group_bytes, dtype, optimizer, schedule",
    [
        (2, True, 4096, torch.float32, "adamw", True),
        (2, False, 32 << 20, torch.float32, "sgd", True),
        (3, True, 16384, torch.float32, "adam", False),
        (3, False, 4096, torch.float32, "rmsprop", True),
        (3, True, 4096, torch.float64, "adagrad", False),
    ],
)
@pytest.mark.parametrize("comm", ["collective", "shm"])
def test_parity(world_size, reshard, group_bytes, dtype, optimizer, schedule, comm):
    """Any element-wise torch optimizer (AdamW, SGD with momentum, Adam, RMSprop, Adagrad), with or without a
    LambdaLR schedule, over two parameter groups, trains the sharded model as it trains the plain one."""
    run = Run(world_size, micro_batches=[2] * world_size, optimizer=optimizer, schedule=schedule)
    results = spawn(sharded_run, world_size, run, dtype, group_bytes, reshard, comm)
    if group_bytes == 4096:
        assert results[0]["groups"] > 5  # many small groups, parameters bigger than a group
    check_against_reference(run, results, dtype)


@pytest.mark.parametrize("compile_backend", [None, "aot_eager"])
def test_parity_whole_layer_units(compile_backend):
    """Hooks on whole decoder layers (uneven micro-batches), eager or with the layers' dense parts compiled."""
    run = Run(2, micro_batches=[1, 2])
    results = spawn(sharded_run, 2, run, torch.float32, 4096, True, "shm", "cpu", 1, None, (DecoderLayer,),
                    compile_backend)
    # The reference compiles the same way: compiled graphs round differently from eager kernels
    # (decomposed backward formulas), which is torch's business, not the sharding's.
    check_against_reference(run, results, torch.float32, compile_backend)
    if compile_backend:  # ODCShard's hooks stay outside the compiled parts
        assert [r["graph_breaks"] for r in results] == [0, 0]


@pytest.mark.parametrize("comm", ["collective", "shm"])
def test_parity_single_process(comm):
    """N = 1 without torch.distributed."""
    run = Run(1, micro_batches=[3])
    check_against_reference(run, [sharded_run(run, torch.float32, 4096, True, comm)], torch.float32)


@pytest.mark.parametrize("micro_batches, zero_grad_first", [
    ([1, 3], False), ([2, 0, 1], False), ([2, 0, 1], True), ([1, 3, 0, 2], True),
])
def test_uneven_micro_batches_one_sided(micro_batches, zero_grad_first):
    """Ranks run different numbers of micro-batches (zero included) in the plain loop, with opt.zero_grad() after
    the step or at the start of the next: same result as one process on the union."""
    run = Run(len(micro_batches), micro_batches=micro_batches, zero_grad_first=zero_grad_first)
    results = spawn(sharded_run, len(micro_batches), run, torch.float32, 4096, True, "shm")
    assert [len(r["losses"][0]) for r in results] == micro_batches
    check_against_reference(run, results, torch.float32)


def _uneven_collective(run: Run) -> str:
    model = ODCShard(ParityModel(), 4096, comm="collective")
    try:
        model.begin_minibatch(len(run.data[0][dist.get_rank()]))
    except RuntimeError as e:
        return str(e)
    finally:
        model.close()
    return "no error"


def test_uneven_micro_batches_refused_by_collective():
    run = Run(2, micro_batches=[1, 3])
    for message in spawn(_uneven_collective, 2, run, timeout=120):
        assert "needs the same number of micro-batches on every rank, got [1, 3]" in message
