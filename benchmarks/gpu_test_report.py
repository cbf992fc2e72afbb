"""Turn a GPU pytest run (JUnit XML + the measured-error JSON lines of tests/test_gpu.py) into JSON + markdown.

    python -m benchmarks.gpu_test_report RUN_DIR OUT_DIR --commit SHA --device "2x NVIDIA H200" --date YYYY-MM-DD
    python -m benchmarks.gpu_test_report results/gpu_tests/n1_3ed1803 /tmp/gpu_tests --commit 3ed1803 \
        --device "1x NVIDIA H200" --date 2026-11-24   # anywhere (CPU): a committed run's raw files

RUN_DIR holds ``gpu_tests.xml`` (pytest --junitxml) and ``gpu_measured.jsonl``
(written by the tests when ODC_RESULTS is set). A run cut off before pytest wrote its XML
is read from ``outcomes.jsonl`` instead (one line per test as it ended, ODC_TEST_OUTCOMES:
tests/conftest.py). Nothing is typed in by hand: every figure comes from those files.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks import harness

COMMAND = (
    "ODC_RESULTS=$OUT/gpu_measured.jsonl python3 -m pytest tests/test_kernels.py "
    "tests/test_standard_loop.py tests/test_loss.py tests/test_gpu.py --junitxml=$OUT/gpu_tests.xml"
)


def _outcomes(path: Path) -> list[dict]:
    """The tests of an ``outcomes.jsonl`` (the run's own record, as each test ended)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [{"name": r["test"].replace("/", ".").replace(".py::", "::"), "outcome": r["outcome"],
             "seconds": r["duration_s"]} for r in rows]


def parse(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The tests (name, outcome, seconds) of ``gpu_tests.xml`` (else ``outcomes.jsonl``) and the records of
    ``gpu_measured.jsonl``."""
    tests = []
    if not (run_dir / "gpu_tests.xml").exists():
        tests = _outcomes(run_dir / "outcomes.jsonl")
    for case in (ET.parse(run_dir / "gpu_tests.xml").getroot().iter("testcase")
                 if (run_dir / "gpu_tests.xml").exists() else ()):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        tests.append({"name": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time", 0))})
    lines = run_dir / "gpu_measured.jsonl"  # absent when no test of the run measured anything
    measured = [json.loads(line) for line in lines.read_text().splitlines() if line] if lines.exists() else []
    return tests, measured


def markdown(meta: dict, tests: list[dict], measured: list[dict]) -> str:
    """The report: outcome counts, the measured agreement table and the tests' table."""
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    lines = [
        "# GPU test run",
        "",
        f"- device: {meta['device']}; date: {meta['date']}; commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- outcome: {counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
        f"{counts['skipped']} skipped",
        "",
        "## Measured agreement with the references (worst over ranks; relative for losses and norms)",
        "",
        "| test | loss rel. error by step | grad-norm rel. error by step | max abs. param error (worst param) |",
        "|---|---|---|---|",
    ]
    agreement = [m for m in measured if "loss_rel_by_step" in m]
    for m in agreement:
        loss = ", ".join(f"{x:.1e}" for x in m["loss_rel_by_step"])
        norm = ", ".join(f"{x:.1e}" for x in m["norm_rel_by_step"])
        lines.append(f"| {m['test']} | {loss} | {norm} | {m['max_param_abs']:.1e} ({m['worst_param']}) |")
    other = [m for m in measured if "loss_rel_by_step" not in m]
    if other:  # timings and the like, as the tests recorded them (per rank where a list holds lists)
        lines += ["", "## Other measurements", "", "| test | values |", "|---|---|"]
        lines += [f"| {m['test']} | `{json.dumps({k: v for k, v in m.items() if k != 'test'})}` |" for m in other]
    lines += ["", "## Tests", "", "| test | outcome | seconds |", "|---|---|---|"]
    lines += [f"| {t['name']} | {t['outcome']} | {t['seconds']:.1f} |" for t in tests]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    """Write ``gpu_tests.json`` and ``gpu_tests.md`` under OUT_DIR from RUN_DIR's two files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--commit", required=True, help="the run's commit (not harness.add_common's default: "
                        "the report is of a run made elsewhere)")
    parser.add_argument("--device", required=True)
    parser.add_argument("--date", required=True)
    parser.add_argument("--command", default=COMMAND, help="the pytest command of the run, if not the default one")
    args = parser.parse_args(argv)
    tests, measured = parse(args.run_dir)
    meta = harness.meta(args.commit, args.command, args.device, date=args.date)
    # rows: the tests; ``measured``: what they recorded, a further table (read old files' ``tests`` as rows)
    harness.write_result(args.out_dir, "gpu_tests", meta, tests, markdown(meta, tests, measured), measured=measured)


if __name__ == "__main__":
    main()
