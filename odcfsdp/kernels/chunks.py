"""Chunk tables: how the gather / scatter-accumulate kernels split a group into programs.

A group's row is a sequence of segments (one per parameter, see [layout] in
``odcfsdp/sharding/placement/layout.py``), each holding a shard of ``s_i`` elements followed by
padding. Each shard is cut into chunks of at most ``block`` elements; program
(chunk, r) moves one chunk of rank r's row. A chunk is four int64 values:

* ``row_start``: first element of the chunk inside a row;
* ``length``: number of elements (<= block);
* ``out_base``: where the chunk of rank 0 lands in the parameter-major buffer,
  ``N * off_i + (row_start - off_i)``;
* ``shard``: the shard length s_i, so rank r's chunk lands at ``out_base + r * shard``.

Row-side starts are always 16-byte aligned (segments are); unsharded-side starts
are when every shard length is a multiple of the alignment unit, which
``dst_divisor`` (the gcd of the shard lengths) lets the kernels decide.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

CHUNK_FIELDS = 4


@dataclass(frozen=True)
class ChunkTable:
    """The ``(num_chunks, 4)`` int64 table, the block size it was cut with (kernels use that block) and the
    gcd of its shard lengths (``dst_divisor``: unsharded-side offsets are multiples of it)."""

    table: torch.Tensor
    block: int
    dst_divisor: int = 0

    def dst_align(self, align: int) -> int:
        """The alignment (elements, a power of two up to ``align``) every unsharded-side chunk start has."""
        return math.gcd(align, self.dst_divisor) or align

    @property
    def num_chunks(self) -> int:
        return self.table.shape[0]


def chunk_table(
    offsets: Sequence[int], shards: Sequence[int], world_size: int, block: int, device: torch.device | str = "cpu"
) -> ChunkTable:
    """Cut the shards at ``offsets`` with lengths ``shards`` into chunks of at most ``block`` elements."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    rows = []
    for off, shard in zip(offsets, shards, strict=True):
        for start in range(off, off + shard, block):
            rows.append((start, min(block, off + shard - start), world_size * off + (start - off), shard))
    divisor = functools.reduce(math.gcd, shards, 0)
    return ChunkTable(torch.tensor(rows, dtype=torch.int64, device=device).view(-1, CHUNK_FIELDS), block, divisor)


def group_chunk_table(layout, block: int, device: torch.device | str = "cpu") -> ChunkTable:
    """``chunk_table`` of a group's layout (``odcfsdp.sharding.placement.layout.GroupLayout``)."""
    return chunk_table([s.offset for s in layout.slots], [s.shard for s in layout.slots], layout.world_size, block,
                       device)
