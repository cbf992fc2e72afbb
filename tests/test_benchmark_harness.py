"""benchmarks/harness.py (the one result schema, the reader of every committed shape), benchmarks/results_index.py
(results/README.md's index kept current) and the GPU host's best_fit / e2e_bench bugs, on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks import best_fit, e2e_report, harness, results_index

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_write_result_is_the_one_schema(tmp_path):
    meta = harness.meta("abc1234", harness.command("benchmarks.x", ["--out", "d"]), "cpu", world=2)
    data = harness.write_result(tmp_path, "x", meta, [{"a": 1}], "# x\n", measured=[2])
    assert json.loads((tmp_path / "x.json").read_text()) == data and (tmp_path / "x.md").read_text() == "# x\n"
    assert list(data) == ["meta", "rows", "measured"] and data["meta"]["command"] == "python -m benchmarks.x --out d"
    assert list(data["meta"])[:4] == list(harness.META_KEYS) and data["meta"]["world"] == 2


def test_every_committed_result_reads_as_the_schema():
    """Legacy shapes (results / runs / points / tests, meta fields at the top, one flat record) read as meta + rows."""
    files = sorted(RESULTS.rglob("*.json"))
    assert len(files) > 100
    for f in files:
        data = harness.load_result(f)
        assert isinstance(data["meta"], dict) and isinstance(data["rows"], list), f  # [] where every run failed
    e2e = json.loads((RESULTS / "e2e/n2_longtail_ba211a2/e2e_bench.json").read_text())
    assert harness.rows(e2e) == e2e["results"]
    flat = harness.load_result(RESULTS / "checkpoint/checkpoint_bench.json")
    assert len(flat["rows"]) == 1 and "save_s" in flat["rows"][0] and flat["meta"]["commit"]
    top = harness.normalize({"date": "d", "commit": "c", "device": "cpu", "rows": [1], "size": "tiny"})
    assert top["meta"] == {"date": "d", "commit": "c", "device": "cpu"} and top["rows"] == [1]


def test_results_index_is_current():
    """results/README.md's index is the generated one (python -m benchmarks.results_index), every file listed;
    the hand-written entries outside its BEGIN / END lines are the README's own."""
    text = (RESULTS / "README.md").read_text()
    assert results_index.render() in text and text.count(results_index.BEGIN) == 1
    assert results_index.main(["--check"]) == 0
    assert text.startswith("# Results from GPU runs") and "- 2026-11-27, 2 H200s" in text
    assert len(results_index.entries()) == len(list(RESULTS.rglob("*.json")))


def test_results_index_owns_only_its_lines(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "r.json").write_text(json.dumps({"meta": {"date": "2026-01-01", "commit": "abc", "device":
                                                                 "cpu", "command": "c"}, "rows": [{}]}))
    (tmp_path / "README.md").write_text("# Results\n\n- hand-written\n")
    assert results_index.main(["--results", str(tmp_path), "--check"]) == 1
    assert results_index.main(["--results", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert text.startswith("# Results\n\n- hand-written\n")
    assert "| [a/r.json](a/r.json) | 2026-01-01 | abc | cpu |" in text
    (tmp_path / "README.md").write_text(text + "\n- after\n")
    assert results_index.main(["--results", str(tmp_path)]) == 0 and text in (tmp_path / "README.md").read_text()
    assert results_index.main(["--results", str(tmp_path), "--check"]) == 0


def test_best_fit_records_a_hung_candidate_as_timeout_and_goes_on(tmp_path, monkeypatch, capsys):
    """(a) A candidate that runs past --timeout-s (an OOM that hung) is killed, recorded as failed ("timeout"), and
    the search goes on with the next one."""
    started = []

    def hang(args, argv):
        started.append(argv)
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    monkeypatch.setattr(best_fit, "torchrun_command", hang)
    best_fit.main(["--size", "tiny", "--workloads", "longtail", "--methods", "fsdp2", "--timeout-s", "1", "--out",
                   str(tmp_path), "--commit", "abc1234"])
    rows = json.loads((tmp_path / "best_fit.json").read_text())["rows"]
    assert len(started) == 2 and [r["error"] for r in rows] == ["timeout", "timeout"]  # AC off, then AC on
    assert [r["activation_checkpointing"] for r in rows] == [False, True]
    assert "| longtail | fsdp2 | nothing fits |" in (tmp_path / "best_fit.md").read_text()
    assert capsys.readouterr().out.count(": timeout\n") == 2


def test_best_fit_progress_line_is_the_candidates_best():
    """(c) After a candidate, its best balancer's tokens/s, not the last row's (lb_micro)."""
    cand = {"method": "odc", "activation_checkpointing": False, "micro_samples": None}
    rows = [{**cand, "balance": "lb_mini", "tokens_per_s": 200.0, "peak_gib": 1.0},
            {**cand, "balance": "lb_micro", "tokens_per_s": 150.0, "peak_gib": 1.0}]
    assert best_fit.progress("longtail", cand, rows, None).endswith(": 200.0 (lb_mini)")
    failed = [{**cand, "error": "timeout"}]
    assert best_fit.progress("longtail", cand, failed, None).endswith(": timeout")


def test_e2e_chart_when_every_run_failed(tmp_path):
    """(b) No completed run: no chart and no crash (was: ValueError: Number of columns must be a positive
    integer, not 0); the report still names the failures."""
    e2e_report.chart([], tmp_path / "e2e_bench.png")
    assert not (tmp_path / "e2e_bench.png").exists()
    meta = harness.meta("abc", "c", "cpu", world_size=2, size="tiny", params=1e9, steps=1, warmup=1, batch=2,
                        args={"seq": 64}, failed=[{"workload": "balanced", "method": "odc", "balance": "lb_micro",
                                                   "error": "OutOfMemoryError: boom"}])
    assert "OutOfMemoryError: boom" in e2e_report.report([], meta)


def test_a_new_benchmark_is_one_file_and_its_smoke_test():
    """The pattern docs/benchmarks.md describes: flags, meta and the writer from the harness."""
    import argparse

    p = harness.add_common(argparse.ArgumentParser(), out="results/x", cpu_ranks=True)
    args = p.parse_args(["--cpu-ranks", "2"])
    assert args.out == "results/x" and args.cpu_ranks == 2 and args.commit
    assert SimpleNamespace(**vars(args)).commit == args.commit


def test_the_recorded_command_names_the_module_run_with_dash_m(monkeypatch):
    """Run as ``python -m benchmarks.e2e_bench`` (or ``torchrun -m``) a script's ``__name__`` is ``__main__``: the
    recorded command names the module from ``__main__``'s spec (it read ``benchmarks.__main__`` on the GPU host)."""
    import sys
    import types

    from benchmarks import harness

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="benchmarks.e2e_bench")
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert harness.command("__main__", ["--size", "1b"]) == "python -m benchmarks.e2e_bench --size 1b"
    assert harness.command("benchmarks.best_fit", []) == "python -m benchmarks.best_fit"


def test_per_step_ratio_is_the_median_of_step_by_step_ratios():
    """Issue 41's honest figure: every method trains the same minibatch at a given step, so the report gives FSDP2's
    step time over the method's, step by step, and their median next to the mean; warm-up steps are left out, and
    the tokens/s ratio (time-weighted) can differ from both. Closed form: steps 3-5 of fsdp2 take 2, 4, 6 s; odc's
    1, 4, 2 s: ratios 2, 1, 3 (median 2, mean 2); all tokens over all time: 12 / 7 = 1.714x."""
    def run(method, balance, times):
        steps = [{"step": k + 1, "step_s": t} for k, t in enumerate(times)]
        return {"workload": "longtail", "method": method, "balance": balance, "steps": steps,
                "tokens_per_s": 3 * 100 / sum(times[2:]), "rank_cost_max_over_mean": 1.5}
    fsdp2, odc = run("fsdp2", "lb_micro", [9, 9, 2, 4, 6]), run("odc", "lb_mini", [1, 1, 1, 4, 2])
    assert e2e_report.step_ratios(odc, fsdp2, warmup=2) == [2.0, 1.0, 3.0]
    assert e2e_report.step_ratio_text(e2e_report.step_ratios(odc, fsdp2, 2)) == "2.00x (2.00x, 1.00-3.00x)"
    assert e2e_report.step_ratio_text([]) == "-" and e2e_report.step_ratios(odc, None, 2) == []
    line = e2e_report.balance_bound([fsdp2, odc], warmup=2)[0]
    assert "= 1.714x (per step: 2.00x (2.00x, 1.00-3.00x))" in line, line


def test_e2e_report_rewrites_a_committed_result_from_its_json(tmp_path):
    """``python -m benchmarks.e2e_report RESULT.json``: the markdown is rebuilt from the JSON alone (a committed run
    gains the per-step ratios without anything typed in by hand); here the figures of a 2-step closed form."""
    steps = lambda times: [{"step": k + 1, "step_s": t} for k, t in enumerate(times)]  # noqa: E731
    row = {"workload": "balanced", "balance": "lb_micro", "mfu": None, "peak_alloc_gib": None, "losses": [1.0],
           "rank_cost_max_over_mean": 1.0, "rank_compute_s": [1.0], "rank_step_s": [0.1], "step_s_min": 1.0,
           "step_s_max": 2.0}
    rows = [{**row, "method": "fsdp2", "steps": steps([5.0, 2.0, 4.0]), "tokens_per_s": 100.0, "step_s_mean": 3.0},
            {**row, "method": "odc", "steps": steps([5.0, 1.0, 4.0]), "tokens_per_s": 120.0, "step_s_mean": 2.5}]
    meta = harness.meta("abc", "c", "cpu", world_size=2, size="tiny", params=1e9, steps=2, warmup=1, batch=2,
                        args={"seq": 64})
    harness.write_result(tmp_path, "e2e_bench", meta, rows, "stale")
    assert e2e_report.main([str(tmp_path / "e2e_bench.json")]) == 0
    text = (tmp_path / "e2e_bench.md").read_text()
    assert "| balanced | odc | lb_micro | 120 | 1.20x | 1.50x (1.50x, 1.00-2.00x) |" in text, text


def test_host_wait_report_lists_the_runtime_calls_that_wait_or_copy():
    """The profiled step's CUDA synchronisations and memcpys by host time, per method; other host ops are left out,
    and a run without a profile gives no section."""
    from benchmarks.e2e_profile import host_wait_report

    ops = [{"name": "cudaStreamSynchronize", "self_ms": 59.7, "calls": 9}, {"name": "aten::mm", "self_ms": 80.0,
                                                                               "calls": 300},
           {"name": "cudaMemcpyAsync", "self_ms": 128.9, "calls": 674}]
    lines = host_wait_report([{"workload": "longtail", "method": "odc-park", "profile": {"top_host_ops": ops}},
                              {"workload": "longtail", "method": "odc"}])
    assert lines[-2:] == ["| longtail | odc-park | cudaStreamSynchronize | 59.7 | 9 |",
                          "| longtail | odc-park | cudaMemcpyAsync | 128.9 | 674 |"]
    assert host_wait_report([{"workload": "w", "method": "odc"}]) == []



def test_idle_by_phase_splits_the_device_gaps_among_the_host_phases_they_fell_in():
    """Kernels at [0, 10], [5, 20], [30, 40], [45, 50] us leave two gaps, [20, 30] and [40, 45]. The sync's range
    [15, 27] holds 7 us of the first, the step's [29, 60] 1 us of it and all of the second; 2 us of the first is in
    no phase (the gather's [0, 19] touches no gap). In ms, as the report prints."""
    import pytest

    from benchmarks.e2e_profile import idle_by_phase, idle_gaps, idle_report

    gaps = idle_gaps([(0, 10), (5, 20), (30, 40), (45, 50)])
    assert gaps == [(20, 30), (40, 45)]
    idle = idle_by_phase(gaps, [("odc::sync", 15, 27), ("Optimizer.step", 29, 60), ("odc::gather", 0, 19)])
    assert idle == pytest.approx({"odc::sync": 7e-3, "Optimizer.step": 6e-3, "outside the phases": 2e-3})
    # nested phases each get their overlap, and only the gap's part in neither is outside
    assert idle_by_phase([(20, 30)], [("odc::sync", 20, 27), ("odc::finish", 25, 29)]) == pytest.approx(
        {"odc::sync": 7e-3, "odc::finish": 4e-3, "outside the phases": 1e-3})
    assert idle_gaps([(0, 10), (2, 4)]) == [] and idle_by_phase([], [("odc::sync", 0, 1)]) == {}
    assert idle_gaps([(0, 10), (2, 4), (6, 12)]) == []  # a span inside another does not end the first one early
    # the device's spans are its kernels, not the ranges' annotations on its track (which span the gaps too)
    from types import SimpleNamespace as Event

    from benchmarks.e2e_profile import device_spans

    def event(name, start, end, device="DeviceType.CUDA", annotation=False):
        return Event(name=name, device_type=device, is_user_annotation=annotation,
                     time_range=Event(start=start, end=end))

    events = [event("gemm", 30, 40), event("odc::sync", 0, 50, annotation=True), event("nccl:all_gather", 0, 50),
              event("gemm", 0, 10), event("odc::sync", 0, 50, device="DeviceType.CPU")]
    assert device_spans(events) == [(0, 10), (30, 40)]
    lines = idle_report([{"workload": "balanced", "method": "odc", "profile": {"idle_ms_by_phase": {"odc::sync": 7.0}}}])
    assert lines[-1] == "| balanced | odc | odc::sync | 7.0 |"
