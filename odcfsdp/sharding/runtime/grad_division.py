"""What step 8 of [lifecycle] divides the summed gradients by, applied once per minibatch and undone when the
gradients go back to accumulating.

The mean as FSDP2's (its post-divide, "less data"): once per minibatch, over this rank's accumulator rows (1/N of
the model), after every rank's pushes and the replicas' all-reduce, so every micro-batch of every rank is summed
first and divided once. Not in the push: the push kernels have no scale, and scaling each pushed gradient would be a
pass over the whole unsharded gradient per micro-batch (N times the data, every micro-batch). ``div_`` as FSDP2's
``_div_if_needed``: exact for a power-of-two factor; before the copies ``attach_grads`` makes (a ``reduce_dtype``
upcast, an offloaded host copy), so they see the mean.
"""

from __future__ import annotations

from typing import Sequence

import torch


class GradDivision:
    """The divide factor of one model's minibatch and the factor its attached accumulators were divided by.

    Args:
        factor: what the summed gradients are divided by (FSDP2's default: the data-parallel ranks).
    """

    def __init__(self, factor: float = 1.0):
        self.factor = 1.0
        self.set(factor)
        self.applied = 1.0  # what the accumulators attached now were divided by (1.0: none, or zeroed since)

    def set(self, factor: float) -> None:
        """A finite number > 0, taking effect at the next ``apply``."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(f"the gradient divide factor must be a finite number > 0 (1.0: sum), got {factor!r}")
        self.factor = float(factor)

    def apply(self, accumulators: Sequence[torch.Tensor]) -> None:
        """Divide the summed accumulators by the factor (step 8, before they are attached as ``.grad``)."""
        if self.factor != 1.0:
            for acc in accumulators:
                acc.div_(self.factor)
        self.applied = self.factor

    def undo(self, accumulators: Sequence[torch.Tensor]) -> None:
        """Multiply back what ``apply`` divided: the next sync divides the whole sum once (exact for a power-of-two
        factor)."""
        if self.applied != 1.0:
            for acc in accumulators:
                acc.mul_(self.applied)
        self.applied = 1.0

    def cleared(self) -> None:
        """The accumulators were zeroed: nothing to undo."""
        self.applied = 1.0
