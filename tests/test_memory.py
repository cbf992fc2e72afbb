"""Memory accounting (odcfsdp/memory/): live categories on the shm transport, the snapshot replay, the e2e report."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from odcfsdp import ODCShard, param_groups
from odcfsdp.launch import spawn
from odcfsdp.memory import FRAME_RULES, classify_frames, memory_breakdown, peak_breakdown, replay_peak
from odcfsdp.memory.live import _Claims
from odcfsdp.models import Llama, LlamaConfig
from odcfsdp.models.llama import DecoderLayer
from odcfsdp.sharding import GroupState

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


# -- live categories -------------------------------------------------------------------------------------------
def _bytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _breakdowns(dtype_name: str) -> dict:
    """One rank: memory_breakdown at each moment of a step, with what the test expects computed independently."""
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = ODCShard(Llama(CFG), group_bytes=4 << 10, comm="shm", param_dtype=dtype, units=(DecoderLayer,))
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    size = _bytes_of(dtype)
    layer0 = {g for g in model.groups for sp in g.params if sp.name.startswith("layers.0.")}
    seen: dict = {}

    def in_forward(_m, _a):  # inside layer 0's forward (its groups gathered)
        gathered = sum(g.layout.unsharded_numel * size for g in model.groups if g.state is GroupState.UNSHARDED)
        seen["forward"] = (memory_breakdown(model, opt).as_dict(), gathered,
                           all(g.state is GroupState.UNSHARDED for g in layer0),
                           sum(g.layout.unsharded_numel * size for g in layer0))

    def in_backward(_grad):  # inside layer 0's backward, its MLP's done: their gradients are computed (autograd
        # accumulates first) and not pushed yet (the site is the whole layer); [fresh-grads]: autograd's own tensors
        pending = [sp.unsharded.grad for g in model.groups for sp in g.params if sp.unsharded.grad is not None]
        seen["backward"] = (memory_breakdown(model, opt).as_dict(), sum(t.numel() * size for t in pending),
                            [g.grad_buffer for g in model.groups if g.grad_buffer is not None])

    def hook_input(_m, args) -> None:
        if args[0].requires_grad:
            args[0].register_hook(in_backward)

    mlp = model.module.layers[0].mlp
    hooks = [mlp.register_forward_pre_hook(in_forward), mlp.register_forward_pre_hook(hook_input)]
    out = {"wrapped": memory_breakdown(model, opt).as_dict()}
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    for _ in range(2):  # two micro-batches: the second one prefetches (the first records the site order)
        model(x).float().pow(2).mean().backward()
    out["after_backward"] = memory_breakdown(model, opt).as_dict()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    out["after_step"] = memory_breakdown(model, opt).as_dict()
    for h in hooks:
        h.remove()
    out["forward"], out["backward"] = seen["forward"], seen["backward"]
    trained = [p for p in model.parameters() if p.requires_grad]
    out["expected"] = {
        "rows": sum(lay.row_len for lay in model.layouts) * size,
        "accumulators": sum(lay.row_len * 4 for lay in model.layouts if lay.requires_grad),
        "masters": 0 if dtype == torch.float32 else sum(lay.row_len * 4 for lay in model.layouts),
        "heap": model.transport.heap_bytes, "groups": len(model.groups),
        # AdamW: exp_avg and exp_avg_sq like each local shard (fp32) and one fp32 `step` scalar per parameter
        "adamw": sum(2 * p.to_local().numel() * 4 + 4 for p in trained),
    }
    model.close()
    return out


def _check(r: dict) -> None:
    exp = r["expected"]
    for point in ("wrapped", "after_backward", "after_step"):
        bd = r[point]
        for key in ("rows", "accumulators", "masters", "heap"):
            assert bd[key] == exp[key], (point, key, bd[key], exp[key])
        assert bd["rows"] + bd["accumulators"] + bd["heap_other"] == bd["heap"]  # the heap, every byte of it
        assert 0 <= bd["heap_other"] < 2 * 256 * exp["groups"]  # alignment only
        assert bd["outside_torch"] == ["rows", "accumulators", "heap_other"]
        assert bd["torch_allocated"] is None  # CPU
        assert bd["unsharded_params"] == 0 and bd["grad_buffers"] == 0, point
    assert r["wrapped"]["optimizer_state"] == 0  # AdamW's state appears with its first step
    assert r["after_step"]["optimizer_state"] == exp["adamw"]
    fwd, gathered, layer0_gathered, layer0_bytes = r["forward"]
    assert layer0_gathered and fwd["unsharded_params"] == gathered > layer0_bytes > 0  # layer 1 prefetched too
    assert fwd["grad_buffers"] == 0
    bwd, pending, buffers = r["backward"]
    assert bwd["grad_buffers"] == pending > 0 and buffers == []  # no zeroed buffer in backward: made at the push


def test_categories_add_up_on_the_shm_transport():
    """fp32 (the row is the master: no separate masters) and bf16 rows (fp32 masters), 2 gloo ranks."""
    for dtype in ("float32", "bfloat16"):
        for r in spawn(_breakdowns, 2, dtype):
            _check(r)


def test_wrapper_subclasses_count_by_their_inner_tensors():
    """FSDP2's float8 parameters are DTensors over torchao's weight wrapper, neither of which has a storage of its
    own (its data pointer raises): the tensors counted are the inner plain ones, here the wrapped fp32 tensor."""
    pytest.importorskip("torchao")
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from odcfsdp.memory.live import plain_tensors, span

    inner = torch.randn(16, 32)
    mm_config = Float8Linear.from_float(nn.Linear(32, 16), Float8LinearConfig()).linear_mm_config
    weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(inner, mm_config, torch.float32))
    with pytest.raises(RuntimeError, match="invalid python storage"):  # what the breakdown met on 2 GPUs
        weight.untyped_storage().data_ptr()
    assert [t.data_ptr() for t in plain_tensors([weight, None])] == [inner.data_ptr()]
    assert span(weight) == (inner.data_ptr(), inner.data_ptr() + inner.numel() * 4)


def test_claims_count_each_byte_once():
    c = _Claims()
    assert c.claim(100, 200) == 100
    assert c.claim(150, 250) == 50  # overlaps: only the new part
    assert c.claim(0, 100) == 100  # touching
    assert c.claim(120, 130) == 0  # a view inside
    assert c.claim(0, 400) == 150
    assert c._iv == [(0, 400)]


# -- the snapshot replay ------------------------------------------------------------------------------------------
def _frame(path: str, name: str, line: int = 1) -> dict:
    return {"filename": path, "name": name, "line": line}


MARKER = [_frame("/src/odcfsdp/memory/peak.py", "_probe_marker"), _frame("/src/odcfsdp/memory/peak.py", "probe")]
FORWARD = [_frame("/src/odcfsdp/models/llama.py", "forward", 170),
           _frame("/usr/lib/torch/nn/modules/module.py", "_call_impl"),
           _frame("/src/odcfsdp/sharding/api/shard.py", "forward")]  # outer frames never decide
GATHER_STAGING = [_frame("/src/odcfsdp/sharding/transport/collective.py", "gather"),
                  _frame("/src/odcfsdp/sharding/transport/streams.py", "gather"),
                  _frame("/src/odcfsdp/sharding/groups/group.py", "to_unsharded")]  # innermost rule wins


def _alloc(addr, size, frames):
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames}


def _free(addr, size, completed=True):
    return {"action": "free_completed" if completed else "free_requested", "addr": addr, "size": size, "stream": 0}


def _snapshot() -> dict:
    """Blocks before the trace: A (0x1000, 1000 B, a master), D (0x1e00, 300 B), E (0x5000, 4000 B, freed in it)."""
    trace = [
        _alloc(0x9000, 1, MARKER), _free(0x9000, 1, False), _free(0x9000, 1),     # probe 0: A is a master
        _alloc(0x8000, 800, FORWARD), _free(0x8000, 800, False), _free(0x8000, 800),   # freed before the peak
        _alloc(0x1600, 2000, [_frame("/src/odcfsdp/sharding/groups/group.py", "to_unsharded")]),
        _alloc(0x3000, 3000, FORWARD),                                                  # labelled by probe 1
        _alloc(0x3c00, 250, FORWARD),
        _alloc(0x4000, 700, GATHER_STAGING),
        {"action": "segment_alloc", "addr": 0x6000, "size": 2 << 20, "stream": 0},  # ignored
        _free(0x3000, 3000, False),                          # requested only: still memory
        _alloc(0x6000, 500, [_frame("/src/odcfsdp/sharding/groups/group.py", "prepare_grad")]),   # the peak: 11750
        _alloc(0x9000, 1, MARKER), _free(0x9000, 1, False), _free(0x9000, 1),     # probe 1: 0x3000 is a gradient
        _free(0x5000, 4000),                                 # E, alive since before the trace
        _free(0x3000, 3000), _free(0x3c00, 250), _free(0x4000, 700), _free(0x6000, 500),
        _alloc(0x7000, 100, [_frame("/usr/lib/torch/optim/adam.py", "_init_group"),
                             _frame("/usr/lib/torch/optim/optimizer.py", "wrapper")]),
        _alloc(0x9000, 1, MARKER), _free(0x9000, 1),                               # probe 2 (nothing known)
    ]
    segments = [
        {"device": 0, "address": 0x1000, "total_size": 4096, "stream": 0, "blocks": [
            {"size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": []},           # A
            {"size": 512, "requested_size": 0, "state": "inactive", "frames": []},
            {"size": 2048, "requested_size": 2000, "state": "active_allocated",                            # C
             "frames": [_frame("/src/odcfsdp/sharding/groups/group.py", "to_unsharded")]},
            {"size": 512, "requested_size": 300, "state": "active_allocated", "frames": []}]},            # D
        {"device": 0, "address": 0x7000, "total_size": 512, "stream": 0, "blocks": [
            {"size": 512, "requested_size": 100, "state": "active_allocated", "frames": []}]},            # I
        {"device": 1, "address": 0x1000, "total_size": 512, "stream": 0, "blocks": [                     # other GPU
            {"size": 512, "requested_size": 512, "state": "active_allocated", "frames": []}]},
    ]
    return {"segments": segments, "device_traces": [trace, []]}


def test_replay_finds_the_peak_and_attributes_it():
    snap = _snapshot()
    probes = [{"masters": [(0x1000 + 16, 64)]}, {"gradients": [(0x3000, 3000)], "masters": [(0x1000, 1000)]}, {}]
    out = replay_peak(snap, 0, probes)
    start = 1000 + 300 + 4000  # A, D, E
    assert out["start_bytes"] == start
    # +800 -800 (freed before the peak), then C 2000, F 3000, F2 250, G 700, H 500
    assert out["peak_bytes"] == start + 2000 + 3000 + 250 + 700 + 500 == 11750
    assert snap["device_traces"][0][out["peak_event"]]["addr"] == 0x6000
    assert out["categories"] == {"masters": 1000, "preexisting_other": 4300, "unsharded_params": 2000,
                                 "gradients": 3000, "activations_and_other": 250, "comm_buffers": 700,
                                 "grad_buffers": 500}
    assert sum(out["categories"].values()) == out["peak_bytes"]
    assert out["end_bytes"] == 1000 + 300 + 2000 + 100  # A, D, C, I
    assert out["probes_found"] == 3 and out["events"] == len(snap["device_traces"][0])
    assert out["unclassified_sites"] == {"llama.py:170:forward": 250}
    assert out["largest_blocks"][0] == {"bytes": 4000, "category": "preexisting_other", "site": "<no python frames>"}


def test_replay_without_probes_and_other_device():
    out = replay_peak(_snapshot(), 0)
    assert out["categories"]["activations_and_other"] == 3250  # 0x3000 unlabelled: by its frames
    assert out["categories"]["preexisting_other"] == 5300  # A unlabelled too
    other = replay_peak(_snapshot(), 1)
    assert other["peak_bytes"] == other["start_bytes"] == 512 and other["peak_event"] == -1
    assert other["categories"] == {"preexisting_other": 512}


def test_frame_rules():
    assert classify_frames(GATHER_STAGING) == "comm_buffers"
    assert classify_frames(FORWARD) is None
    fsdp = "/usr/lib/torch/distributed/fsdp/_fully_shard/"
    assert classify_frames([_frame(fsdp + "_fsdp_param.py", "alloc_storage"),
                            _frame(fsdp + "_fsdp_param.py", "alloc_all_gather_outputs")]) == "unsharded_params"
    assert classify_frames([_frame(fsdp + "_fsdp_collectives.py", "allocate"),
                            _frame(fsdp + "_fsdp_collectives.py", "foreach_reduce")]) == "comm_buffers"
    assert classify_frames([_frame("/usr/lib/torch/optim/adamw.py", "_fused_adamw")]) == "optimizer_step"
    split = [_frame("/x/odcfsdp/sharding/groups/split_master.py", "split_low_bits"),  # innermost first
             _frame("/x/odcfsdp/sharding/runtime/minibatch.py", "before_forward")]
    assert classify_frames(split) == "masters"  # a split master's low bits, allocated in a forward ([split-masters])
    assert classify_frames([_frame("C:\\torch\\nn\\utils\\clip_grad.py", "_get_total_norm")]) == "grad_norm"
    extra = (("mine", "my/pkg/", None),) + FRAME_RULES
    assert classify_frames([_frame("/x/my/pkg/a.py", "f")], extra) == "mine"


@pytest.mark.gpu
def test_peak_breakdown_on_cuda():
    """The real allocator's trace: the peak, a parameter and a gradient known by address, the rest by frames."""
    d = torch.device("cuda", torch.cuda.current_device())
    p = torch.nn.Parameter(torch.zeros(1 << 20, device=d))  # 4 MiB
    opt = torch.optim.SGD([p], lr=0.1)

    def step():
        a = torch.empty(3 << 20, device=d)  # 12 MiB
        p.grad = torch.ones_like(p)  # 4 MiB, known at the optimizer's step pre-hook
        b = torch.empty(1 << 20, device=d)
        del b
        c = torch.empty(2 << 20, device=d)  # 8 MiB: the peak is a + grad + c
        del a, c
        opt.step()
        opt.zero_grad()

    out = peak_breakdown(step, lambda: {"masters": [p], "gradients": [p.grad]}, optimizer=opt, device=d)
    mib = 1 << 20
    assert out["peak_bytes"] - out["start_bytes"] == 24 * mib and out["end_bytes"] == out["start_bytes"]
    assert out["categories"]["masters"] == 4 * mib and out["categories"]["gradients"] == 4 * mib
    assert out["categories"]["activations_and_other"] == 20 * mib
    assert [s for s in out["unclassified_sites"] if s.startswith("test_memory.py:")] and "warning" not in out
    assert out["probes_found"] == out["probes_given"] == 3
    assert out["allocator_peak_bytes"] >= out["peak_bytes"] - out["start_bytes"]


def test_peak_table_of_the_report():
    """The CUDA part of e2e_bench.md, from peak_breakdown-shaped records (the CPU smoke run has none)."""
    from benchmarks.e2e_report import memory_report

    def record(outside):
        peak = replay_peak(_snapshot(), 0, [{"masters": [(0x1000, 1000)]}])
        return dict(peak, allocator_peak_bytes=peak["peak_bytes"] + 512, reserved_peak_bytes=1 << 16,
                    outside_torch=outside)

    results = [{"workload": "longtail", "method": m, "balance": "lb_micro", "memory_breakdown": {"ranks": [
        {"peak": record(outside), "points": {}}, {"peak": record({k: 2 * v for k, v in outside.items()}),
                                                   "points": {}}]}}
        for m, outside in (("odc", {"rows": 2048, "accumulators": 4096, "heap_other": 0}), ("fsdp2", {}))]
    md = "\n".join(memory_report(results))
    assert "## Memory at the peak of one extra step, by category (KiB)" in md
    assert "| category | longtail odc lb_micro (rank 1) | longtail fsdp2 lb_micro (rank 0) |" in md
    assert "| masters | 0.977 | 0.977 |" in md and "| heap: rows (outside torch) | 4.000 | 0.000 |" in md
    assert f"| torch peak allocated + heap | {(11750 + 512 + 12288) / 1024:.3f} | {(11750 + 512) / 1024:.3f} |" in md
    assert "largest `activations_and_other` sites: `llama.py:170:forward` 0 MiB" in md


# -- the e2e benchmark ------------------------------------------------------------------------------------------------
def test_e2e_bench_memory_breakdown_on_cpu(tmp_path):
    from benchmarks import e2e_bench

    e2e_bench.main(["--cpu-ranks", "2", "--size", "tiny", "--vocab", "256", "--steps", "1", "--warmup", "1",
                    "--batch", "4", "--seq", "64", "--pool", "20000", "--group-bytes", "8192", "--workloads",
                    "balanced", "--methods", "odc", "fsdp2", "--memory-breakdown", "--out", str(tmp_path)])
    runs = {r["method"]: r for r in json.loads((tmp_path / "e2e_bench.json").read_text())["rows"]}
    assert runs["fsdp2"]["memory_breakdown"] is None  # on CPU only odc records (no peak without CUDA)
    ranks = runs["odc"]["memory_breakdown"]["ranks"]
    assert len(ranks) == 2
    for rec in ranks:
        assert rec["peak"] is None
        before, after = rec["points"]["before_step"], rec["points"]["after_step"]
        assert before["rows"] > 0 and before["accumulators"] > 0 and before["heap"] > 0
        assert before["optimizer_state"] > 0  # after the warm-up and measured steps
        assert after["unsharded_params"] == after["grad_buffers"] == before["grad_buffers"] == 0
    md = (tmp_path / "e2e_bench.md").read_text()
    assert "## odc memory by category at two points of one extra step" in md
    assert "| category | balanced odc lb_micro before_step | balanced odc lb_micro after_step |" in md
    assert "| rows |" in md and "| optimizer_state |" in md
