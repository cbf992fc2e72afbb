"""The step simulator's cost model, fitted on committed GPU runs, and its validation (issues 26 and 31).

    refit("8b")                                                   # in Python: refit, revalidate, from committed runs
    python -m benchmarks.step_sim --validate --size 8b --out results/sim/validate_8b    # the same, written out
    python -m benchmarks.step_sim --validate --size 8b --held-out <run> --out ...         # a new held-out run too

``refit(size)`` is the one entry point that refits and revalidates: it replays the size's fit runs
(``SETUPS[size].fit``), fits the time model on them, prices their own steps (the *fit* table, in-sample), prices
each held-out run from the fit (``SETUPS[size].held_out`` and ``extra_held_out``; the *held-out* table) and each
same-stream cross-check (``SETUPS[size].same_stream``). The sweep (``step_sim`` without ``--validate``) fits
the same runs by default, so the sweep and its validation cannot drift apart.

Held out means another data stream: a target with the fit run's seed and samples per GPU (same length
distribution and cap) draws the same samples, grouped the same (or, at another GPU count, regrouped), so it
checks the stack, not the model's reach; ``check_held_out`` refuses such a pair (and a run with itself) as
held-out in one line, and the refusal is what the same-stream table gives as the reason. Every speedup row also
carries the error in the gain (speedup - 1): ``gain_errors`` (percentage points and relative).

Each committed ``results/e2e/<run>/e2e_bench.json`` records, per measured step, every rank's compute and optimizer
seconds and micro-batch count, and the plan's cost per rank; the samples themselves are not stored, but they are
seeded: ``replay`` draws them again (``odcfsdp.data.lengths``) and plans them with ``odcfsdp.data.balance`` under
the run's own cost model (the model's shape from ``e2e_hf.bench_model``: our Llama or an HF model), and refuses a
run whose recorded micro-batch counts or rank costs it does not reproduce. Fit and prediction follow [step-sim]
in ``step_sim_model.py``.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.step_sim_model import (TimeModel, _sizes, balance_bound, collective_step, minibatch_sizes,
                                       one_sided_step, overheads)

from odcfsdp.data.balance import CostModel, plan_minibatch, rank_costs
from odcfsdp.data.lengths import LengthDistribution, longalign_lengths
from odcfsdp.models import llama_config

E2E = Path(__file__).resolve().parents[1] / "results" / "e2e"
# (method, balancer) -> how its ranks meet ([step-sim]). fsdp2_nosync (FSDP2's gradient accumulation: no
# reduce-scatter before the last micro-batch) still re-gathers every layer for each micro-batch's backward
# (layers reshard after forward): collective per micro-batch too. hf_*: the same wrapping of an HF model.
PREDICTED = {("odc", "lb_mini"): "one_sided", ("odc", "lb_micro"): "one_sided", ("fsdp2", "lb_micro"): "collective",
             ("fsdp2_nosync", "lb_micro"): "collective", ("hf_fsdp2", "lb_micro"): "collective",
             ("hf_fsdp2_nosync", "lb_micro"): "collective"}
FAMILY = {"odc": "odc", "fsdp2": "fsdp2", "fsdp2_nosync": "fsdp2", "hf_fsdp2": "fsdp2", "hf_fsdp2_nosync": "fsdp2"}
MINI = ("odc", "lb_mini")


@dataclass(frozen=True)
class Setup:
    """A size's fit runs, its host-floor run, held-out pairs and same-stream checks: (fit runs, target, what)."""

    fit: tuple[str, ...]
    host_run: str
    held_out: tuple = ()
    same_stream: tuple = ()
    pending: str = ""  # where the next held-out run comes from, while none is committed


# fcc8415's runs are left out: cuDNN built its per-shape plans inside the first timed method there
# (results/e2e/README.md), which no cost model of the step can carry.
_CUDNN, _COSTFIT = "n2_longtail_cudnn_compiled_d89966a", "n2_longtail_cudnn_costfit_compiled_93d573e"
_FLASH4, _FLASH8 = "n2_longtail_compiled_40df8df", "n2_longtail_b16_compiled_40df8df"
_N2, _N4 = "n2_longtail_ba211a2", "n4_longtail_ba211a2"
_8B, _HF8B = "n2_8b_longtail_memory_949626a", "n2_hf_8b_longtail_9921c73"
SETUPS = {
    "1b": Setup((_COSTFIT,), "n2_balanced_cudnn_compiled_d89966a",
                held_out=(((_FLASH4,), _FLASH8, "flash attention, compiled: 4 -> 8 samples per GPU"),
                          ((_FLASH8,), _FLASH4, "flash attention, compiled: 8 -> 4 samples per GPU")),
                same_stream=(((_CUDNN,), _COSTFIT, "cuDNN attention, compiled: FLOP-balanced -> time-balanced plans"),
                             ((_COSTFIT,), _CUDNN, "cuDNN attention, compiled: time-balanced -> FLOP-balanced plans"),
                             ((_N2,), _N4, "flash attention, eager: 2 -> 4 GPUs"),
                             ((_N4,), _N2, "flash attention, eager: 4 -> 2 GPUs"))),
    # today's engine (949626a / 9921c73, 2 H200s, compiled layers + recomputation); no 8B run of another stream yet
    "8b": Setup((_8B,), "n2_8b_balanced_memory_949626a",
                same_stream=(((_8B,), _HF8B, "HF LlamaForCausalLM (transformers' modelling code), vocabulary "
                              "128256 (LM head 4x), hf_fsdp2 baselines; the same seeded lengths: the fit's steps 2-3, "
                              "and step 4"),),
                pending="gpu_suite.sh's `sim_heldout_8b` (seed 1, 2 samples per GPU) is the next held-out run: once "
                        "committed, `--validate --size 8b --held-out <its results/e2e folder>` prices it."),
}


@dataclass
class Run:
    """One committed run replayed: per (method, balancer), per measured step, the plan's sizes and the timings."""

    name: str
    model: str  # e2e_bench's label, e.g. "Llama 8b" or "HF llama3-8b (LlamaForCausalLM)"
    shape: tuple  # (layers, dim, matmul params, params): what the time model scales by
    world: int
    per_gpu: int
    cap: int
    seed: int
    steps: dict = field(default_factory=dict)  # (method, balance) -> [(sizes[rank][mb], step record)]


def model_shape(args: dict) -> tuple[str, tuple]:
    """The run's model label and (layers, dim, matmul params, params), as e2e_bench built it (``bench_model``)."""
    from benchmarks import e2e_hf

    ns = argparse.Namespace(model=args.get("model") or "llama", model_path=args.get("model_path"),
                            size=args.get("size", "1b"), vocab=args["vocab"], activation_checkpointing=False,
                            compile="", attention="auto")
    try:
        bm = e2e_hf.bench_model(ns)
    except ImportError as e:
        raise ValueError(f"replaying {ns.model} needs its model code ({e}); install the test extra") from e
    return bm.label, (bm.layers, bm.dim, bm.matmul_params, bm.params)


def replay(name: str) -> Run:
    """The run's measured steps with their plans drawn again; one-line error where the replay disagrees."""
    data = harness.load_result(E2E / name / "e2e_bench.json")  # committed runs: "results"
    meta, args = data["meta"], data["meta"]["args"]
    label, shape = model_shape(args)
    cost = CostModel.for_transformer(shape[0], shape[1], shape[2], args.get("attention_cost_factor", 1.0))
    sampler = LengthDistribution(longalign_lengths(args["cap"]), args["seed"])
    run = Run(name, label, shape, meta["world_size"], meta["batch"] // meta["world_size"], args["cap"], args["seed"])
    for r in data["rows"]:
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


def check_held_out(fit_runs: list[Run], target: Run) -> None:
    """One-line ``ValueError`` where ``target`` is not held out from ``fit_runs``: the same run, or the same seed
    and samples per GPU under the same length cap (the same seeded samples, so the same data stream)."""
    for f in fit_runs:
        if f.name == target.name:
            raise ValueError(f"not held out: {target.name} is a fit run itself")
        if (f.seed, f.per_gpu, f.cap) == (target.seed, target.per_gpu, target.cap):
            raise ValueError(f"not held out: {target.name} has {f.name}'s seed {f.seed} and {f.per_gpu} samples "
                             f"per GPU (cap {f.cap}): the same data stream")


def gain_errors(predicted: float, measured: float) -> tuple[float, float | None]:
    """Error in the gain of a speedup (gain = speedup - 1): ``(s_pred - 1) - (s_meas - 1)`` in percentage points,
    and ``(s_pred - 1) / (s_meas - 1) - 1`` (``None`` where the measured gain is 0)."""
    gain = measured - 1.0
    return 100.0 * (predicted - measured), (None if gain == 0 else (predicted - 1.0) / gain - 1.0)


@dataclass
class Fit:
    """A time model fitted on runs, the optimizer seconds at 2 GPUs by method family, and how well it fits."""

    time: TimeModel
    opt_s: dict
    shape: tuple
    model: str
    runs: list
    points: int
    max_rel_residual: float

    def as_dict(self) -> dict:
        """JSON form."""
        return {"a": self.time.a, "b": self.time.b, "c": self.time.c, "h": self.time.h, "opt_s_at_2": self.opt_s,
                "model": self.model, "shape": list(self.shape), "runs": self.runs, "points": self.points,
                "max_rel_residual": self.max_rel_residual}


def _features(rank: list[list[int]]) -> list[float]:
    return [float(sum(s * s for mb in rank for s in mb)), float(sum(s for mb in rank for s in mb)), float(len(rank))]


def host_floor(name: str) -> float:
    """Host-issue seconds per micro-batch of a committed run, the least over its methods (see [step-sim])."""
    data = harness.load_result(E2E / name / "e2e_bench.json")  # committed runs: "results"
    per = []
    for r in data["rows"]:
        steps = [st for st in r["steps"][data["meta"]["warmup"]:] if "rank_host_s" in st]
        pairs = [(h, m) for st in steps for h, m in zip(st["rank_host_s"], st["rank_micro_batches"]) if m]
        if pairs:
            per.append(sum(h for h, _ in pairs) / sum(m for _, m in pairs))
    if not per:
        raise ValueError(f"{name} records no host-issue times (run before the host timer); name a later run")
    return min(per)


def fit(runs: list[Run], h: float = 0.0) -> Fit:
    """Least squares of one-sided ranks' compute seconds on (sum s^2, sum s, micro-batches), all terms >= 0."""
    if len({r.shape for r in runs}) != 1:
        raise ValueError(f"runs of several model shapes {sorted({r.model for r in runs})}: fit one at a time")
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
    for family in ("odc", "fsdp2"):  # the last rank to finish waits for no one: its step seconds are the step's
        vals = [min(st["rank_step_s"]) * run.world / 2 for run in runs for (m, _), rows in run.steps.items()
                if FAMILY.get(m) == family for _, st in rows]
        opt[family] = sum(vals) / len(vals)
    return Fit(TimeModel(*coef, h), opt, runs[0].shape, runs[0].model, [r.name for r in runs], len(y), residual)


def fit_runs(names: list[str], host_run: str) -> Fit:
    """``fit`` over the named committed runs, with the host floor of ``host_run``."""
    return fit([replay(n) for n in names], host_floor(host_run))


def scaled(f: Fit, shape: tuple) -> tuple[TimeModel, dict]:
    """The fit's time model and optimizer seconds at 2 GPUs for a model of ``shape`` (layers, dim, matmul params,
    params): attention rates by layers x dim, matmul rates by matmul parameters, the host floor by layers, the
    optimizer by parameters; the fit's own where the shape is its own."""
    (l0, d0, m0, p0), (l1, d1, m1, p1) = f.shape, shape
    return f.time.scaled(l1 * d1 / (l0 * d0), m1 / m0, l1 / l0), {k: v * p1 / p0 for k, v in f.opt_s.items()}


def for_size(f: Fit, size: str) -> tuple[TimeModel, int, dict]:
    """The fit's time model for our Llama of ``size`` (vocabulary 32000), its parameter count, and the optimizer
    seconds at 2 GPUs (see ``scaled``)."""
    cfg = llama_config(size, 32000)
    tm, opt = scaled(f, (cfg.n_layers, cfg.dim, cfg.matmul_params(), cfg.num_params()))
    return tm, cfg.num_params(), opt


def predict(run: Run, f: Fit, nccl_gbps: float = 360.0) -> dict:
    """Mean predicted step seconds of the run's methods over its measured steps, and the mean balance bound."""
    tm, opt2 = scaled(f, run.shape)
    over = overheads(run.world, run.shape[3], opt2, nccl_gbps)
    out = {}
    for key, how in PREDICTED.items():
        if key not in run.steps:
            continue
        step = one_sided_step if how == "one_sided" else collective_step
        fam, rows = FAMILY[key[0]], run.steps[key]
        out[key] = sum(step(plan, tm, over.floor[fam], over.opt_s[fam]) for plan, _ in rows) / len(rows)
        if key == MINI:
            sizes = [[s for rank in plan for mb in rank for s in mb] for plan, _ in rows]
            out["bound"] = sum(balance_bound(s, run.world, run.cap, tm, min(over.opt_s.values()))
                               for s in sizes) / len(rows)
    return out


def measured_step(run: Run, key: tuple[str, str]) -> float:
    """The run's mean measured step seconds of one method (its warm-up excluded, as e2e_bench's figures)."""
    rows = run.steps[key]
    return sum(st["step_s"] for _, st in rows) / len(rows)


def rows_for(run: Run, f: Fit, what: str, nccl_gbps: float = 360.0, note: str = "") -> list[dict]:
    """``run`` priced by ``f``: every predicted method's step, ODC + LB-Mini's speedup over each other one (with
    ``gain_errors``), and LB-Mini's step over the balance bound; ``error`` = predicted / measured - 1."""
    pred = predict(run, f, nccl_gbps)
    base = {"fit": " + ".join(f.runs), "target": run.name, "what": what, "note": note, "model": run.model,
            "gpus": run.world, "samples_per_gpu": run.per_gpu, "seed": run.seed, "gain_pp": None, "gain_rel": None}
    rows = []

    def row(quantity: str, m: float, p: float, speedup: bool = False) -> None:
        gains = dict(zip(("gain_pp", "gain_rel"), gain_errors(p, m))) if speedup else {}
        rows.append({**base, "quantity": quantity, "measured": m, "predicted": p, "error": p / m - 1, **gains})

    keys = [k for k in PREDICTED if k in run.steps]
    for key in keys:
        row(f"{key[0]} + {key[1]} step s", measured_step(run, key), pred[key])
    if MINI in run.steps:
        for other in (k for k in keys if k != MINI):
            row(f"speedup: odc lb_mini over {other[0]} {other[1]}",
                measured_step(run, other) / measured_step(run, MINI), pred[other] / pred[MINI], speedup=True)
        row("odc lb_mini step / balance bound", measured_step(run, MINI) / pred["bound"], pred[MINI] / pred["bound"])
    return rows


def refit(size: str = "1b", extra_held_out: tuple = (), fit_names: tuple = (), host_run: str | None = None,
          nccl_gbps: float = 360.0) -> dict:
    """The entry point: refit ``SETUPS[size]`` (or ``fit_names``) on the committed runs and revalidate it.

    Returns ``fit`` (the fit, as JSON), ``fit_rows`` (its own runs priced: in-sample), ``held_out_rows`` (each
    held-out pair; ``extra_held_out`` targets are priced from the size's fit), ``same_stream_rows`` and ``fits``
    (every pair's fit). A held-out pair that is not held out (``check_held_out``) raises its one-line error.
    """
    setup = SETUPS[size]
    runs = functools.cache(replay)  # each run replayed once
    host = host_floor(host_run or setup.host_run)
    names = tuple(fit_names) or setup.fit
    main = fit([runs(n) for n in names], host)
    fits = {" + ".join(names): main}

    def fit_of(group: tuple) -> Fit:
        key = " + ".join(group)
        if key not in fits:
            fits[key] = fit([runs(n) for n in group], host)
        return fits[key]

    out = {"size": size, "fit": main.as_dict(), "host_run": host_run or setup.host_run, "pending": setup.pending,
           "fit_rows": [],
           "held_out_rows": [], "same_stream_rows": []}
    for n in names:
        out["fit_rows"] += rows_for(runs(n), main, "in-sample: the fit's own steps", nccl_gbps)
    held = [*setup.held_out, *((names, t, "named with --held-out") for t in extra_held_out)]
    for group, target, what in held:
        check_held_out([runs(n) for n in group], runs(target))
    for group, target, what in held:
        out["held_out_rows"] += rows_for(runs(target), fit_of(tuple(group)), what, nccl_gbps)
    for group, target, what in setup.same_stream:
        try:
            check_held_out([runs(n) for n in group], runs(target))
            note = ""
        except ValueError as e:
            note = str(e)
        out["same_stream_rows"] += rows_for(runs(target), fit_of(tuple(group)), what, nccl_gbps, note)
    out["fits"] = {k: v.as_dict() for k, v in fits.items()}
    return out


def measured_speedups(names: list[str]) -> list[dict]:
    """ODC + LB-Mini over each run's FSDP2 + LB-Micro (fsdp2 or hf_fsdp2): the chart's measured points."""
    out = []
    for name in dict.fromkeys(names):
        run = replay(name)
        base = next((k for k in (("fsdp2", "lb_micro"), ("hf_fsdp2", "lb_micro")) if k in run.steps), None)
        if base is None or MINI not in run.steps:
            continue
        out.append({"run": name, "model": run.model, "gpus": run.world, "samples_per_gpu": run.per_gpu,
                    "seed": run.seed, "baseline": base[0],
                    "speedup_vs_lb_micro": measured_step(run, base) / measured_step(run, MINI)})
    return out


def setup_runs(size: str) -> list[str]:
    """Every run a size's setup names (fit, held-out and same-stream targets), in order."""
    s = SETUPS[size]
    return list(dict.fromkeys([*s.fit, *(n for g, t, _ in (*s.held_out, *s.same_stream) for n in (*g, t))]))
