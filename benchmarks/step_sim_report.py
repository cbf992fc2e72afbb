"""The step simulator's markdown reports and chart (``step_sim.py`` writes them; see [step-sim] there)."""

from __future__ import annotations

from pathlib import Path


def _head(meta: dict, title: str) -> list[str]:
    return [f"# {title}", "", f"- date {meta['date']}, commit {meta['commit']}; a model, not a measurement",
            f"- command: `{meta['command']}`"]


def sweep_markdown(data: dict) -> str:
    """The sweep: per distribution, GPU count and samples per GPU, every balancer's mean step and ODC's speedups."""
    meta, fit = data["meta"], data["meta"]["fit"]
    tm = meta["time_model"]
    lines = _head(meta, f"Step-time simulation: ODC + LB-Mini vs FSDP2's balancers ({meta['size']})")
    lines += [f"- time model: fitted on {', '.join(f'`{r}`' for r in fit['runs'])} ({fit['model']}, {fit['points']} "
              f"rank-steps, largest residual {fit['max_rel_residual']:.1%}): a = {tm['a']:.4g} s/pos^2, "
              f"b = {tm['b']:.4g} s/pos, c = {tm['c']:.4g} s per micro-batch, host floor h = {tm['h']:.4g} s per "
              f"micro-batch; optimizer at 2 GPUs "
              f"{meta['opt_s_at_2']['odc']:.3f} s (odc), {meta['opt_s_at_2']['fsdp2']:.3f} s (fsdp2)"
              + (f"; {meta['size']}: the {fit['model']} rates scaled by attention and matmul FLOPs (not validated)"
                 if meta["scaled"] else ""),
              "- step = FSDP2: sum over micro-batches of the slowest rank's; ODC: the slowest rank's sum; both "
              "+ optimizer; bound = every rank at the mean work (`benchmarks/step_sim.py`, [step-sim])",
              "- speedups are balancing's share only: FSDP2's own per-micro-batch speed (2-4% below odcfsdp's on "
              "2 GPUs) is not modelled", ""]
    for name, source in meta["distributions"].items():
        lines += [f"## {name}", "", source, "",
                  "| GPUs | samples/GPU | FSDP2 LB-Micro s | FSDP2 dynamic s | FSDP2 fixed s | ODC LB-Mini s | bound s "
                  "| ODC / LB-Micro | ODC / dynamic | ODC / fixed | bound / LB-Micro | LB-Mini / bound |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in (p for p in data["rows"] if p["distribution"] == name):
            s = p["step_s"]
            lines.append(f"| {p['gpus']} | {p['samples_per_gpu']} | {s['fsdp2_lb_micro']:.3f} | "
                         f"{s['fsdp2_dynamic']:.3f} | {s['fsdp2_fixed']:.3f} | {s['odc_lb_mini']:.3f} | "
                         f"{s['bound']:.3f} | {p['speedup_vs_lb_micro']:.2f}x | {p['speedup_vs_dynamic']:.2f}x | "
                         f"{p['speedup_vs_fixed']:.2f}x | {p['bound_speedup_vs_lb_micro']:.2f}x | "
                         f"{p['lb_mini_over_bound']:.3f} |")
        lines.append("")
    study = [p for p in data["rows"] if "odc_kk" in p["step_s"]]
    if study:
        lines += ["## LB-Mini against other partitions (mean step / balance bound; lower is better)", "",
                  "| distribution | GPUs | samples/GPU | LB-Mini (LPT or LB-Micro's shares) | Karmarkar-Karp "
                  "| LPT + overhead share |",
                  "|---|---|---|---|---|---|"]
        for p in study:
            s, b = p["step_s"], p["step_s"]["bound"]
            lines.append(f"| {p['distribution']} | {p['gpus']} | {p['samples_per_gpu']} | {s['odc_lb_mini'] / b:.4f} | "
                         f"{s['odc_kk'] / b:.4f} | {s['odc_lpt_overhead'] / b:.4f} |")
        lines.append("")
    lines += [f"## Measured (committed runs of {meta['size']}, LongAlign-like; ODC + LB-Mini over FSDP2 + "
              "LB-Micro)", "",
              "| run | model | GPUs | samples/GPU | seed | baseline | measured |", "|---|---|---|---|---|---|---|"]
    lines += [f"| `{m['run']}` | {m['model']} | {m['gpus']} | {m['samples_per_gpu']} | {m['seed']} | {m['baseline']} | "
              f"{m['speedup_vs_lb_micro']:.3f}x |" for m in data["measured"]]
    return "\n".join(lines) + "\n"


def _fit_line(name: str, f: dict) -> str:
    return (f"- fit `{name}` ({f['model']}): a = {f['a']:.4g}, b = {f['b']:.4g}, c = {f['c']:.4g}, h = {f['h']:.4g}, "
            f"optimizer at 2 GPUs {f['opt_s_at_2']['odc']:.3f} / {f['opt_s_at_2']['fsdp2']:.3f} s (odc / fsdp2), "
            f"largest residual {f['max_rel_residual']:.1%} over {f['points']} rank-steps")


def prediction_markdown(data: dict) -> str:
    """Planned runs priced before they run (``--predict``): each method's step by step, ODC's speedups."""
    meta = data["meta"]
    lines = _head(meta, f"Predicted before the run: {meta['size']} at {', '.join(map(str, meta['gpus']))} GPUs")
    lines += [_fit_line(" + ".join(meta["fit"]["runs"]), meta["fit"]),
              "- fsdp2 and fsdp2_nosync are one model: collective at every micro-batch (fsdp2_nosync still "
              "re-gathers each layer for every micro-batch's backward, [step-sim])",
              f"- each row is the e2e run `{meta['e2e_command']}` with that seed, on that many GPUs: the same "
              "seeded lengths and plans as the run will draw (its measured steps, after the warm-up); once the run "
              "is committed, `--validate --held-out <its folder>` prices it again from this fit", "",
              *(f"- {m}: priced from the {meta['fit']['model']} fit, its time model scaled by FLOPs (step_sim_fit."
                "scaled), as the sweep prices other sizes" for m in sorted({r['model'] for r in data['rows']})
                if m != meta["fit"]["model"]), "",
              "| run | method | balance | predicted step s, by step | mean | ODC's speedup (LB-Mini on long-tailed "
              "data): mean, median per step |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        speedup = (f"{r['odc_speedup_mean']:.3f}x, {r['odc_speedup_median_per_step']:.3f}x"
                   if "odc_speedup_mean" in r else "-")
        lines.append(f"| {r['run']} | {r['method']} | {r['balance']} | "
                     f"{', '.join(f'{x:.2f}' for x in r['step_s'])} | {r['mean_step_s']:.2f} | {speedup} |")
    lines += ["", *(f"- {r['run']}: ODC's mean step over the balance bound {r['odc_over_bound']:.3f}"
                    for r in data["rows"] if "odc_over_bound" in r)]
    return "\n".join(lines) + "\n"


def _table(rows: list[dict], with_fit: bool) -> list[str]:
    """Rows as a markdown table (what differs listed once per pair above it): ratio error and, for speedups, the
    error in the gain; a summary line."""
    if not rows:
        return []
    lines = []
    if with_fit:
        pairs = dict.fromkeys((r["fit"], r["target"], r["what"], r["note"]) for r in rows)
        lines += [f"- `{f}` -> `{t}` ({w}){': ' + n if n else ''}"
                  for f, t, w, n in pairs] + [""]
    head = ("| fit -> target " if with_fit else "| target ") + (
        "| GPUs | samples/GPU | seed | quantity | measured | predicted | error | gain error (pp) | gain error (rel) "
        "| within 5% |")
    lines += [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        who = f"`{r['fit']}` -> `{r['target']}`" if with_fit else f"`{r['target']}`"
        gain = "| | " if r["gain_pp"] is None else (
            f"| {r['gain_pp']:+.1f} | " + ("n/a" if r["gain_rel"] is None else f"{r['gain_rel']:+.0%}") + " ")
        lines.append(f"| {who} | {r['gpus']} | {r['samples_per_gpu']} | {r['seed']} | {r['quantity']} | "
                     f"{r['measured']:.3f} | {r['predicted']:.3f} | {r['error']:+.1%} {gain}| "
                     f"{'yes' if abs(r['error']) <= 0.05 else 'NO'} |")
    misses = sum(abs(r["error"]) > 0.05 for r in rows)
    gains = [abs(r["gain_pp"]) for r in rows if r["gain_pp"] is not None]
    return lines + ["", f"{len(rows) - misses} of {len(rows)} within 5%; largest gain error "
                        f"{max(gains, default=0.0):.1f} pp over {len(gains)} speedups.", ""]


def validation_markdown(data: dict) -> str:
    """The validation (``step_sim_fit.refit``): the fit's own steps, held-out runs, same-stream checks."""
    size, fit = data["size"], data["fit"]
    lines = _head(data["meta"], f"Step simulator against the committed long-tailed runs ({size})")
    lines += ["- each row: the time model fitted on the `fit` runs' one-sided ranks, the target run's measured steps "
              "replayed (same seeded samples, same plans) and priced; error = predicted / measured - 1 (target: "
              "within 5%); for a speedup s, the error in its gain s - 1: (s_pred - 1) - (s_meas - 1) in percentage "
              "points, and relative, (s_pred - 1) / (s_meas - 1) - 1",
              "- held out = another data stream (another seed, or another number of samples per GPU); a target with "
              "a fit run's seed and samples per GPU draws the same samples and is a same-stream check, not held out",
              f"- host floor h from `{data['host_run']}`", ""]
    lines += [_fit_line(k, f) for k, f in data["fits"].items()]
    lines += ["", f"## Fit (in-sample): {', '.join(f'`{r}`' for r in fit['runs'])}", ""]
    lines += _table(data["fit_rows"], with_fit=False)
    lines += ["## Held out (another data stream)", ""]
    lines += _table(data["held_out_rows"], with_fit=True) or [
        f"None committed for {size}: every other {size} run replays the fit's data stream (below). "
        + data.get("pending", ""), ""]
    if data["same_stream_rows"]:
        lines += ["## Same data stream (not held out)", ""]
        lines += _table(data["same_stream_rows"], with_fit=True)
    return "\n".join(lines) + "\n"


def chart(data: dict, path: Path) -> Path | None:
    """ODC's predicted speedup over FSDP2 + LB-Micro and over dynamic batching against GPUs, a line per samples/GPU,
    the bound dashed, the measured runs as points; ``None`` without matplotlib (the JSON holds the data)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(data["meta"]["distributions"])
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 8), squeeze=False, sharex=True)
    per_gpu = sorted({p["samples_per_gpu"] for p in data["rows"]})
    colors = plt.get_cmap("viridis")([i / max(1, len(per_gpu) - 1) * 0.9 for i in range(len(per_gpu))])
    for col, name in enumerate(names):
        for row, (other, label) in enumerate((("fsdp2_lb_micro", "FSDP2 + LB-Micro"),
                                              ("fsdp2_dynamic", "FSDP2 + dynamic batching (verl)"))):
            ax = axes[row][col]
            for k, color in zip(per_gpu, colors):
                pts = sorted((p for p in data["rows"] if p["distribution"] == name and p["samples_per_gpu"] == k),
                             key=lambda p: p["gpus"])
                n = [p["gpus"] for p in pts]
                ax.plot(n, [p["step_s"][other] / p["step_s"]["odc_lb_mini"] for p in pts], "o-", color=color,
                        label=f"{k} samples/GPU")
                ax.plot(n, [p["step_s"][other] / p["step_s"]["bound"] for p in pts], "--", color=color, alpha=0.5)
            if row == 0 and name == "longalign":
                for m in data["measured"]:
                    ax.plot(m["gpus"], m["speedup_vs_lb_micro"], "rx", markersize=9)
                    ax.annotate(f"{m['samples_per_gpu']}/GPU", (m["gpus"], m["speedup_vs_lb_micro"]), fontsize=7,
                                xytext=(4, -3), textcoords="offset points", color="red")
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_title(f"{name}: ODC + LB-Mini over {label}", fontsize=9)
            ax.set_xlabel("GPUs")
            ax.set_ylabel("step-time speedup (dashed: balance bound)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, title=f"red x: measured ({data['meta']['size']})", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
