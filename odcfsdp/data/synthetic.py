"""Synthetic token data with learnable structure, deterministic by seed.

Tokens follow a fixed random first-order Markov chain whose rows are peaked
(``concentration`` < 1 gives low-entropy transitions), so a small model's loss
falls quickly from ln(vocab) towards the chain's entropy rate.
"""

from __future__ import annotations

import bisect
import random

import torch


class MarkovTokens:
    """Sample token sequences from a seeded random Markov chain.

    Args:
        vocab_size: number of distinct tokens.
        seed: seeds both the chain and the sampling stream.
        concentration: Dirichlet concentration of each transition row (smaller = easier).
    """

    def __init__(self, vocab_size: int, seed: int = 0, concentration: float = 0.05):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        g = torch.Generator().manual_seed(seed)
        alpha = torch.full((vocab_size,), float(concentration))
        gamma = torch._standard_gamma(alpha.expand(vocab_size, vocab_size).contiguous(), generator=g)
        self.transition = gamma / gamma.sum(-1, keepdim=True)
        self.vocab_size = vocab_size
        self.seed = seed
        # Python lists: bisect on them is far cheaper per token than torch scalar ops.
        self._cdf = self.transition.double().cumsum(-1).tolist()

    def entropy_rate(self) -> float:
        """Expected next-token entropy in nats under a uniform start (a loss floor)."""
        p = self.transition.clamp_min(1e-30)
        return float(-(p * p.log()).sum(-1).mean())

    def sample(self, length: int, index: int) -> torch.Tensor:
        """Sequence number ``index`` of ``length`` tokens (the same for every caller)."""
        rng = random.Random(self.seed * 1_000_003 + index)
        last = self.vocab_size - 1
        tok = rng.randrange(self.vocab_size)
        out = [tok]
        for _ in range(length - 1):
            tok = min(bisect.bisect_left(self._cdf[tok], rng.random()), last)
            out.append(tok)
        return torch.tensor(out, dtype=torch.long)
