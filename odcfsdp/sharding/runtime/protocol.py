"""The step protocol: when ranks meet in a minibatch, and every change of the rows (``Minibatch`` runs it).

Design note [step-protocol]
---------------------------
During a minibatch rows do not change, so any rank gathers any row at any time, and
pushes are adds that need no order: ranks do not meet. They meet where the standard
PyTorch loop already needs every rank's gradients, without any call of odcfsdp's own
(the steps are [lifecycle] 8-10, ``Minibatch``'s in ``minibatch.py``; this note says when they run):

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

The protocol is one state machine, owned by ``Minibatch`` (``minibatch.py``), which also
runs steps 8-10: the other tiers only report events (the lifecycle: a root forward, the end
of backward; a sharded parameter: a ``.grad`` read or write; an optimizer: a step over some
of its parameters) and never call its transitions. Its states are ``GradState``
([grad-protocol]); its transitions are this table, whose methods are ``Minibatch``'s and
which is ``minibatch.TRANSITIONS`` verbatim (a test holds them equal). An event missing
from the table changes nothing.

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

READ, STEP and CLEARED are torch's implicit events, caught in the adapter ([implicit-events] in
``torch_private.py``) and ignored once ``set_implicit_minibatch(False)``.
The explicit path calls the same two steps itself: ``end_minibatch`` (``Minibatch.end``) runs ``_sync`` in
ACCUMULATING, or in EMPTY not yet ended, and marks the minibatch ended (reads meet nobody until its finish; a forward
in grad mode before the finish raises); ``finish_minibatch`` (``Minibatch.finish_step``) runs ``_finish`` in READY or
EMPTY, and in ACCUMULATING where a master changed (every rank stepped without gradients); otherwise it does
nothing in a fresh ACCUMULATING with implicit events on (a step hook finished it) and raises on every rank where
nothing was synced.

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

import enum


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


__all__ = ["GradState", "StepEvent"]
