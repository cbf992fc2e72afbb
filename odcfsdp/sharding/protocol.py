"""The step protocol: when ranks meet in a minibatch, and every change of the rows.

Design note [step-protocol]
---------------------------
During a minibatch rows do not change, so any rank gathers any row at any time, and
pushes are adds that need no order: ranks do not meet. They meet where the standard
PyTorch loop already needs every rank's gradients, without any call of odcfsdp's own:

1. *sync*, at the first read of a sharded parameter's ``.grad`` after the
   minibatch's backward passes (``clip_grad_norm_`` or the optimizer's step read
   it): this rank's pushes are made complete and visible (its push stream, the
   transport's ``quiesce``), then one meeting: afterwards every rank's pushes are
   in, so each rank's accumulator rows hold its fully reduced gradient shard, and
   they are attached as the shards' ``.grad`` ([params]);
2. the user's ``clip_grad_norm_`` (one all-reduce of the norm) and ``opt.step()``
   update the fp32 masters in place; an optimizer step (global step hooks) or
   setting ``.grad`` to None (``opt.zero_grad()``) *releases* the gradients;
3. *finish*, at the next forward (or ``.grad`` read) after a release: reshard
   every group, publish masters to rows (trained groups, and any other whose
   master changed: in-place edits between the step and the next forward, such as
   an EMA or a clamp, are published too), zero accumulators, drop ``.grad``, one
   meeting: nobody gathers or pushes before every row is final.

Anything else that changes rows (``load_state_dict``, checkpoint and Hugging Face
loads, user code in ``ODCShard.changing_parameters()``) runs inside
``rows_changing()``: reshard, pushes complete, meeting, the change, then the
finish's work and its meeting. A parameter changed in place anywhere else (the
master's version counter, which its shards' views share, tells) would leave peers
gathering stale rows, so the next forward raises instead.

Ranks run the same loop with possibly different numbers of micro-batches (zero
included), so they reach these points in the same order: a rank with no
micro-batch meets at its ``clip_grad_norm_`` (1, after finishing the previous
minibatch, 3) while the others finish at their first forward and sync at theirs.
Every meeting is one small all-gather of (kind, minibatch number, pushes): if ranks
meet at different points (a rank finishing while another syncs), every rank raises
the same error instead of mixing two minibatches. Supported: ``opt.zero_grad()`` with
its default ``set_to_none=True``, before the micro-batches or after the step.
``zero_grad(set_to_none=False)`` leaves gradients attached, so a rank without
micro-batches cannot tell the next minibatch's ``clip_grad_norm_`` from the previous
one's; with one-sided transports it needs every rank to run at least one micro-batch.

Design note [grad-protocol]
---------------------------
``GradState`` and the ``.grad`` property of sharded parameters:

* ``ACCUMULATING``: a ``.grad`` read syncs (1): the state becomes ``READY``, with
  the accumulator shards attached; or ``EMPTY`` if no rank had pushed anything;
* ``EMPTY``: ``.grad`` is None (nothing was accumulated anywhere, as in plain PyTorch
  before a backward); the first read of each parameter returns it, a second read
  of the same parameter is a new pass over the parameters and syncs again: a rank
  without micro-batches takes ``zero_grad()`` before them and ``clip_grad_norm_``
  after them as two passes, as ranks with micro-batches do (their forward in
  between goes back to ``ACCUMULATING`` without a meeting);
* ``READY``: reads return the attached shard; setting it to None releases; a
  forward without grad (evaluation) keeps them; one in grad mode goes back to
  accumulating (the gradients read so far keep growing, as in plain PyTorch) in a
  single process or with the collective transport, where every rank runs the same
  micro-batches, and raises with one-sided transports on several ranks, where other
  ranks took that read for the end of the minibatch;
* ``RELEASED``: reads return a still-attached shard (a second optimizer over other
  parameters; ``zero_grad`` reading what it clears), while a read of a dropped one
  finishes (3) and syncs the next minibatch: that is a rank without micro-batches
  at its ``clip_grad_norm_``; the next forward finishes.

Reads during forward or backward never meet (they return what is attached). Frozen
parameters have no gradient. Trained parameters that got no gradient in a
minibatch in which some rank pushed get zeros (ranks cannot tell "none" from
"zero" without another meeting), so weight decay and momentum still move them, as
in other flat-buffer optimizers. A tensor assigned to ``.grad`` is kept and used by
the next optimizer step, as in plain PyTorch (``torch.distributed.checkpoint``
initialises optimizer state that way).
"""

from __future__ import annotations

import contextlib
import enum
import time
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from .mesh import ShardMesh
from .transport import Transport

if TYPE_CHECKING:
    from .group import FlatGroup
    from .param import ShardedParam


class GradState(enum.Enum):
    """Where a minibatch's gradients are (see [grad-protocol])."""

    ACCUMULATING = enum.auto()
    """Pushes land in the accumulators; no ``.grad`` is attached."""
    EMPTY = enum.auto()
    """Synced, and no rank had pushed anything: no ``.grad`` (as in plain PyTorch before any backward)."""
    READY = enum.auto()
    """Every rank's pushes are in; ``.grad`` are the accumulator shards."""
    RELEASED = enum.auto()
    """An optimizer stepped on the gradients, or they were set to None: the minibatch is to be finished."""


class _Meeting(enum.IntEnum):
    SYNC = 1
    CHANGE = 2
    FINISH = 3


class StepProtocol:
    """Counts gradient pushes and runs the minibatch's meetings (see [step-protocol]).

    Args:
        transport: moves the groups' rows.
        mesh: the ranks that meet.
        gather_stream: the prefetch stream (CUDA), which must see updated rows.
        push_stream: the stream pushes run on (CUDA), which must be done before a step.
        busy: returns True while a forward or backward pass is in flight.
    """

    def __init__(self, transport: Transport, mesh: ShardMesh, gather_stream: torch.cuda.Stream | None = None,
                 push_stream: torch.cuda.Stream | None = None, busy=lambda: False):
        self.groups: list[FlatGroup] = []
        self.transport = transport
        self.mesh = mesh
        self.gather_stream = gather_stream
        self.push_stream = push_stream
        self.busy = busy
        self.state = GradState.ACCUMULATING
        self.pushes = 0  # gradient pushes of this rank since the last finish
        self.minibatch = 0  # finished minibatches (every rank counts the same)
        self.synced_pushes = 0  # every rank's pushes, as of the last sync
        self._read_while_empty: set = set()  # parameters whose .grad was read since a sync that found nothing
        self.last_wait_s = 0.0  # time the last sync waited for the other ranks
        self._hooks = []

    def attach(self, groups: Sequence[FlatGroup]) -> None:
        """Take the model's groups and watch every optimizer's steps (global hooks, removed by ``close``)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.groups = list(groups)
        self._trained = [g for g in self.groups if g.layout.requires_grad]
        self._hooks = [register_optimizer_step_post_hook(self._after_step)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- pushes ------------------------------------------------------------------------------------
    def push(self, group: FlatGroup) -> None:
        """Push ``group``'s pending gradient (if any) and count it."""
        self.pushes += group.push_grad(self.push_stream)

    @property
    def pending_pushes(self) -> int:
        """Pushes whose gradients no optimizer step or release has consumed yet."""
        return 0 if self.state is GradState.RELEASED else self.pushes

    def reshard_all(self) -> None:
        """Free every group's unsharded buffer (the modules hold shards)."""
        for g in self.groups:
            g.to_sharded()

    def wait_pushes(self) -> None:
        """Make this rank's pushes complete and visible to their owners."""
        if self.push_stream is not None:
            torch.cuda.current_stream(self.push_stream.device).wait_stream(self.push_stream)
        self.transport.quiesce()

    # -- meetings ------------------------------------------------------------------------------------
    def _meet(self, kind: _Meeting) -> torch.Tensor:
        """One meeting of all ranks; returns every rank's pushes. Raises alike on every rank if they disagree."""
        mine = torch.tensor([int(kind), self.minibatch, self.pushes], dtype=torch.int64, device=self.mesh.device)
        table = self.mesh.all_gather_rows(mine).cpu()
        if (table[:, :2] != table[0, :2]).any():
            names = {int(m): m.name.lower() for m in _Meeting}
            where = ", ".join(f"rank {r}: {names.get(k, f'meeting {k}')} of minibatch {m}"
                              for r, (k, m, _) in enumerate(table.tolist()))
            raise RuntimeError(
                f"ranks disagree about the minibatch ({where}). Every rank must read .grad (clip_grad_norm_, "
                "opt.step) only after its last backward of the minibatch, and clear it with opt.zero_grad() "
                "(set_to_none=True, the default) after the step")
        return table[:, 2]

    def sync(self) -> None:
        """Meeting 1 of [step-protocol]: every rank's pushes are in; attach the gradient shards."""
        t0 = time.perf_counter()
        self.wait_pushes()
        pushes = self._meet(_Meeting.SYNC)
        self.last_wait_s = time.perf_counter() - t0
        if not self.transport.one_sided and (pushes != pushes[0]).any():
            raise RuntimeError(
                f"comm='{self.transport.name}' needs the same number of micro-batches on every rank, but ranks pushed "
                f"{pushes.tolist()} gradients: balance with lb_micro, or use a one-sided transport")
        self.synced_pushes = int(pushes.sum())
        self._read_while_empty = set()
        if self.synced_pushes:
            for g in self._trained:
                g.attach_grads()
            self.state = GradState.READY
        else:  # nothing pushed anywhere: no gradients, as in plain PyTorch before a backward
            self.state = GradState.EMPTY

    def finish(self) -> None:
        """Meeting 3 of [step-protocol]: publish the updated rows, zero the accumulators, start a minibatch."""
        self.reshard_all()
        self._settle([g for g in self.groups if g.layout.requires_grad or g.master_changed], _Meeting.FINISH)

    def _settle(self, changed: Sequence[FlatGroup], kind: _Meeting) -> None:
        for g in changed:
            g.publish()
        for g in self._trained:
            g.zero_accumulator()
            g.detach_grads()
        self.transport.quiesce()
        if self.gather_stream is not None:  # later prefetches (side stream) must see the new rows
            self.gather_stream.wait_stream(torch.cuda.current_stream(self.gather_stream.device))
        self._meet(kind)
        self.pushes = 0
        self.minibatch += 1
        self.state = GradState.ACCUMULATING

    @contextlib.contextmanager
    def rows_changing(self) -> Iterator[None]:
        """Context in which master rows may change (collective; pending gradients are dropped)."""
        self.reshard_all()
        self.wait_pushes()
        self._meet(_Meeting.CHANGE)
        yield
        self._settle(self.groups, _Meeting.CHANGE)

    # -- the hooks of the standard loop ----------------------------------------------------------
    def finish_released(self) -> None:
        """Finish the minibatch if an optimizer step (or ``zero_grad``) released its gradients (collective then)."""
        if self.state is GradState.RELEASED:
            self.finish()

    def before_forward(self) -> None:
        """The root forward starts: finish a released minibatch; see [grad-protocol] for READY."""
        if self.state is GradState.RELEASED:
            self.finish()
            return
        changed = [g for g in self.groups if g.master_changed]
        if changed:
            names = [sp.name for sp in changed[0].params]
            raise RuntimeError(
                f"parameters were changed in place outside an optimizer step (one of {names[:4]}"
                f"{' ...' if len(names) > 4 else ''}), so the rows other ranks gather are stale: change them inside "
                "`with model.changing_parameters():` (collective), or with model.load_state_dict(), or between "
                "opt.step() and the next forward")
        if self.state is GradState.EMPTY and torch.is_grad_enabled():
            self.state = GradState.ACCUMULATING
        elif self.state is GradState.READY and torch.is_grad_enabled():
            if self.transport.one_sided and self.mesh.world_size > 1:
                raise RuntimeError(
                    "a forward pass after gradients were read (.grad, clip_grad_norm_) but neither stepped on nor "
                    "cleared: with a one-sided transport on several ranks, reading .grad ends the minibatch (it is "
                    "where ranks meet, and ranks may run different numbers of micro-batches). Read gradients only "
                    "after the minibatch's last backward, then opt.step() and/or opt.zero_grad()")
            for g in self._trained:
                g.detach_grads()
            self.state = GradState.ACCUMULATING

    def ready(self) -> None:
        """Make the gradients complete and attached (a ``.grad`` read; collective where it meets)."""
        self.finish_released()
        if self.state in (GradState.ACCUMULATING, GradState.EMPTY):
            self.sync()

    def read_grad(self, sp: ShardedParam) -> torch.Tensor | None:
        """The ``.grad`` property of a sharded parameter (see [grad-protocol])."""
        attached = sp.attached
        if not sp.trained or self.busy() or self.state is GradState.READY:
            return attached
        if self.state is GradState.RELEASED and attached is not None:
            return attached
        if self.state is GradState.EMPTY and sp not in self._read_while_empty:
            self._read_while_empty.add(sp)
            return attached
        self.ready()
        if self.state is GradState.EMPTY:
            self._read_while_empty.add(sp)
        return sp.attached

    def write_grad(self, sp: ShardedParam, value) -> None:
        """Setting ``.grad``: None releases the minibatch's gradients (``zero_grad``); a tensor is stored (and used
        by the next optimizer step, as plain PyTorch does)."""
        if value is None:
            sp.detach_grad()
            if self.state is GradState.READY:
                self.state = GradState.RELEASED
            return
        torch._C.TensorBase.grad.__set__(sp.sharded, value)

    def _after_step(self, optimizer, args, kwargs) -> None:
        """An optimizer stepped: if it holds this model's parameters, the minibatch's gradients are consumed."""
        if self.state in (GradState.READY, GradState.EMPTY) and any(
                getattr(p, "_odc", None) is not None and p._odc.protocol is self
                for group in optimizer.param_groups for p in group["params"]):
            self.state = GradState.RELEASED

    def discard(self) -> None:
        """Drop every gradient accumulated since the last step (collective)."""
        with self.rows_changing():
            pass

