"""Learning-rate schedules as ``torch.optim.lr_scheduler.LambdaLR`` factors."""

from __future__ import annotations

import math
from typing import Callable


def warmup_cosine(warmup_steps: int, total_steps: int, schedule: str = "cosine",
                  min_lr_ratio: float = 0.1) -> Callable[[int], float]:
    """Factor of step k (0-based): linear warm-up to 1 over ``warmup_steps``, then constant or cosine down to
    ``min_lr_ratio`` at ``total_steps``.

    Example::

        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(5, 1000))
    """
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule={schedule!r} is not one of ('constant', 'cosine')")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
