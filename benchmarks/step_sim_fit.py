"""The step simulator's cost model, fitted on the committed long-tailed GPU runs, and its validation (issue 26).

Each committed ``results/e2e/<run>/e2e_bench.json`` records, per measured step, every rank's compute and optimizer
seconds and micro-batch count, and the plan's cost per rank; the samples themselves are not stored, but they are
seeded: ``replay`` draws them again (``odcfsdp.data.lengths``) and plans them with ``odcfsdp.data.balance`` under
the run's own cost model, and refuses a run whose recorded micro-batch counts or rank costs it does not reproduce.
Fit and prediction follow [step-sim] in ``step_sim.py``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from step_sim import TimeModel, _sizes, balance_bound, collective_step, minibatch_sizes, one_sided_step, overheads

from odcfsdp.data.balance import CostModel, plan_minibatch, rank_costs
from odcfsdp.data.lengths import LengthDistribution, longalign_lengths
from odcfsdp.models import llama_config

E2E = Path(__file__).resolve().parents[1] / "results" / "e2e"
PREDICTED = {("odc", "lb_mini"): "one_sided", ("odc", "lb_micro"): "one_sided", ("fsdp2", "lb_micro"): "collective"}
# Fit -> predict pairs: the same stack (host, kernels, compile) in another invocation, with other plans, other
# samples per GPU, or another GPU count. fcc8415's runs are left out: cuDNN built its per-shape plans inside the
# first timed method there (results/e2e/README.md), which no cost model of the step can carry.
VALIDATION = [
    ("n2_longtail_cudnn_compiled_d89966a", "n2_longtail_cudnn_costfit_compiled_93d573e",
     "cuDNN attention, compiled: FLOP-balanced plans -> time-balanced plans"),
    ("n2_longtail_cudnn_costfit_compiled_93d573e", "n2_longtail_cudnn_compiled_d89966a",
     "cuDNN attention, compiled: time-balanced plans -> FLOP-balanced plans"),
    ("n2_longtail_compiled_40df8df", "n2_longtail_b16_compiled_40df8df",
     "flash attention, compiled: 4 -> 8 samples per GPU"),
    ("n2_longtail_b16_compiled_40df8df", "n2_longtail_compiled_40df8df",
     "flash attention, compiled: 8 -> 4 samples per GPU"),
    ("n2_longtail_ba211a2", "n4_longtail_ba211a2", "flash attention, eager: 2 -> 4 GPUs"),
    ("n4_longtail_ba211a2", "n2_longtail_ba211a2", "flash attention, eager: 4 -> 2 GPUs"),
]


@dataclass
class Run:
    """One committed run replayed: per (method, balancer), per measured step, the plan's sizes and the timings."""

    name: str
    size: str
    world: int
    per_gpu: int
    cap: int
    steps: dict = field(default_factory=dict)  # (method, balance) -> [(sizes[rank][mb], step record)]


def replay(name: str) -> Run:
    """The run's measured steps with their plans drawn again; one-line error where the replay disagrees."""
    data = json.loads((E2E / name / "e2e_bench.json").read_text())
    meta, args = data["meta"], data["meta"]["args"]
    cfg = llama_config(meta["size"], args["vocab"])
    cost = CostModel.for_transformer(cfg.n_layers, cfg.dim, cfg.matmul_params(), args.get("attention_cost_factor", 1.0))
    sampler = LengthDistribution(longalign_lengths(args["cap"]), args["seed"])
    run = Run(name, meta["size"], meta["world_size"], meta["batch"] // meta["world_size"], args["cap"])
    for r in data["results"]:
        rows = []
        for st in r["steps"][meta["warmup"]:]:
            sizes = minibatch_sizes(sampler, args["cap"], st["step"] - 1, meta["batch"])
            plan = plan_minibatch(sizes, meta["world_size"], r["balance"], args["cap"], cost)
            got = rank_costs(plan, sizes, cost)
            if [len(p) for p in plan] != st["rank_micro_batches"] or any(
                    abs(g - w) > 1e-6 * w for g, w in zip(got, st["rank_cost"])):
                raise ValueError(f"{name}: step {st['step']} of {r['method']}/{r['balance']} does not replay with "
                                 f"today's odcfsdp.data (balancers or lengths changed); fit on a run that does")
            rows.append((_sizes(plan, sizes), st))
        run.steps[(r["method"], r["balance"])] = rows
    return run


@dataclass
class Fit:
    """A time model fitted on runs, the optimizer seconds at 2 GPUs by method, and how well it fits."""

    time: TimeModel
    opt_s: dict
    size: str
    runs: list
    points: int
    max_rel_residual: float

    def as_dict(self) -> dict:
        """JSON form."""
        return {"a": self.time.a, "b": self.time.b, "c": self.time.c, "h": self.time.h, "opt_s_at_2": self.opt_s, "size": self.size,
                "runs": self.runs, "points": self.points, "max_rel_residual": self.max_rel_residual}


def _features(rank: list[list[int]]) -> list[float]:
    return [float(sum(s * s for mb in rank for s in mb)), float(sum(s for mb in rank for s in mb)), float(len(rank))]


def host_floor(name: str) -> float:
    """Host-issue seconds per micro-batch of a committed run, the least over its methods (see [step-sim])."""
    data = json.loads((E2E / name / "e2e_bench.json").read_text())
    per = []
    for r in data["results"]:
        steps = [st for st in r["steps"][data["meta"]["warmup"]:] if "rank_host_s" in st]
        pairs = [(h, m) for st in steps for h, m in zip(st["rank_host_s"], st["rank_micro_batches"]) if m]
        if pairs:
            per.append(sum(h for h, _ in pairs) / sum(m for _, m in pairs))
    if not per:
        raise ValueError(f"{name} records no host-issue times (run before the host timer); name a later run")
    return min(per)


def fit(runs: list[Run], h: float = 0.0) -> Fit:
    """Least squares of one-sided ranks' compute seconds on (sum s^2, sum s, micro-batches), all terms >= 0."""
    if len({r.size for r in runs}) != 1:
        raise ValueError(f"runs of several model sizes {sorted({r.size for r in runs})}: fit one size at a time")
    x, y = [], []
    for run in runs:
        for (method, balance), rows in run.steps.items():
            if PREDICTED.get((method, balance)) == "one_sided":  # their ranks do not wait for each other
                for plan, st in rows:
                    x += [_features(rank) for rank in plan]
                    y += st["rank_compute_s"]
    if not x:
        raise ValueError(f"{[r.name for r in runs]} have no odc run to fit on")
    X, Y = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    scale = X.abs().amax(0).clamp_min(1.0)  # columns of similar size: s^2 sums are ~1e9
    keep = [0, 1, 2]
    while True:  # a negative term has no meaning (a rate or an overhead): drop it and fit the rest
        sol = torch.linalg.lstsq(X[:, keep] / scale[keep], Y[:, None]).solution[:, 0] / scale[keep]
        if (sol >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(sol.argmin()))
    coef = [0.0, 0.0, 0.0]
    for j, v in zip(keep, sol.tolist()):
        coef[j] = max(v, 0.0)
    residual = ((X @ torch.tensor(coef, dtype=torch.float64) - Y).abs() / Y).max().item()
    opt = {}
    for method in ("odc", "fsdp2"):  # the last rank to finish waits for no one: its step seconds are the step's
        vals = [min(st["rank_step_s"]) * run.world / 2 for run in runs for (m, _), rows in run.steps.items()
                if m == method for _, st in rows]
        opt[method] = sum(vals) / len(vals)
    return Fit(TimeModel(*coef, h), opt, runs[0].size, [r.name for r in runs], len(y), residual)


def fit_runs(names: list[str], host_run: str) -> Fit:
    """``fit`` over the named committed runs, with the host floor of ``host_run``."""
    return fit([replay(n) for n in names], host_floor(host_run))


def for_size(f: Fit, size: str) -> tuple[TimeModel, int, dict]:
    """The fit's time model for ``size`` (the fit's own, or its rates scaled by attention / matmul FLOPs), the
    size's parameter count, and the optimizer seconds at 2 GPUs (scaled by the parameter count)."""
    mine, other = llama_config(f.size, 32000), llama_config(size, 32000)
    att = (other.n_layers * other.dim) / (mine.n_layers * mine.dim)
    layers = other.n_layers / mine.n_layers
    opt = {k: v * other.num_params() / mine.num_params() for k, v in f.opt_s.items()}
    return f.time.scaled(att, other.matmul_params() / mine.matmul_params(), layers), other.num_params(), opt


def predict(run: Run, f: Fit, nccl_gbps: float = 360.0) -> dict:
    """Mean predicted step seconds of the run's methods over its measured steps, and the mean balance bound."""
    over = overheads(run.world, llama_config(run.size, 32000).num_params(), f.opt_s, nccl_gbps)
    out = {}
    for key, how in PREDICTED.items():
        if key not in run.steps:
            continue
        step = one_sided_step if how == "one_sided" else collective_step
        rows = run.steps[key]
        out[key] = sum(step(plan, f.time, over.floor[key[0]], over.opt_s[key[0]]) for plan, _ in rows) / len(rows)
        if key == ("odc", "lb_mini"):
            sizes = [[s for rank in plan for mb in rank for s in mb] for plan, _ in rows]
            out["bound"] = sum(balance_bound(s, run.world, run.cap, f.time, min(over.opt_s.values()))
                               for s in sizes) / len(rows)
    return out


def measured_step(run: Run, key: tuple[str, str]) -> float:
    """The run's mean measured step seconds of one method (its warm-up excluded, as e2e_bench's figures)."""
    rows = run.steps[key]
    return sum(st["step_s"] for _, st in rows) / len(rows)


def validate(pairs=VALIDATION, host_run: str = "n2_balanced_cudnn_compiled_d89966a", nccl_gbps: float = 360.0) -> dict:
    """Each pair: fit on the first run, predict the second; errors of step times and of ODC's speedups."""
    runs = functools.cache(replay)  # each run replayed once

    host = host_floor(host_run)
    rows, fits = [], {}
    for fit_name, target, what in pairs:
        f = fit([runs(fit_name)], host)
        fits[fit_name] = f.as_dict()
        run = runs(target)
        pred = predict(run, f, nccl_gbps)
        base = {"fit": fit_name, "target": target, "what": what, "gpus": run.world, "samples_per_gpu": run.per_gpu}
        for key in PREDICTED:
            if key in run.steps:
                m, p = measured_step(run, key), pred[key]
                rows.append({**base, "quantity": f"{key[0]} + {key[1]} step s", "measured": m, "predicted": p,
                             "error": p / m - 1})
        for other, label in ((("fsdp2", "lb_micro"), "speedup: odc lb_mini over fsdp2 lb_micro"),
                             (("odc", "lb_micro"), "speedup: odc lb_mini over odc lb_micro")):
            m = measured_step(run, other) / measured_step(run, ("odc", "lb_mini"))
            p = pred[other] / pred[("odc", "lb_mini")]
            rows.append({**base, "quantity": label, "measured": m, "predicted": p, "error": p / m - 1})
        m = measured_step(run, ("odc", "lb_mini")) / pred["bound"]
        rows.append({**base, "quantity": "odc lb_mini step / balance bound", "measured": m,
                     "predicted": pred[("odc", "lb_mini")] / pred["bound"], "error": pred[("odc", "lb_mini")] /
                     pred["bound"] / m - 1})
    return {"fits": fits, "rows": rows}


def measured_speedups() -> list[dict]:
    """ODC + LB-Mini over FSDP2 + LB-Micro in each run the validation uses (the chart's measured points)."""
    out = []
    for name in dict.fromkeys(n for pair in VALIDATION for n in pair[:2]):
        run = replay(name)
        out.append({"run": name, "gpus": run.world, "samples_per_gpu": run.per_gpu, "size": run.size,
                    "speedup_vs_lb_micro": measured_step(run, ("fsdp2", "lb_micro"))
                    / measured_step(run, ("odc", "lb_mini"))})
    return out
