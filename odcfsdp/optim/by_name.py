"""Optimizers chosen by name: any ``torch.optim.Optimizer`` subclass and the keyword arguments it takes."""

from __future__ import annotations

import inspect

import torch

from ..checks import did_you_mean


# torch.optim classes whose step is not element-wise over each parameter, which a sharded run cannot take: each
# rank would step its shard as if it were the whole tensor (Muon orthogonalises, Adafactor factors by rows and
# columns) or the loop cannot drive them (LBFGS needs a closure, SparseAdam sparse gradients).
NOT_ELEMENTWISE = {"Adafactor": "factors its state by rows and columns of the whole tensor",
                   "Muon": "orthogonalises each whole matrix", "LBFGS": "needs a closure and a line search",
                   "SparseAdam": "needs sparse gradients"}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """``torch.optim.<name>``; a ``ValueError`` naming ``optim.name`` and the closest names otherwise, or why
    a sharded run cannot use it (``NOT_ELEMENTWISE``)."""
    if name in NOT_ELEMENTWISE:
        raise ValueError(f"optim.name={name}: torch.optim.{name} {NOT_ELEMENTWISE[name]}, which a rank holding "
                         "shards cannot do: choose an element-wise optimizer (AdamW, Adam, SGD, ...)")
    known = {n: c for n, c in vars(torch.optim).items() if n not in NOT_ELEMENTWISE and isinstance(c, type)
             and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    if name in known:
        return known[name]
    hint = did_you_mean(name, sorted(known), cutoff=0.5, ignore_case=True)
    raise ValueError(f"optim.name={name!r} is not a torch.optim optimizer: {hint}choose one of {tuple(sorted(known))}")


def optimizer_keywords(cls: type[torch.optim.Optimizer]) -> tuple[str, ...]:
    """The keyword arguments ``cls`` takes besides the parameters (``lr``, ``momentum``, ...), in signature order."""
    params = inspect.signature(cls.__init__).parameters
    return tuple(n for n, p in params.items() if n not in ("self", "params")
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
