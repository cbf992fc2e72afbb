"""The e2e benchmark's report: the markdown tables and the chart (the profiled step's: ``e2e_profile.py``)."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks import harness
from benchmarks.e2e_hf import bench_model
from benchmarks.e2e_profile import profile_report


def baseline(method: str) -> str:
    """The method a run's method is, for wrapping and for the tables: ``hf_fsdp2`` / ``hf_ddp`` are FSDP2 and DDP on
    a Hugging Face model (``--model hf:<name>``, [e2e-hf]); a run has one or the other, never both."""
    return method.removeprefix("hf_")


def report(results: list[dict], meta: dict) -> str:
    lines = [
        "# End-to-end training: odcfsdp vs PyTorch FSDP2 vs DDP", "",
        f"- device: {meta['device']} x {meta['world_size']}; date {meta['date']}; commit {meta['commit']}",
        f"- command: `{meta['command']}`" + ("; each (workload, method) ran in a process group of its own "
                                              "(`--isolate`; each one's own results: `isolated/<workload>_<method>/`, `runs/` before 9f344f4)"
                                              if meta.get("isolated") else ""),
        f"- model: {meta.get('model') or 'Llama ' + meta['size']} ({meta['params'] / 1e9:.2f}B); {meta['steps']} "
        f"measured steps after "
        f"{meta['warmup']} warm-up; {meta['batch']} samples per minibatch; balanced: "
        f"{meta['args'].get('balanced_micro_samples', 1)} sample(s) of {meta['args'].get('seq')} tokens per micro-batch; "
        f"PYTORCH_CUDA_ALLOC_CONF={meta['args'].get('alloc_conf') or '(default)'}",
        "- memory: torch's peak allocated / reserved per rank during training (reset after wrapping; building "
        "the full fp32 model first is the same for every method and not counted); odc adds its NVSHMEM heap "
        "(rows + fp32 accumulators), which lives outside torch's allocator",
        "- DDP keeps fp32 parameters and computes under bf16 autocast; odc and FSDP2 compute with bf16 "
        "parameters and reduce gradients in fp32",
        f"- attention kernels (every method): {meta['args'].get('attention', 'flash')}; "
        f"decoder layers compiled (every method): {meta['args'].get('compile') or 'no'}; activation checkpointing "
        f"(every method): {'yes' if meta['args'].get('activation_checkpointing') else 'no'}; odc hooks whole decoder "
        "layers (`units`) unless the run is `odc-module_hooks`",
        "- Python's GC (every method): " + (
            f"automatic collection off, gc.collect(1) every {meta['args']['gc_every']} steps between steps "
            "(torchtitan's training.gc_freq, [step-gc])" if meta['args'].get('gc_every')
            else "automatic (a run from before --gc-every)" if 'gc_every' not in meta['args']
            else "automatic (--gc-every 0)"),
        *([f"- float8 (odc and FSDP2): torchao {meta['args']['float8']}; odc gathers tensorwise weights in "
           f"{'float8' if meta['args'].get('float8_gather') else 'bf16'} (float8_gather; the flag's default changed "
           "to on at 28e8f72: runs before it without --float8-gather gathered bf16)"]
          if meta['args'].get('float8') else []),
        *([f"- HSDP (odc and FSDP2): {meta['args']['replicas']} replicas of "
           f"{meta['world_size'] // meta['args']['replicas']} shards, a 2-D mesh (FSDP2's HSDP; odc shards inside a replica and sums the replicas' gradients once per "
           "minibatch)"] if meta['args'].get('replicas', 1) > 1 else []),
        "- rank cost max/mean: the balancer's result by the cost model (a*s^2 + b*s): the busiest rank's work over "
        "the mean, over the measured steps (1.00 = perfectly balanced); compute s per rank: forward/backward time "
        "summed over the measured steps; host-issue s: the part of it until the host had queued the last kernel "
        "(close to compute s: the host, not the GPU, sets the pace); optimizer-step s: the step including the wait "
        "for the other ranks",
        "- vs fsdp2: tokens/s over FSDP2's (+ lb_micro) over all measured steps; per step: every method trains the "
        "same minibatch at a given step, so FSDP2's step time over the method's, step by step: the median of those "
        "ratios (their mean, min-max)",
        "", "| workload | method | balance | tokens/s | vs fsdp2 | per step vs fsdp2: median (mean, min-max) | MFU | "
        "peak alloc / reserved GiB (+heap) | "
        "step s (min-max) | rank cost max/mean | compute s per rank | host-issue s per rank | "
        "optimizer-step s per rank | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bases = {}
    for r in results:
        if baseline(r["method"]) == "fsdp2":
            bases.setdefault(r["workload"], r)
    base = {w: r["tokens_per_s"] for w, r in bases.items()}
    for r in results:
        ratio = f"{r['tokens_per_s'] / base[r['workload']]:.2f}x" if r["workload"] in base else "-"
        per_step = step_ratio_text(step_ratios(r, bases.get(r["workload"]), meta["warmup"]))
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = "-" if r["peak_alloc_gib"] is None else (f"{r['peak_alloc_gib']:.1f} / {r['peak_reserved_gib']:.1f} "
                                                        f"(+{r['nvshmem_heap_gib']:.1f})")
        lines.append(
            f"| {r['workload']} | {r['method']} | {r['balance']} | {r['tokens_per_s']:.0f} | {ratio} | {per_step} | "
            f"{mfu} | {mem} | "
            f"{r['step_s_mean']:.2f} ({r['step_s_min']:.2f}-{r['step_s_max']:.2f}) | {r['rank_cost_max_over_mean']:.3f} | "
            f"{', '.join(f'{x:.1f}' for x in r['rank_compute_s'])} | "
            f"{', '.join(f'{x:.1f}' for x in r.get('rank_host_s', []))} | {', '.join(f'{x:.2f}' for x in r['rank_step_s'])} | "
            f"{r['losses'][-1]:.4f} |")
    lines += balance_bound(results, meta["warmup"])
    for r in results:  # [park-fit]: each rank chose its own share of the optimizer's state to park
        if any(f is not None for f in r.get("park_fraction_by_rank") or ()):
            lines.append(f"- {r['workload']} {r['method']}: the optimizer's state parked at the end, by rank: "
                         + ", ".join("-" if f is None else f"{f:.2f}" for f in r["park_fraction_by_rank"]))
    lines += outlier_steps(results, meta["warmup"])
    for f in meta.get("failed", []):
        lines.append(f"\n- FAILED {f['workload']} / {f['method']} / {f['balance']}: `{f['error'][:300]}`")
    lines += profile_report(results)
    lines += memory_report(results)
    return "\n".join(lines) + "\n"


def outlier_steps(results: list[dict], warmup: int, gc_s: float = 0.05) -> list[str]:
    """A line per measured step that compiled frames or spent over ``gc_s`` in Python's GC (rank 0's
    ``StepEvents``): what may explain a slow step."""
    lines = []
    for r in results:
        for s in r.get("steps", [])[warmup:]:
            if s.get("compiled_frames") or s.get("gc_s", 0) > gc_s:
                lines.append(f"- {r['workload']} {r['method']} step {s['step']} ({s['step_s']:.2f} s): "
                             f"{s.get('compiled_frames', 0)} frame(s) compiled, {s.get('gc_s', 0):.2f} s in GC")
    return lines


def step_ratios(run: dict, base: dict | None, warmup: int) -> list[float]:
    """``base``'s measured step times over ``run``'s, step by step (the same minibatch at the same step number):
    above 1 where ``run`` was faster. Empty without a base or per-step times."""
    if base is None or not run.get("steps") or not base.get("steps"):
        return []
    theirs = {s["step"]: s["step_s"] for s in base["steps"][warmup:]}
    return [theirs[s["step"]] / s["step_s"] for s in run["steps"][warmup:] if s["step"] in theirs and s["step_s"] > 0]


def step_ratio_text(ratios: list[float]) -> str:
    """``1.20x (1.18x, 1.01-1.35x)``: the median of per-step ratios (mean, min-max); ``-`` for none."""
    if not ratios:
        return "-"
    return (f"{statistics.median(ratios):.2f}x ({statistics.fmean(ratios):.2f}x, "
            f"{min(ratios):.2f}-{max(ratios):.2f}x)")


def balance_bound(results: list[dict], warmup: int = 0) -> list[str]:
    """Per workload, odc + lb_mini's speed-up over FSDP2 + lb_micro (over all measured steps, and the median of the
    per-step ratios) against the most balancing can win at this world size: FSDP2's busiest-rank cost over the mean
    cost (its ``rank cost max/mean``)."""
    out = []
    for w in dict.fromkeys(r["workload"] for r in results):
        runs = {(baseline(r["method"]), r["balance"]): r for r in results if r["workload"] == w}
        base = runs.get(("fsdp2", "lb_micro"))
        odc = runs.get(("odc", "lb_mini"))
        if base and odc:
            speedup, bound = odc["tokens_per_s"] / base["tokens_per_s"], base["rank_cost_max_over_mean"]
            per_step = step_ratio_text(step_ratios(odc, base, warmup))
            out.append(f"\n- {w}: odc lb_mini / {base['method']} lb_micro = {speedup:.3f}x (per step: {per_step}); "
                       "balance bound "
                       f"({base['method']}'s rank cost max/mean) {bound:.3f}x: {speedup / bound:.1%} of it")
        nosync = runs.get(("fsdp2_nosync", "lb_micro"))
        if nosync and odc:  # the ZeRO-2-memory baseline: its speed and the memory it costs, side by side
            peaks = [f"{r['peak_alloc_gib']:.1f}" if r["peak_alloc_gib"] is not None else "-" for r in (odc, nosync)]
            out.append(f"- {w}: odc lb_mini / {nosync['method']} lb_micro = "
                       f"{odc['tokens_per_s'] / nosync['tokens_per_s']:.3f}x, peak allocated {peaks[0]} vs "
                       f"{peaks[1]} GiB")
    return out


# Rows of the peak table, in this order (then any other category a rule produced); see odcfsdp/memory/.
PEAK_ORDER = ("masters", "rows", "accumulators", "gradients", "optimizer_state", "unsharded_params", "grad_buffers",
              "comm_buffers", "optimizer_step", "grad_norm", "fsdp2_other", "preexisting_other",
              "activations_and_other")
POINT_ORDER = ("masters", "rows", "accumulators", "heap_other", "heap", "optimizer_state", "unsharded_params",
               "grad_buffers", "torch_allocated", "activations_and_other", "allocator_slack")


def _unit(values) -> tuple[str, float]:
    top = max([abs(v) for v in values if v is not None] or [0])
    return next((u, d) for u, d in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if top >= d or d == 1)


def _table(title: str, note: str, columns: list[str], rows: list[tuple[str, list]]) -> list[str]:
    unit, div = _unit([v for _, vals in rows for v in vals])
    out = ["", f"## {title} ({unit})", "", note, "", "| category | " + " | ".join(columns) + " |",
           "|---|" + "---|" * len(columns)]
    for name, vals in rows:
        out.append(f"| {name} | " + " | ".join("-" if v is None else f"{v / div:.3f}" for v in vals) + " |")
    return out


def _with_heap(peak: dict, key: str) -> int:
    """One of torch's peaks in a ``peak_breakdown`` record plus the bytes outside torch's allocator (the heap)."""
    return peak[key] + sum(peak["outside_torch"].values())


def memory_report(results: list[dict]) -> list[str]:
    """``--memory-breakdown``: bytes by category at each method's peak (CUDA), and odc's at two points of a step."""
    runs = [r for r in results if r.get("memory_breakdown")]
    lines: list[str] = []
    peaks = []  # (run, rank, record): the rank whose peak (torch's + heap) is highest
    for r in runs:
        ranks = [(k, rec["peak"]) for k, rec in enumerate(r["memory_breakdown"]["ranks"]) if rec.get("peak")]
        if ranks:
            peaks.append((r, *max(ranks, key=lambda kp: _with_heap(kp[1], "allocator_peak_bytes"))))
    if peaks:
        cats = [c for c in PEAK_ORDER if any(p["categories"].get(c) for _, _, p in peaks)]
        cats += sorted({c for _, _, p in peaks for c in p["categories"]} - set(cats))
        heap = [k for k in POINT_ORDER if any(k in p["outside_torch"] for _, _, p in peaks)]
        rows = [(c, [p["categories"].get(c, 0) for _, _, p in peaks]) for c in cats]
        rows += [("= replayed peak (torch, requested bytes)", [p["peak_bytes"] for _, _, p in peaks]),
                 ("torch peak allocated (rounded blocks)", [p["allocator_peak_bytes"] for _, _, p in peaks]),
                 ("rounding (allocated - replayed)",
                  [p["allocator_peak_bytes"] - p["peak_bytes"] for _, _, p in peaks])]
        rows += [(f"heap: {k} (outside torch)", [p["outside_torch"].get(k, 0) for _, _, p in peaks]) for k in heap]
        rows += [("torch peak allocated + heap", [_with_heap(p, "allocator_peak_bytes") for _, _, p in peaks]),
                 ("torch peak reserved + heap", [_with_heap(p, "reserved_peak_bytes") for _, _, p in peaks])]
        lines += _table("Memory at the peak of one extra step, by category",
                        "Each method's rank with the highest peak (allocated + heap). The allocator's history is "
                        "replayed to the peak; each block alive then is attributed by address (parameters, "
                        "gradients, optimizer state, odc's rows) or by its allocation frames, else "
                        "`activations_and_other` (allocated in the step) or `preexisting_other` (alive before it). "
                        "See [memory-model] and [peak-replay] in `odcfsdp/memory/`.",
                        [f"{r['workload']} {r['method']} {r['balance']} (rank {k})" for r, k, _ in peaks], rows)
        lines.append("")
        for r, k, p in peaks:
            sites = ", ".join(f"`{s}` {b / 2**20:.0f} MiB" for s, b in list(p["unclassified_sites"].items())[:4])
            warn = f" **{p['warning']}**" if p.get("warning") else ""
            lines.append(f"- {r['workload']} {r['method']} {r['balance']}: peak at event {p['peak_event']} of "
                         f"{p['events']}; largest `activations_and_other` sites: {sites or '-'}{warn}")
    points = [(r, name, bd) for r in runs
              for name, bd in (r["memory_breakdown"]["ranks"][0].get("points") or {}).items()]
    if points:
        cats = [c for c in POINT_ORDER if any(bd.get(c) is not None for _, _, bd in points)]
        lines += _table("odc memory by category at two points of one extra step (rank 0, `memory_breakdown`)",
                        "before_step: the optimizer's step pre-hook (after the last backward and clip_grad_norm_); "
                        "after_step: after the step and zero_grad. With a one-sided transport (heap > 0) rows, "
                        "accumulators and heap_other are the heap, outside torch's allocator; with `collective` rows "
                        "and accumulators are torch tensors. On CUDA activations_and_other is torch's allocated "
                        "bytes minus the torch-allocated categories.",
                        [f"{r['workload']} {r['method']} {r['balance']} {name}" for r, name, _ in points],
                        [(c, [bd.get(c) for _, _, bd in points]) for c in cats])
    return lines


def chart(results: list[dict], path: Path) -> None:
    """tokens/s by run, one panel per workload; no chart when no run completed (every one failed) or without
    matplotlib."""
    if not results:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        rows = [r for r in results if r["workload"] == w]
        ax.bar([f"{r['method']}\n{r['balance']}" for r in rows], [r["tokens_per_s"] for r in rows])
        ax.set_title(f"{w}: tokens/s (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: list[dict], failed: list[dict], args, device: str, world_size: int | None, final: bool,
                  **extra) -> None:
    """JSON + markdown (+ PNG at the end) under ``--out``, rewritten after every run: a cut-off run keeps its part.
    ``device``: its name (``harness.device_name``); ``extra``: more meta (``--isolate``'s children)."""
    bm = bench_model(args)
    meta = harness.meta(args.commit, args.command, device, world_size=world_size, size=args.size, model=bm.label,
                        params=bm.params, steps=args.steps, warmup=args.warmup, batch=args.batch, args=vars(args),
                        complete=final, failed=failed, isolated=args.isolate, **extra)
    out = Path(args.out)
    harness.write_result(out, "e2e_bench", meta, results, report(results, meta))
    if final:
        chart(results, out / "e2e_bench.png")
        print(report(results, meta))


def main(argv=None) -> int:
    """``python -m benchmarks.e2e_report RESULT.json ...``: rewrite each result's ``e2e_bench.md`` from its JSON (the
    committed figures, this version's tables: e.g. the per-step ratios added after a run was made)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path)
    for path in p.parse_args(argv).results:
        data = harness.load_result(path)
        path.with_suffix(".md").write_text(report(data["rows"], data["meta"]))
        print(f"rewrote {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
