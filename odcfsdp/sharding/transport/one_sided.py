"""Common base of the one-sided transports: rows and accumulators on a symmetric heap."""

from __future__ import annotations

from abc import abstractmethod

from ..placement.layout import GroupLayout
from ..placement.mesh import ShardMesh
from .base import Transport
from .heap import SymmetricHeap, heap_plan


class OneSidedTransport(Transport):
    """Places every group's row and accumulator on a symmetric heap (see [heap]).

    ``peer_rows[q][g]`` / ``peer_accs[q][g]`` are rank q's row / accumulator of group
    g as seen from this rank; ``rows`` / ``accumulators`` are this rank's own. Owners'
    rows change only between two meetings of the step protocol ([step-protocol]: the sync
    or change meeting, then the finish), so gathers need no synchronisation; pushes are atomic adds (or
    locked adds), so neither do they.
    """

    def __init__(self, mesh: ShardMesh):
        super().__init__(mesh)
        self.heap: SymmetricHeap | None = None
        self.heap_bytes = 0

    @abstractmethod
    def _make_heap(self, nbytes: int) -> SymmetricHeap:
        """Create the heap (collective over the group)."""

    def _allocate(self, layouts: list[GroupLayout]):
        plan = heap_plan(layouts, self.row_dtypes, self.accum_dtypes)
        self.heap_bytes = plan.nbytes
        self.heap = self._make_heap(plan.nbytes)
        self.peer_rows = [
            [self.heap.view(q, off, lay.row_len, dtype)
             for off, lay, dtype in zip(plan.row_offsets, layouts, self.row_dtypes)]
            for q in range(self.world_size)
        ]
        self.peer_accs = [
            [
                None if off is None else self.heap.view(q, off, lay.row_len, dtype)
                for off, lay, dtype in zip(plan.acc_offsets, layouts, self.accum_dtypes)
            ]
            for q in range(self.world_size)
        ]
        self.heap.region(self.rank).zero_()
        return self.peer_rows[self.rank], self.peer_accs[self.rank]

    def close(self) -> None:
        super().close()
        self.peer_rows, self.peer_accs = [], []
        if self.heap is not None:
            self.heap.close()
            self.heap = None
