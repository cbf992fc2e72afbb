"""Charts of a run: ``python -m odcfsdp.plot RUN_DIR [--out DIR]`` (needs matplotlib).

Writes ``loss.png`` (loss per step, the held-out ``eval_loss`` where the run evaluated, and the
gradient norm) and ``ranks.png`` (per rank:
time computing its micro-batches vs time waiting for the others at the optimizer
step, summed over the steps after warm-up) next to the run's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .metrics import read_metrics


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, warmup: int = 0) -> list[Path]:
    """Write the charts of ``run_dir``; return their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')") from e
    rows = read_metrics(run_dir)
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]

    fig, ax = plt.subplots(figsize=(7, 4))
    nan = float("nan")
    ax.plot(steps, [nan if r["loss"] is None else r["loss"] for r in rows], label="loss")
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if evals:  # run.eval_interval: the held-out loss, on the training loss's axis
        ax.plot(*zip(*evals), "o-", color="tab:green", label="eval loss (held out)")
    bad = [r["step"] for r in rows if r.get("nonfinite")]
    for k, step in enumerate(bad):  # minibatches whose update was not applied (non-finite loss or gradient)
        ax.axvline(step, color="tab:red", alpha=0.4, lw=1, label="non-finite (skipped)" if k == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (per target token)")
    ax2 = ax.twinx()
    ax2.plot(steps, [nan if r["grad_norm"] is None else r["grad_norm"] for r in rows], color="tab:orange",
             alpha=0.6, label="grad norm")
    ax2.set_ylabel("gradient norm (pre-clip)")
    fig.legend(loc="upper right")
    ax.set_title(f"{Path(run_dir).name}: loss")
    fig.tight_layout()
    loss_png = out / "loss.png"
    fig.savefig(loss_png, dpi=120)
    plt.close(fig)

    kept = rows[warmup:] or rows
    n = len(kept[0]["rank_compute_s"])
    compute = [sum(r["rank_compute_s"][k] for r in kept) for k in range(n)]
    wait = [sum(r["rank_wait_s"][k] for r in kept) for k in range(n)]
    fig, ax = plt.subplots(figsize=(max(4, 1 + 0.8 * n), 4))
    ax.bar(range(n), compute, label="compute (forward + backward)")
    ax.bar(range(n), wait, bottom=compute, label="wait at the step")
    ax.set_xticks(range(n))
    ax.set_xlabel("rank")
    ax.set_ylabel(f"seconds over steps {kept[0]['step']}-{kept[-1]['step']}")
    ax.set_title("per-rank compute vs wait")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=1, frameon=False)
    fig.tight_layout()
    ranks_png = out / "ranks.png"
    fig.savefig(ranks_png, dpi=120)
    plt.close(fig)
    return [loss_png, ranks_png]


def main() -> None:
    """Console-script entry point (``odcfsdp-plot``)."""
    parser = argparse.ArgumentParser(description="Plot a run's metrics as PNG charts.")
    parser.add_argument("run_dir", help="directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="where to write the PNGs (default: the run directory)")
    parser.add_argument("--warmup", type=int, default=0, help="steps left out of the per-rank chart")
    args = parser.parse_args()
    try:
        paths = plot_run(args.run_dir, args.out, args.warmup)
    except (ImportError, FileNotFoundError) as e:  # no matplotlib, no run: one line naming the fix
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
