"""``python -m benchmarks.e2e_bench --isolate``: each (workload, method) of e2e_bench in a process group of its own,
one combined result.

Why: in one e2e_bench process the runs share compile caches, torchao's state, storages the previous run freed and
the NVSHMEM heap (sized once per process, by the first model). With ``--isolate`` nothing can carry over from one
method to the next. (It was built when FSDP2 + torchao float8 failed after odc's run in one process,
``results/e2e/n2_8b_balanced_fp8_5b19202``; the cause turned out to be the memory breakdown reading a wrapper
subclass's storage, fixed in ``odcfsdp/memory/live.py``, and the failure came back in a process of its own.)

How: this process (the parent) starts no process group; it refuses to run under torchrun. It plans the runs as
e2e_bench does (``runs_for``) and starts one child per (workload, method), one after another, their output streamed
to its own: ``torchrun --standalone --nproc-per-node gpu -m benchmarks.e2e_bench`` on GPUs (``CUDA_VISIBLE_DEVICES``
decides the count; run as ``python -m torch.distributed.run``, torchrun's module, with this interpreter), or
``python -m benchmarks.e2e_bench`` with ``--cpu-ranks`` (the child spawns its CPU ranks). A child gets the parent's
arguments with overrides appended (argparse keeps the last): ``--no-isolate --workloads W --methods M --ablate
--variants --balancers B.. --out OUT/isolated/W_M``. Ablations and variants are methods of their own there (``odc-<name>``,
``fsdp2-offload``); ``--balancers`` are the ones the parent planned for the child (``--methods odc-<name>`` alone
would also run lb_micro on longtail, where the variant of ``odc`` runs lb_mini only).

After every child (a cut-off call keeps what finished) the parent merges every finished child's rows and failures
into ``OUT/e2e_bench.json`` and ``.md`` (meta ``isolated: true``, the children and their exit codes; device and world
size from the children's meta); the chart comes at the end. A child that exits non-zero has its runs that wrote no
row recorded as failed (the error names its exit code) and the next child runs, whatever ``--keep-going`` says: a
crash of one child must not lose the others (``--keep-going`` still decides, inside a child, whether its other runs
go on after one fails). Without ``--keep-going`` the parent exits with status 1 at the end if a child failed.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.e2e_report import write_outputs

#: the children's folder under --out ("runs/" is what .gitignore keeps training runs out of git by)
CHILDREN = "isolated"

RESULT = "e2e_bench.json"


def misfit(args) -> str | None:
    """One line on why ``--isolate`` cannot run here (under torchrun: it starts its own torchrun), or None."""
    if args.isolate and ("RANK" in os.environ or "LOCAL_RANK" in os.environ):
        return "--isolate starts its own torchrun per method: run it with python -m benchmarks.e2e_bench, not torchrun"
    return None


def children(runs: list[tuple[str, str, str]]) -> dict[tuple[str, str], list[str]]:
    """The planned (workload, method, balancer) runs by child: {(workload, method): [balancer, ...]}, in run order."""
    out: dict[tuple[str, str], list[str]] = {}
    for w, m, b in runs:
        out.setdefault((w, m), []).append(b)
    return out


def child_argv(argv: list[str], workload: str, method: str, balancers: list[str], out: Path) -> list[str]:
    """The child's e2e_bench arguments: the parent's, then its own (argparse keeps the last occurrence)."""
    return [*argv, "--no-isolate", "--workloads", workload, "--methods", method, "--ablate", "--variants",
            "--balancers", *balancers, "--out", str(out)]


def child_command(args, argv: list[str]) -> list[str]:
    """CPU ranks: the child spawns them itself; GPUs: torchrun, one rank per visible GPU."""
    launcher = [] if args.cpu_ranks else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "gpu"]
    return [sys.executable, *launcher, "-m", "benchmarks.e2e_bench", *argv]


def collect(done: list[tuple[Path, list[tuple[str, str, str]], int]]) -> tuple[list, list, str | None, int | None]:
    """The finished children's rows and failures, and the device and world size their meta names.

    ``done``: (folder, planned runs, exit code) per child. A planned run with neither a row nor a failure in its
    child's result is recorded as failed, naming the child's exit code (a crash, or a result never written)."""
    rows, failed, device, world = [], [], None, None
    for folder, planned, code in done:
        path = folder / RESULT
        data = harness.load_result(path) if path.is_file() else {"meta": {}, "rows": []}
        meta = data["meta"]
        device, world = device or meta.get("device"), world or meta.get("world_size")
        mine = meta.get("failed", [])
        seen = {(r["workload"], r["method"], r["balance"]) for r in [*data["rows"], *mine]}
        why = f"the isolated child process exited with code {code}" + (f" (signal {-code})" if code < 0 else "")
        rows += data["rows"]
        failed += mine + [{"workload": w, "method": m, "balance": b,
                           "error": f"{why} without a result for this run (its output: the parent's; folder {folder})"}
                          for w, m, b in planned if (w, m, b) not in seen]
    return rows, failed, device, world


def merge(done: list, args, final: bool) -> None:
    """``OUT/e2e_bench.json`` / ``.md`` (``.png`` when final) over the finished children."""
    rows, failed, device, world = collect(done)
    kids = [{"workload": planned[0][0], "method": planned[0][1], "balancers": [b for _, _, b in planned],
             "out": str(folder), "returncode": code} for folder, planned, code in done]
    write_outputs(rows, failed, args, device or ("cpu" if args.cpu_ranks else "unknown (no child wrote a result)"),
                  world or args.cpu_ranks or None, final, children=kids)


def run(args, runs: list[tuple[str, str, str]]) -> None:
    """Each (workload, method) of ``runs`` in a child process (group) of its own, one after another; one result."""
    out, groups, done = Path(args.out), children(runs), []
    for i, ((w, m), balancers) in enumerate(groups.items(), 1):
        folder = out / CHILDREN / f"{w}_{m}"
        (folder / RESULT).unlink(missing_ok=True)  # an earlier call's result is not this child's
        cmd = child_command(args, child_argv(args.argv, w, m, balancers, folder))
        print(f"[isolate] {i}/{len(groups)}: {w} {m} ({' '.join(balancers)}): {shlex.join(cmd)}", flush=True)
        sys.stderr.flush()
        code = subprocess.run(cmd, env=harness.module_env()).returncode
        if code:
            print(f"[isolate] {i}/{len(groups)}: {w} {m} exited with code {code}; going on", flush=True)
        done.append((folder, [(w, m, b) for b in balancers], code))
        merge(done, args, final=False)
    merge(done, args, final=True)
    crashed = [f"{planned[0][0]} {planned[0][1]} ({code})" for _, planned, code in done if code]
    if crashed and not args.keep_going:
        raise SystemExit(f"[isolate] children exited non-zero: {', '.join(crashed)} (recorded in {out / RESULT})")
