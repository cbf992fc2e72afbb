"""One process group's rank, size and rare collectives (``RankGroup``), and the tensor collectives under
whichever names this torch has. Without ``torch.distributed`` initialised a group is a single rank and every
collective is the identity.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


# torch >= 2.13 renamed the tensor collectives; keep working on older releases. Looked up at
# call time so that wrappers installed on torch.distributed (profilers, tests) see every call.
def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``all_gather_into_tensor`` under whichever name this torch has."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, group=group)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """``reduce_scatter_tensor`` (sum) under whichever name this torch has."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, group=group)


def _check_not_launched() -> None:
    """One process alone, though a launcher started several (torchrun's ``WORLD_SIZE``): refused, since each would
    train a copy of its own and none would say so."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise RuntimeError(f"WORLD_SIZE={launched}: a launcher (torchrun) started {launched} ranks, but "
                           "torch.distributed is not initialised, so each would train a separate copy of the model: "
                           "call torch.distributed.init_process_group() before sharding it")


class RankGroup:
    """Rank, size and the rare collectives (set-up, the step, checkpoints) of one process group.

    Args:
        group: the process group (None: the default group, or one process if
            torch.distributed is not initialised).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.distributed = group is not None or dist.is_initialized()
        if self.distributed:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            _check_not_launched()
            self.rank, self.world_size = 0, 1

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's ``rank``."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def barrier(self) -> None:
        """Wait for all ranks."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ranks (in place) and return it."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Stack every rank's copy of ``row`` into ``(N, len)``; for rare, whole-model work."""
        out = torch.empty(self.world_size * row.numel(), dtype=row.dtype, device=row.device)
        if self.world_size == 1:
            out.copy_(row.reshape(-1))
        else:
            all_gather_tensor(out, row.contiguous(), group=self.group)
        return out.view(self.world_size, -1)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group)
        return box[0]
