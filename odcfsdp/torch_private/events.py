"""torch's implicit events, caught in one place: ``.grad`` reads and writes, optimizer steps, ``zero_grad``.

Design note [implicit-events]
-----------------------------
A minibatch has two points where ranks meet: the sync, once the micro-batches are over
([lifecycle] 8), and the finish, once the optimizer stepped ([lifecycle] 10). The explicit
path names them: ``model.end_minibatch()`` and ``model.finish_minibatch()``
(``Minibatch.end`` and ``Minibatch.finish_step``). The standard loop makes neither call,
so by default they are also inferred from what torch does, here and nowhere else:

* a ``.grad`` read of a sharded parameter, through ``EventGrad`` (the property over torch's C-level
  ``.grad`` slot, ``TENSOR_GRAD``): the first read of a pass after the micro-batches stands for
  ``end_minibatch()`` ([grad-protocol]);
* ``opt.step()`` over the model's parameters, through the process's global optimizer post-step hook
  (``install_optimizer_hooks``): once every trained gradient is consumed, it stands for
  ``finish_minibatch()``;
* ``zero_grad``, through ``EventGrad``'s setter (``.grad = None`` consumes a gradient) and
  ``inside_zero_grad`` (its reads of a fresh minibatch meet nobody, [zero-grad-pass]);
* an optimizer over the parameters as they were before wrapping, through the global pre-step hook
  (``UNSHARDED``): not an event but an error, raised before it steps.

Each catcher hands the event to the model's sink (``EventSink``: the ``Minibatch``, which
decides what it means, [step-protocol]); none knows the protocol. The private torch
names they stand on are ``torch_private``'s ([torch-private]): ``TENSOR_GRAD``,
``optimizer_hooks_present`` and ``called_from``.

``model.set_implicit_minibatch(False)`` turns the inference off: reads and writes of ``.grad``
are plain, optimizer steps and ``zero_grad`` pass unseen, and only the explicit calls sync and
finish. Use it where an optimizer steps outside ``torch.optim.Optimizer.step`` (its hooks never
fire) or where a loop reads ``.grad`` mid-minibatch. The end of a backward pass is the other
implicit event: autograd's final callback ([lifecycle] 7, ``queue_end_of_backward``), as FSDP2's.

Design note [optimizer-events]
------------------------------
Optimizers are built by the user after wrapping, so a model learns of their steps
through torch's global optimizer step hooks: one pair for the process, installed with
the first model and never removed, which keeps no list of models. Each sharded
parameter points to its model's sink (``sp.events``, [params]), so the post-step hook
hands every model the parameters of its own that the optimizer holds
(``optimizer_stepped``); a model that is gone has no parameter in any live optimizer,
and a closed one ignores the event. The pre-step hook refuses an optimizer built from
the parameters as they were before wrapping (``UNSHARDED``: by id, holding them weakly;
not a ``WeakSet``, whose lookups compare tensors with ``==``, elementwise, on storages
that may be freed; filled by [params]). Should something remove torch's hooks (a test
fixture clearing the global tables), the next model puts the pair back.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import TENSOR_GRAD, called_from, optimizer_hooks_present


class EventSink(Protocol):
    """Where a model's implicit events go (its ``Minibatch``); ``sp`` is a sharded parameter's record."""

    def grad_read(self, sp: Any) -> torch.Tensor | None:
        """``sp.sharded.grad`` was read: return what the read gives."""

    def grad_written(self, sp: Any, value: torch.Tensor | None) -> None:
        """``sp.sharded.grad`` was assigned ``value`` (None: cleared, as ``zero_grad`` does)."""

    def optimizer_stepped(self, sps: Sequence[Any]) -> None:
        """An optimizer stepped over ``sps``, parameters of this model."""


class EventGrad:
    """A parameter class's ``.grad``, read and written as events of its model's sink (``self._odc.events``)."""

    @property
    def grad(self):
        """This rank's fully reduced gradient shard (reading it may be where ranks meet)."""
        return self._odc.events.grad_read(self._odc)

    @grad.setter
    def grad(self, value):
        self._odc.events.grad_written(self._odc, value)

    @grad.deleter
    def grad(self):
        self._odc.events.grad_written(self._odc, None)


def stored_grad(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad`` as stored, without an event."""
    return TENSOR_GRAD.__get__(t)


def store_grad(t: torch.Tensor, value: torch.Tensor | None) -> None:
    """Store ``value`` as ``t.grad``, without an event."""
    TENSOR_GRAD.__set__(t, value)


def inside_zero_grad(depth: int = 3) -> bool:
    """Whether a ``zero_grad`` method (an optimizer's or a module's) is among the nearest ``depth`` callers of
    the ``.grad`` read being handled ([zero-grad-pass]): frames above the sink's ``grad_read`` and the property."""
    return called_from("zero_grad", depth, skip=2)


#: the trained parameters as they were before wrapping (now the unsharded forms): an optimizer over them is refused.
UNSHARDED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_hooks: tuple | None = None  # the process's one pair of handles


def install_optimizer_hooks() -> None:
    """Register the process's pair of optimizer step hooks, once (again if they were removed)."""
    global _hooks
    if _hooks is not None and optimizer_hooks_present(_hooks[0].id, _hooks[1].id):
        return
    if _hooks is not None:
        for handle in _hooks:
            handle.remove()
    _hooks = (register_optimizer_step_pre_hook(_before_optimizer_step),
              register_optimizer_step_post_hook(_after_optimizer_step))


def _before_optimizer_step(optimizer, args, kwargs) -> None:
    if any(UNSHARDED.get(id(p)) is p for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError(
            "this optimizer holds the model's parameters as they were before ODCShard wrapped it; build the "
            "optimizer after wrapping, from the wrapped model's parameters (as with FSDP2)")


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    by_model: dict[int, tuple] = {}  # id(sink) -> (sink, its parameters in this optimizer)
    for g in optimizer.param_groups:
        for p in g["params"]:
            sp = getattr(p, "_odc", None)
            if sp is not None and sp.events is not None:
                by_model.setdefault(id(sp.events), (sp.events, []))[1].append(sp)
    for sink, sps in by_model.values():
        sink.optimizer_stepped(sps)


__all__ = ["EventGrad", "EventSink", "UNSHARDED", "inside_zero_grad", "install_optimizer_hooks", "store_grad",
           "stored_grad"]
