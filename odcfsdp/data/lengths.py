"""Sequence-length distributions for synthetic SFT data, deterministic by seed.

``LengthDistribution.sample(index)`` gives the length of sample ``index``, the same
on every rank and in every run with the same seed, so balancing decisions need no
communication and resumed runs see the same data.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

# LongAlign-style SFT spread (8K-64K tokens): bins and their shares.
LONGALIGN_BINS = [(8192, 16384), (16384, 32768), (32768, 49152), (49152, 65536)]
LONGALIGN_WEIGHTS = [0.55, 0.3, 0.1, 0.05]


@dataclass
class LengthConfig:
    """How long synthetic samples are.

    Attributes:
        kind: ``fixed`` (always ``max_len``), ``lognormal`` (median ``median``,
            log-space std ``sigma``, clipped to [min_len, max_len]) or ``histogram``
            (uniform within bins picked with ``weights``; defaults to LongAlign's
            8K-64K spread).
    """

    kind: str = "lognormal"
    """fixed (always max_len) | lognormal (median, sigma) | histogram (bins, weights)"""
    min_len: int = 16
    """shortest sample (tokens)"""
    max_len: int = 512
    """longest sample (tokens); every sample with kind=fixed"""
    median: float = 64.0
    """lognormal: the median length"""
    sigma: float = 1.0
    """lognormal: the standard deviation of log(length)"""
    bins: list[list[int]] = field(default_factory=lambda: [list(b) for b in LONGALIGN_BINS])
    """histogram: [lo, hi]s"""
    weights: list[float] = field(default_factory=lambda: list(LONGALIGN_WEIGHTS))
    """histogram: each bin's share"""


KINDS = ("fixed", "lognormal", "histogram")


def longalign_lengths(cap: int = 65536) -> LengthConfig:
    """LongAlign's 8K-64K spread scaled so the longest sample just fits ``cap`` positions (the benchmarks' long-tailed
    workload: ``cap + 1`` tokens, inputs and the shifted target)."""
    scale = (cap + 1) / LONGALIGN_BINS[-1][1]
    bins = [[max(2, int(lo * scale)), int(hi * scale)] for lo, hi in LONGALIGN_BINS]
    return LengthConfig(kind="histogram", bins=bins)


class LengthDistribution:
    """Seeded sampler of sequence lengths following a ``LengthConfig``."""

    def __init__(self, cfg: LengthConfig, seed: int):
        if cfg.kind not in KINDS:
            raise ValueError(f"data.lengths.kind={cfg.kind!r} is not one of {KINDS}")
        if not 2 <= cfg.min_len <= cfg.max_len:
            raise ValueError(f"need 2 <= data.lengths.min_len <= max_len, got {cfg.min_len}, {cfg.max_len}")
        if cfg.kind == "histogram":
            if len(cfg.bins) != len(cfg.weights) or not cfg.bins:
                raise ValueError("data.lengths.bins and weights must be non-empty and of equal length")
            if any(lo < 2 or hi < lo for lo, hi in cfg.bins):
                raise ValueError(f"data.lengths.bins must be [lo, hi] pairs with 2 <= lo <= hi, got {cfg.bins}")
        self.cfg = cfg
        self.seed = seed

    def sample(self, index: int) -> int:
        """Length of sample ``index``."""
        c = self.cfg
        rng = random.Random(self.seed * 7_919 + index)
        if c.kind == "fixed":
            return c.max_len
        if c.kind == "lognormal":
            n = int(round(math.exp(rng.gauss(math.log(c.median), c.sigma))))
            return min(max(n, c.min_len), c.max_len)
        lo, hi = rng.choices(c.bins, weights=c.weights)[0]
        return rng.randint(lo, hi)
