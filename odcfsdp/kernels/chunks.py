"""Chunk tables: how the gather / scatter-accumulate kernels split a group into programs.

A group's row is a sequence of segments (one per parameter, see [layout] in
``odcfsdp/sharding/layout.py``). Each segment is cut into chunks of at most
``block`` elements; program (chunk, r) moves one chunk of rank r's row. A chunk
is four int64 values:

* ``row_start``: first element of the chunk inside a row;
* ``length``: number of elements (<= block);
* ``out_base``: where the chunk of rank 0 lands in the parameter-major buffer,
  ``N * off_i + (row_start - off_i)``;
* ``seg``: the segment length c_i, so rank r's chunk lands at ``out_base + r * seg``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

CHUNK_FIELDS = 4


@dataclass(frozen=True)
class ChunkTable:
    """The ``(num_chunks, 4)`` int64 table and the block size it was cut with (kernels use that block)."""

    table: torch.Tensor
    block: int

    @property
    def num_chunks(self) -> int:
        return self.table.shape[0]


def chunk_table(
    offsets: Sequence[int], segs: Sequence[int], world_size: int, block: int, device: torch.device | str = "cpu"
) -> ChunkTable:
    """Cut segments at ``offsets`` with lengths ``segs`` into chunks of at most ``block`` elements."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    rows = []
    for off, seg in zip(offsets, segs, strict=True):
        for start in range(off, off + seg, block):
            rows.append((start, min(block, off + seg - start), world_size * off + (start - off), seg))
    return ChunkTable(torch.tensor(rows, dtype=torch.int64, device=device).view(-1, CHUNK_FIELDS), block)
