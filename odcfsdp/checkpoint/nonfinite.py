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
    checked = [(n, t) for n, t in named if t.numel() and t.is_floating_point()]
    if not checked:
        return None, 0
    device = checked[0][1].device
    per = torch.stack([(~torch.isfinite(t)).sum().to(device) for _, t in checked]).tolist()
    return next((n for (n, _), c in zip(checked, per) if c), None), int(sum(per))
