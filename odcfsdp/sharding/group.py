"""One flat parameter group: its master row, unsharded buffer and gradient buffer.

Design note [storage-resize]
----------------------------
Each parameter of the group is, for its whole life, a view into the group's
parameter-major unsharded buffer (``param.data = view``). Resharding frees that
buffer by resizing its *storage* to zero bytes, and unsharding resizes it back and
refills it in place. Autograd keeps references to the parameters it saved for
backward; because those references share the storage, a re-gather before backward
makes them valid again without autograd noticing (the parameters' version counters
are their own, not the buffer's, so the in-place refill trips no check).

Design note [grad-buffers]
--------------------------
A trained parameter's ``.grad`` is, during backward, a view of its group's
parameter-major gradient buffer, so autograd's own gradient accumulation adds into
the buffer in place: no Python runs per parameter (a post-accumulate-grad hook per
parameter cost ~0.1 ms of host time each, which made backward launch-bound). The
post-backward of a site runs after the gradients of its parameters have been
accumulated: autograd runs gradient accumulation first among the nodes that are
ready together, which FSDP2 relies on too. A gradient that reaches a parameter after
its group was pushed (a parameter used outside its site, after the site's backward)
lands in a fresh ``.grad``; the end-of-backward callback collects it
(``collect_late_grads``) and pushes it too, so nothing is lost, only pushed late.

Design note [split-master]
--------------------------
With bf16 rows and fp32 masters, the master is not kept as a separate fp32 row: the
communicated bf16 row holds its upper 16 bits (rounded to nearest, ties away from
zero) and ``master_lo`` its lower 16 bits, from which the exact fp32 value is rebuilt
(``odcfsdp.kernels.split_master``). That saves 2 bytes per parameter over N, the
cost of the bf16 row copy other mixed-precision FSDPs cast on the fly. Code reads
masters with ``read_master`` and changes them inside ``updating_master``.
"""

from __future__ import annotations

import contextlib
import enum
from typing import Iterator

import torch
import torch.nn as nn

from ..kernels.split_master import join_master, split_master_
from .layout import GroupLayout
from .transport import Transport


def _after_current(stream: torch.cuda.Stream | None):
    """Context running on ``stream`` after the work queued so far on the current stream (None: stay)."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


class GroupState(enum.Enum):
    """Whether a group's full values are materialised on this rank."""

    SHARDED = enum.auto()
    """Only this rank's row (and master row) is held; the unsharded storage is freed."""
    UNSHARDED = enum.auto()
    """The unsharded buffer holds the full values; the parameters can be used."""


class FlatGroup:
    """A flat group of parameters sharded row-wise over the ranks of a transport.

    Storage, owned here: ``row`` (this rank's row, what peers gather; on the
    transport's heap), ``accumulator`` (this rank's fp32 gradient accumulator row, what
    peers push into; None for frozen groups) and the master row (``read_master``).

    Args:
        layout: the group's layout (see [layout]).
        params: the group's parameters, in slot order. Their current values become
            this rank's master row; they then become views into the unsharded
            buffer, which stays freed until ``to_unsharded`` is called.
        transport: allocated this group's row and accumulator; moves them.
        master_dtype: dtype of the master row the optimizer updates (fp32 or wider).
    """

    def __init__(self, layout: GroupLayout, params: list[nn.Parameter], transport: Transport, master_dtype: torch.dtype):
        initial = [p.detach() for p in params]  # keeps the original storage alive until loaded
        self.layout = layout
        self.params = list(params)
        self.transport = transport
        self.index = layout.index
        self.rank = transport.rank
        self.row = row = transport.rows[self.index]
        self.accumulator = transport.accumulators[self.index]
        self.master_dtype = master_dtype
        self.split = row.dtype == torch.bfloat16 and master_dtype == torch.float32  # see [split-master]
        # With comm dtype == master dtype the row *is* the master: no second copy.
        self._master = None if self.split else row if row.dtype == master_dtype else torch.zeros_like(row, dtype=master_dtype)
        self.master_lo = torch.zeros_like(row, dtype=torch.int16) if self.split else None
        self.unsharded = torch.empty(layout.unsharded_numel, dtype=row.dtype, device=row.device)
        self._unsharded_nbytes = self.unsharded.untyped_storage().nbytes()
        self.grad: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None  # set while a prefetch may still be writing
        self._trained = [i for i, p in enumerate(params) if p.requires_grad]
        self.sites = 0  # hook sites that use this group (set once the hooks are registered)
        # Sites of this group still to run in the current forward / backward pass.
        self.forward_uses_left = 0
        self.backward_uses_left = 0
        if not params[0].is_meta:  # a meta model has no values yet: rows stay zero until loaded
            self.load_full_(initial)
        self.bind_params()
        self.state = GroupState.UNSHARDED
        self.to_sharded()

    # -- values ----------------------------------------------------------------
    def load_full_(self, values: list[torch.Tensor]) -> None:
        """Set this rank's master row (and row) from full parameter values."""
        with self.updating_master() as master:
            master.copy_(self.layout.shard_row(values, self.rank, master.dtype))

    def read_master(self) -> torch.Tensor:
        """This rank's master row in ``master_dtype`` (treat as read-only: it may be the stored row itself)."""
        if self.split:
            return join_master(self.row, self.master_lo)
        return self._master

    @contextlib.contextmanager
    def updating_master(self) -> Iterator[torch.Tensor]:
        """The master row to change in place; on exit it is stored and published to the communicated row."""
        master = self.read_master()
        yield master
        row = self.row
        if self.split:
            split_master_(master, row, self.master_lo)
        elif row is not master:
            row.copy_(master)

    def release(self) -> None:
        """Drop the rows and buffers (the wrapper is closing; the transport frees the heap)."""
        self._master = self.master_lo = self.row = self.accumulator = self.grad = None

    def bind_params(self) -> None:
        """Point every parameter at its view of the unsharded buffer.

        Meta parameters cannot be re-pointed to another device; they are replaced by
        new ``nn.Parameter`` objects (``self.params``), which the caller swaps into
        the modules.
        """
        for i, p in enumerate(self.params):
            view = self.layout.param_view(self.unsharded, i)
            if p.is_meta:
                # Not nn.Parameter(view): that would share the buffer's version counter (see
                # [storage-resize]); .data assignment gives the parameter its own.
                p = self.params[i] = nn.Parameter(view.new_empty(0), requires_grad=p.requires_grad)
            p.data = view

    # -- use counting ----------------------------------------------------------
    def reset_uses(self) -> None:
        """A forward pass starts: every site of the group is still to run, forward and backward."""
        self.forward_uses_left = self.backward_uses_left = self.sites

    def forward_use_done(self) -> bool:
        """A site of the group finished its forward; True once it was the group's last."""
        self.forward_uses_left -= 1
        return self.forward_uses_left <= 0

    def backward_use_done(self) -> bool:
        """A site of the group finished its backward; True once it was the group's last."""
        self.backward_uses_left -= 1
        return self.backward_uses_left <= 0

    # -- state transitions -----------------------------------------------------
    def to_unsharded(self, stream: torch.cuda.Stream | None = None) -> None:
        """Materialise the full values (gather from all ranks); no-op if already there.

        With ``stream`` (a prefetch) the buffer is filled on that stream, after the
        work queued so far on the current stream; ``wait_ready`` must run before the
        current stream uses it (``to_sharded`` runs it, so a freed buffer is never
        reused while the gather may still write it).
        """
        if self.state is GroupState.UNSHARDED:
            return
        with torch.no_grad():
            # Allocated on the current (compute) stream, whose pool activations share: a buffer from
            # the prefetch stream's pool could never be reused by the compute stream, and reserved
            # memory grew by that pool. The prefetch then waits for the compute queue up to here
            # (when the block's previous user is done), which is the site before the one it serves:
            # the gather still overlaps the current site's compute.
            self.unsharded.untyped_storage().resize_(self._unsharded_nbytes)
            with _after_current(stream):
                self.transport.gather(self.index, self.unsharded)
                if stream is not None:
                    self._ready = torch.cuda.Event()
                    self._ready.record(stream)
        self.state = GroupState.UNSHARDED

    def wait_ready(self) -> None:
        """Make the current stream wait for a pending prefetch of this group."""
        if self._ready is not None:
            torch.cuda.current_stream(self.unsharded.device).wait_event(self._ready)
            self._ready = None

    def to_sharded(self) -> None:
        """Free the full values; parameters keep their (now empty) views."""
        if self.state is GroupState.SHARDED:
            return
        self.wait_ready()
        self.unsharded.untyped_storage().resize_(0)
        self.state = GroupState.SHARDED

    # -- gradients -------------------------------------------------------------
    def prepare_grad(self) -> None:
        """Point each trained parameter's ``.grad`` at its view of a zeroed gradient buffer.

        Autograd then accumulates gradients into the buffer in place, with no Python
        hook per parameter (see [grad-buffers] in the wrapper); no-op when the buffer
        exists or nothing is trained.
        """
        if self.grad is not None or not self._trained:
            return
        self.grad = torch.zeros(self.layout.unsharded_numel, dtype=self.unsharded.dtype, device=self.unsharded.device)
        for i in self._trained:
            self.params[i].grad = self.layout.param_view(self.grad, i)

    def add_grad(self, i: int, grad: torch.Tensor) -> None:
        """Add a gradient of parameter ``i`` that autograd left outside the buffer (see ``prepare_grad``)."""
        if self.grad is None:
            self.grad = torch.zeros(self.layout.unsharded_numel, dtype=grad.dtype, device=grad.device)
        self.layout.param_view(self.grad, i).add_(grad)

    def collect_late_grads(self) -> bool:
        """Move gradients autograd left in parameters' own ``.grad`` into a buffer; True if there were any."""
        found = False
        for i in self._trained:
            p = self.params[i]
            if p.grad is not None:
                self.add_grad(i, p.grad)
                p.grad = None
                found = True
        return found

    def push_grad(self, stream: torch.cuda.Stream | None = None) -> bool:
        """Scatter-accumulate the pending gradient into the owners' rows; return whether one was pushed.

        With ``stream`` the push runs there, after everything queued so far on the
        current stream (which wrote the gradient), overlapping what comes next.
        """
        if self.grad is None:
            return False
        with torch.no_grad(), _after_current(stream):
            self.transport.scatter_accumulate(self.index, self.grad)
        if stream is not None:
            self.grad.record_stream(stream)  # freed only once the push has read it
        self.grad = None
        for i in self._trained:
            self.params[i].grad = None
        return True
