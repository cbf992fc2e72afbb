"""Symmetric heaps: one equally sized region per rank, every rank's region addressable by all.

Design note [heap]
------------------
The one-sided transports place, for every group, this rank's row and accumulator row
at the *same offset* of every rank's region, so "rank q's
row of group g" is ``region(q)[row_offset[g] : ...]`` on every rank. The size is
computed by the framework from the plan (``heap_plan``), never guessed by the user.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from ..placement.layout import GroupLayout

HEAP_ALIGN = 256  # bytes; keeps every row start aligned for vector access and cache lines


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class HeapPlan:
    """Byte offsets of each group's row and accumulator inside a rank's region."""

    row_offsets: tuple[int, ...]
    acc_offsets: tuple[int | None, ...]
    nbytes: int


def heap_plan(layouts: Sequence[GroupLayout], row_dtypes: Sequence[torch.dtype],
              accum_dtypes: Sequence[torch.dtype]) -> HeapPlan:
    """Lay out rows (group g's in ``row_dtypes[g]``) then accumulators (in ``accum_dtypes[g]``); frozen groups get no
    accumulator."""
    off = 0
    rows, accs = [], []
    for lay, dtype in zip(layouts, row_dtypes, strict=True):
        rows.append(off)
        off = _round_up(off + lay.row_len * torch.empty((), dtype=dtype).element_size(), HEAP_ALIGN)
    for lay, dtype in zip(layouts, accum_dtypes, strict=True):
        if lay.requires_grad:
            accs.append(off)
            off = _round_up(off + lay.row_len * torch.empty((), dtype=dtype).element_size(), HEAP_ALIGN)
        else:
            accs.append(None)
    return HeapPlan(tuple(rows), tuple(accs), max(off, HEAP_ALIGN))


class SymmetricHeap(ABC):
    """``nbytes`` of memory on each of ``world_size`` ranks; ``region(q)`` addresses rank q's."""

    def __init__(self, nbytes: int, rank: int, world_size: int):
        self.nbytes = nbytes
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def region(self, q: int) -> torch.Tensor | None:
        """Rank q's region as a uint8 tensor this rank can read and atomically add into (None: not reachable)."""

    def view(self, q: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``numel`` elements of ``dtype`` at byte ``offset`` of rank q's region (None if unreachable).

        Each view has a version counter of its own (``.data``): rows and accumulators
        share one allocation, and a push into an accumulator must not look like a
        change of a row ([step-protocol] watches the master rows' versions).
        """
        region = self.region(q)
        if region is None:
            return None
        size = torch.empty((), dtype=dtype).element_size()
        return region[offset : offset + numel * size].view(dtype).data

    @abstractmethod
    def close(self) -> None:
        """Release the memory (idempotent)."""
