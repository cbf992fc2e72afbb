"""One training step as this rank's wrapper lives it: steps 1-7 here (``StepLifecycle``), 8-10 in ``minibatch.py``.

Design note [lifecycle]
-----------------------
The standard loop (``model(x)``, ``loss.backward()`` per micro-batch, then ``clip_grad_norm_``,
``opt.step()``, ``opt.zero_grad()``) runs these steps, after FSDP2's ``FSDPParamGroup``
(``pre_forward`` ... ``finalize_backward``). The hooks ([hooks] in ``hooks.py``) and the step
protocol's transitions ([step-protocol] in ``protocol.py``) only decide *when*; each step is one
method, run under a ``torch.profiler.record_function`` range ``odc::<step>`` (named below), so a
user's trace shows the phases as FSDP2's do. Steps 1-7 are ``StepLifecycle``'s methods, below; they
repeat for every micro-batch, ranks may run different numbers of micro-batches (zero included), and
nothing in them waits for another rank. Steps 8-10 are ``Minibatch``'s (``minibatch.py``), the one
object that holds the minibatch: its pushes, meetings, gradients and state.

1. ``begin_forward`` (the root's forward pre-hook): checks that no row is stale and no gradient
   half consumed (the minibatch's ``before_forward``), resets the groups' use counts.
2. ``gather`` (a site's forward pre-hook), ``odc::gather``: unshard the site's groups (waiting for
   a gather started ahead on the side stream), then start gathering the groups the next sites need
   ([prefetch] in ``prefetch.py``, [streams] in ``streams.py``).
3. forward: the site's own code runs on unsharded parameters ([params] in ``param.py``,
   [storage-resize] in ``group.py``); nothing of ours.
4. ``reshard`` (a site's forward post-hook; ``end_forward`` at the root), ``odc::reshard``: once a
   group's last site has run, free its unsharded storage if its ``reshard_after_forward`` (always
   without grad); the root's post-hook frees every such group then. A group held by a method
   registered with ``register_fsdp_forward_method`` (``generate``) stays gathered until it returns.
5. ``pre_backward`` (the first gradient of a site's outputs), ``odc::pre_backward``: re-gather the
   site's groups; autograd keeps each trained parameter's gradient as its kernel wrote it, copied into
   the group's buffer at the push ([fresh-grads] in ``fresh_grads.py``; a zeroed buffer autograd adds
   into where the gradients' dtype is not the buffer's, [grad-buffers] in ``group.py``).
6. ``post_backward`` (the gradients of all a site's inputs are done), ``odc::push``: each group whose
   last site is through is pushed (scatter-accumulate into the owners' accumulator rows) and
   resharded (a group whose ``reshard_after_backward`` is off stays gathered until step 10).
7. ``finalize_backward`` (autograd's end-of-backward callback), ``odc::flush``: push what is still
   pending (sites whose inputs need no gradient, late gradients), reshard everything.
8. ``Minibatch.sync`` (the first ``.grad`` read of a pass after the micro-batches: ``clip_grad_norm_`` or the
   optimizer), ``odc::sync``: this rank's pushes complete, one meeting, then every rank's pushes are
   in; with HSDP the replicas' one all-reduce ([hsdp] in ``hsdp.py``); the summed rows are divided by
   the gradient divide factor (FSDP2's ``set_gradient_divide_factor``: by default the data-parallel
   ranks, shard ranks x replicas, so ``.grad`` is the mean over ranks as FSDP2's; 1.0 keeps the sum),
   once, in place; the accumulator rows become the shards' ``.grad``.
9. clip and step: the user's ``clip_grad_norm_`` (one all-reduce of the norm) and ``opt.step()``
   (fp32 masters updated in place); the optimizer's post-hook reports it ([optimizer-events]).
10. ``Minibatch.finish`` (every trained gradient consumed: stepped on, or cleared by ``zero_grad``),
    ``odc::finish``: reshard every group, publish masters to rows, drop ``.grad``, and zero the
    accumulators around one meeting ([streams] 5): nobody gathers or pushes before every row is final.
    Float8 rows ([float8-gather] in ``float8.py``): the masters' amaxes ride that meeting, and each
    owner casts its float8 rows with the scales right after it, before any peer's gather ([streams] 6).

So a minibatch costs two meetings (8 and 10) however many micro-batches each rank ran, and
``zero_grad`` none ([zero-grad-pass]). Changes of rows outside a step (``rows_changing``: checkpoint
and Hugging Face loads) run step 10's work around their own meetings.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Callable, Sequence

import torch

from ...torch_private import in_backward, phase_range, queue_end_of_backward
from ..groups.group import FlatGroup, reshard_all
from .minibatch import Minibatch
from .prefetch import PrefetchSchedule
from ..transport.streams import CommStreams

Site = tuple[FlatGroup, ...]


class TrainingPhase(enum.Enum):
    """Where the wrapper is in a forward/backward pass."""

    IDLE = enum.auto()
    """No forward or backward pass in flight."""
    FORWARD = enum.auto()
    """Inside the root module's forward."""
    BACKWARD = enum.auto()
    """Between the first pre-backward hook and the end-of-backward callback."""


class StepLifecycle:
    """The steps of [lifecycle], one method each, over one model's groups.

    Args:
        groups: the model's groups.
        comm: moves the groups' rows, on side streams where there are some ([streams]).
        prefetch: the site order and how far ahead to gather ([prefetch]).
        minibatch: steps 8-10 (``Minibatch``, ``minibatch.py``): takes what steps 1-7 report (a forward,
            the pushes, the end of backward, whether a pass is in flight).
        checks: run at the start of every root forward, before anything else (may raise).
    """

    def __init__(self, groups: Sequence[FlatGroup], comm: CommStreams, prefetch: PrefetchSchedule,
                 minibatch: Minibatch, checks: Callable[[], None] = lambda: None):
        self.groups = list(groups)
        self.comm = comm
        self.prefetch = prefetch
        self.minibatch = minibatch
        self.checks = checks
        self.phase = TrainingPhase.IDLE
        self.backward_pushes = 0  # pushes queued in the current (or last) backward: the post-backward hooks read it
        # torch's RemovableHandle's ids -> hooks (an OrderedDict: the handle holds it by a weak reference)
        self.post_backward_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()

    # -- 1-4: forward ---------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """Step 1: the root forward starts: checks, the minibatch's forward event, every site still to run."""
        if self.phase is TrainingPhase.BACKWARD:
            if in_backward():  # the whole model recomputed in backward: nothing to reset
                return
            raise RuntimeError("a backward pass raised before it ended, so gradients are half pushed and parameters "
                               "may be gathered: call model.reset_iter_state() and then opt.zero_grad(), as FSDP2's "
                               "recovery does, before the next forward")
        self.checks()
        self.minibatch.before_forward()
        for g in self.groups:
            g.reset_uses()
        self._set_phase(TrainingPhase.FORWARD)

    def gather(self, site: Site) -> None:
        """Step 2 (and 5's re-gather): unshard ``site``'s groups for the current stream, then prefetch what the
        next sites need. During backward this is activation recomputation: what comes next is backward order."""
        backward = self.phase is TrainingPhase.BACKWARD
        with phase_range("pre_backward" if backward else "gather"):
            self._unshard(site, backward)

    def _unshard(self, site: Site, backward: bool) -> None:
        for g in site:
            g.to_unsharded()
            g.wait_ready()
            if backward:
                g.prepare_grad()
        self.prefetch.record(site)
        for g in self.prefetch.targets(site, backward):
            g.to_unsharded(ahead=True)  # on CPU (no side stream) a plain gather ahead of use

    def reshard(self, site: Site) -> None:
        """Step 4: after a forward use of ``site``, free each of its groups whose last site this was (with the
        group's ``reshard_after_forward``, or without grad). Forwards during backward (recomputation) never
        reshard."""
        if self.phase is TrainingPhase.BACKWARD:
            return
        with phase_range("reshard"):
            no_grad = not torch.is_grad_enabled()
            for g in site:
                if g.forward_use_done() and (g.reshard_after_forward or no_grad) and not g.held:
                    g.to_sharded()

    def end_forward(self) -> None:
        """Step 4 at the root: the forward is over (or failed): fix the site order, free what backward gathers
        again."""
        if self.phase is not TrainingPhase.FORWARD:
            return
        self._set_phase(TrainingPhase.IDLE)
        self.prefetch.finish_recording()
        no_grad = not torch.is_grad_enabled()
        for g in self.groups:
            if (g.reshard_after_forward or no_grad) and not g.held:
                g.to_sharded()

    # -- 5-7: backward ------------------------------------------------------------------------------
    def pre_backward(self, site: Site) -> None:
        """Step 5: the first gradient of ``site``'s outputs: backward begins (the end-of-backward callback is
        queued once), then re-gather with gradient buffers."""
        if self.phase is not TrainingPhase.BACKWARD:
            self._set_phase(TrainingPhase.BACKWARD)
            self.backward_pushes = 0
            queue_end_of_backward(self.finalize_backward)
        with phase_range("pre_backward"):
            self._unshard(site, backward=True)

    def post_backward(self, site: Site) -> None:
        """Step 6: the gradients of all of ``site``'s inputs are done: push each group whose last site is
        through, and reshard it (unless its ``reshard_after_backward`` is off: then the step's finish does); then
        the model's post-backward hooks run (``register_post_backward_hook``)."""
        with phase_range("push"):
            for g in site:
                if g.backward_use_done():
                    self.push(g)
                    if g.reshard_after_backward:
                        g.to_sharded()
            self.comm.site_pushed()  # bounded pushes ([streams] 2): wait for an earlier site's
        if self.post_backward_hooks:  # none unless registered: nothing on every unit's backward
            for hook in tuple(self.post_backward_hooks.values()):
                hook()

    def finalize_backward(self) -> None:
        """Step 7: autograd's end of backward: push everything still pending, late gradients too
        ([grad-buffers]), reshard everything (but groups whose ``reshard_after_backward`` is off, kept until the
        step's finish); the next ``.grad`` read starts a pass."""
        with phase_range("flush"):
            for g in self.groups:
                self.push(g)
                if g.reshard_after_backward:
                    g.to_sharded()
            late = [g for g in self.groups if g.collect_late_grads()]
            for g in late:
                self.push(g)
            self.comm.backward_done()
        self._set_phase(TrainingPhase.IDLE)
        self.minibatch.after_backward()

    def push(self, group: FlatGroup) -> None:
        """Push ``group``'s pending gradient (if any): scatter-accumulate it into the owners' accumulator rows (on CUDA
        on the push stream, after everything queued so far on the current stream, which wrote the gradient, and
        overlapping what comes next: [streams] 2); the minibatch counts it."""
        grad = group.take_grad_buffer()
        if grad is None:
            return
        with torch.no_grad():
            self.comm.push(group.index, grad)
        self.minibatch.count_pushes(1)
        self.backward_pushes += 1

    def reshard_all(self) -> None:
        """Free every group's unsharded buffer (the modules hold shards)."""
        reshard_all(self.groups)

    def reset(self) -> None:
        """After an exception aborted a forward or a backward (FSDP2's ``reset_iter_state``): the pass's gradient
        buffers not pushed yet are dropped (a failed backward never reached step 7), every group is resharded, and
        the wrapper is idle: the next forward starts a pass. What was pushed stays in the accumulators."""
        for g in self.groups:
            g.drop_grad_buffer()
            g.held = 0  # a registered method that raised never reached its post-forward
        self.comm.backward_done()
        self.reshard_all()
        self._set_phase(TrainingPhase.IDLE)

    def _set_phase(self, phase: TrainingPhase) -> None:
        self.phase = phase
        self.minibatch.in_pass = phase is not TrainingPhase.IDLE  # a .grad read in a pass meets nobody


__all__ = ["StepLifecycle", "TrainingPhase"]
