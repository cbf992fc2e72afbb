"""Step-time simulator, the model: where ODC + LB-Mini beats FSDP2's balancers, from 2 to 64 GPUs (issue 26).

The time model and the step prices live here; ``step_sim_fit`` fits them to committed runs (it imports this
module), ``step_sim`` is the command line (it imports both), ``step_sim_report`` renders. Run it as:

    python -m benchmarks.step_sim --size 8b --out results/sim/<name>      # the sweep (JSON + markdown + chart)
    python -m benchmarks.step_sim --validate --size 8b --out results/sim/<name>   # refit + revalidate (see below)

``--validate`` is the refit entry point (``step_sim_fit.refit``): it refits the size's time model on the committed
runs (``step_sim_fit.SETUPS[size]``: its fit runs and host-floor run) and prices the fit's own steps (in-sample),
its held-out runs (another seed or samples per GPU; ``--held-out RUN`` adds a newly committed one) and its
same-stream checks; each speedup with its error in the gain (speedup - 1). The sweep fits the same runs unless
``--fit`` names others; ``--size`` without a setup needs ``--fit``.

It replays seeded length distributions through the balancers we ship (``odcfsdp.data.balance``) and the ones
users run, and prices every plan with a cost model fitted on committed GPU runs (``results/e2e/``). No GPU.

Design note [step-sim]
----------------------
Time of one sample of ``s`` positions ``t(s) = a s^2 + b s`` (attention per document, matmuls per token);
of one micro-batch ``m``: ``t(m) = max(c + sum_{i in m} t(s_i), h, q_N)``, ``c`` a per-micro-batch overhead (the
loss, exposed communication at the fitted scale), ``h`` the host's floor (the time to launch one micro-batch's
kernels: short micro-batches are host-bound), and ``q_N`` the communication floor of one micro-batch at N
GPUs (``benchmarks/multinode_cost_model.py``'s per-micro-batch NVLink / InfiniBand time for the model's bytes: at
the fitted 2 GPUs it never binds; it matters for short samples and across nodes). Rank r's time
``T_r = sum_k t(m_rk)``. A step:

* one-sided (ODC): ranks meet once, at the optimizer: ``step = max_r T_r + o_N``;
* collective (FSDP2, DDP): every micro-batch gathers and reduces per layer with every rank, so micro-batch k
  ends when its slowest rank does: ``step = sum_k max_r t(m_rk) + o_N`` (ranks run the same micro-batch count;
  each balancer's own micro-batch order);
* ``o_N``: clip + optimizer step, ``o_2 * 2 / shard_N`` (shard-sized work) plus, for ODC beyond one node (HSDP,
  sharding inside the node: the one-sided path does not cross nodes), the replicas' gradient all-reduce.

Balance bound (the step if every rank had the mean work), for any plan whose micro-batches fit the cap ``C``:
``B = max(max(sum_i t(s_i) + c M, h M) / N, max_i t(s_i) + c, h) + min(o_N)``, ``M = ceil(S / C)``, S the
minibatch's positions. It is a lower bound: ``max_r T_r >= mean_r T_r``, at least M micro-batches exist and each
costs at least ``c + sum t`` and at least ``h``; some rank runs the largest sample; ``sum_k max_r >= max_r sum_k``.
The communication floor ``q_N`` only raises times.

Balancers (``plans``): ``odc_lb_mini`` (LB-Mini, one-sided), ``odc_lb_micro`` (one-sided on LB-Micro's plan),
``fsdp2_lb_micro`` (LB-Micro, collective), ``fsdp2_fixed`` (each rank its contiguous B/N samples, one per
micro-batch, as a DistributedSampler with micro-batch size 1), ``fsdp2_dynamic`` (verl's ``use_dynamic_bsz`` with
``balance_batch``: ranks get equal sample counts balanced by tokens with Karmarkar-Karp differencing; each rank
cuts its share into ``max_r ceil(S_r / C)`` micro-batches, balanced by tokens with Karmarkar-Karp, largest first).
LB-Mini's alternatives for the study: ``odc_kk`` (Karmarkar-Karp on cost across ranks, then LB-Mini's packing)
and ``odc_lpt_overhead`` (LB-Mini's LPT on ``t(s) + c s / C``: each sample's share of a micro-batch's overhead).

Fit (``step_sim_fit.py``): least squares of one-sided ranks' measured compute seconds per step against
``(sum s^2, sum s, micro-batches)`` (non-negative: a negative term is dropped and the rest refitted; one-sided
ranks do not wait for each other, collective ones do); ``o_2`` = the mean over steps of the smallest rank's
optimizer seconds (the last rank to finish waits for no one); ``h`` = the host-issue seconds per micro-batch of a
committed balanced run (4K-token micro-batches, host-bound), the least over its methods (the model's own launch
path, which every method pays), scaled by the layer count for other sizes. A run of another model shape (the HF
8B's 128256-token LM head) is priced with the fit's rates scaled as for another size (``step_sim_fit.scaled``).
Both methods use the same ``t``: the simulator predicts what balancing does; FSDP2's own per-micro-batch speed
(measured 2-4% slower than odcfsdp on the same plan) is not in it, so its ratios are balancing's share of ODC's
gain. ``fsdp2_nosync`` (no reduce-scatter before the last micro-batch) is priced as collective too: its layers
still re-gather for every micro-batch's backward, and with 2 micro-batches per rank (the committed 8B runs) the
first one's forward gathers and the last one's backward reduces with every rank either way.

What it found about LB-Mini (``--study``, ``results/sim/sweep_1b/``): on the long-tailed distributions LB-Mini's
step is within 3% of the bound (within 2% at 4 or more samples per GPU); Karmarkar-Karp on cost gains at most 0.9%
over it, too little to change the shipped balancer. LPT alone is not a best partition: on single minibatches it
lost to LB-Micro's own partition (85 of the sweep's 2064 long-tailed minibatches at 2-16 GPUs, by up to 3.8%), so
LB-Mini now keeps LB-Micro's rank shares where they are better balanced ([never-worse] in
``odcfsdp/data/balance.py``; tests/test_step_sim.py checks never-worse per minibatch). ``odc_lpt_overhead`` is
plain LPT on weights with an overhead share, which equals plain LPT while the fitted ``c`` is 0 (the
per-micro-batch overhead of micro-batches of 8K+ positions is below the fit's resolution; ``h`` is what short
micro-batches pay).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
from dataclasses import dataclass

from benchmarks.multinode_cost_model import measured as measured_rates
from benchmarks.multinode_cost_model import step_time as cost_model_step

from odcfsdp.data.balance import CostModel, _lpt, plan_minibatch
from odcfsdp.data.lengths import LengthConfig, LengthDistribution, longalign_lengths

SIZES = list[list[list[int]]]  # sizes[rank][micro_batch] = the positions of its samples


@dataclass(frozen=True)
class Distribution:
    """A named length distribution, its packing cap and where its shape comes from."""

    name: str
    lengths: LengthConfig
    cap: int
    source: str


DISTRIBUTIONS = {
    "longalign": Distribution("longalign", longalign_lengths(), 65536,
                              "LongAlign-10k's 8K-64K spread (Bai et al. 2024), odcfsdp.data.lengths' histogram; "
                              "the committed long-tailed e2e runs use it"),
    "swe": Distribution("swe", LengthConfig(kind="lognormal", min_len=2048, max_len=131072, median=30000, sigma=0.55),
                        131072, "SWE-Smith-like agent trajectories (Yang et al. 2025): lognormal, median 30K, "
                        "sigma 0.55, 2K-128K (mean ~35K); an assumed shape with the issue's mean, not fitted to the "
                        "data"),
    "chat": Distribution("chat", LengthConfig(kind="lognormal", min_len=16, max_len=16384, median=600, sigma=1.0),
                         16384, "short chat SFT (ShareGPT / UltraChat-like): lognormal, median 600, sigma 1.0, "
                         "16-16K (mean ~1K); an assumed shape with the issue's mean"),
}


def minibatch_sizes(dist: LengthDistribution, cap: int, index: int, batch: int) -> list[int]:
    """Positions of minibatch ``index``'s samples, truncated to the cap as ``odcfsdp.loop.plan_step`` does."""
    return [min(dist.sample(index * batch + i), cap + 1) - 1 for i in range(batch)]


@dataclass(frozen=True)
class TimeModel:
    """Seconds of a sample (``a s^2 + b s``) and of a micro-batch (``+ c``, at least ``h``); see [step-sim]."""

    a: float
    b: float
    c: float
    h: float = 0.0

    def sample(self, s: int) -> float:
        """Seconds of one sample of ``s`` positions."""
        return self.a * s * s + self.b * s

    def micro_batch(self, sizes: list[int], floor: float = 0.0) -> float:
        """Seconds of one micro-batch (an empty one still costs the overhead), at least the host's and the
        communication floor."""
        return max(self.c + sum(map(self.sample, sizes)), self.h, floor)

    def balance_cost(self) -> CostModel:
        """The balancers' cost model in seconds (what ``balance.attention_cost_factor`` approximates)."""
        return CostModel(self.a, self.b)

    def scaled(self, attention: float, matmul: float, layers: float) -> "TimeModel":
        """The same rates for a model with ``attention`` x the attention FLOPs, ``matmul`` x the matmul FLOPs and
        ``layers`` x the layers (the host's launches per micro-batch)."""
        return TimeModel(self.a * attention, self.b * matmul, self.c, self.h * layers)


def karmarkar_karp(weights: list[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Multiway largest differencing: ``k`` sets of item indices with close weight sums, largest set first.

    Every item starts as a partial partition (``equal_size``: every k consecutive items by weight form one, one
    item per set, so all sets end with the same count); the two partials with the largest spread are merged,
    the heaviest set of one with the lightest of the other, until one is left. Ties break by position.
    """
    if k < 1 or (equal_size and len(weights) % k):
        raise ValueError(f"cannot split {len(weights)} items into {k} sets{' of equal size' if equal_size else ''}")
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    groups = [order[j:j + k] for j in range(0, len(order), k)] if equal_size else [[i] for i in order]
    heap, tie = [], itertools.count()
    for group in groups:
        sets = sorted([(weights[i], [i]) for i in group] + [(0.0, [])] * (k - len(group)), key=lambda x: -x[0])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(tie), sets))
    while len(heap) > 1:
        _, _, x = heapq.heappop(heap)
        _, _, y = heapq.heappop(heap)
        sets = sorted([(x[i][0] + y[k - 1 - i][0], x[i][1] + y[k - 1 - i][1]) for i in range(k)], key=lambda z: -z[0])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(tie), sets))
    return [sorted(members) for _, members in heap[0][2]] if heap else [[] for _ in range(k)]


def _sizes(plan: list[list[list[int]]], sizes: list[int]) -> SIZES:
    return [[[sizes[i] for i in mb] for mb in rank] for rank in plan]


def _pack_shares(shares: list[list[int]], sizes: list[int], cap: int, cost: CostModel) -> SIZES:
    """Each rank's share packed as LB-Mini packs it (``plan_minibatch`` on one rank)."""
    out = []
    for share in shares:
        sub = [sizes[i] for i in share]
        out.append([[sub[j] for j in mb] for mb in plan_minibatch(sub, 1, "lb_mini", cap, cost)[0]] if sub else [])
    return out


def plans(sizes: list[int], n: int, cap: int, tm: TimeModel, study: bool = False) -> dict[str, SIZES]:
    """Every balancer's plan of one minibatch as sizes[rank][micro_batch] (see [step-sim])."""
    cost = tm.balance_cost()
    micro = _sizes(plan_minibatch(sizes, n, "lb_micro", cap, cost), sizes)
    out = {"odc_lb_mini": _sizes(plan_minibatch(sizes, n, "lb_mini", cap, cost), sizes),
           "odc_lb_micro": micro, "fsdp2_lb_micro": micro}
    per = len(sizes) // n
    out["fsdp2_fixed"] = [[[s] for s in sizes[r * per:(r + 1) * per]] for r in range(n)]
    shares = karmarkar_karp([float(s) for s in sizes], n, equal_size=len(sizes) % n == 0)
    count = max(math.ceil(sum(sizes[i] for i in share) / cap) for share in shares)
    dynamic = []
    for share in shares:
        parts = karmarkar_karp([float(sizes[i]) for i in share], count)
        dynamic.append(sorted(([sizes[share[j]] for j in p] for p in parts), key=lambda mb: (-sum(mb), mb)))
    out["fsdp2_dynamic"] = dynamic
    if study:
        costs = [cost(s) for s in sizes]
        out["odc_kk"] = _pack_shares(karmarkar_karp(costs, n), sizes, cap, cost)
        weights = [cost(s) + tm.c * s / cap for s in sizes]
        out["odc_lpt_overhead"] = _pack_shares([sorted(m) for m in _lpt(weights, n)], sizes, cap, cost)
    return out


def one_sided_step(plan: SIZES, tm: TimeModel, floor: float, opt_s: float) -> float:
    """ODC: ranks run their micro-batches independently and meet at the optimizer."""
    return max(sum(tm.micro_batch(mb, floor) for mb in rank) for rank in plan) + opt_s


def collective_step(plan: SIZES, tm: TimeModel, floor: float, opt_s: float) -> float:
    """FSDP2 / DDP: micro-batch k of every rank ends together (per-layer collectives)."""
    count = max(len(rank) for rank in plan)
    return sum(max(tm.micro_batch(rank[k], floor) if k < len(rank) else 0.0 for rank in plan)
               for k in range(count)) + opt_s


def balance_bound(sizes: list[int], n: int, cap: int, tm: TimeModel, opt_s: float) -> float:
    """The step if every rank had the mean work: a lower bound of every plan under the cap (see [step-sim])."""
    work, count = sum(map(tm.sample, sizes)), math.ceil(sum(sizes) / cap)
    return max(max(work + tm.c * count, tm.h * count) / n, max(map(tm.sample, sizes)) + tm.c, tm.h) + opt_s


@dataclass(frozen=True)
class Overheads:
    """Per-N figures from the multinode cost model: micro-batch communication floors and optimizer seconds."""

    floor: dict
    opt_s: dict


def overheads(n: int, params: int, opt2: dict, nccl_gbps: float = 360.0) -> Overheads:
    """``q_N`` and ``o_N`` for odc and fsdp2 at ``n`` GPUs (8 per node beyond 8), from ``opt2`` at 2 GPUs."""
    rates = measured_rates()
    nodes, per_node = (1, n) if n <= 8 else (math.ceil(n / 8), 8)
    a = argparse.Namespace(nodes=nodes, gpus_per_node=per_node, ib_gbps=50.0, ib_efficiency=0.9,
                           nccl_nvlink_gbps=nccl_gbps, peak_tflops=989.0, mfu=0.3, tokens=0, micro_batches=1,
                           no_reshard=False, fsdp2_defer_all_reduce=False)
    floor, opt_s = {}, {}
    for method, layout in (("odc", "odc_full" if nodes == 1 else "odc_hsdp"), ("fsdp2", "fsdp2_full")):
        row = cost_model_step(layout, a, rates, params)
        floor[method] = max(row["intra_s"], row["inter_s"])
        opt_s[method] = opt2[method] * 2 / row["shard_group"] + row["replica_sync_s"] * (layout == "odc_hsdp")
    return Overheads(floor, opt_s)


METHODS = ("odc_lb_mini", "odc_lb_micro", "fsdp2_lb_micro", "fsdp2_fixed", "fsdp2_dynamic")
STUDY = ("odc_kk", "odc_lpt_overhead")


def simulate(dist: Distribution, n: int, per_gpu: int, tm: TimeModel, over: Overheads, minibatches: int,
             seed: int = 0, study: bool = False) -> dict:
    """Mean step seconds of every balancer (and the bound) over ``minibatches`` seeded minibatches."""
    sampler = LengthDistribution(dist.lengths, seed)
    totals = dict.fromkeys((*METHODS, *(STUDY if study else ()), "bound"), 0.0)
    for m in range(minibatches):
        sizes = minibatch_sizes(sampler, dist.cap, m, n * per_gpu)
        for name, plan in plans(sizes, n, dist.cap, tm, study).items():
            method = name.split("_")[0]
            step = one_sided_step if method == "odc" else collective_step
            totals[name] += step(plan, tm, over.floor[method], over.opt_s[method])
        totals["bound"] += balance_bound(sizes, n, dist.cap, tm, min(over.opt_s.values()))
    mean = {k: v / minibatches for k, v in totals.items()}
    return {"distribution": dist.name, "gpus": n, "samples_per_gpu": per_gpu, "minibatches": minibatches,
            "step_s": mean, "speedup_vs_lb_micro": mean["fsdp2_lb_micro"] / mean["odc_lb_mini"],
            "speedup_vs_dynamic": mean["fsdp2_dynamic"] / mean["odc_lb_mini"],
            "speedup_vs_fixed": mean["fsdp2_fixed"] / mean["odc_lb_mini"],
            "bound_speedup_vs_lb_micro": mean["fsdp2_lb_micro"] / mean["bound"],
            "lb_mini_over_bound": mean["odc_lb_mini"] / mean["bound"]}
