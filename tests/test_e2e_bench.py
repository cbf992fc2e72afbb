"""The end-to-end benchmark harness on CPU: every method (odc, and the baselines of e2e_baselines.py) trains the same
thing, and the reports are written."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from benchmarks import e2e_bench, e2e_isolate, harness

#: odc and FSDP2 on the balanced workload: the variants' run, and the same in processes of their own (--isolate)
BALANCED = ["--cpu-ranks", "2", "--size", "tiny", "--vocab", "256", "--batch", "8", "--seq", "64", "--pool", "20000",
            "--group-bytes", "8192", "--methods", "odc", "fsdp2", "--workloads", "balanced"]


@pytest.fixture(scope="module")
def variants_run(tmp_path_factory) -> dict:
    """One process: odc and FSDP2 with the lean, offload, park and park50 variants, odc with split_masters and
    zeroed_grads (the runs by method); odc and FSDP2 run one more step under the profiler."""
    out = tmp_path_factory.mktemp("variants")
    e2e_bench.main([*BALANCED, "--steps", "2", "--warmup", "1", "--variants", "lean", "offload", "park",
                    "park50", "split_masters", "zeroed_grads", "--profile", "odc", "fsdp2", "--out", str(out)])
    return {r["method"]: r for r in json.loads((out / "e2e_bench.json").read_text())["rows"]}


def test_all_methods_train_the_same_model(tmp_path):
    e2e_bench.main(["--cpu-ranks", "2", "--size", "tiny", "--vocab", "256", "--steps", "3", "--warmup", "1",
                    "--batch", "8", "--seq", "64", "--cap", "512", "--pool", "20000", "--group-bytes", "8192",
                    "--lr", "1e-2", "--ablate", "prefetch0", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "e2e_bench.json").read_text())
    runs = data["rows"]
    assert {(r["workload"], r["method"], r["balance"]) for r in runs} == set(
        e2e_bench.runs_for(["balanced", "longtail"], ["odc", "odc_collective", "fsdp2", "ddp"], ["prefetch0"]))
    assert any(r["method"] == "odc-prefetch0" for r in runs)
    for workload in ("balanced", "longtail"):
        rows = [r for r in runs if r["workload"] == workload]
        ref = next(r for r in rows if r["method"] == "ddp")["losses"]
        assert min(ref) > 1.0  # real losses, not empty batches
        assert ref[-1] < ref[0]  # it trains
        ref_norms = [s["grad_norm"] for s in next(r for r in rows if r["method"] == "ddp")["steps"]]
        for r in rows:  # same data, model, optimizer: fp32 on CPU agrees closely across methods
            for a, b in zip(r["losses"], ref):
                assert abs(a - b) <= 1e-4 * abs(b), (workload, r["method"], r["balance"], r["losses"], ref)
            for a, b in zip([s["grad_norm"] for s in r["steps"]], ref_norms):  # the same gradient, not N times it
                assert abs(a - b) <= 1e-4 * abs(b), (workload, r["method"], r["balance"], "grad norms", a, b)
            assert r["tokens_per_s"] > 0 and len(r["rank_compute_s"]) == 2
    for r in runs:
        if r["balance"] == "lb_micro":  # what the collective methods rely on
            assert all(len(set(s["rank_micro_batches"])) == 1 for s in r["steps"]), r["method"]
    assert "| longtail | fsdp2 | lb_micro |" in (tmp_path / "e2e_bench.md").read_text()
    assert (tmp_path / "e2e_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_compiled_layers_with_recomputation_train_the_same_model(tmp_path):
    """--compile (aot_eager on CPU) and --activation-checkpointing for every method: still one model trained."""
    e2e_bench.main(["--cpu-ranks", "2", "--size", "tiny", "--vocab", "256", "--steps", "2", "--warmup", "1",
                    "--batch", "8", "--cap", "512", "--pool", "20000", "--group-bytes", "8192", "--lr", "1e-2",
                    "--workloads", "longtail", "--methods", "odc", "fsdp2", "ddp", "--compile", "aot_eager",
                    "--activation-checkpointing", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "e2e_bench.json").read_text())["rows"]
    assert len(runs) == 4
    ref = next(r for r in runs if r["method"] == "ddp")["losses"]
    for r in runs:
        for a, b in zip(r["losses"], ref):
            assert abs(a - b) <= 1e-4 * abs(b), (r["method"], r["balance"], r["losses"], ref)
    assert "decoder layers compiled (every method): aot_eager" in (tmp_path / "e2e_bench.md").read_text()
    # StepEvents: the process's first step compiled the layers, and the warm-up absorbed compilation: no measured
    # step compiled (runs after the first may reuse its compiled code: the same layer classes)
    assert runs[0]["steps"][0]["compiled_frames"] > 0
    assert all(s["compiled_frames"] == 0 for r in runs for s in r["steps"][1:]), [r["steps"] for r in runs]


def test_memory_variants_train_the_same_model(variants_run):
    """``--variants``: odc with the fp32 masters gathered and bf16 gradient accumulators trains what odc trains
    (on CPU the compute is fp32, so only the bf16 sums differ: losses within bf16 rounding); with ``offload`` odc and
    FSDP2 (``fsdp2-offload``, the baseline) step on host masters and train what they train without it; with ``park``
    odc's optimizer state (``park50``: half of it) waits on the host between steps and odc trains what it trains."""
    runs = variants_run
    assert set(runs) == {"odc", "odc-lean", "odc-offload", "odc-park", "odc-park50", "odc-split_masters",
                         "odc-zeroed_grads", "fsdp2", "fsdp2-offload"}
    # [fresh-grads]' ablation: autograd adding into zeroed buffers sums a parameter's contributions in another
    # order (into the buffer, one at a time), so to fp32's rounding, not to the bit (CI at f2ea2e4: 4e-8 relative)
    for a, b in zip(runs["odc-zeroed_grads"]["losses"], runs["odc"]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert [runs[m]["fresh_grads"] for m in ("odc", "odc-zeroed_grads", "fsdp2")] == [True, False, None]
    for park in ("odc-park", "odc-park50"):  # [parking]: the state (half of it) moved and back (shm sums in any
        for a, b in zip(runs[park]["losses"], runs["odc"]["losses"]):  # order: not to the bit between runs)
            assert abs(a - b) <= 1e-5 * abs(b), park
    for lean in ("odc-lean", "odc-split_masters"):  # bf16 sums, or bf16 compute ([split-masters] needs it)
        for a, b in zip(runs[lean]["losses"], runs["odc"]["losses"]):
            assert abs(a - b) <= 1e-2 * abs(b), lean
    for method in ("odc", "fsdp2"):
        for a, b in zip(runs[f"{method}-offload"]["losses"], runs[method]["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), method
    # each rank's share parked at the end, as the rows report it ([park-fit] chooses one per rank)
    assert [runs[m]["park_fraction_by_rank"] for m in ("odc-park", "odc-park50", "odc")] == [
        [1.0, 1.0], [0.5, 0.5], [None, None]]
    from benchmarks import e2e_report

    meta = harness.meta("abc", "c", "cpu", world_size=2, size="tiny", params=1e9, steps=2, warmup=1, batch=8,
                        args={"seq": 64})
    text = e2e_report.report(list(runs.values()), meta)
    assert "balanced odc-park50: the optimizer's state parked at the end, by rank: 0.50, 0.50" in text
    assert "odc-offload: the optimizer's state parked" not in text


def test_profiled_step_reports_host_time_per_sharding_phase(variants_run):
    """``--profile``: the host's time per phase of one step, odc's [lifecycle] ranges beside FSDP2's (folded over
    modules), with openings that count the hook sites: FSDP2 opens pre_forward once per fully_shard call (each decoder
    layer and the root) per micro-batch, odc gathers each of its sites in forward and again in backward, and meets
    once (sync, finish) per step. 8 samples over 2 ranks: 4 micro-batches a rank."""
    from odcfsdp.models.llama import LLAMA_SIZES

    odc, fsdp2 = (variants_run[m]["profile"]["host_ms_by_phase"] for m in ("odc", "fsdp2"))
    for r in variants_run.values():  # StepEvents: nothing compiled without --compile
        assert all(s["compiled_frames"] == 0 for s in r["steps"]), r["method"]
    assert variants_run["odc-park"]["profile"] is None  # only the methods named
    assert fsdp2["FSDP::pre_forward"]["calls"] == 4 * (LLAMA_SIZES["tiny"]["n_layers"] + 1)
    assert odc["odc::gather"]["calls"] == odc["odc::pre_backward"]["calls"] > 0
    assert odc["odc::gather"]["calls"] % 4 == 0
    assert odc["odc::sync"]["calls"] == odc["odc::finish"]["calls"] == odc["odc::publish"]["calls"] == 1
    assert odc["odc::meet"]["calls"] == odc["odc::quiesce"]["calls"] == 2  # inside sync and finish, each
    assert all(p["ms"] > 0 and p["ms_per_call"] == pytest.approx(p["ms"] / p["calls"]) for p in odc.values())
    from benchmarks import e2e_report

    meta = harness.meta("abc", "c", "cpu", world_size=2, size="tiny", params=1e9, steps=2, warmup=1, batch=8,
                        args={"seq": 64})
    text = e2e_report.report(list(variants_run.values()), meta)
    assert "| balanced | fsdp2 | FSDP::pre_forward | " in text and "| balanced | odc | odc::gather | " in text


def test_fsdp2_nosync_trains_what_fsdp2_trains(tmp_path):
    """Issue 31's baseline: FSDP2 with gradient sync off and no reshard after backward until the last micro-batch
    takes the same steps as FSDP2 reducing every micro-batch (fp32 on CPU; 4 micro-batches per rank), and the
    report sets odc beside it."""
    e2e_bench.main(["--cpu-ranks", "2", "--size", "tiny", "--vocab", "256", "--steps", "3", "--warmup", "1",
                    "--batch", "8", "--seq", "64", "--cap", "512", "--pool", "20000", "--group-bytes", "8192",
                    "--lr", "1e-2", "--methods", "odc", "fsdp2", "fsdp2_nosync", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "e2e_bench.json").read_text())["rows"]
    for workload in ("balanced", "longtail"):
        by = {r["method"]: r for r in runs if r["workload"] == workload and r["balance"] == "lb_micro"}
        ref, nosync = by["fsdp2"], by["fsdp2_nosync"]
        deferred = [min(s["rank_micro_batches"]) >= 2 for s in nosync["steps"]]  # steps with a reduction to defer
        assert all(deferred) if workload == "balanced" else any(deferred), (workload, deferred)
        assert ref["losses"][-1] < ref["losses"][0]
        for a, b in zip(nosync["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (workload, nosync["losses"], ref["losses"])
        for s, t in zip(nosync["steps"], ref["steps"]):
            assert abs(s["grad_norm"] - t["grad_norm"]) <= 1e-5 * abs(t["grad_norm"]), workload
    assert "odc lb_mini / fsdp2_nosync lb_micro = " in (tmp_path / "e2e_bench.md").read_text()


def test_isolate_runs_each_method_in_a_process_of_its_own(tmp_path, variants_run):
    """``--isolate``: a child process (its own CPU ranks) per method, one combined result with the children's rows,
    which are the rows one process gives (the variants' run above: the same model, data and seed)."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.e2e_bench", *BALANCED, "--steps", "1", "--warmup", "1",
                          "--isolate", "--out", str(tmp_path)], env=harness.module_env(), cwd=harness.ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[isolate] 1/2: balanced odc (lb_micro)" in run.stdout and "[isolate] 2/2: balanced fsdp2" in run.stdout
    data = json.loads((tmp_path / "e2e_bench.json").read_text())
    assert [r["method"] for r in data["rows"]] == ["odc", "fsdp2"] and data["meta"]["failed"] == []
    assert data["meta"]["isolated"] is True and data["meta"]["complete"] is True
    assert data["meta"]["device"] == "cpu" and data["meta"]["world_size"] == 2
    assert "--isolate" in data["meta"]["command"] and "process group of its own" in (
        tmp_path / "e2e_bench.md").read_text()
    for r in data["rows"]:
        child = json.loads((tmp_path / "isolated" / f"balanced_{r['method']}" / "e2e_bench.json").read_text())
        assert [c["method"] for c in child["rows"]] == [r["method"]] and child["meta"]["isolated"] is False
        # the same steps: to the bit at the first; after it to fp32's rounding, since two ranks' pushes add into an
        # owner's accumulator in whichever order they come (4 micro-batches a rank), and fp32 sums depend on order
        want = variants_run[r["method"]]["losses"][:2]
        assert r["losses"][0] == want[0] and r["losses"][1] == pytest.approx(want[1], rel=1e-6), r["method"]
    assert (tmp_path / "e2e_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_isolate_children_run_exactly_the_planned_runs(tmp_path):
    """Each child runs the runs the parent planned for it, no more (``odc-<variant>`` as a method alone would also run
    lb_micro on longtail); a child that crashed has its runs without a row recorded as failed, naming its exit code."""
    planned = e2e_bench.runs_for(["balanced", "longtail"], ["odc", "fsdp2"], ["prefetch0"], ["offload"])
    groups = e2e_isolate.children(planned)
    assert groups[("longtail", "odc")] == ["lb_mini", "lb_micro"] and groups[("longtail", "odc-offload")] == ["lb_mini"]
    again = []
    for (w, m), balancers in groups.items():
        argv = e2e_isolate.child_argv(["--isolate", "--ablate", "prefetch0", "--variants", "offload"], w, m, balancers,
                                      tmp_path / f"{w}_{m}")
        args = e2e_bench.parse(argv)
        assert not args.isolate and args.out == str(tmp_path / f"{w}_{m}")
        again += e2e_bench.runs_for(args.workloads, args.methods, args.ablate, args.variants, args.balancers)
    assert again == planned
    ok, crashed = tmp_path / "ok", tmp_path / "crashed"
    harness.write_result(ok, "e2e_bench", harness.meta("abc", "cmd", "cpu", world_size=2, failed=[]),
                         [{"workload": "longtail", "method": "odc", "balance": "lb_mini"}])
    rows, failed, device, world = e2e_isolate.collect([
        (ok, [("longtail", "odc", "lb_mini"), ("longtail", "odc", "lb_micro")], -9),
        (crashed, [("longtail", "fsdp2", "lb_micro")], 1)])
    assert len(rows) == 1 and (device, world) == ("cpu", 2)
    assert [(f["method"], f["balance"]) for f in failed] == [("odc", "lb_micro"), ("fsdp2", "lb_micro")]
    assert "exited with code -9 (signal 9)" in failed[0]["error"] and "exited with code 1" in failed[1]["error"]


def test_isolate_refuses_torchrun(monkeypatch, capsys):
    """--isolate starts its own torchrun per method: under torchrun (RANK set) it refuses at once, in one line."""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        e2e_bench.parse(["--isolate"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: --isolate starts its own torchrun per method: run it with python -m benchmarks.e2e_bench, not torchrun")
    assert not e2e_bench.parse([]).isolate  # without --isolate torchrun is the way


def test_balancers_filter_odc_runs_and_keep_the_baseline():
    """``--balancers lb_mini``: odc's runs (and its variants') with LB-Mini only; FSDP2 keeps LB-Micro, its only
    balancer, so the comparison the run exists for is still made (it used to drop FSDP2 altogether)."""
    assert e2e_bench.runs_for(["longtail"], ["fsdp2", "odc"], variants=["gather_masters"], only=["lb_mini"]) == [
        ("longtail", "fsdp2", "lb_micro"), ("longtail", "odc", "lb_mini"), ("longtail", "odc-gather_masters", "lb_mini")]
    assert ("longtail", "odc", "lb_micro") in e2e_bench.runs_for(["longtail"], ["odc"])


def test_park_variants_name_their_share_and_bad_ones_are_refused():
    from benchmarks.e2e_args import park_fraction, variant

    assert [park_fraction(v) for v in ("park", "park60", "park05", "park00", "park100", "parkxx", "lean")] == [
        1.0, 0.6, 0.05, None, None, None, None]
    assert variant("park60+gather_masters") == "park60+gather_masters"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown variant 'park100'"):
        variant("park100")
    from benchmarks.e2e_args import park_fit_budget

    assert [park_fit_budget(v) for v in ("parkfit", "parkfit51", "parkfit00", "parkfit100", "park60", "lean")] == [
        0.9, 0.51, None, None, None, None]
    assert [park_fraction(v) for v in ("parkfit", "parkfit51")] == [None, None]
    assert variant("parkfit51+gather_masters") == "parkfit51+gather_masters"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown variant 'parkfit100'"):
        variant("parkfit100")
    assert variant("parkfit51+park_late") == "parkfit51+park_late"  # [park-backward] off
    assert variant("park+park_at_once") == "park+park_at_once"  # [park-trickle] off
    for how in ("park_late", "park_at_once", "park_largest_first"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{how} says how parked state moves"):
            variant(f"gather_masters+{how}")


def test_pushes_variants_name_their_bound():
    """``pushesN``: odc with N sites of pushes in flight ([streams] 2), N = 1-9; anything else is refused."""
    from benchmarks.e2e_args import pushes_in_flight, variant

    assert [pushes_in_flight(v) for v in ("pushes1", "pushes2", "pushes9", "pushes0", "pushes10", "pushes",
                                          "unbounded_pushes", "park60")] == [1, 2, 9, None, None, None, None, None]
    assert variant("pushes2+unit_groups") == "pushes2+unit_groups"
    for bad in ("pushes0", "pushesN", "parkNN", "parkfitNN"):  # the templates are no variants
        with pytest.raises(argparse.ArgumentTypeError, match=f"unknown variant '{bad}'"):
            variant(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="sets the pushes in flight twice"):
        variant("unbounded_pushes+pushes2")


def test_hsdp_runs_train_what_fully_sharded_ones_do(tmp_path):
    """``--replicas 2`` on 4 ranks (issue 45's HSDP 2x4 run, shrunk): odc and FSDP2 shard over 2 ranks and replicate
    twice, and take the steps DDP takes on the same samples (fp32 on CPU); the report names the mesh; a replica count
    that does not divide the ranks is refused before any rank starts."""
    e2e_bench.main(["--cpu-ranks", "4", "--replicas", "2", "--size", "tiny", "--vocab", "256", "--steps", "2",
                    "--warmup", "1", "--batch", "8", "--cap", "512", "--pool", "20000", "--group-bytes", "8192",
                    "--lr", "1e-2", "--workloads", "longtail", "--methods", "odc", "fsdp2", "ddp",
                    "--balancers", "lb_micro", "--out", str(tmp_path)])
    runs = {r["method"]: r for r in json.loads((tmp_path / "e2e_bench.json").read_text())["rows"]}
    assert set(runs) == {"odc", "fsdp2", "ddp"}
    for method in ("odc", "fsdp2"):
        assert len(runs[method]["losses"]) == len(runs["ddp"]["losses"]) == 3  # 1 warm-up + 2 measured steps
        assert len(runs[method]["steps"]) == len(runs["ddp"]["steps"]) > 0
        for a, b in zip(runs[method]["losses"], runs["ddp"]["losses"]):
            assert abs(a - b) <= 1e-4 * abs(b), (method, runs[method]["losses"], runs["ddp"]["losses"])
        for s, t in zip(runs[method]["steps"], runs["ddp"]["steps"]):
            assert abs(s["grad_norm"] - t["grad_norm"]) <= 1e-4 * abs(t["grad_norm"]), method
    assert "- HSDP (odc and FSDP2): 2 replicas of 2 shards" in (tmp_path / "e2e_bench.md").read_text()
    with pytest.raises(SystemExit):
        e2e_bench.parse(["--cpu-ranks", "4", "--replicas", "3", "--out", str(tmp_path)])
