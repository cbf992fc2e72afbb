"""The speed memory buys: each method's fastest configuration that fits on the GPUs, searched alike, side by side.

    python -m benchmarks.best_fit --nproc 2 --size 8b --workloads balanced --methods odc fsdp2 --out DIR --commit SHA
    python -m benchmarks.best_fit --cpu-ranks 2 --size tiny --workloads balanced --steps 2 --warmup 1 --out DIR  # CPU
    python -m benchmarks.best_fit --merge DIR1 DIR2 ... --out DIR   # one report over searches run in separate calls

Every method gets the same search over what FSDP users reach for (issue 23, part 4): activation
checkpointing off or on (full recomputation of each decoder layer: the model has no selective mode),
micro-batch size (balanced workload: samples per micro-batch; the long-tailed one packs under its cap),
and, for odcfsdp, its memory levers (``lean``: fp32 masters gathered + bf16 accumulators; ``offload``:
masters and optimizer step in host memory). Candidates run one per process (``torchrun ...
benchmarks/e2e_bench.py``; on CPU ``--cpu-ranks`` ranks spawned in this process), so an out-of-memory run
leaves nothing behind; a candidate *fits* when it completes and its peak (torch's allocated + odc's heap)
stays under ``--max-gib``. Per method the fitting candidate with the most tokens/s is its best fit.
Writes ``best_fit.json`` (every candidate) and ``best_fit.md`` (the best fits side by side) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from pathlib import Path

from benchmarks import harness

ODC_LEVERS = ("", "lean", "offload")  # e2e_bench methods odc, odc-lean, odc-offload (slowest last)


def candidates(method: str, workload: str, micro_samples: list[int]) -> list[dict]:
    """The configurations tried for ``method``, the ones expected to run fastest first."""
    methods = [f"odc-{lever}" if lever else "odc" for lever in ODC_LEVERS] if method == "odc" else [method]
    sizes = micro_samples if workload == "balanced" else [None]
    return [{"method": m, "activation_checkpointing": ac, "micro_samples": k}
            for ac in (False, True) for k in sizes for m in methods]


def best_of(runs: list[dict], max_gib: float | None) -> dict | None:
    """The fitting run with the most tokens/s (None if none fits): completed, and under ``max_gib`` when given."""
    fits = [r for r in runs if r.get("tokens_per_s")
            and (max_gib is None or (r["peak_gib"] is not None and r["peak_gib"] <= max_gib))]
    return max(fits, key=lambda r: r["tokens_per_s"], default=None)


def _e2e_args(cand: dict, workload: str, args, out: Path) -> list[str]:
    argv = ["--size", args.size, "--workloads", workload, "--methods", cand["method"], "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--keep-going", "--out", str(out),
            "--commit", args.commit, *args.e2e_args]
    if cand["micro_samples"]:
        argv += ["--balanced-micro-samples", str(cand["micro_samples"])]
    if cand["activation_checkpointing"]:
        argv.append("--activation-checkpointing")
    return argv


def torchrun_command(args, argv: list[str]) -> list[str]:
    """The command that runs one candidate on the GPUs."""
    return ["torchrun", f"--nproc-per-node={args.nproc}", f"--master-port={args.port}", "-m", "benchmarks.e2e_bench",
            *argv]


def launch(cmd: list[str], log: Path, timeout_s: float) -> bool:
    """Run ``cmd`` (its output to ``log``) in a session of its own; False when it ran past ``timeout_s``, its whole
    process group (torchrun and every rank) killed then: a hung candidate costs only itself."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=harness.module_env(),
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False


def run_candidate(cand: dict, workload: str, args, out: Path) -> list[dict]:
    """Run one candidate; its results (one per balancer) with the peak it took, or one failed record (``timeout``:
    it ran past ``--timeout-s``, e.g. an out-of-memory rank that hung; what it finished before is kept)."""
    argv = _e2e_args(cand, workload, args, out)
    finished = True
    if args.cpu_ranks:
        from benchmarks import e2e_bench

        e2e_bench.main(["--cpu-ranks", str(args.cpu_ranks), *argv])
    else:
        finished = launch(torchrun_command(args, argv), out / "run.log", args.timeout_s)
    timeout = [] if finished else [{**cand, "workload": workload, "error": "timeout"}]
    try:
        data = harness.load_result(out / "e2e_bench.json")
    except (FileNotFoundError, json.JSONDecodeError):
        return timeout or [{**cand, "workload": workload, "error": "no result (out of memory, or cut by --timeout-s)"}]
    def plus_heap(r: dict, key: str) -> float | None:  # None on CPU: torch keeps no allocator statistics there
        return None if r.get(key) is None else r[key] + (r.get("nvshmem_heap_gib") or 0.0)

    rows = [{**cand, "workload": workload, "balance": r["balance"], "tokens_per_s": r["tokens_per_s"],
             "mfu": r["mfu"], "peak_gib": plus_heap(r, "peak_alloc_gib"),
             "peak_reserved_gib": plus_heap(r, "peak_reserved_gib")} for r in data["rows"]]
    rows += [{**cand, "workload": workload, "error": f["error"]} for f in data["meta"].get("failed", [])]
    return rows + timeout


def progress(workload: str, cand: dict, rows: list[dict], max_gib: float | None) -> str:
    """The line printed after a candidate: its best fit's tokens/s (its balancers' best), else its errors."""
    best = best_of(rows, max_gib)
    if best is not None:
        return f"{workload} {cand}: {best['tokens_per_s']} ({best.get('balance')})"
    return f"{workload} {cand}: {'; '.join(str(r.get('error', 'does not fit')) for r in rows)}"


def report(runs: list[dict], meta: dict) -> str:
    """The best fit of each method per workload, side by side, and the ratio to FSDP2's."""
    under = "" if meta["max_gib"] is None else f" with peak (allocated + heap) <= {meta['max_gib']} GiB"
    lines = ["# Best fit: each method's fastest configuration that fits", "",
             f"- device: {meta['device']}; date {meta['date']}; commit {meta['commit']}",
             f"- command: `{meta['command']}`",
             f"- fits: completed{under}; {len(runs)} candidate runs, {sum('error' in r for r in runs)} did not fit "
             "or failed", "",
             "| workload | method | best configuration | tokens/s | vs fsdp2 | MFU | peak GiB (+heap) |",
             "|---|---|---|---|---|---|---|"]
    for workload in sorted({r["workload"] for r in runs}):
        best = {m: best_of([r for r in runs if r["workload"] == workload and r["method"].split("-")[0] == m],
                           meta["max_gib"]) for m in meta["methods"]}
        base = best.get("fsdp2")
        for m, b in best.items():
            if b is None:
                lines.append(f"| {workload} | {m} | nothing fits | - | - | - | - |")
                continue
            config = (f"{b['method']}, {b.get('balance')}, AC {'on' if b['activation_checkpointing'] else 'off'}"
                      + (f", {b['micro_samples']} samples/micro-batch" if b["micro_samples"] else ""))
            ratio = f"{b['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
            peak = "-" if b["peak_gib"] is None else f"{b['peak_gib']:.1f}"
            mfu = "-" if b["mfu"] is None else f"{b['mfu']:.1%}"
            lines.append(f"| {workload} | {m} | {config} | {b['tokens_per_s']:.0f} | {ratio} | {mfu} | {peak} |")
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="8b")
    p.add_argument("--workloads", nargs="+", default=["balanced"], choices=["balanced", "longtail"])
    p.add_argument("--methods", nargs="+", default=["odc", "fsdp2"], choices=["odc", "fsdp2", "ddp"])
    p.add_argument("--micro-samples", type=int, nargs="+", default=[2, 1], help="balanced: samples per micro-batch")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2, help="GPUs (torchrun --nproc-per-node)")
    p.add_argument("--max-gib", type=float, default=None, help="a fit's peak allocated + heap must stay under this")
    p.add_argument("--timeout-s", type=float, default=900, help="per candidate (a GPU run)")
    p.add_argument("--port", type=int, default=29631)
    harness.add_common(p, out="results/best_fit", cpu_ranks=True)
    p.add_argument("--merge", nargs="+", default=[], help="only merge these folders' best_fit.json into one report")
    p.add_argument("--e2e-args", nargs=argparse.REMAINDER, default=[], help="passed on to e2e_bench.py (last)")
    args = p.parse_args(argv)
    args.command = harness.command(__name__, argv)
    return args


def main(argv=None) -> None:
    """Run every method's candidates, then write the report."""
    args = parse(argv)
    out = Path(args.out)
    if args.merge:  # searches split over several device calls (each call has a time limit): one report
        parts = [harness.load_result(Path(d) / "best_fit.json") for d in args.merge]  # "runs" before 4b
        meta = {**parts[0]["meta"], "command": args.command,
                "methods": list(dict.fromkeys(m for p in parts for m in p["meta"]["methods"]))}
        runs = [r for p in parts for r in p["rows"]]
        harness.write_result(out, "best_fit", meta, runs, report(runs, meta))
        print(report(runs, meta))
        return
    runs = []
    for workload in args.workloads:
        for method in args.methods:
            for k, cand in enumerate(candidates(method, workload, args.micro_samples)):
                sub = out / f"{workload}_{method}_{k}"
                sub.mkdir(parents=True, exist_ok=True)
                rows = run_candidate(cand, workload, args, sub)
                runs += rows
                print(progress(workload, cand, rows, args.max_gib), flush=True)
    device = "cpu" if args.cpu_ranks else harness.device_name(world=args.nproc)
    meta = harness.meta(args.commit, args.command, device, max_gib=args.max_gib, methods=args.methods)
    harness.write_result(out, "best_fit", meta, runs, report(runs, meta))
    print(report(runs, meta))


if __name__ == "__main__":
    main()
