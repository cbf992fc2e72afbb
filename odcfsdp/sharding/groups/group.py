"""One flat parameter group: its rows, unsharded buffer and gradient buffer, its state and its parameters.

A group's life, in numbered steps (its states are ``GroupState``):

1. built: the transport allocated its row and accumulator; the master row is filled
   from the model's values and published to the row; SHARDED (modules hold shards);
2. a site needs it ([lifecycle] 2 and 5 in ``lifecycle.py``): ``to_unsharded`` resizes
   the unsharded storage back and gathers every rank's row into it (ahead of use on a
   side stream, [streams]); UNSHARDED (modules hold the unsharded parameters, [params]);
3. in backward ([lifecycle] 5-7): autograd keeps the trained parameters' gradients, and after
   the group's last site the lifecycle takes them, copied into one buffer ([fresh-grads] in
   ``fresh_grads.py``; where their dtype is not the buffer's, ``prepare_grad`` gives the parameters
   a zeroed buffer to accumulate into, [grad-buffers]) (``take_grad_buffer``), and pushes it into
   the owners' accumulator rows; ``to_sharded`` frees the storage:
   SHARDED again;
4. at the minibatch's meetings ([lifecycle] 8-10, [step-protocol]): ``attach_grads``
   shows the accumulator as the shards' ``.grad``; the optimizer updates the master
   in place; ``publish`` copies the master into the row, ``detach_grads`` and the
   zeroed accumulator ([streams] 5) start the next minibatch;
5. ``release`` drops rows and buffers when the wrapper closes.

Design note [storage-resize]
----------------------------
Each unsharded parameter is, for its whole life, a view into the group's
parameter-major unsharded buffer (``param.data = view``). Resharding frees that
buffer by resizing its *storage* to zero bytes, and unsharding resizes it back and
refills it in place. Autograd keeps references to the parameters it saved for
backward; because those references share the storage, a re-gather before backward
makes them valid again without autograd noticing (the parameters' version counters
are their own, not the buffer's, so the in-place refill trips no check). Outside
their group's unsharded state, modules hold the sharded form instead ([params]), so
no code outside forward ever sees a freed storage.

Design note [grad-buffers]
--------------------------
(Only where a group's gradients are not in its buffer's dtype since [fresh-grads], ``fresh_grads.py``; the
rest of this note holds for both.) A trained parameter's ``.grad`` is, during backward, a view of its group's
parameter-major gradient buffer, so autograd's own gradient accumulation adds into
the buffer in place: no Python runs per parameter (a post-accumulate-grad hook per
parameter cost host time per parameter, which made backward launch-bound). The
post-backward of a site runs after the gradients of its parameters have been
accumulated: autograd runs gradient accumulation first among the nodes that are
ready together, which FSDP2 relies on too. A gradient that reaches a parameter after
its group was pushed (a parameter used outside its site, after the site's backward)
lands in a fresh ``.grad``; the end-of-backward callback collects it
(``collect_late_grads``) and pushes it too, so nothing is lost, only pushed late. One that
arrives *before* its group's buffer exists (a parameter read outside its site, in the
forward of a site whose backward comes later: TRL's fused head reads ``lm_head.weight``)
is added into the buffer when it is made (``prepare_grad``): it was overwritten, and
the head trained on a zero gradient.

Design note [masters]
---------------------
Each group keeps an fp32 master row (wider for wider parameters), the local tensor
of its parameters' shards: optimizers update it in place. The communicated row in
``param_dtype`` is published from it (``publish``: a cast, rounding to nearest
even) when a minibatch ends ([step-protocol]); with ``param_dtype`` equal to the
master's dtype the row *is* the master and publishing is nothing. (A bf16 row plus
16 low bits would save 2 bytes per parameter / N, but no torch optimizer can update
such a pair in place: ``split_masters`` holds the masters so only inside a minibatch, [split-masters].)

Design note [offload]
---------------------
``offload_policy=CPUOffloadPolicy(pin_memory=True)`` (FSDP2's) keeps each group's fp32
master in host memory (pinned), so optimizers create their state there and step on the
CPU: 12 bytes per parameter / N (master 4 + AdamW 8) leave the GPU, which keeps the
``param_dtype`` row peers read (2) and the accumulator peers push into (4). At the sync the
accumulator is copied into a host gradient buffer (kept from minibatch to minibatch) that
``.grad`` views; at the finish the updated master is copied (and cast) into the row. Both
copies are whole groups, queued back to back, between the two meetings and not overlapped
with compute: an accumulator is final only at the sync (peers push into it until then) and
a row must be final before the finish's meeting (peers read it one-sidedly right after).
FSDP2 overlaps its copies because each layer's reduce-scatter output is final in backward and
each layer's parameters are needed only at its forward; doing the same here needs per-group
device-side flags (a peer's gather of group g waits for g's row, the copy of g's gradient
starts once its last push landed), and the user's single ``opt.step()`` reads every ``.grad``
before it updates any (how the step compares with FSDP2's offload: docs/design.md, Figures behind the design notes). The
clip's norm is reduced over host gradients, so the process group needs a CPU backend
(``cuda:nccl,cpu:gloo``, as for FSDP2's offload; ``odcfsdp.launch`` sets it up).

Design note [gather-masters]
----------------------------
By default a rank keeps two copies of its rows: the fp32 master (optimizers update it)
and a ``param_dtype`` row on the transport's heap (peers gather it), published from the
master when a minibatch ends ([masters]). With ``gather_masters=True`` the master itself
lives where peers read it, and gathers cast while they unpack (to nearest even, what
publishing does), so the gathered values are the same to the bit and the resident
``param_dtype`` row is gone: 2 bytes per parameter / N with bf16, the whole gap between
odcfsdp's resident state (master 4 + row 2 + accumulator 4 + AdamW 8 = 18 P/N) and
FSDP2's (16 P/N). The price is twice the bytes per gather (fp32 over NVLink), hidden
behind compute when a layer's compute outlasts its gather. Masters change only between
the minibatch's meetings, when nobody gathers ([step-protocol]), so peers never see a
half-updated master. NVSHMEM get calls (peers without load/store) cannot cast, so that
path refuses it.
"""

from __future__ import annotations

import enum

import torch
import torch.nn as nn

from ..placement.layout import GroupLayout
from .fresh_grads import buffer_from_grads, fresh_grads_apply
from .param import ShardedParam
from .row_format import RowFormat
from ..transport.streams import CommStreams
from ...torch_private import version_of


class GroupState(enum.Enum):
    """Whether a group's full values are materialised on this rank."""

    SHARDED = enum.auto()
    """Only this rank's row (and master row) is held; the unsharded storage is freed; modules hold shards."""
    UNSHARDED = enum.auto()
    """The unsharded buffer holds the full values; modules hold the unsharded parameters."""


def reshard_all(groups) -> None:
    """Free every group's unsharded buffer (the modules hold their shards again)."""
    for g in groups:
        g.to_sharded()


class FlatGroup:
    """A flat group of parameters sharded row-wise over the ranks of a transport.

    Storage, owned here: ``row`` (this rank's row, what peers gather; on the
    transport's heap), ``accumulator`` (this rank's gradient accumulator row, what
    peers push into; None for frozen groups) and ``master`` (the row optimizers
    update, see [masters]).

    Args:
        layout: the group's layout (see [layout]).
        params: the model's parameters of the group, in slot order. Their current
            values become this rank's master row.
        registrations: for each, every (module, attribute) it is registered under.
        comm: moves rows (its transport allocated this group's row and accumulator), on
            side streams where there are some ([streams]).
        row_format: what the row holds, where the master lives and how it is published ([row-format]).
        device_mesh: the DTensor mesh of the shards (None in a single process).
        first_position: the model-order position of the group's first parameter.
    """

    def __init__(self, layout: GroupLayout, params: list[nn.Parameter],
                 registrations: list[list[tuple[nn.Module, str]]], comm: CommStreams, row_format: RowFormat,
                 device_mesh, first_position: int = 0):
        initial = [p.detach() for p in params]  # keeps the original storage alive until loaded
        transport = comm.transport
        self.format = row_format
        self.layout = layout
        self.comm = comm
        self.index = layout.index
        self.rank = transport.rank
        self.row = transport.rows[self.index]
        self.accumulator = transport.accumulators[self.index]
        self.master = row_format.make_master(self.row)  # [offload]: in host memory, with the optimizer's state
        self.join_masters = None  # [split-masters]: makes every split master whole (set where they may be split)
        self._grad_host: torch.Tensor | None = None  # [offload]: the host copy of the accumulator .grad views
        self.unsharded = torch.empty(layout.unsharded_numel, dtype=row_format.compute_dtype, device=self.row.device)
        self.grad_dtype = row_format.grad_dtype
        self._unsharded_nbytes = self.unsharded.untyped_storage().nbytes()
        self.grad_buffer: torch.Tensor | None = None  # parameter-major gradients of the current backward
        self._grad_copy: torch.Tensor | None = None  # READY: the accumulator in the masters' dtype ([precision])
        self._ready: torch.cuda.Event | None = None  # set while a gather queued ahead may still be writing
        self.sites = 0  # hook sites that use this group (set once the hooks are registered)
        # FSDP2's per-module settings ([lifecycle] 4, 6, 7): free the unsharded storage after the last forward
        # use (else keep it for backward) and after backward (else keep it until the step's finish)
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.held = 0  # methods registered with register_fsdp_forward_method running over it: stays gathered
        self.owner = None  # the settings of the fully_shard unit this group belongs to ([fully-shard])
        # Sites of this group still to run in the current forward / backward pass.
        self.forward_uses_left = 0
        self.backward_uses_left = 0
        wraps = row_format.wraps(layout)  # per parameter, its unsharded form from its view (None: the view)
        self.params = [ShardedParam(layout, i, self.unsharded, self.master, self.accumulator, self.rank, p, regs,
                                    device_mesh, first_position + i, wraps[i] if wraps else None)
                       for i, (p, regs) in enumerate(zip(params, registrations, strict=True))]
        self._trained = [sp for sp in self.params if sp.trainable]  # may be trained: an accumulator view each
        self._fresh_grads = fresh_grads_apply(self.params, self.grad_dtype, self.unsharded)  # [fresh-grads]
        self._published_version = self._versions()
        if not params[0].is_meta:  # a meta model has no values yet: rows stay zero until loaded
            self.load_full_(initial)
        self.state = GroupState.UNSHARDED
        self.to_sharded()

    # -- values ----------------------------------------------------------------
    def load_full_(self, values: list[torch.Tensor]) -> None:
        """Set this rank's master row (and row) from full parameter values (inside ``rows_changing``)."""
        with torch.no_grad():
            self.master.copy_(self.layout.shard_row(values, self.rank, self.master.dtype))
        self.publish()

    def read_master(self) -> torch.Tensor:
        """This rank's master row (the shards' storage: treat as read-only outside a row change); whole again first
        where it was split ([split-masters])."""
        if self.join_masters is not None:
            self.join_masters()
        return self.master

    def publish(self) -> None:
        """Make the communicated row peers gather from the master, as the group's row format does ([row-format]):
        a cast, nothing when they coincide, or for float8 rows the cast after the finish's meeting."""
        self.format.publish(self.master, self.row)
        self.note_published()

    def note_published(self) -> None:
        """The master is what its row was published from (after a publish, or a split master joined:
        [split-masters])."""
        self._published_version = self._versions()

    def _versions(self) -> tuple[int, ...]:
        # A plain tensor view shares its base's version counter, but an in-place op on a DTensor bumps only the
        # DTensor's own (its local tensor is changed below autograd): both are watched.
        return (version_of(self.master), *(version_of(sp.sharded) for sp in self.params))

    @property
    def master_changed(self) -> bool:
        """Whether the master row (through a shard or directly) changed in place since it was last published."""
        return self._versions() != self._published_version

    @property
    def offloaded(self) -> bool:
        """Whether the master lives in host memory ([offload]; the row format's)."""
        return self.format.offloaded

    def release(self) -> None:
        """Drop the rows and buffers (the wrapper is closing; the transport frees the heap)."""
        for sp in self.params:
            sp.release()
        self.master = self.row = self.accumulator = self.grad_buffer = self._grad_host = self._grad_copy = None

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
    def to_unsharded(self, ahead: bool = False) -> None:
        """Materialise the full values (gather from all ranks) and register them; no-op if already there.

        ``ahead`` (a prefetch) fills the buffer on the gather stream, after the work
        queued so far on the current stream ([streams]); ``wait_ready`` must run before
        the current stream uses it (``to_sharded`` runs it, so a freed buffer is never
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
            self._ready = self.comm.gather(self.index, self.unsharded, ahead)
        for sp in self.params:
            sp.to_unsharded()
        self.state = GroupState.UNSHARDED

    def wait_ready(self) -> None:
        """Make the current stream wait for a pending prefetch of this group."""
        self.comm.wait(self._ready)
        self._ready = None

    def to_sharded(self) -> None:
        """Free the full values; the modules hold the shards again."""
        if self.state is GroupState.SHARDED:
            return
        self.wait_ready()
        self.unsharded.untyped_storage().resize_(0)
        for sp in self.params:
            sp.to_sharded()
        self.state = GroupState.SHARDED

    # -- gradients -------------------------------------------------------------
    def prepare_grad(self) -> None:
        """Point each trained parameter's ``.grad`` at its view of a zeroed gradient buffer.

        Autograd then accumulates gradients into the buffer in place, with no Python
        hook per parameter (see [grad-buffers]); no-op when the buffer exists or
        nothing is trained.
        """
        if self.grad_buffer is not None or self._fresh_grads or not any(sp.trained for sp in self._trained):
            return  # [fresh-grads]: autograd keeps its own gradient tensors, copied into a buffer at the push
        self.grad_buffer = torch.zeros(self.layout.unsharded_numel, dtype=self.grad_dtype,
                                       device=self.unsharded.device)
        for i, sp in enumerate(self.params):
            if sp.trained:
                view = self.layout.param_view(self.grad_buffer, i)
                if sp.unsharded.grad is not None:  # arrived before the buffer: the parameter was read outside its
                    view.add_(sp.unsharded.grad)  # site (TRL's fused head reads lm_head.weight), and is kept
                sp.unsharded.grad = view

    def add_grad(self, i: int, grad: torch.Tensor) -> None:
        """Add a gradient of parameter ``i`` that autograd left outside the buffer (see ``prepare_grad``)."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros(self.layout.unsharded_numel, dtype=grad.dtype, device=grad.device)
        self.layout.param_view(self.grad_buffer, i).add_(grad)

    def collect_late_grads(self) -> bool:
        """Move gradients autograd left in unsharded parameters' own ``.grad`` into a buffer; True if any."""
        found = False
        for i, sp in enumerate(self.params):
            if sp.trained and sp.unsharded.grad is not None:
                self.add_grad(i, sp.unsharded.grad)
                sp.unsharded.grad = None
                found = True
        return found

    def take_grad_buffer(self) -> torch.Tensor | None:
        """The pending gradient buffer, handed over for its push ([lifecycle] 6-7): the group forgets it, and the
        push stream holds what it still reads ([streams] 2). None: nothing pending."""
        grad = self.grad_buffer
        if grad is None and self._fresh_grads:
            grad = buffer_from_grads(self.layout, self.params, self.grad_dtype, self.unsharded.device)
        if grad is not None:
            self.drop_grad_buffer()
        return grad

    def pending_grads(self) -> list[torch.Tensor]:
        """The gradients of this backward not pushed yet: the buffer, or autograd's own tensors ([fresh-grads])."""
        if self.grad_buffer is not None:
            return [self.grad_buffer]
        return [sp.unsharded.grad for sp in self._trained if sp.unsharded.grad is not None] if self._fresh_grads else []

    def drop_grad_buffer(self) -> None:
        """Forget the gradient buffer and the parameters' views of it: once pushed, or, unpushed, after an aborted
        backward ([lifecycle]'s ``reset``)."""
        self.grad_buffer = None
        for sp in self._trained:
            sp.unsharded.grad = None

    # -- the step protocol's per-group work ----------------------------------------------------
    def attach_grads(self) -> None:
        """Every trained parameter's shard ``.grad`` is its view of the (complete) accumulator, or, when the
        accumulator is narrower than the master (a ``reduce_dtype``, [precision]) or on another device (the master
        offloaded, [offload]), of a copy of it in the master's dtype and place."""
        if self.accumulator is not None and (self.offloaded or self.accumulator.dtype != self.master.dtype):
            if self.offloaded:  # [offload]: a host copy, its buffer kept from minibatch to minibatch
                if self._grad_host is None:
                    self._grad_host = torch.empty(self.master.shape, dtype=self.master.dtype,
                                                  pin_memory=self.format.pin)
                # Queued, not waited for: every group's copy goes back to back, and the protocol waits once
                # for all of them (wait_host_copies) before the optimizer reads them on the CPU.
                self._grad_copy = self._grad_host.copy_(self.accumulator, non_blocking=self.format.pin)
            else:
                self._grad_copy = self.accumulator.to(self.master.dtype)
            for sp in self._trained:
                if sp.trained:
                    sp.attach_grad(self.layout, self._grad_copy, self.rank)
            return
        for sp in self._trained:
            if sp.trained:  # a parameter frozen since it was sharded gets no .grad, as FSDP2's ([requires-grad])
                sp.attach_grad()

    def wait_host_copies(self) -> None:
        """Wait until the queued copies into the host gradient buffers are done ([offload]): every group's are
        queued on the current stream, so one group's wait covers them all."""
        if self.offloaded and self.accumulator is not None and self.accumulator.is_cuda:
            torch.cuda.current_stream(self.accumulator.device).synchronize()

    def detach_grads(self) -> None:
        """Drop every trained parameter's shard ``.grad`` (and the upcast copy, if any)."""
        for sp in self._trained:
            sp.detach_grad()
        self._grad_copy = None

