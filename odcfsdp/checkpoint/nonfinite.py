"""The save's guard against poisoned checkpoints: no parameter or optimizer state with a NaN or an infinity is
written (an update can make weights non-finite with a finite gradient norm, the loop's own guard)."""

from __future__ import annotations

import torch

from .manifest import CheckpointError


class NonFiniteStateError(CheckpointError):
    """A save refused because a parameter or an optimizer state holds a NaN or an infinity."""


def first_nonfinite(named: list[tuple[str, torch.Tensor]]) -> tuple[str | None, int]:
    """(name of the first tensor holding a non-finite value or None, how many such values in all), on each
    tensor's own device, one host read at the end."""
    counts = [(~torch.isfinite(t)).sum() for _, t in named if t.numel() and t.is_floating_point()]
    if not counts:
        return None, 0
    per = torch.stack([c.to(counts[0].device) for c in counts]).tolist()
    names = [n for n, t in named if t.numel() and t.is_floating_point()]
    return next((n for n, c in zip(names, per) if c), None), int(sum(per))
