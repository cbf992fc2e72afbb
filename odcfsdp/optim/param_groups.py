"""Parameter groups for ``torch.optim`` optimizers: weight decay for matrices, none for norms and biases."""

from __future__ import annotations

import fnmatch
from typing import Callable, Iterable

import torch.nn as nn

NoDecay = Callable[[str, tuple[int, ...]], bool] | Iterable[str]
DEFAULT_NO_DECAY = ("*norm*", "*bias")


def _predicate(no_decay: NoDecay) -> Callable[[str, tuple[int, ...]], bool]:
    if callable(no_decay):
        return no_decay
    if isinstance(no_decay, str):
        raise TypeError("no_decay takes a list of names or glob patterns, not a single string")
    patterns = list(no_decay)
    return lambda name, shape: any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def param_groups(model: nn.Module, no_decay: NoDecay = DEFAULT_NO_DECAY, **no_decay_options) -> list[dict]:
    """Two ``torch.optim`` parameter groups of ``model``'s trained parameters: with and without weight decay.

    The first group takes the optimizer's ``weight_decay``; the second (parameters
    matching ``no_decay``) has ``weight_decay=0.0`` plus any ``no_decay_options``.
    Frozen parameters are left out; tied parameters appear once; empty groups are
    dropped. Works on any module, an ``ODCShard`` included (its names are the wrapped
    model's).

    Args:
        model: the model.
        no_decay: names or glob patterns (``["*norm*", "*bias"]``, the default), or a
            predicate ``(name, shape) -> bool``.

    Example::

        opt = torch.optim.AdamW(param_groups(model), lr=3e-4, weight_decay=0.1, fused=True)
    """
    skip = _predicate(no_decay)
    decay, keep = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (keep if skip(name, tuple(p.shape)) else decay).append(p)
    groups = [{"params": decay}, {"params": keep, "weight_decay": 0.0, **no_decay_options}]
    return [g for g in groups if g["params"]]
