"""Every script under benchmarks/ runs here on the CPU, small, so that a changed signature or a stale check fails CI.

GPU benchmarks run their CPU path (gloo ranks + the shm transport, wall-clock timing, tiny sizes) or, where
the measured thing is a CUDA kernel, everything around it; the post-processing scripts run on committed
results. ``hf_attention_bench.py`` is run by tests/test_hf.py, ``e2e_bench.py`` (and its ``e2e_report.py``)
by tests/test_e2e_bench.py, its HF models (``e2e_hf.py``) by tests/test_e2e_hf.py; ``test_every_benchmark_is_run``
keeps this list complete, and ``test_every_result_is_the_schema`` (last) checks what they all wrote.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = ROOT / "results"

from benchmarks import (attention_bench, best_fit, checkpoint_bench, comm_bench, e2e_summary, gpu_test_report, harness,
                        multinode_cost_model, optim_bench, park_bench, step_sim)

#: scripts whose result file another module writes (through harness.write_result)
WRITTEN_BY = {"e2e_bench": "e2e_report"}
RUN_ELSEWHERE = {"hf_attention_bench.py": "tests/test_hf.py", "e2e_bench.py": "tests/test_e2e_bench.py",
                 "e2e_report.py": "benchmarks/e2e_bench.py",  # e2e_bench's report: run with it
                 "step_sim_fit.py": "benchmarks/step_sim.py", "step_sim_report.py": "benchmarks/step_sim.py",
                 "e2e_hf.py": "tests/test_e2e_hf.py", "e2e_baselines.py": "tests/test_e2e_bench.py",
                 "e2e_isolate.py": "tests/test_e2e_bench.py",  # e2e_bench --isolate
                 "e2e_args.py": "benchmarks/e2e_bench.py",  # e2e_bench's flags
                 "fp8_bench.py": "tests/test_float8.py",  # needs torchao: skipped with the other float8 tests
                 "timing.py": "benchmarks/optim_bench.py",  # the timers of optim_bench, comm_bench, attention_bench
                 "provenance.py": "tests/test_provenance.py", "step_sim_model.py": "tests/test_step_sim.py",
                 "harness.py": "tests/test_benchmark_harness.py", "results_index.py": "tests/test_benchmark_harness.py",
                 "gpu_suite.sh": "tests/test_benchmark_suite.py", "meeting_bench.py": "tests/test_watchdog.py",
                 "e2e_profile.py": "benchmarks/e2e_bench.py",  # e2e_bench --profile (test_e2e_bench runs it)
                 "step_sim_predict.py": "tests/test_step_sim.py"}  # step_sim --predict


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """One folder for the module's runs (each script in a subfolder of its own)."""
    return tmp_path_factory.mktemp("benchmarks")


def finite_positive(*values) -> bool:
    """Whether every value is a finite number above zero."""
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_every_benchmark_is_run():
    """A new script under benchmarks/ needs a CPU run here (or in the test module named in RUN_ELSEWHERE)."""
    source = Path(__file__).read_text()
    for script in sorted(BENCH.glob("*.py")) + sorted(BENCH.glob("*.sh")):
        if script.name == "__init__.py":
            continue
        if script.name in RUN_ELSEWHERE:
            assert script.name.removesuffix(".py") in (ROOT / RUN_ELSEWHERE[script.name]).read_text(), script.name
        else:
            assert f"def test_{script.stem}" in source, f"{script.name} has no CPU run in {Path(__file__).name}"


def test_attention_bench(out):
    """The harness on PyTorch's CPU kernels: flash and math checked against flash, cuDNN recorded as not run;
    the report also renders the committed H200 results."""
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            attention_bench.main(["--out", str(out / "attention_gpu")])
    d = out / "attention"
    attention_bench.main(["--device", "cpu", "--lengths", "64", "128", "--heads", "4", "--kv-heads", "2", "--dim",
                          "16", "--backends", "flash", "math", "cudnn", "--iters", "2", "--out", str(d)])
    data = json.loads((d / "attention_bench.json").read_text())
    rows = data["rows"]
    assert {(r["backend"], r["gqa_in_kernel"], r["length"]) for r in rows} == {
        (b, g, s) for b in ("flash", "math", "cudnn") for g in (True, False) for s in (64, 128)}
    for r in rows:
        if r["backend"] == "cudnn":  # no CPU kernel: recorded, not fatal
            assert not r["ok"] and r["error"]
            continue
        assert r["ok"] and finite_positive(r["ms"], r["first_call_ms"], r["tflops"])
        assert r["max_rel_err_vs_flash"] < 2e-2, r  # bf16: the kernels agree with flash (in-kernel GQA)
    md = (d / "attention_bench.md").read_text()
    assert md.count("| math |") == 4 and "| flash | in kernel | 128 |" in md and "not run:" in md
    committed = json.loads((RESULTS / "attention/h200_7eb86d9/attention_bench.json").read_text())
    text = attention_bench.report(committed["rows"], committed["meta"])
    assert sum(line.startswith("| ") for line in text.splitlines()) == len(committed["rows"]) + 1
    assert "| flash | in kernel | 4096 |" in text and "| 1.00x |" in text


def test_checkpoint_bench(out):
    """Save, load (the state zeroed in between must come back) and HF export on 2 gloo ranks."""
    d = out / "checkpoint"
    checkpoint_bench.main(["--cpu-ranks", "2", "--size", "tiny", "--vocab", "256", "--seq", "64",
                           "--dir", str(d / "files"), "--out", str(d)])
    data = json.loads((d / "checkpoint_bench.json").read_text())
    meta, (res,) = data["meta"], data["rows"]
    from odcfsdp.models import llama_config

    assert meta["params"] == llama_config("tiny", 256).num_params() and meta["world_size"] == 2
    assert meta["device"] == "cpu x 2" and meta["command"].startswith("python -m benchmarks.checkpoint_bench")
    assert res["load_restores_state"] is True
    assert finite_positive(res["save_s"], res["load_s"], res["export_hf_bf16_s"], res["save_gbps"], res["load_gbps"])
    assert res["sharded_bytes"] > 12 * meta["params"]  # fp32 masters + two AdamW moments, at least
    assert list((d / "files/hf").glob("*.safetensors")) and (d / "files/hf/config.json").exists()
    assert "| load (checksums verified) |" in (d / "checkpoint_bench.md").read_text()


def test_comm_bench(out):
    """shm gather / scatter-accumulate against gloo collectives on 2 ranks; the script's own checks pass first."""
    d = out / "comm"
    comm_bench.main(["--cpu-ranks", "2", "--sizes-mib", "1", "--iters", "9", "--out", str(d)])  # 9: p10/p90 in range
    (res,) = json.loads((d / "comm_bench.json").read_text())["rows"]
    assert res["group_bytes"] == 1 << 20
    assert set(res["gather"]) == {"nccl_allgather+copyout", "odc_shm"}
    assert set(res["scatter"]) == {"nccl_copyin+reducescatter", "odc_shm"}
    for entry in [*res["gather"].values(), *res["scatter"].values()]:
        assert finite_positive(*entry.values()), entry
        assert entry["p10_us"] <= entry["median_us"] <= entry["p90_us"]
    md = (d / "comm_bench.md").read_text()
    assert md.count("| 1 MiB |") == 2 and "(shm)" in md


def test_e2e_summary(out, capsys):
    """The summary over every committed e2e run (odc-only A/B runs included), one row per run and workload."""
    files = sorted(RESULTS.glob("e2e/**/e2e_bench.json"))
    assert len(files) > 10
    both = out / "e2e_two_workloads" / "e2e_bench.json"  # one run of two workloads, as e2e_bench writes it now
    data = harness.load_result(files[-1])  # committed files come in both shapes ("results" before the schema)
    data["rows"] += [dict(r, workload="other", tokens_per_s=r["tokens_per_s"] / 2) for r in data["rows"]]
    both.parent.mkdir()
    both.write_text(json.dumps(data))
    e2e_summary.main([*map(str, files), str(both), "--out", str(out / "e2e_summary.md")])
    text = (out / "e2e_summary.md").read_text()
    assert capsys.readouterr().out == text
    rows = [line for line in text.split("\n\n")[0].splitlines()[2:]]
    expected = sum(len({r["workload"] for r in harness.rows(f)}) for f in [*files, both])
    assert len(rows) == expected
    for f in files:
        runs = harness.rows(f)
        odc = next((r for r in runs if (r["method"], r["balance"]) == ("odc", "lb_mini")), None) or next(
            (r for r in runs if (r["method"], r["balance"]) == ("odc", "lb_micro")), None)
        if odc is None:  # a baseline run alone (FSDP2 float8 in its own process): "-" where odc's figure goes
            assert any(f"`{f.parent.name}`" in row and row.split(" | ")[3] == "-" for row in rows), f
            continue
        assert any(f"`{f.parent.name}`" in row and f"| {odc['tokens_per_s']:.0f} ({odc['balance']}) |" in row
                   for row in rows), f
    assert any(row.startswith("| other |") for row in rows) and "| workload | commit | method |" in text


@pytest.mark.parametrize("run", ["n1_3ed1803", "n2_93d573e"])
def test_gpu_test_report(out, run):
    """From a committed run's raw files (JUnit XML + measured JSON lines), the committed report's data again."""
    src = RESULTS / "gpu_tests" / run
    committed = json.loads((src / "gpu_tests.json").read_text())
    meta = committed["meta"]
    d = out / "gpu_tests" / run
    gpu_test_report.main([str(src), str(d), "--commit", meta["commit"], "--device", meta["device"],
                          "--date", meta["date"], "--command", meta["command"]])
    got = json.loads((d / "gpu_tests.json").read_text())
    # the committed file predates the one schema (its tests as "tests"): compared as harness reads it, exactly
    assert got == harness.normalize(committed) and set(got) == {"meta", "rows", "measured"}
    md = (d / "gpu_tests.md").read_text()
    passed = sum(t["outcome"] == "passed" for t in committed["tests"])
    assert f"- outcome: {passed} passed" in md and committed["measured"]
    measured, tests = md.split("## Tests")
    assert sum(line.startswith("| ") for line in measured.splitlines()) == len(committed["measured"]) + 1
    assert sum(line.startswith("| ") for line in tests.splitlines()) == len(committed["tests"]) + 1


def test_hf_finetune_check(out):
    """The CLI fine-tune of a local HF checkpoint on 2 gloo ranks: the first loss equals transformers' (fp32)."""
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from benchmarks import hf_finetune_check

    d = out / "hf_finetune"
    hf_finetune_check.main(["--out", str(d), "--cpu-ranks", "2", "--size", "micro", "--steps", "2"])
    data = json.loads((d / "hf_finetune_check.json").read_text())
    (res,) = data["rows"]
    assert data["meta"]["device"] == "cpu x 2" and "run.world_size=2" in data["meta"]["train_command"]
    assert res["first_loss_rel_diff"] < 1e-5, res  # fp32 on both sides
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])
    assert set(res["eval_losses"]) == {"1", "2"} and all(math.isfinite(x) for x in res["eval_losses"].values())
    assert res["export_loads"] and res["tokenizer_has_template"]
    assert finite_positive(res["summary"]["tokens_per_s"])
    assert "| first-step loss: odcfsdp / transformers (fp32) |" in (d / "hf_finetune_check.md").read_text()
    assert not (d / "work").exists()


def test_hf_finetune_check_longtail(out):
    """--chats longtail: LongAlign-like lengths (scaled to the CPU's 256-token micro-batches), the first loss still
    transformers', and the e2e bench's figures (--e2e) in the report next to the CLI's."""
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from benchmarks import hf_finetune_check

    d = out / "hf_finetune_longtail"
    e2e = sorted(RESULTS.glob("e2e/**/e2e_bench.json"))[-1]
    hf_finetune_check.main(["--out", str(d), "--cpu-ranks", "2", "--size", "micro", "--steps", "2", "--chats",
                            "longtail", "--e2e", str(e2e)])
    data = json.loads((d / "hf_finetune_check.json").read_text())
    (res,), meta = data["rows"], data["meta"]
    assert res["first_loss_rel_diff"] < 1e-5, res
    want, got = meta["target_tokens"], meta["chat_tokens"]
    assert len(want) == got["count"] == 16 and all(8 <= n <= 256 for n in want)  # 1K-64K scaled by 256 / 64K
    assert got["max"] <= 257 and abs(got["mean"] - sum(want) / len(want)) <= 0.1 * got["mean"] + 20
    runs = harness.rows(e2e)
    md = (d / "hf_finetune_check.md").read_text()
    assert md.count("| e2e bench, ") == len(runs) == len(meta["e2e"]["runs"])
    assert "| CLI (`odcfsdp.train`), cpu x 2 |" in md and "Chats: longtail, 16 of " in md


def test_hf_load_memory(out):
    """Save a tiny checkpoint, load it with load_hf on 2 CPU ranks, and report each rank's memory."""
    pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from benchmarks import hf_load_memory

    d = out / "hf_load"
    # 14M parameters (54 MiB in fp32): large enough for resident-memory figures above the allocator's noise
    hf_load_memory.main(["--out", str(d), "--layers", "2", "--dim", "512", "--vocab", "8192", "--world", "2"])
    data = json.loads((d / "hf_load_memory.json").read_text())
    meta, ranks = data["meta"], data["rows"]
    dim, inter = 512, int(512 * 8 / 3) // 64 * 64
    kv = dim // 128 * 64  # the script's config: heads of 64, a key-value head per two query heads
    per_layer = 2 * dim * dim + 2 * dim * kv + 3 * dim * inter + 2 * dim
    assert meta["params"] == 2 * 8192 * dim + 2 * per_layer + dim
    assert meta["world"] == 2 and meta["device"] == "cpu x 2" and [r["rank"] for r in ranks] == [0, 1]
    model_mib = meta["params"] * 4 / 2**20
    for r in ranks:
        assert all(math.isfinite(v) for v in r.values())
        assert r["anon_state_mib"] >= 0.9 * model_mib / 2  # the rank holds its fp32 shard, written
        # what the loader is for: no rank materialises the model; the page cache it read stays below it too
        assert r["anon_load_peak_mib"] < 0.5 * model_mib and r["load_peak_mib"] < model_mib
    assert (d / "hf_load_memory.md").read_text().count(" of 2 |") == 2


@pytest.mark.parametrize("variant", ["8b_2x8_measured_nccl", "8b_2x8_nccl360"])
def test_multinode_cost_model(out, variant):
    """The committed cost models again, from the committed one-node measurements and their recorded command."""
    committed = json.loads((RESULTS / "cost_model" / variant / "cost_model.json").read_text())
    words = shlex.split(committed["meta"]["command"])[2:]
    d = out / "cost_model" / variant
    words[words.index("--out") + 1] = str(d)
    multinode_cost_model.main(words)
    got = json.loads((d / "cost_model.json").read_text())
    assert got["meta"]["device"] == "model (no device)" and got["meta"]["params"] == committed["meta"]["params"]
    assert got["meta"]["measured"] == committed["meta"]["measured"]
    assert len(got["rows"]) == len(committed["rows"]) == 16
    for g, c in zip(got["rows"], committed["rows"]):
        assert g.keys() == c.keys()
        for k in g:
            want = pytest.approx(c[k], rel=1e-9) if isinstance(c[k], float) else c[k]
            assert g[k] == want, (variant, g["method"], k)
        assert g["step_s"] >= g["micro_batches"] * g["compute_s"] > 0
        if g["method"] == "odc_hsdp":
            assert g["inter_s"] == 0  # sharding stays in the node
    assert (d / "cost_model.md").read_text().count("| odc_hsdp |") == 4


def test_optim_bench(out):
    """Every optimizer-step variant on rank 0's shards of the tiny Llama, timed on the CPU."""
    import torch.distributed as dist

    d = out / "optim"
    optim_bench.main(["--sizes", "tiny", "--iters", "2", "--warmup", "1", "--out", str(d)])
    assert not dist.is_initialized()  # its one-rank group is gone again
    (res,) = json.loads((d / "optim_bench.json").read_text())["rows"]
    assert set(res["variants"]) == set(optim_bench.BYTES_PER_PARAM)
    from odcfsdp.models import Llama, llama_config

    with torch.device("meta"):
        shapes = [p.shape for p in Llama(llama_config("tiny", 32000)).parameters()]
    shard = sum(-(-s[0] // 2) * math.prod(s[1:]) for s in shapes)  # rank 0 of 2, dim-0 sharding
    assert shard <= res["params_on_rank"] < shard + optim_bench.ALIGN * len(shapes)
    for name, v in res["variants"].items():
        assert finite_positive(v["ms_median"], v["gb_per_s"]), (name, v)
        assert v["ms_min"] <= v["ms_median"] <= v["ms_max"]
    assert (d / "optim_bench.md").read_text().count("| tiny |") == len(optim_bench.BYTES_PER_PARAM)


def test_park_bench(out):
    """The parked state's copies on rank 0's shards of the tiny Llama, on the CPU: each fraction parks the share
    ``share_of`` picks (whole state tensors, in order, until the share is reached; all of it at 1.0), and its parts
    are timed."""
    d = out / "park"
    park_bench.main(["--size", "tiny", "--vocab", "256", "--iters", "1", "--warmup", "0", "--fractions", "0.5", "1.0",
                     "--out", str(d)])
    rows = json.loads((d / "park_bench.json").read_text())["rows"]
    assert [r["fraction"] for r in rows] == [0.0, 0.5, 1.0]
    shapes = park_bench.shard_shapes("tiny", 256, 2)
    tensors = [8 * math.prod(s) / 2**30 for _, s in shapes]  # AdamW's two fp32 moments per parameter
    assert all(r["state_gib"] == pytest.approx(sum(tensors)) for r in rows)
    assert rows[0]["parked_gib"] == 0 and rows[2]["parked_gib"] == pytest.approx(sum(tensors))
    assert 0.5 * sum(tensors) <= rows[1]["parked_gib"] < 0.5 * sum(tensors) + max(tensors)
    assert all(finite_positive(r["step_ms"]) for r in rows) and finite_positive(rows[2]["back_ms"], rows[2]["park_ms"])
    # the host's issue times behind device work (none queued on the CPU): the step's includes the step itself
    assert all(finite_positive(r["step_issue_busy_ms"]) and r["back_issue_busy_ms"] >= 0 for r in rows)
    assert "step issue ms, busy" in (d / "park_bench.md").read_text()


def test_best_fit(out):
    """Every method runs the same candidates; a fit is the fastest completed run under the memory bound; CPU run."""
    d = out / "best_fit"
    best_fit.main(["--cpu-ranks", "2", "--size", "tiny", "--workloads", "balanced", "--methods", "odc", "fsdp2",
                   "--micro-samples", "1", "--batch", "4", "--steps", "2", "--warmup", "1", "--out", str(d),
                   "--e2e-args", "--vocab", "256", "--seq", "64", "--pool", "20000", "--group-bytes", "8192"])
    runs = json.loads((d / "best_fit.json").read_text())["rows"]
    assert sorted({r["method"] for r in runs}) == ["fsdp2", "odc", "odc-lean", "odc-offload"]
    assert all(finite_positive(r["tokens_per_s"]) for r in runs) and len(runs) == 8  # AC off / on for each
    table = (d / "best_fit.md").read_text()
    assert "| balanced | odc |" in table and "| balanced | fsdp2 | fsdp2, lb_micro" in table
    fast, slow, big = ({"tokens_per_s": t, "peak_gib": g} for t, g in ((10.0, 5.0), (5.0, 1.0), (20.0, 50.0)))
    assert best_fit.best_of([fast, slow, big, {"error": "out of memory"}], max_gib=8.0) is fast
    assert best_fit.best_of([big], max_gib=8.0) is None and best_fit.best_of([big, fast], None) is big
    best_fit.main(["--merge", str(d), str(d), "--out", str(d / "merged")])  # searches split over calls: one report
    assert len(json.loads((d / "merged" / "best_fit.json").read_text())["rows"]) == 16


def test_loss_bench(out):
    """Fused and unfused head + loss on the CPU in fp32: both run, and agree to fp32 rounding."""
    from benchmarks import loss_bench

    d = out / "loss"
    report = loss_bench.main(["--tokens", "300", "--hidden", "16", "--vocab", "1000", "--dtype", "float32",
                              "--repeat", "2", "--out", str(d)])
    assert [r["method"] for r in report["rows"]] == ["unfused", "fused"]
    assert all(finite_positive(r["ms"]) and not r["oom"] for r in report["rows"])
    assert max(report["rows"][1]["rel_diff_vs_unfused"].values()) < 1e-5
    assert json.loads((d / "loss_bench.json").read_text()) == report
    assert "| fused |" in (d / "loss_bench.md").read_text()


def test_step_sim(out):
    """A small sweep of the step simulator on the committed fit: every point priced, ODC's speedups and the bound
    consistent, the report and (with matplotlib) the chart written; tests/test_step_sim.py checks the model."""
    d = out / "step_sim"
    data = step_sim.main(["--gpus", "2", "16", "--per-gpu", "1", "4", "--distributions", "longalign", "chat",
                          "--samples", "16", "--study", "--out", str(d)])
    assert len(data["rows"]) == 2 * 2 * 2 and len(data["measured"]) == 6
    for p in data["rows"]:
        s = p["step_s"]
        assert finite_positive(*s.values()) and min(s.values()) == s["bound"], p
        assert p["speedup_vs_lb_micro"] == pytest.approx(s["fsdp2_lb_micro"] / s["odc_lb_mini"])
    assert json.loads((d / "step_sim.json").read_text())["rows"] == data["rows"]
    md = (d / "step_sim.md").read_text()
    assert sum(line.startswith("| 16 | 4 |") for line in md.splitlines()) == 2 and "Karmarkar-Karp" in md
    assert data["meta"]["command"] in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (d / "step_sim.png").exists()
    else:
        assert (d / "step_sim.png").stat().st_size > 0


#: the result file each script's smoke test above writes, and the further tables a script adds beside ``rows``
RESULT_FILES = {"attention_bench": "attention_bench.json", "best_fit": "best_fit.json",
                "checkpoint_bench": "checkpoint_bench.json", "comm_bench": "comm_bench.json",
                "gpu_test_report": "gpu_tests.json", "hf_finetune_check": "hf_finetune_check.json",
                "hf_load_memory": "hf_load_memory.json", "loss_bench": "loss_bench.json",
                "multinode_cost_model": "cost_model.json", "optim_bench": "optim_bench.json",
                "park_bench": "park_bench.json",
                "step_sim": "step_sim.json",
                "e2e_bench": "e2e_bench.json"}  # e2e_bench: best_fit's candidates (its own test: test_e2e_bench.py)
FURTHER_TABLES = {"step_sim.json": {"measured"}, "gpu_tests.json": {"measured"}}


def test_every_result_is_the_schema(out, request):
    """Last: every result file the smoke tests above wrote is ``{meta, rows}`` (plus the script's declared further
    tables), its meta with date, commit, command and device; each script whose smoke test ran wrote one, and no
    script writes JSON but through ``harness.write_result``."""
    ran = {item.originalname for item in request.session.items if item.module is request.module}
    written = {}
    for path in out.rglob("*.json"):
        if path.name in RESULT_FILES.values():
            written.setdefault(path.name, []).append(path)
    for script, name in RESULT_FILES.items():
        test = "test_best_fit" if script == "e2e_bench" else f"test_{script}"
        assert test not in ran or written.get(name), f"{test} ran but wrote no {name}"
        if script in RUN_ELSEWHERE:
            continue
        writer = WRITTEN_BY.get(script, script)
        assert "harness.write_result(" in (BENCH / f"{writer}.py").read_text(), (script, writer)
    for name, paths in written.items():
        for path in paths:
            data = json.loads(path.read_text())
            assert set(data) - FURTHER_TABLES.get(name, set()) == {"meta", "rows"}, (path, sorted(data))
            assert all(isinstance(data["meta"].get(k), str) and data["meta"][k] for k in harness.META_KEYS), path
            assert isinstance(data["rows"], list), path
    for script in set(BENCH.glob("*.py")) - {BENCH / "harness.py"}:
        assert "write_text(json.dump" not in script.read_text().replace(" ", ""), f"{script.name}: harness.write_result"
