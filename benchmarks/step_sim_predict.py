"""Predictions of planned e2e runs, written down before the runs (issue 45): the exact minibatches a run of
``benchmarks/e2e_bench.py`` will draw, planned by its balancers and priced by a size's fit ([step-sim]).

    python -m benchmarks.step_sim --predict --size 8b --gpus 8 --per-gpu 4 --seeds 0 1 --out results/sim/<name>

A planned run is what ``replay`` makes of a committed one, without its timings: the same seeded lengths
(``minibatch_sizes``), the same plans (``plan_minibatch`` with e2e_bench's cost model), for the measured steps
after the warm-up. Once the run is committed, ``--validate --held-out <its folder>`` prices it again from the same
fit and puts the prediction against the measurement. The balanced workload (every sample ``seq`` tokens, one per
micro-batch) is priced the same way; there the model has only the methods' floors and optimizer steps to tell
them apart.
"""

from __future__ import annotations

import statistics

from benchmarks.step_sim_fit import FAMILY, MINI, PREDICTED, Fit, Run, model_shape, scaled
from benchmarks.step_sim_model import (_sizes, balance_bound, collective_step, minibatch_sizes, one_sided_step,
                                       overheads)
from odcfsdp.data.balance import CostModel, plan_minibatch
from odcfsdp.data.lengths import LengthDistribution, longalign_lengths

#: the methods a planned run prices: ODC with LB-Mini against FSDP2 with LB-Micro, and with sync off until the last
#: micro-batch (the baselines issue 45 names)
PLANNED = (MINI, ("fsdp2", "lb_micro"), ("fsdp2_nosync", "lb_micro"))


def planned_run(size: str, world: int, per_gpu: int, seed: int, steps: int, warmup: int, workload: str = "longtail",
                cap: int = 65536, seq: int = 4096, methods: tuple = ("fsdp2", "fsdp2_nosync", "odc")) -> Run:
    """The run ``e2e_bench --size SIZE --workloads WORKLOAD --batch WORLD*PER_GPU --seed SEED --steps STEPS
    --warmup WARMUP --methods METHODS`` will make on WORLD GPUs, its measured steps planned (no timings)."""
    label, shape = model_shape({"size": size, "vocab": 32000})
    cost = CostModel.for_transformer(shape[0], shape[1], shape[2])
    batch = world * per_gpu
    if workload == "balanced":  # e2e_bench: fixed lengths, one sample per micro-batch
        cap, draw = seq, (lambda step: [seq] * batch)
    else:
        sampler = LengthDistribution(longalign_lengths(cap), seed)
        draw = (lambda step: minibatch_sizes(sampler, cap, step, batch))  # noqa: E731 - the sampler is seeded
    run = Run(f"planned: {workload}, {size}, {world} GPUs, {per_gpu} per GPU, seed {seed}", label, shape, world,
              per_gpu, cap, seed)
    for method, balance in (k for k in PLANNED if k[0] in methods):
        balance = balance if workload == "longtail" else "lb_micro"  # e2e_bench: lb_mini only on long-tailed data
        rows = []
        for step in range(warmup + 1, warmup + steps + 1):
            sizes = draw(step - 1)
            rows.append((_sizes(plan_minibatch(sizes, world, balance, cap, cost), sizes), {"step": step}))
        run.steps[(method, balance)] = rows
    return run


def priced_steps(run: Run, f: Fit, nccl_gbps: float = 360.0) -> dict:
    """Each planned method's predicted seconds, step by step, and the balance bound's (key ``bound``)."""
    tm, opt2 = scaled(f, run.shape)
    over = overheads(run.world, run.shape[3], opt2, nccl_gbps)
    out = {}
    for key, rows in run.steps.items():
        step = one_sided_step if PREDICTED[key] == "one_sided" else collective_step
        out[key] = [step(plan, tm, over.floor[FAMILY[key[0]]], over.opt_s[FAMILY[key[0]]]) for plan, _ in rows]
    first = next(iter(run.steps.values()))
    out["bound"] = [balance_bound([s for rank in plan for mb in rank for s in mb], run.world, run.cap, tm,
                                  min(over.opt_s.values())) for plan, _ in first]
    return out


def prediction_rows(run: Run, f: Fit, workload: str, nccl_gbps: float = 360.0) -> list[dict]:
    """One row per planned method: its predicted step seconds by step and their mean; for ODC, its speedup over
    each other method as the mean ratio and as the median of the per-step ratios (how e2e_bench reports it)."""
    priced = priced_steps(run, f, nccl_gbps)
    odc = next(k for k in run.steps if k[0] == "odc")
    rows = []
    for key in run.steps:
        row = {"run": run.name, "workload": workload, "model": run.model, "gpus": run.world,
               "samples_per_gpu": run.per_gpu, "seed": run.seed, "method": key[0], "balance": key[1],
               "steps": [st["step"] for _, st in run.steps[key]], "step_s": priced[key],
               "mean_step_s": statistics.fmean(priced[key])}
        if key != odc:
            ratios = [b / a for a, b in zip(priced[odc], priced[key])]
            row |= {"odc_speedup_mean": row["mean_step_s"] / statistics.fmean(priced[odc]),
                    "odc_speedup_median_per_step": statistics.median(ratios)}
        else:
            row["odc_over_bound"] = statistics.fmean(priced[odc]) / statistics.fmean(priced["bound"])
        rows.append(row)
    return rows
