"""The explicit minibatch path, on both front doors: ``begin_minibatch``, ``end_minibatch``, ``finish_minibatch``.

By default a minibatch's two meetings are inferred from the standard loop: its first ``.grad`` read
after the micro-batches syncs, and its optimizer step finishes ([implicit-events] in
``torch_private.py``). These methods make both points explicit; they compose with the
inferred ones (a point already reached is not repeated), and after ``set_implicit_minibatch(False)``
they are the only way a minibatch syncs and finishes::

    model.begin_minibatch(len(micro_batches))   # optional: checks counts (collective), sums tokens
    for mb in micro_batches:
        loss_fn(model(mb)).backward()
    model.end_minibatch()                        # [lifecycle] 8: ranks meet, .grad is the reduced shard
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.finish_minibatch()                     # [lifecycle] 10: rows published, accumulators zeroed
    opt.zero_grad()
"""

from __future__ import annotations

from typing import Callable

from torch.utils.hooks import RemovableHandle

from ..runtime.lifecycle import StepLifecycle
from ..runtime.minibatch import Minibatch


class MinibatchControl:
    """The explicit minibatch methods of ``ODCShard`` and of ``fully_shard`` modules (over the model's engine),
    and the hook on each unit's end of backward."""

    def _control_minibatch(self) -> Minibatch:
        raise NotImplementedError

    def _control_lifecycle(self) -> StepLifecycle:
        raise NotImplementedError

    def register_post_backward_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` after each unit's backward, in every backward pass until the handle's ``remove()``.

        It runs once the unit's gradients are done and handed to the pushes ([lifecycle] 6), in the thread that
        runs the backward, with the backward's stream current: work it queues follows the unit's. Its activations
        are freed by then, which is what ``odcfsdp.loop.train_step`` uses to bring a parked optimizer's state back
        under the last backward ([park-backward]). The hook must not start a forward or a backward.
        """
        hooks = self._control_lifecycle().post_backward_hooks
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def gradient_bytes_in_flight(self) -> int | None:
        """Bytes of gradient buffers still held for pushes in flight: with pushes bounded to a site in flight
        ([streams] 2 in ``streams.py``) a unit's buffer lives until the next unit's push has queued its own. Read in
        a post-backward hook, it is what the next unit's backward holds on top of its own buffer, which
        [park-backward] leaves unfilled. None where pushes are not held: on CPUs (no push stream), with unbounded
        pushes and with none in flight (``pushes_in_flight`` 0)."""
        return self._control_lifecycle().comm.held_bytes()

    def backward_pushes(self) -> int:
        """How many gradient pushes the current backward has queued so far (the last backward's, after it). Read in
        a post-backward hook, 0 says the hook fired before anything of the backward was pushed: a site whose
        gradients are not all in yet, its transient still allocated, which [park-backward] does not count."""
        return self._control_lifecycle().backward_pushes

    def begin_minibatch(self, micro_batches: int, tokens: int | None = None) -> int | None:
        """Declare this rank's share of the coming minibatch; return the global token count.

        Optional with one-sided transports, which accept any number of micro-batches
        per rank (zero included) and communicate here only to sum ``tokens`` (one small
        all-gather). With ``comm="collective"`` it checks that every rank runs the same
        number of micro-batches and raises otherwise, instead of letting mismatched
        collectives hang later.

        Args:
            micro_batches: micro-batches this rank will run before the next step.
            tokens: this rank's loss-bearing tokens; if given, the sum over ranks is
                returned (normalise the loss by it: ranks' shares differ).
        """
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 0:
            raise ValueError(f"micro_batches must be an int >= 0, got {micro_batches!r}")
        return self._control_minibatch().declare_minibatch(micro_batches, tokens)

    def end_minibatch(self) -> None:
        """This rank's micro-batches are over ([lifecycle] 8, collective: every rank calls it, with or without
        micro-batches): ranks meet once, every rank's pushes are in, and each sharded parameter's ``.grad`` is its
        reduced gradient shard (None if no rank pushed). A no-op where the minibatch already synced."""
        self._control_minibatch().end()

    def finish_minibatch(self) -> None:
        """The optimizer has stepped ([lifecycle] 10, collective): the updated masters are published to the rows
        peers gather, ``.grad`` is dropped and the accumulators are zeroed around one meeting. A no-op where an
        optimizer step already finished the minibatch (implicit events on); raises, on every rank, where nothing
        was synced (a master changed by every rank's step without gradients is finished)."""
        self._control_minibatch().finish_step()

    def set_implicit_minibatch(self, enabled: bool) -> None:
        """Whether torch's implicit events drive the minibatch (default True): ``.grad`` reads sync, optimizer
        steps and ``zero_grad`` finish ([implicit-events]). With False, ``.grad`` reads and writes are plain and
        only ``end_minibatch()`` and ``finish_minibatch()`` sync and finish: for optimizers that step outside
        ``torch.optim.Optimizer.step``, or loops that read ``.grad`` mid-minibatch. Set it between minibatches, to the
        same value on every rank."""
        self._control_minibatch().set_implicit(enabled)


__all__ = ["MinibatchControl"]
