"""The step protocol: when ranks meet in a minibatch, and every change of the rows.

Design note [step-protocol]
---------------------------
During a minibatch rows do not change, so any rank gathers any row at any time, and
pushes are adds that need no order: ranks do not meet. They meet where the standard
PyTorch loop already needs every rank's gradients, without any call of odcfsdp's own
(the steps are [lifecycle] 8-10 in ``lifecycle.py``; this note says when they run):

1. *sync* ([lifecycle] 8), where a pass over the parameters first reads a sharded parameter's
   ``.grad`` after the rank's micro-batches (``clip_grad_norm_``, or the optimizer's
   step): this rank's pushes are made complete and visible (its push stream, the
   transport's ``quiesce``), then one meeting; afterwards every rank's pushes are in,
   so each rank's accumulator rows hold its fully reduced gradient shard (with HSDP
   after a sum over the replicas, [hsdp] in ``hsdp.py``; divided by the gradient divide
   factor, [lifecycle] 8), and they are attached as the shards' ``.grad`` ([params]);
2. the user's ``clip_grad_norm_`` (one all-reduce of the norm) and ``opt.step()``
   update the fp32 masters in place ([lifecycle] 9);
3. *finish* ([lifecycle] 10), as soon as every trained parameter's gradient is consumed (stepped on
   by an optimizer, seen by a global step hook, or set to None by ``zero_grad``): in
   that hook, every group is resharded, masters are published to rows (trained groups,
   and any other whose master changed), ``.grad`` dropped, one meeting: nobody gathers
   or pushes before every row is final and every accumulator zeroed ([streams] 5).

Every rank runs the same loop, so every rank steps: the finish happens at a point all
ranks reach, and a forward that only some ranks run between steps (an evaluation on
rank 0) meets nobody. Anything else that changes rows (``load_state_dict``,
checkpoint and Hugging Face loads, user code in ``ODCShard.changing_parameters()``)
runs inside ``rows_changing()``: reshard, pushes complete, meeting, the change, then
the finish's work and its meeting. A parameter changed in place anywhere else (the
master's or the DTensor shard's version counter tells; changes through ``.data``
cannot be seen) would leave peers gathering stale rows, so the next forward raises.

Every meeting is one small all-gather of (kind, minibatch number, pushes): if ranks
meet at different points (one finishing while another syncs), every rank raises the
same error instead of mixing two minibatches.

The protocol is one state machine, owned by ``StepProtocol``: the other tiers only
report events (the hooks: a root forward, the end of backward; a sharded parameter:
a ``.grad`` read or write; an optimizer: a step over some of its parameters) and
never call its transitions. Its states are ``GradState`` ([grad-protocol]); its
transitions are this table, which is ``TRANSITIONS`` verbatim (a test holds them
equal). An event missing from the table changes nothing.

==============  ===========  ==================================================  ======================
state           event        what happens                                        next state
==============  ===========  ==================================================  ======================
ACCUMULATING    READ         _sync: meeting (1)                                  READY, or EMPTY
ACCUMULATING    STEP         _finish (3): the step may have changed masters      ACCUMULATING
EMPTY           READ         _sync again                                         READY, or EMPTY
EMPTY           STEP         _finish (3)                                         ACCUMULATING
EMPTY           FORWARD      _accumulate: gradients start accumulating           ACCUMULATING
READY           STEP         _consume: note the parameters; _finish after the    READY, or ACCUMULATING
                             last trained one
READY           CLEARED      _consume, as for STEP                               READY, or ACCUMULATING
READY           FORWARD      _forward_after_read: drop the gradients read, or    ACCUMULATING
                             raise ([grad-protocol])
==============  ===========  ==================================================  ======================

Events: READ, a ``.grad`` read that starts a pass ([grad-protocol]) outside forward and backward, except a
``zero_grad`` pass of a fresh minibatch ([zero-grad-pass]); STEP, an optimizer step over any of this model's
parameters ([optimizer-events]); CLEARED, a trained parameter's ``.grad`` set to None (``zero_grad``); FORWARD, a root
forward in grad mode. Every root forward first checks that no gradient was half consumed and no row is stale;
``rows_changing`` works from any state and ends in ACCUMULATING.

Design note [grad-protocol]
---------------------------
A rank without micro-batches reads ``.grad`` at the same points as the others (its
``zero_grad`` and ``clip_grad_norm_``) but runs nothing in between, so reads are
grouped into *passes* over the parameters: a pass starts at the first read after a
finish, a sync, a forward or a backward, and whenever a read goes back in the model's
parameter order (``zero_grad`` then ``clip_grad_norm_``: two passes, however many
parameters each covers). ``GradState`` and the ``.grad`` property of sharded
parameters:

* ``ACCUMULATING``: no gradient is attached; a read that starts a pass syncs (1):
  the state becomes ``READY``, with the accumulator shards attached, or ``EMPTY`` if
  no rank had pushed anything;
* ``EMPTY``: ``.grad`` is None (nothing was accumulated anywhere, as in plain PyTorch
  before a backward) unless the user assigned one; a read that starts a new pass
  syncs again (ranks with micro-batches sync there after theirs); an optimizer step
  finishes (it may have changed masters); a forward in grad mode goes back to
  ``ACCUMULATING``;
* ``READY``: reads return the attached shard (None once consumed); when every trained
  parameter is consumed the minibatch finishes (3). A forward without grad
  (evaluation) keeps the gradients; one in grad mode raises if some were consumed and
  others not (a parameter in no optimizer, or two optimizers stepping at different
  rates: its gradient would be dropped or mixed into the next minibatch), and if none
  was consumed goes back to accumulating (the gradients read so far keep growing, as
  in plain PyTorch) in a single process or with the collective transport, where every
  rank runs the same micro-batches, but raises with one-sided transports on several
  ranks, where the other ranks took that read for the end of the minibatch.

Reads during forward or backward never meet (they return what is attached).

Design note [zero-grad-pass]
----------------------------
The standard loop calls ``zero_grad()`` right after ``opt.step()`` (or at the top of
the next iteration), and ``zero_grad`` reads every ``.grad``. The step already
finished the minibatch (3), so those reads would start a pass in ``ACCUMULATING``
and sync: a second meeting per minibatch whose ``pushes_done`` waits for the
whole device, the accumulators' zeroing on the push stream ([streams] 5) included,
which is then back on the step's path. So a pass that starts inside a ``zero_grad``
(any optimizer's or module's method of that name: the read's caller frames tell)
while this rank's minibatch is *fresh* (no forward in grad mode, so no push, since
the last finish or change) meets nobody: nothing is attached, nothing can be, and
the reads return None. A rank without micro-batches cannot tell that pass from the
``clip_grad_norm_`` pass that must meet (both come after a finish with no forward),
which is why it takes the caller's name and not the order. Ranks must still agree:
every meeting carries each rank's count of such skipped passes since the last
meeting, and a difference raises alike on every rank (a ``zero_grad`` between
micro-batches on ranks with micro-batches is a sync there, and skipped on a rank
without). The step then costs two meetings, the sync and the finish, and
``zero_grad`` none (``tests/test_protocol.py`` counts them). Frozen
parameters have no gradient. Trained parameters that got no gradient in a minibatch
in which some rank pushed get zeros (ranks cannot tell "none" from "zero" without
another meeting), so weight decay and momentum still move them, as in other
flat-buffer optimizers. A tensor assigned to ``.grad`` is kept and used by the next
optimizer step, as in plain PyTorch (``torch.distributed.checkpoint`` initialises
optimizer state that way).
"""

from __future__ import annotations

import contextlib
import enum
import time
from typing import Iterator, Sequence

import torch

from typing import TYPE_CHECKING

from .group import FlatGroup
from .meetings import Meeting, Meetings
from .mesh import ShardMesh
from .optimizer_events import install_optimizer_hooks
from .param import ShardedParam
from .streams import CommStreams
from ..torch_private import called_from

if TYPE_CHECKING:
    from .lifecycle import StepLifecycle


class GradState(enum.Enum):
    """Where a minibatch's gradients are (see [grad-protocol])."""

    ACCUMULATING = enum.auto()
    """Pushes land in the accumulators; no ``.grad`` is attached."""
    EMPTY = enum.auto()
    """Synced, and no rank had pushed anything: no ``.grad`` (as in plain PyTorch before a backward)."""
    READY = enum.auto()
    """Every rank's pushes are in; ``.grad`` are the accumulator shards until consumed."""


class StepEvent(enum.Enum):
    """What the other tiers report to the step protocol (see the table in [step-protocol])."""

    READ = enum.auto()
    """A ``.grad`` read that starts a pass, outside forward and backward."""
    STEP = enum.auto()
    """An optimizer step over some of the model's parameters (trained or not: it may have changed masters)."""
    CLEARED = enum.auto()
    """A trained parameter's ``.grad`` was set to None (``zero_grad``)."""
    FORWARD = enum.auto()
    """A root forward in grad mode."""


#: (state, event) -> the transition's method: the table of [step-protocol].
TRANSITIONS: dict[tuple[GradState, StepEvent], str] = {
    (GradState.ACCUMULATING, StepEvent.READ): "_sync",
    (GradState.ACCUMULATING, StepEvent.STEP): "_finish",
    (GradState.EMPTY, StepEvent.READ): "_sync",
    (GradState.EMPTY, StepEvent.STEP): "_finish",
    (GradState.EMPTY, StepEvent.FORWARD): "_accumulate",
    (GradState.READY, StepEvent.STEP): "_consume",
    (GradState.READY, StepEvent.CLEARED): "_consume",
    (GradState.READY, StepEvent.FORWARD): "_forward_after_read",
}


def _inside_zero_grad(depth: int = 3) -> bool:
    """Whether a ``zero_grad`` method (an optimizer's or a module's) is among the nearest ``depth`` callers of
    the ``.grad`` read being handled ([zero-grad-pass]): frames above ``grad_read`` and the property getter."""
    return called_from("zero_grad", depth, skip=2)


class StepProtocol:
    """The minibatch's state machine: counts gradient pushes and runs the meetings (see [step-protocol]).

    Args:
        comm: moves the groups' rows, on side streams where there are some ([streams]).
        mesh: the ranks that meet.
        busy: returns True while a forward or backward pass is in flight.
    """

    def __init__(self, comm: CommStreams, mesh: ShardMesh):
        self.groups: list[FlatGroup] = []
        self.lifecycle = None  # the steps the transitions run ([lifecycle]); given by attach
        self.transport = comm.transport
        self.mesh = mesh
        #: ranks may push different numbers of times per minibatch (the transport's capability, read once here).
        self.uneven_micro_batches = self.transport.caps.uneven_micro_batches
        self.meetings = Meetings(mesh, self.transport.name, self.uneven_micro_batches)
        self.state = GradState.ACCUMULATING
        self.closed = False
        self.pushes = 0  # gradient pushes of this rank since the last finish
        self.minibatch = 0  # finished minibatches (every rank counts the same)
        self.synced_pushes = 0  # every rank's pushes, as of the last sync
        self.last_wait_s = 0.0  # time the last sync waited for the other ranks
        self._pass_position: int | None = None  # model position of the last .grad read of the current pass
        self.fresh = True  # no forward in grad mode since the last finish or change ([zero-grad-pass])
        self.skipped_passes = 0  # zero_grad passes that met nobody since the last meeting
        self._consumed: set = set()  # READY: trained parameters whose gradient was stepped on or cleared
        self._to_consume: dict = {}  # READY: the parameters trained at the sync (ordered), all to be consumed
        self._trainable_params: list[ShardedParam] = []  # trained when sharded; trained now: _trained_params
        self.publish_at_next_forward = False  # to_empty() ran: publish whatever the model's init writes ([meta-init])

    @property
    def _trained_params(self) -> list[ShardedParam]:
        """The parameters trained now ([requires-grad]: a parameter may be frozen and unfrozen between steps)."""
        return [sp for sp in self._trainable_params if sp.trained]

    def attach(self, groups: Sequence[FlatGroup], lifecycle: StepLifecycle) -> None:
        """Take the model's groups and the steps its transitions run; optimizers' steps reach it through the
        parameters ([optimizer-events])."""
        install_optimizer_hooks()
        self.groups = list(groups)
        self.lifecycle = lifecycle
        self._trainable_params = [sp for g in self.groups if g.layout.requires_grad for sp in g.params if sp.trainable]

    def busy(self) -> bool:
        """A forward or backward pass is in flight (the lifecycle's phase)."""
        return self.lifecycle is not None and self.lifecycle.busy

    def close(self) -> None:
        """The model is closing: later events (an optimizer that still holds its shards) change nothing."""
        self.closed = True
        self.lifecycle.close()

    def _fire(self, event: StepEvent, params: Sequence[ShardedParam] = ()) -> None:
        """Run the transition ``TRANSITIONS`` names for (state, ``event``), if any; ``params``: whose event it is."""
        action = TRANSITIONS.get((self.state, event))
        if action is not None:
            getattr(self, action)(params)

    # -- pushes ------------------------------------------------------------------------------------
    def count_pushes(self, n: int) -> None:
        """``n`` gradient pushes of this rank ([lifecycle] 6-7)."""
        self.pushes += n

    @property
    def pending_pushes(self) -> int:
        """Pushes whose gradients no finished minibatch has consumed yet."""
        return self.pushes

    # -- meetings ------------------------------------------------------------------------------------
    def meet(self, kind: Meeting) -> int:
        """One meeting of all ranks (``Meetings.meet``); returns every rank's pushes."""
        skipped, self.skipped_passes = self.skipped_passes, 0
        return self.meetings.meet(kind, self.minibatch, skipped, self.pushes)

    def meet_carrying(self, kind: Meeting, carry: torch.Tensor) -> torch.Tensor:
        """``meet``, carrying this rank's ``carry`` (the float8 amaxes); returns every rank's
        (``Meetings.meet_carrying``)."""
        skipped, self.skipped_passes = self.skipped_passes, 0
        return self.meetings.meet_carrying(kind, self.minibatch, skipped, self.pushes, carry)[1]

    def declare_minibatch(self, micro_batches: int, tokens: int | None) -> int | None:
        """``ODCShard.begin_minibatch``: one small all-gather (none if one-sided without tokens); see there."""
        return self.meetings.declare_minibatch(micro_batches, tokens)

    def _sync(self, _params=()) -> None:
        """Meeting 1 of [step-protocol] ([lifecycle] 8): every rank's pushes are in; the gradient shards attached."""
        t0 = time.perf_counter()
        self.synced_pushes = self.lifecycle.sync()
        self.last_wait_s = time.perf_counter() - t0
        self._consumed = set()
        self._to_consume = dict.fromkeys(self._trained_params)  # trained now: fixed until the finish
        # nothing pushed anywhere: no gradients, as in plain PyTorch before a backward
        self.state = GradState.READY if self.synced_pushes else GradState.EMPTY

    def _finish(self, _params=()) -> None:
        """Meeting 3 of [step-protocol] ([lifecycle] 10): publish the updated rows, zero the accumulators."""
        self.lifecycle.finish()
        self._new_minibatch()

    def _new_minibatch(self) -> None:
        self.pushes = 0
        self.minibatch += 1
        self.state = GradState.ACCUMULATING
        self.fresh = True
        self._consumed = set()
        self._to_consume = {}
        self._pass_position = None

    @contextlib.contextmanager
    def rows_changing(self) -> Iterator[None]:
        """Context in which master rows may change (collective; pending gradients are dropped)."""
        self.lifecycle.begin_change()
        yield
        self.lifecycle.finish(self.groups, Meeting.CHANGE)
        self.publish_at_next_forward = False  # every row was published
        self._new_minibatch()

    # -- transitions that meet nobody ----------------------------------------------------------------
    def _accumulate(self, _params=()) -> None:
        self.state = GradState.ACCUMULATING

    def _consume(self, params: Sequence[ShardedParam]) -> None:
        self._consumed.update(sp for sp in params if sp in self._to_consume)
        if len(self._consumed) == len(self._to_consume):
            self._finish()

    def _forward_after_read(self, _params=()) -> None:
        """READY + FORWARD: gradients were read but none consumed (a half-consumed set raised before)."""
        if (self.uneven_micro_batches and self.mesh.world_size > 1) or self.mesh.replicas > 1:
            raise RuntimeError(
                "a forward pass after gradients were read (.grad, clip_grad_norm_) but neither stepped on nor "
                "cleared: with a one-sided transport on several ranks, or with HSDP replicas (summed at that read), "
                "reading .grad ends the minibatch (it is where ranks meet, and ranks may run different numbers of "
                "micro-batches). Read gradients only "
                "after the minibatch's last backward, then opt.step() and/or opt.zero_grad()")
        self.lifecycle.drop_grads()
        self.state = GradState.ACCUMULATING

    # -- events from the hooks -------------------------------------------------------------------------
    def before_forward(self) -> None:
        """The root forward starts (see [grad-protocol]): a new pass; stale rows and half-consumed gradients raise."""
        self._pass_position = None
        if self.state is GradState.READY and self._consumed:
            left = [sp.name for sp in self._to_consume if sp not in self._consumed]
            raise RuntimeError(
                f"trained parameters got gradients that no optimizer step consumed and no zero_grad() cleared "
                f"({left[:3]}{' ...' if len(left) > 3 else ''}): put every trained parameter in an optimizer, "
                "or freeze it (requires_grad=False) before wrapping; gradients cannot accumulate over steps")
        if self.publish_at_next_forward:  # [meta-init]: the values written since to_empty() reach the rows
            with self.rows_changing():
                pass
        changed = [g for g in self.groups if g.master_changed]
        if changed:
            names = [sp.name for sp in changed[0].params]
            raise RuntimeError(
                f"parameters were changed in place outside an optimizer step (one of {names[:4]}"
                f"{' ...' if len(names) > 4 else ''}), so the rows other ranks gather are stale: change them inside "
                "`with model.changing_parameters():` (collective), or with model.load_state_dict()")
        if torch.is_grad_enabled():
            self.fresh = False
            self._fire(StepEvent.FORWARD)

    def after_backward(self) -> None:
        """Backward is over: the next ``.grad`` read starts a pass."""
        self._pass_position = None

    # -- events from the parameters (GradEvents) ---------------------------------------------------------
    def grad_read(self, sp: ShardedParam) -> torch.Tensor | None:
        """The ``.grad`` property of a sharded parameter (see [grad-protocol]); a closed model's meets nobody."""
        if not sp.trained or self.closed or self.busy() or self.state is GradState.READY:
            return sp.attached
        new_pass = self._pass_position is None or sp.position <= self._pass_position
        self._pass_position = sp.position
        if not new_pass:
            return sp.attached
        if self.fresh and self.state is GradState.ACCUMULATING and _inside_zero_grad():
            self.skipped_passes += 1  # [zero-grad-pass]: nothing attached, nothing pushed; no meeting
        else:
            self._fire(StepEvent.READ)
        return sp.attached

    def grad_written(self, sp: ShardedParam, value) -> None:
        """Setting ``.grad``: None consumes it (``zero_grad``); a tensor is kept for the next optimizer step."""
        if value is not None:
            sp.assign_grad(value)
            return
        sp.detach_grad()
        if sp.trained and not self.closed:
            self._fire(StepEvent.CLEARED, (sp,))

    # -- events from optimizers -------------------------------------------------------------------------
    def optimizer_stepped(self, sps: list[ShardedParam]) -> None:
        """An optimizer stepped over ``sps`` (this model's): their gradients are consumed ([optimizer-events])."""
        if self.closed:
            return
        self._fire(StepEvent.STEP, sps)
