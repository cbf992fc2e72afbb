"""Balancing one global minibatch across ranks, without communication.

Every rank sees the lengths of the whole minibatch and runs the same
deterministic algorithm (ties broken by position), so all ranks agree on the plan.
Cost of a sequence of s positions: ``a * s**2 + b * s`` (attention is quadratic).

* ``none``: rank r takes the r-th contiguous slice of samples (equal sample counts)
  and packs it; ranks may end with different numbers of micro-batches.
* ``lb_micro`` (what collectives need): the minibatch is cut into M micro-batches,
  M a multiple of N, each under the token cap and balanced by cost; each rank gets
  M / N of them, chosen to balance the ranks' total cost.
* ``lb_mini`` (needs one-sided communication): samples go to ranks by longest-
  processing-time-first on cost, balancing each rank's *total*, unless the ranks'
  shares of ``lb_micro``'s plan are strictly better balanced ([never-worse]); each
  rank then packs its share into as few micro-batches as the cap allows, with the
  positions spread evenly over them (``_pack_even``).

Packing for ``none`` is first-fit decreasing by length under ``cap`` positions.

Design note [even-packing]
--------------------------
A rank's peak activation memory follows its *largest* micro-batch (activations, and
the logits of the loss, grow with its positions), while its compute depends only on
which samples it runs. First-fit decreasing fills the first micro-batches to the cap
and leaves the last ones short, so with the same number of micro-batches an even
spread of positions lowers the peak for free (the FFD-packed run's activation peak
against even packing, every other category equal: docs/design.md, Figures behind the design notes).
``_pack_even`` keeps FFD's micro-batch count and places
samples, longest first, into the emptiest micro-batch with room.

Design note [never-worse]
-------------------------
LPT's partition is within (4/3 - 1/(3N)) of the best one (Graham), not always better
than the one ``lb_micro`` reaches through its balanced micro-batches: over the
minibatches of the step simulator's sweep (``benchmarks/step_sim.py``, seed 0,
LongAlign-like and SWE-Smith-like lengths, 2-16 ranks, 1-16 samples per rank) LPT's
busiest rank cost more than ``lb_micro``'s in a few of them (docs/design.md, Figures
behind the design notes). Since one-sided ranks need not run equal micro-batch counts,
any partition is open to ``lb_mini``; it plans both (``lb_micro``'s is a few list
passes) and keeps ``lb_micro``'s shares where their busiest rank costs strictly less, so
by the cost model ``lb_mini`` is never worse than ``lb_micro`` and is LPT wherever LPT is
at least as good (plans of earlier runs replay unchanged there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BALANCERS = ("none", "lb_micro", "lb_mini")


@dataclass(frozen=True)
class CostModel:
    """Cost of one sequence: ``a * s**2 + b * s``."""

    a: float
    b: float

    def __call__(self, s: int) -> float:
        return self.a * s * s + self.b * s

    @classmethod
    def for_transformer(cls, n_layers: int, dim: int, matmul_params: int, attention_factor: float = 1.0) -> "CostModel":
        """Training FLOPs: 6 per matmul parameter per token, plus causal attention.

        Attention scores and values take 4 * s^2 * dim FLOPs per layer forward, half of
        them masked out by causality; backward doubles forward: 6 * s^2 * dim per layer.
        ``attention_factor`` weighs an attention FLOP against a matmul FLOP, for a cost
        that tracks time rather than FLOPs: attention kernels run at a lower rate than
        large matmuls (the value fitted from measured compute times: ``balance.attention_cost_factor``
        in docs/cli.md). Keep 1.0 where the model's FLOPs are wanted (MFU).
        """
        if attention_factor <= 0:
            raise ValueError(f"attention_factor must be > 0, got {attention_factor}")
        return cls(a=6.0 * n_layers * dim * attention_factor, b=6.0 * matmul_params)


Plan = list[list[list[int]]]  # plan[rank][micro_batch] = positions in the minibatch


def _pack_ffd(items: list[int], sizes: list[int], cap: int) -> list[list[int]]:
    """First-fit decreasing: fewest bins of at most ``cap`` total size, items in stable order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(items, key=lambda i: (-sizes[i], i)):
        for b, left in enumerate(room):
            if sizes[i] <= left:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(cap - sizes[i])
    return bins


def _pack_even(items: list[int], sizes: list[int], cap: int) -> list[list[int]]:
    """As few bins as first-fit decreasing needs, with the positions spread evenly over them (see [even-packing]).

    Bins come largest first, each in stable (sample) order. The even placement (longest first into
    the emptiest bin) is a heuristic: where it cannot keep every bin under ``cap`` with FFD's count,
    or its largest bin is not smaller than FFD's, FFD's bins are kept.
    """
    ffd = _pack_ffd(items, sizes, cap)
    sub = [sizes[i] for i in items]
    bins = _balanced_bins(sub, [float(s) for s in sub], cap, len(ffd))

    def largest(packing: list[list[int]]) -> int:
        return max((sum(sizes[i] for i in b) for b in packing), default=0)

    even = None if bins is None else [sorted(items[j] for j in b) for b in bins if b]
    best = even if even is not None and largest(even) < largest(ffd) else ffd
    return sorted(best, key=lambda b: (-sum(sizes[i] for i in b), b))


def _lpt(weights: list[float], n: int, limit: int | None = None) -> list[list[int]]:
    """Longest-processing-time-first: item -> the least loaded of ``n`` bins (at most ``limit`` items each)."""
    loads, members = [0.0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_bins = [b for b in range(n) if limit is None or len(members[b]) < limit]
        b = min(open_bins, key=lambda b: (loads[b], b))
        loads[b] += weights[i]
        members[b].append(i)
    return members


def _balanced_bins(sizes: list[int], costs: list[float], cap: int, count: int) -> list[list[int]] | None:
    """``count`` bins under ``cap``, items placed by decreasing cost into the cheapest bin with room."""
    loads, used, bins = [0.0] * count, [0] * count, [[] for _ in range(count)]
    for i in sorted(range(len(sizes)), key=lambda i: (-costs[i], i)):
        fits = [b for b in range(count) if used[b] + sizes[i] <= cap]
        if not fits:
            return None
        b = min(fits, key=lambda b: (loads[b], b))
        loads[b] += costs[i]
        used[b] += sizes[i]
        bins[b].append(i)
    return bins


def plan_minibatch(sizes: list[int], world_size: int, kind: str, cap: int, cost: CostModel) -> Plan:
    """Split a minibatch (``sizes[i]`` = positions of sample i) into per-rank micro-batches.

    Returns ``plan[rank][k]`` = the sample positions of rank ``rank``'s k-th
    micro-batch. ``lb_micro`` may produce empty micro-batches when there are fewer
    samples than micro-batch slots; the trainer runs those as zero-loss steps.
    """
    if kind not in BALANCERS:
        raise ValueError(f"balance.kind={kind!r} is not one of {BALANCERS}")
    too_long = [s for s in sizes if s > cap]
    if too_long:
        raise ValueError(f"a sample has {max(too_long)} positions, more than the micro-batch cap of {cap}")
    n = len(sizes)
    costs = [cost(s) for s in sizes]
    if kind == "none":
        bounds = [round(r * n / world_size) for r in range(world_size + 1)]
        shares = [list(range(bounds[r], bounds[r + 1])) for r in range(world_size)]
        return [_pack_ffd(share, sizes, cap) for share in shares]
    if kind == "lb_mini":
        shares = _lpt(costs, world_size)
        micro = [sorted(i for mb in rank for i in mb) for rank in _lb_micro(sizes, costs, world_size, cap)]
        if _busiest(micro, costs) < _busiest(shares, costs):  # [never-worse]
            shares = micro
        return [_pack_even(sorted(share), sizes, cap) for share in shares]
    return _lb_micro(sizes, costs, world_size, cap)


def _busiest(shares: list[list[int]], costs: list[float]) -> float:
    """The cost of the busiest rank's share."""
    return max(sum(costs[i] for i in share) for share in shares)


def _lb_micro(sizes: list[int], costs: list[float], world_size: int, cap: int) -> Plan:
    """``lb_micro``'s plan: balanced micro-batches under ``cap``, a multiple of ``world_size`` of them, dealt to the
    ranks by LPT on their cost with equal counts."""
    n = len(sizes)
    count = world_size * math.ceil(max(1, len(_pack_ffd(list(range(n)), sizes, cap))) / world_size)
    while (bins := _balanced_bins(sizes, costs, cap, count)) is None:
        count += world_size
    per_rank = count // world_size
    bin_costs = [sum(costs[i] for i in b) for b in bins]
    ranks = _lpt(bin_costs, world_size, limit=per_rank)
    return [[sorted(bins[b]) for b in sorted(r, key=lambda b: (-bin_costs[b], b))] for r in ranks]


def rank_costs(plan: Plan, sizes: list[int], cost: CostModel) -> list[float]:
    """Total cost per rank of a plan."""
    return [sum(cost(sizes[i]) for mb in rank for i in mb) for rank in plan]
