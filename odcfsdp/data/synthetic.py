"""Synthetic SFT data with learnable structure and long-tailed lengths, deterministic by seed.

Tokens come from a fixed random first-order Markov chain with peaked transition
rows, so a model's loss falls from ln(vocab) towards the chain's entropy rate. One
stream of ``pool_tokens`` tokens is generated per process at start; sample i is a
window of it at a seeded offset, with its length drawn from a ``LengthDistribution``.
The first ``prompt_fraction`` of every sample is a prompt (no loss).
"""

from __future__ import annotations

import bisect
import random

import torch

from ..torch_private import standard_gamma
from .lengths import LengthDistribution
from .packing import Sample


class MarkovTokens:
    """A seeded random Markov chain over ``vocab_size`` tokens.

    Each token can be followed by at most ``successors`` tokens (all of them when the
    vocabulary is that small), so the chain costs ``vocab_size * successors`` numbers
    rather than ``vocab_size**2``: a dense 32K-token chain would need 4 GB as a tensor
    and tens of GB as the Python lists sampling bisects on.

    Args:
        vocab_size: number of distinct tokens.
        seed: seeds the chain and every stream drawn from it.
        concentration: Dirichlet concentration of each transition row (smaller = easier).
        successors: most distinct next tokens per token (drawn at random, with repeats
            merged, when ``vocab_size`` is larger).
    """

    def __init__(self, vocab_size: int, seed: int = 0, concentration: float = 0.05, successors: int = 256):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if successors < 1:
            raise ValueError(f"successors must be >= 1, got {successors}")
        g = torch.Generator().manual_seed(seed)
        k = min(successors, vocab_size)
        gamma = standard_gamma(torch.full((vocab_size, k), float(concentration)), g)
        self.transition = gamma / gamma.sum(-1, keepdim=True)  # row t: probabilities of next_tokens[t]
        if k == vocab_size:
            self.next_tokens = torch.arange(vocab_size).expand(vocab_size, k)
        else:
            self.next_tokens = torch.randint(0, vocab_size, (vocab_size, k), generator=g)
        self.vocab_size = vocab_size
        self.seed = seed
        # Python lists: bisect on them is far cheaper per token than torch scalar ops.
        self._cdf = self.transition.double().cumsum(-1).tolist()
        self._next = self.next_tokens.tolist()

    def entropy_rate(self) -> float:
        """Expected next-token entropy in nats under a uniform state (a loss floor)."""
        v = self.vocab_size
        keys = (torch.arange(v)[:, None] * v + self.next_tokens).flatten()
        uniq, inverse = keys.unique(return_inverse=True)  # one entry per distinct (token, next token)
        p = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, self.transition.double().flatten())
        p = p.clamp_min(1e-300)
        return float(-(p * p.log()).sum() / v)

    def stream(self, length: int, index: int = 0) -> torch.Tensor:
        """Token stream number ``index`` of ``length`` tokens (the same for every caller)."""
        rng = random.Random(self.seed * 1_000_003 + index)
        last = len(self._cdf[0]) - 1
        tok = rng.randrange(self.vocab_size)
        out = [tok]
        for _ in range(length - 1):
            tok = self._next[tok][min(bisect.bisect_left(self._cdf[tok], rng.random()), last)]
            out.append(tok)
        return torch.tensor(out, dtype=torch.long)


class SyntheticSFT:
    """An endless SFT source: sample i = a Markov-chain window of seeded length."""

    num_samples = None  # endless

    def __init__(self, vocab_size: int, lengths: LengthDistribution, seed: int = 0,
                 pool_tokens: int = 1 << 20, prompt_fraction: float = 0.2, concentration: float = 0.05):
        if not 0 <= prompt_fraction < 1:
            raise ValueError(f"data.prompt_fraction must be in [0, 1), got {prompt_fraction}")
        self.chain = MarkovTokens(vocab_size, seed, concentration)
        self.lengths = lengths
        self.seed = seed
        self.prompt_fraction = prompt_fraction
        longest = max(lengths.cfg.max_len, max((hi for _, hi in lengths.cfg.bins), default=0))
        self.pool = self.chain.stream(max(pool_tokens, 2 * longest))

    def length(self, index: int) -> int:
        """Token count of sample ``index`` (cheap: balancing needs no tokens)."""
        return self.lengths.sample(index)

    def __getitem__(self, index: int) -> Sample:
        n = self.length(index)
        start = random.Random(self.seed * 31 + index).randrange(self.pool.numel() - n)
        tokens = self.pool[start : start + n].clone()
        mask = torch.ones(n, dtype=torch.bool)
        mask[: int(n * self.prompt_fraction)] = False
        return Sample(index, tokens, mask)
