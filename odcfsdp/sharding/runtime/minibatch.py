"""``Minibatch``: one model's minibatch, steps 8-10 of [lifecycle] and everything they hold.

Steps 1-7 (a micro-batch's forward and backward, ``StepLifecycle`` in ``lifecycle.py``) never wait
for another rank; they report to this object: a root forward, the pushes they made, the end of a
pass. What happens once the micro-batches are over is all here, in the order it runs:

8. ``sync``: this rank's pushes complete, one meeting, every rank's pushes in (the replicas'
   all-reduce with HSDP), the sum divided by the gradient divide factor, the accumulator rows
   attached as ``.grad``;
9. the user's ``clip_grad_norm_`` and ``opt.step()`` read those gradients and update the fp32
   masters; the optimizer's step is reported here ([optimizer-events]);
10. ``finish``: once every trained gradient is consumed, reshard, publish the masters to rows,
    drop ``.grad``, zero the accumulators around one meeting ([streams] 5; rows published late, float8's, carry
    what they need to it and are written after it, [row-format], [streams] 6).

*When* each runs is the state machine of [step-protocol] (``protocol.py``): the events below
(``grad_read``, ``grad_written``, ``optimizer_stepped``, ``before_forward``) run the transitions of
``TRANSITIONS``, a table of this class's methods; the explicit path (``end``, ``finish_step``:
``end_minibatch`` and ``finish_minibatch``) runs the same steps where the loop names them. *How* ranks meet is
``Meetings`` (``meetings.py``), and where the streams wait is ``CommStreams`` (``streams.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Sequence

import torch

from ..groups.group import FlatGroup, reshard_all
from ..placement.meetings import Meeting, Meetings
from ..placement.mesh import ShardMesh
from ..groups.param import ShardedParam
from ..groups.row_format import LatePublish
from ..groups.split_master import SplitMasters
from .grad_division import GradDivision
from .protocol import GradState, StepEvent
from ..transport.streams import CommStreams
from ...torch_private import inside_zero_grad, install_optimizer_hooks, phase_range


class Minibatch:
    """One model's minibatch: its state ([grad-protocol]), its meetings and steps 8-10 of [lifecycle].

    Built over the model's groups, it becomes their parameters' ``.grad`` event sink ([params]).

    Args:
        groups: the model's groups.
        comm: the side streams and the transport ([streams]).
        mesh: the ranks that meet.
        divide_factor: what step 8 divides the summed gradients by (FSDP2's default: the data-parallel ranks).
        late: the rows published after the finish's meeting from what every rank carried to it (``LatePublish``,
            [row-format]: float8 rows' amaxes and cast); None: every row is published before the meeting.
    """

    def __init__(self, groups: Sequence[FlatGroup], comm: CommStreams, mesh: ShardMesh, divide_factor: float = 1.0,
                 late: LatePublish | None = None):
        install_optimizer_hooks()
        self.groups = list(groups)
        self.comm = comm
        self.transport = comm.transport
        self.mesh = mesh
        self.late = late
        #: ranks may push different numbers of times per minibatch (the transport's capability, read once here).
        self.uneven_micro_batches = self.transport.caps.uneven_micro_batches
        self.meetings = Meetings(mesh, self.transport.name, self.uneven_micro_batches)
        self.meetings.carry_len = late.carry_len if late is not None else 0
        self.state = GradState.ACCUMULATING
        self.closed = False
        self.in_pass = False  # a forward or backward pass is in flight (the lifecycle says so)
        self.pushes = 0  # gradient pushes of this rank since the last finish
        self.minibatch = 0  # finished minibatches (every rank counts the same)
        self.synced_pushes = 0  # every rank's pushes, as of the last sync
        self.last_wait_s = 0.0  # time the last sync waited for the other ranks
        self.division = GradDivision(divide_factor)  # step 8's divisor, undone by drop_grads
        self._pass_position: int | None = None  # model position of the last .grad read of the current pass
        self.fresh = True  # no forward in grad mode since the last finish or change ([zero-grad-pass])
        self.skipped_passes = 0  # zero_grad passes that met nobody since the last meeting
        self.implicit = True  # torch's implicit events drive steps 8 and 10 ([implicit-events]); False: only end/finish
        self.ended = False  # end() synced this minibatch: .grad reads meet nobody until its finish
        self._consumed: set = set()  # READY: trained parameters whose gradient was stepped on or cleared
        self._to_consume: dict = {}  # READY: the parameters trained at the sync (ordered), all to be consumed
        self.publish_at_next_forward = False  # to_empty() ran: publish whatever the model's init writes ([meta-init])
        self.split: SplitMasters | None = None  # [split-masters]: masters held as rows + low bits inside a minibatch
        self._trained = [g for g in self.groups if g.layout.requires_grad]
        self._accumulators = [g.accumulator for g in self._trained if g.accumulator is not None]
        self.comm.written_aside(self._accumulators)  # zeroed on the push stream ([streams] 5)
        self._trainable_params = [sp for g in self._trained for sp in g.params if sp.trainable]
        for g in self.groups:
            for sp in g.params:
                sp.events = self

    @property
    def _trained_params(self) -> list[ShardedParam]:
        """The parameters trained now ([requires-grad]: a parameter may be frozen and unfrozen between steps)."""
        return [sp for sp in self._trainable_params if sp.trained]

    @property
    def pending_pushes(self) -> int:
        """Pushes whose gradients no finished minibatch has consumed yet."""
        return self.pushes

    def close(self) -> None:
        """The model is closing: later events (an optimizer that still holds its shards) change nothing, and the
        accumulators are the transport's to free."""
        self.closed = True
        self._accumulators = []

    # -- what steps 1-7 report ----------------------------------------------------------------------
    def count_pushes(self, n: int) -> None:
        """``n`` gradient pushes of this rank ([lifecycle] 6-7)."""
        self.pushes += n

    def before_forward(self) -> None:
        """The root forward starts (see [grad-protocol]): a new pass; stale rows and half-consumed gradients raise."""
        self._pass_position = None
        if self.state is GradState.READY and self._consumed:
            left = [sp.name for sp in self._to_consume if sp not in self._consumed]
            raise RuntimeError(
                f"trained parameters got gradients that no optimizer step consumed and no zero_grad() cleared "
                f"({left[:3]}{' ...' if len(left) > 3 else ''}): put every trained parameter in an optimizer, "
                "or freeze it (requires_grad=False) before wrapping; gradients cannot accumulate over steps")
        if self.ended and torch.is_grad_enabled():
            raise RuntimeError("a forward pass after end_minibatch() before its finish: call finish_minibatch() "
                               "after the optimizer step (the next minibatch starts after it)")
        if self.publish_at_next_forward:  # [meta-init]: the values written since to_empty() reach the rows
            with self.rows_changing():
                pass
        changed = [g for g in self.groups if g.master_changed]
        if changed:
            names = [sp.name for sp in changed[0].params]
            explicit = "" if self.implicit else (" (with set_implicit_minibatch(False), call finish_minibatch() "
                                                 "after each optimizer step)")
            raise RuntimeError(
                f"parameters were changed in place outside an optimizer step (one of {names[:4]}"
                f"{' ...' if len(names) > 4 else ''}), so the rows other ranks gather are stale: change them inside "
                f"`with model.changing_parameters():` (collective), or with model.load_state_dict(){explicit}")
        if torch.is_grad_enabled():
            self.fresh = False
            self._fire(StepEvent.FORWARD)
            if self.split is not None and self.state is GradState.ACCUMULATING:
                self.split.split()  # [split-masters] 1: the rows are current (a changed master raised above)

    def after_backward(self) -> None:
        """Backward is over: the next ``.grad`` read starts a pass."""
        self._pass_position = None

    # -- torch's implicit events ([implicit-events]): .grad reads and writes, optimizer steps ------------------
    def grad_read(self, sp: ShardedParam) -> torch.Tensor | None:
        """The ``.grad`` property of a sharded parameter (see [grad-protocol]); a closed model's meets nobody."""
        if (not sp.trained or self.closed or self.in_pass or self.state is GradState.READY or self.ended
                or not self.implicit):
            return sp.attached
        new_pass = self._pass_position is None or sp.position <= self._pass_position
        self._pass_position = sp.position
        if not new_pass:
            return sp.attached
        if self.fresh and self.state is GradState.ACCUMULATING and inside_zero_grad():
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
        if sp.trained and not self.closed and self.implicit:
            self._fire(StepEvent.CLEARED, (sp,))

    def optimizer_stepped(self, sps: list[ShardedParam]) -> None:
        """An optimizer stepped over ``sps`` (this model's): their gradients are consumed ([optimizer-events])."""
        if not self.closed and self.implicit:
            self._fire(StepEvent.STEP, sps)

    # -- the explicit path ([implicit-events]): what the events above stand for ---------------------------------
    def end(self) -> None:
        """``end_minibatch()``: this rank's micro-batches are over; step 8 (the sync: one meeting) unless this
        minibatch already synced. Every rank calls it once per minibatch, with or without micro-batches."""
        self._check_explicit("end_minibatch")
        if self.state is GradState.ACCUMULATING or (self.state is GradState.EMPTY and not self.ended):
            self._sync()
        self.ended = True

    def finish_step(self) -> None:
        """``finish_minibatch()``: the optimizer stepped; step 10 (publish the masters, zero the accumulators: one
        meeting) unless the minibatch already finished (an optimizer's step hook did it: implicit events on, no
        forward since). Raises where nothing was synced, on every rank alike. Every rank calls it."""
        self._check_explicit("finish_minibatch")
        if self.state is not GradState.ACCUMULATING:
            self._finish()
        elif any(g.master_changed for g in self.groups):  # every rank stepped without gradients (DCP's state init)
            self._finish()
        elif not self.fresh or not self.implicit:  # never synced: alike on ranks with micro-batches and without
            raise RuntimeError("finish_minibatch() before this minibatch's gradients were synced: call "
                               "end_minibatch() after the last micro-batch's backward, then step, then finish")

    def set_implicit(self, enabled: bool) -> None:
        """``set_implicit_minibatch``: whether torch's implicit events drive steps 8 and 10; only between
        minibatches (no pass in flight, nothing pushed, synced or ended since the last finish)."""
        if not isinstance(enabled, bool):
            raise ValueError(f"set_implicit_minibatch takes True or False, got {enabled!r}")
        between = self.state is GradState.ACCUMULATING and self.fresh and not self.ended
        if self.in_pass or not between:
            raise RuntimeError("set_implicit_minibatch() inside a minibatch: call it before its first forward")
        self.implicit = enabled

    def _check_explicit(self, name: str) -> None:
        if self.closed:
            raise RuntimeError(f"{name}() on a closed model")
        if self.in_pass:
            raise RuntimeError(f"{name}() inside a forward or backward pass: call it between passes")

    def _fire(self, event: StepEvent, params: Sequence[ShardedParam] = ()) -> None:
        """Run the transition of ``TRANSITIONS`` for (state, ``event``), if any; ``params``: whose event it is."""
        transition = TRANSITIONS.get((self.state, event))
        if transition is not None:
            transition(self, params)

    # -- the transitions of [step-protocol] ---------------------------------------------------------------
    def _sync(self, _params=()) -> None:
        """Meeting 1 of [step-protocol] (step 8): every rank's pushes are in; the gradient shards attached."""
        t0 = time.perf_counter()
        self.synced_pushes = self.sync()
        self.last_wait_s = time.perf_counter() - t0
        self._consumed = set()
        self._to_consume = dict.fromkeys(self._trained_params)  # trained now: fixed until the finish
        # nothing pushed anywhere: no gradients, as in plain PyTorch before a backward
        self.state = GradState.READY if self.synced_pushes else GradState.EMPTY

    def _finish(self, _params=()) -> None:
        """Meeting 3 of [step-protocol] (step 10): publish the updated rows, zero the accumulators."""
        self.finish()
        self._new_minibatch()

    def _accumulate(self, _params=()) -> None:
        self.state = GradState.ACCUMULATING
        self.ended = False

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
                "micro-batches). Read gradients only after the minibatch's last backward, then opt.step() and/or "
                "opt.zero_grad()")
        self.drop_grads()
        self.state = GradState.ACCUMULATING

    def _new_minibatch(self) -> None:
        self.pushes = 0
        self.minibatch += 1
        self.state = GradState.ACCUMULATING
        self.fresh = True
        self.ended = False
        self._consumed = set()
        self._to_consume = {}
        self._pass_position = None

    # -- meetings -----------------------------------------------------------------------------------------
    def meet(self, kind: Meeting) -> int:
        """One meeting of all ranks (``Meetings.meet``); returns every rank's pushes."""
        return self._meet(kind, None)[0]

    def meet_carrying(self, kind: Meeting, carry: torch.Tensor) -> torch.Tensor:
        """``meet``, carrying this rank's ``carry`` (``LatePublish.carry``); returns every rank's
        (``Meetings.meet_carrying``)."""
        return self._meet(kind, carry)[1]

    def _meet(self, kind: Meeting, carry: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        skipped, self.skipped_passes = self.skipped_passes, 0
        with phase_range("meet"):  # the profile's split of sync and finish: the meeting, the wait, the publish
            return self.meetings.meet_carrying(kind, self.minibatch, skipped, self.pushes, carry)

    def declare_minibatch(self, micro_batches: int, tokens: int | None) -> int | None:
        """``ODCShard.begin_minibatch``: one small all-gather (none if one-sided without tokens); see there."""
        return self.meetings.declare_minibatch(micro_batches, tokens)

    # -- steps 8 and 10 -------------------------------------------------------------------------------------
    def sync(self) -> int:
        """Step 8: this rank's pushes complete, one meeting, the HSDP replicas' all-reduce, then the accumulator
        rows attached as ``.grad``. Returns every rank's pushes (0: nothing to attach)."""
        with phase_range("sync"):
            with phase_range("quiesce"):
                self.comm.pushes_done()
            # [split-masters] 2, queued before the meeting (the pushes' buffers are free by now): the device joins
            # the masters while the host meets; the stale-row check waits for the meeting (it read the device)
            self.join_masters(check=False)
            pushes = self.meet(Meeting.SYNC)  # with HSDP, over every replica
            if self.mesh.replicas > 1 and pushes:  # [hsdp]: the replicas' one exchange of gradients
                for g in self._trained:
                    self.mesh.replicate.all_reduce_sum(g.accumulator)
            if pushes:
                self.division.apply([g.accumulator for g in self._trained])
                for g in self._trained:
                    g.attach_grads()
                if (offloaded := next((g for g in self._trained if g.offloaded), None)) is not None:
                    offloaded.wait_host_copies()  # every group's host copies are queued back to back: one wait
            self.join_masters()  # the stale-row check of the join queued above
        return pushes

    def join_masters(self, check: bool = True) -> None:
        """[split-masters] 2: every master whole again (nothing to do unless split); ``check``: as
        ``SplitMasters.join``'s."""
        if self.split is not None:
            self.split.join(check)

    @property
    def divide_factor(self) -> float:
        """What step 8 divides the summed gradients by."""
        return self.division.factor

    def set_divide_factor(self, factor: float) -> None:
        """What step 8 divides the summed gradients by (``ODCShard.set_gradient_divide_factor``): a finite
        number > 0, taking effect at the next sync (``GradDivision`` in ``grad_division.py``)."""
        self.division.set(factor)

    def finish(self, changed: Sequence[FlatGroup] | None = None, kind: Meeting = Meeting.FINISH) -> None:
        """Step 10: reshard, publish the masters of the trained groups and of ``changed`` ones (default: those
        whose master changed), drop ``.grad``, zero the accumulators around one meeting of ``kind``."""
        with phase_range("finish"):
            self.join_masters()
            reshard_all(self.groups)
            if changed is None:
                changed = [g for g in self.groups if g.layout.requires_grad or g.master_changed]
            with phase_range("publish"):
                for g in changed:
                    g.publish()
            for g in self._trained:
                g.detach_grads()
            self.division.cleared()  # the accumulators are zeroed below
            with phase_range("quiesce"):
                self.comm.rows_published()
            self.comm.zero_before_meeting(self._accumulators)
            if self.late is None:
                self.meet(kind)
            else:  # [row-format]: the masters are final, so what late rows need of them rides this meeting
                self.late.publish_after(self.meet_carrying(kind, self.late.carry(self.mesh.device)))
                self.comm.late_rows_written(self.mesh)
            self.comm.zero_after_meeting(self._accumulators, self.mesh)

    @contextlib.contextmanager
    def rows_changing(self) -> Iterator[None]:
        """Context in which master rows may change (collective; pending gradients are dropped): reshard, this
        rank's pushes complete, one meeting; then step 10 with every group around a meeting of its own."""
        reshard_all(self.groups)
        self.join_masters()
        self.comm.pushes_done()
        self.meet(Meeting.CHANGE)
        yield
        self.finish(self.groups, Meeting.CHANGE)
        self.publish_at_next_forward = False  # every row was published
        self._new_minibatch()

    def drop_grads(self) -> None:
        """Gradients read but not consumed go back to accumulating (READY + FORWARD): the division of step 8 is
        undone, so the next sync divides the whole sum once (exact for a power-of-two factor)."""
        for g in self._trained:
            g.detach_grads()
        self.division.undo([g.accumulator for g in self._trained])


#: (state, event) -> the transition, a method of ``Minibatch``: the table of [step-protocol] (``protocol.py``).
TRANSITIONS: dict[tuple[GradState, StepEvent], Callable[[Minibatch, Sequence[ShardedParam]], None]] = {
    (GradState.ACCUMULATING, StepEvent.READ): Minibatch._sync,
    (GradState.ACCUMULATING, StepEvent.STEP): Minibatch._finish,
    (GradState.EMPTY, StepEvent.READ): Minibatch._sync,
    (GradState.EMPTY, StepEvent.STEP): Minibatch._finish,
    (GradState.EMPTY, StepEvent.FORWARD): Minibatch._accumulate,
    (GradState.READY, StepEvent.STEP): Minibatch._consume,
    (GradState.READY, StepEvent.CLEARED): Minibatch._consume,
    (GradState.READY, StepEvent.FORWARD): Minibatch._forward_after_read,
}

__all__ = ["Minibatch", "TRANSITIONS"]
