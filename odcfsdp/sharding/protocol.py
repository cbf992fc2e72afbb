"""The step protocol: the one place ranks meet in a minibatch, and every change of the rows.

Design note [step-protocol]
---------------------------
Between two steps, rows do not change, so any rank may gather any row at any time,
and pushes are adds that need no order. Everything that changes rows (an optimizer
update, a checkpoint or Hugging Face load, ``load_full_state_dict``) happens inside
``rows_changing()``:

1. reshard every group (full copies would go stale);
2. make this rank's pushes complete and visible (its push stream, then the
   transport's ``quiesce``);
3. barrier: every rank's pushes are in, and nobody gathers any more;
4. (the body) read the complete accumulators, change master rows, publish them to the
   communicated rows, zero accumulators;
5. make the writes visible, let later prefetches (side stream) see them, barrier:
   nobody gathers or pushes before every row is final.

The time spent in step 3 is the rank's wait for the others (``last_wait_s``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Sequence

import torch

from .group import FlatGroup
from .mesh import ShardMesh
from .transport import Transport


class StepProtocol:
    """Counts gradient pushes and runs the minibatch's meeting (see [step-protocol]).

    Args:
        groups: every group of the model.
        transport: moves the groups' rows.
        mesh: the ranks that meet.
        gather_stream: the prefetch stream (CUDA), which must see updated rows.
        push_stream: the stream pushes run on (CUDA), which must be done before a step.
    """

    def __init__(self, groups: Sequence[FlatGroup], transport: Transport, mesh: ShardMesh,
                 gather_stream: torch.cuda.Stream | None = None, push_stream: torch.cuda.Stream | None = None):
        self.groups = list(groups)
        self.transport = transport
        self.mesh = mesh
        self.gather_stream = gather_stream
        self.push_stream = push_stream
        self.pushes = 0  # gradient pushes of this rank since the last step
        self.last_wait_s = 0.0

    def push(self, group: FlatGroup) -> None:
        """Push ``group``'s pending gradient (if any) and count it."""
        self.pushes += group.push_grad(self.push_stream)

    def consume_push_count(self) -> int:
        """Pushes since the last call (the step's bookkeeping)."""
        n, self.pushes = self.pushes, 0
        return n

    def reshard_all(self) -> None:
        """Free every group's unsharded buffer."""
        for g in self.groups:
            g.to_sharded()

    def wait_pushes(self) -> None:
        """Make this rank's pushes complete and visible to their owners."""
        if self.push_stream is not None:
            torch.cuda.current_stream(self.push_stream.device).wait_stream(self.push_stream)
        self.transport.quiesce()

    def after_update(self) -> None:
        """Rows changed: later prefetches (issued on the side stream) must see the new values."""
        if self.gather_stream is not None:
            self.gather_stream.wait_stream(torch.cuda.current_stream(self.gather_stream.device))

    @contextlib.contextmanager
    def rows_changing(self) -> Iterator[None]:
        """The context in which rows may change (collective: every rank enters; see [step-protocol])."""
        self.reshard_all()
        t0 = time.perf_counter()
        self.wait_pushes()
        self.mesh.barrier()
        self.last_wait_s = time.perf_counter() - t0
        yield
        self.transport.quiesce()
        self.after_update()
        self.mesh.barrier()
