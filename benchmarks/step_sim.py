"""Step-time simulator's command line: the sweep, or ``--validate`` (the refit); the model and its design note
[step-sim] are ``step_sim_model``'s, the fit ``step_sim_fit``'s, the reports ``step_sim_report``'s.

    python -m benchmarks.step_sim --size 8b --out results/sim/<name>      # the sweep (JSON + markdown + chart)
    python -m benchmarks.step_sim --validate --size 8b --out results/sim/<name>   # refit + revalidate
    python -m benchmarks.step_sim --predict --size 8b --gpus 8 --per-gpu 4 --seeds 0 1 --out results/sim/<name>
        # planned e2e runs priced before they run (step_sim_predict)

Imports run one way: step_sim -> step_sim_fit -> step_sim_model (and step_sim -> step_sim_model, step_sim_report).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from benchmarks import harness, step_sim_fit, step_sim_predict, step_sim_report
from benchmarks.step_sim_model import DISTRIBUTIONS, overheads, simulate


def parse(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--validate", action="store_true", help="refit on the committed runs and predict them (in-sample, "
                   "held out, same stream) instead of sweeping: step_sim_fit.refit")
    p.add_argument("--fit", nargs="+", default=None, help="results/e2e long-tailed runs whose one-sided ranks fit "
                   "the time model (pooled); default: the size's setup (step_sim_fit.SETUPS)")
    p.add_argument("--host-run", default=None, help="results/e2e balanced run whose host-issue seconds per "
                   "micro-batch give the host floor h; default: the size's setup")
    p.add_argument("--held-out", nargs="+", default=[], help="--validate: more held-out runs, priced by the fit")
    p.add_argument("--predict", action="store_true", help="price planned e2e_bench runs (--gpus, --per-gpu, --seeds, "
                   "--workload, --steps, --warmup) before they run: step_sim_predict")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="--predict: the runs' --seed values")
    p.add_argument("--workload", choices=["longtail", "balanced"], default="longtail", help="--predict: the runs'")
    p.add_argument("--steps", type=int, default=3, help="--predict: the runs' measured steps")
    p.add_argument("--warmup", type=int, default=1, help="--predict: the runs' warm-up steps")
    p.add_argument("--methods", nargs="+", default=["fsdp2", "fsdp2_nosync", "odc"],
                   choices=["fsdp2", "fsdp2_nosync", "odc"], help="--predict: the runs' methods")
    p.add_argument("--size", default="1b", help="model size priced: its setup's fit, or --fit's scaled by FLOPs")
    p.add_argument("--distributions", nargs="+", default=list(DISTRIBUTIONS), choices=list(DISTRIBUTIONS))
    p.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--per-gpu", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="samples per GPU per minibatch")
    p.add_argument("--samples", type=int, default=2048, help="samples simulated per point (8..64 minibatches)")
    p.add_argument("--study", action="store_true", help="also price LB-Mini's alternatives (Karmarkar-Karp, ...)")
    p.add_argument("--nccl-gbps", type=float, default=360.0, help="NCCL bus GB/s inside a node (cost model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if any(n < 1 or (n > 8 and n % 8) for n in args.gpus):
        p.error("--gpus: 1..8, or a multiple of 8 (8 GPUs per node beyond one node)")
    if args.held_out and not args.validate:
        p.error("--held-out: with --validate (held-out runs are priced, not swept)")
    if args.predict and "odc" not in args.methods:
        p.error("--predict --methods: odc among them (each row is ODC's speedup over the others)")
    if args.predict and args.validate:
        p.error("--predict and --validate: one at a time (--validate prices committed runs, --predict planned ones)")
    setup = step_sim_fit.SETUPS.get(args.size)
    if setup is None and (args.validate or not (args.fit and args.host_run)):
        p.error(f"--size {args.size}: no fit setup ({', '.join(step_sim_fit.SETUPS)}); name --fit and --host-run")
    if not args.validate:
        args.fit, args.host_run = args.fit or list(setup.fit), args.host_run or setup.host_run
    args.command = harness.command(__name__, argv)
    return args


def main(argv=None) -> dict:
    """Sweep (or ``--validate``) and write ``step_sim.json`` / ``step_sim.md`` (+ ``step_sim.png``) under ``--out``."""
    args = parse(argv)
    meta = harness.meta(harness.provenance.default_commit(), args.command, "none: a model, not a measurement")
    if args.validate:
        try:
            found = step_sim_fit.refit(args.size, tuple(args.held_out), tuple(args.fit or ()), args.host_run,
                                       args.nccl_gbps)
        except ValueError as e:  # a refused held-out pair or a run that does not replay: one line
            sys.exit(f"step_sim --validate: {e}")
        data = {"meta": meta, **found}
        text = step_sim_report.validation_markdown(data)
        tables = {k: v for k, v in found.items() if k != "fit_rows"}  # rows: the fit's; held out etc. beside
        harness.write_result(args.out, "step_sim", meta, found["fit_rows"], text, **tables)
    elif args.predict:
        data = predict(args, meta)
        text = step_sim_report.prediction_markdown(data)
        harness.write_result(args.out, "step_sim", data["meta"], data["rows"], text)
    else:
        fit = step_sim_fit.fit_runs(args.fit, args.host_run)
        tm, params, opt2 = step_sim_fit.for_size(fit, args.size)
        meta.update(fit=fit.as_dict(), size=args.size, time_model=vars(tm), opt_s_at_2=opt2, scaled=tm != fit.time,
                    distributions={d: DISTRIBUTIONS[d].source for d in args.distributions})
        points = []
        over = {n: overheads(n, params, opt2, args.nccl_gbps) for n in args.gpus}  # measured rates read once per N
        for d, n, k in itertools.product(args.distributions, args.gpus, args.per_gpu):
            count = min(64, max(8, args.samples // (n * k)))
            points.append(simulate(DISTRIBUTIONS[d], n, k, tm, over[n], count, args.seed, args.study))
        known = step_sim_fit.setup_runs(args.size) if args.size in step_sim_fit.SETUPS else []  # the size's runs
        measured = step_sim_fit.measured_speedups(known)
        text = step_sim_report.sweep_markdown({"meta": meta, "rows": points, "measured": measured})
        data = harness.write_result(args.out, "step_sim", meta, points, text, measured=measured)
        chart = step_sim_report.chart(data, args.out / "step_sim.png")
        if chart is None:  # no matplotlib: the chart's data is the JSON's rows
            print("matplotlib is not installed: no chart (its data is step_sim.json's rows)")
    print(text)
    return data


def predict(args, meta: dict) -> dict:
    """``--predict``: every (GPU count, samples per GPU, seed) run planned and priced by the fit."""
    fit = step_sim_fit.fit_runs(args.fit, args.host_run)
    per_gpu = " ".join(map(str, args.per_gpu))
    meta.update(fit=fit.as_dict(), size=args.size, gpus=args.gpus, workload=args.workload,
                e2e_command=f"python -m benchmarks.e2e_bench --isolate --size {args.size} --workloads {args.workload} "
                            f"--batch <GPUs x {per_gpu}> --seed <seed> --steps {args.steps} --warmup {args.warmup} "
                            f"--activation-checkpointing --compile --methods {' '.join(args.methods)}"
                            + (" --balancers lb_mini" if args.workload == "longtail" else ""))
    rows = []
    for n, k, seed in itertools.product(args.gpus, args.per_gpu, args.seeds):
        run = step_sim_predict.planned_run(args.size, n, k, seed, args.steps, args.warmup, args.workload,
                                           methods=args.methods)
        rows += step_sim_predict.prediction_rows(run, fit, args.workload, args.nccl_gbps)
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
