"""The adapter between odcfsdp and torch's internals: every private torch API the package uses, and torch's implicit
events (``.grad`` reads and writes, optimizer steps, ``zero_grad``), caught here and nowhere else.

A torch upgrade that moves a private API breaks here, and here only.

Design note [torch-private]
---------------------------
odcfsdp follows the standard loop without calls of its own, so it learns of some events through
torch's internals; FSDP2 uses most of the same. Each use is one name below, and no other file of the
package touches a private torch API (``tests/test_torch_private.py`` holds the package to it, and
tests each use against this torch). ``torch._foreach_*`` ops are not counted: torch documents them
as its multi-tensor ops. Tested with torch 2.11 (the GPU host) and 2.13 (CI).

====================================  ==============================================================
private API                           what odcfsdp needs it for
====================================  ==============================================================
``torch._C.TensorBase.grad``          ``TENSOR_GRAD``: the C-level ``.grad`` slot under the event
                                      property of sharded parameters ([params], [grad-protocol])
``torch._C._current_graph_task_id``   ``in_backward``: a forward inside backward is recomputation; one
                                      outside it after a backward that raised is refused ([lifecycle])
``Variable._execution_engine          ``queue_end_of_backward``: the end-of-backward callback
.queue_callback``                     ([lifecycle] 7), as FSDP2's
``torch.optim.optimizer.              ``register_foreach_types``: sharded parameters get torch's
_foreach_supported_types``,           multi-tensor kernels in optimizers and ``clip_grad_norm_``
``torch.utils._foreach_utils.         (torch picks them by exact type; DTensor registers itself alike)
_foreach_supported_types``
``torch.optim.optimizer.              ``optimizer_hooks_present``: whether the process's pair of
_global_optimizer_pre_hooks`` /       global optimizer step hooks is still registered
``_post_hooks``                       ([optimizer-events])
``sys._getframe``                     ``called_from``: a ``.grad`` read inside a ``zero_grad`` meets
                                      nobody ([zero-grad-pass])
``torch.distributed.tensor.           ``DTensorSpec``, ``TensorMeta``: a DTensor over a master view
_dtensor_spec``                       without a copy or a collective ([params])
``torch.utils._pytree.tree_leaves``   ``tree_leaves``: the tensors among a hook site's inputs (not
                                      ``tree_flatten``: its recursive closure is a reference cycle
                                      per call, cyclic garbage that brings full GC pauses)
``torch.utils._python_dispatch.       ``is_traceable_wrapper_subclass``: the memory breakdown counts a
is_traceable_wrapper_subclass``       wrapper subclass (float8 weights) by its inner tensors
``Tensor._version``                   ``version_of``: an in-place change of a master outside a step
                                      leaves rows stale, and the next forward says so ([step-protocol])
``DTensor._local_tensor``             ``local_of``, ``set_local``: a sharded parameter's local view read
                                      without an autograd op, and emptied when a model closes
``Tensor._is_param``                  ``mark_parameter``: a DTensor parameter passes
                                      ``isinstance(p, nn.Parameter)``, as ``nn.Parameter(dtensor)``'s
``torch.autograd.profiler.            ``profiler_enabled``, ``phase_range``: the ``odc::`` ranges cost nothing
_is_profiler_enabled``                unless a profiler records ([lifecycle], [parking])
``torch.cuda.memory.                  ``record_memory_history``, ``memory_snapshot``: the peak breakdown
_record_memory_history``, ``_snapshot``  replays the allocator's history ([peak-replay])
``torch._standard_gamma``             ``standard_gamma``: the synthetic data's Dirichlet rows drawn
                                      from a generator of their own (``Gamma`` takes none)
``nn.modules.module._IncompatibleKeys``  ``IncompatibleKeys``: ``load_state_dict`` returns what
                                      ``nn.Module``'s returns
``torch.distributed.utils.            ``apply_to_tensors``: the input and output casts of a unit, as
_apply_to_tensors``                   ``fully_shard``'s (dataclasses included)
``distributed_c10d._get_default_store``  ``default_store``: the watchdog's heartbeats through the
                                      process group's own store ([watchdog])
``LRScheduler._last_lr``              ``set_last_lr``: a resumed run's new learning rate is what the
                                      scheduler's ``get_last_lr()`` reports ([resume-setup])
``torch.distributed._composable.      ``register_fully_shard_state``: torch's ``fully_shard.state(m)``
contract``: ``STATE_KEY``,            and its registry of composable APIs see a unit odcfsdp's
``REGISTRY_KEY``, ``RegistryItem``;   ``fully_shard`` made, as one torch's made ([fully-shard] 5)
``fsdp._fully_shard._fully_shard``
``Tensor._make_wrapper_subclass``     ``ValuesOnRead``: a shard whose values are held in another form
                                      is made whole by its first read instead of reading freed
                                      storage ([split-masters] 3)
====================================  ==============================================================

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
names they stand on are in the table above: ``TENSOR_GRAD``, ``optimizer_hooks_present`` and
``called_from``.

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

import contextlib
import sys
import weakref
from typing import Any, Callable, Protocol, Sequence

import torch
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.utils import _apply_to_tensors as apply_to_tensors
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys
from torch.optim import optimizer as _optimizer
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._foreach_utils import _foreach_supported_types as _utils_foreach_types
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

#: torch versions this module is tested with: CI runs its tests under both (the oldest, pyproject's floor, in a venv of
#: its own: ``.ci/run``); the GPU host has 2.11
TESTED_TORCH = ("2.11", "2.13")

#: the C-level ``.grad`` descriptor of tensors, under ``ODCParameter``'s event property
TENSOR_GRAD = torch._C.TensorBase.grad


def in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (its graph task id; -1 outside one)."""
    return torch._C._current_graph_task_id() != -1


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now running ends (autograd's final callbacks)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def register_foreach_types(*classes: type) -> None:
    """Let torch's optimizers and ``clip_grad_norm_`` use their multi-tensor kernels on tensors of ``classes``."""
    for types in (_optim_foreach_types, _utils_foreach_types):
        for cls in classes:
            if cls not in types:
                types.append(cls)


def optimizer_hooks_present(pre_id: int, post_id: int) -> bool:
    """Whether the global optimizer step hooks with these handle ids are still registered."""
    return pre_id in _optimizer._global_optimizer_pre_hooks and post_id in _optimizer._global_optimizer_post_hooks


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter: bumped by every in-place change through autograd."""
    return t._version


def local_of(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, read without an autograd op (any other tensor: itself)."""
    return getattr(t, "_local_tensor", t)


def set_local(t: torch.Tensor, local: torch.Tensor) -> None:
    """Point a DTensor at another local tensor in place (the object stays: optimizers may hold it)."""
    t._local_tensor = local


class ValuesOnRead(torch.Tensor):
    """A tensor with a shape, dtype and device whose values exist only in another form: the first operation on it
    calls ``read()``, which makes them and returns the real tensor, and runs on that (``repr`` too). Metadata (shape,
    dtype, device, version) reads make nothing. It stands as a DTensor's local tensor while the values are held
    in another form ([split-masters] 3), where an operation would otherwise touch freed storage (a crash)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, read: Callable[[], torch.Tensor]):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                device=like.device, requires_grad=False)
        t.read = read
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.read())

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*_real(args), **_real(kwargs or {}))


def _real(a):
    """``a`` (an ATen op's arguments: tensors in lists, tuples and dicts) with each ``ValuesOnRead`` read."""
    if isinstance(a, ValuesOnRead):
        return a.read()
    if isinstance(a, (list, tuple)):
        return type(a)(_real(x) for x in a)
    if isinstance(a, dict):
        return {k: _real(v) for k, v in a.items()}
    return a


def mark_parameter(t: torch.Tensor) -> None:
    """Make a DTensor (not built by ``nn.Parameter``) pass ``isinstance(t, nn.Parameter)``."""
    t._is_param = True


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` session is recording."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def phase_range(name: str):
    """A ``record_function`` range ``odc::<name>`` while a profiler records, else nothing (no cost per call): each
    step of [lifecycle], and a parked optimizer's copies ([parking])."""
    if profiler_enabled():
        return torch.profiler.record_function(f"odc::{name}")
    return contextlib.nullcontext()


def record_memory_history(*args, **kwargs):
    """``torch.cuda.memory._record_memory_history``: start or stop recording the allocator's history."""
    return torch.cuda.memory._record_memory_history(*args, **kwargs)


def memory_snapshot() -> dict:
    """``torch.cuda.memory._snapshot()``: the allocator's segments and recorded history."""
    return torch.cuda.memory._snapshot()


def standard_gamma(concentration: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gamma(concentration, 1) samples drawn from ``generator``."""
    return torch._standard_gamma(concentration, generator=generator)


def default_store():
    """The default process group's key-value store."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def called_from(name: str, depth: int, skip: int) -> bool:
    """Whether a function called ``name`` is among the ``depth`` callers above the caller's ``skip`` frames."""
    frame = sys._getframe(skip + 1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


def set_last_lr(sched, lrs: list[float]) -> None:
    """Make a scheduler's ``get_last_lr()`` return ``lrs`` (set where its own ``step`` sets them)."""
    sched._last_lr = list(lrs)


def register_fully_shard_state(module: torch.nn.Module, state: object) -> None:
    """Record ``state`` on ``module`` where torch's ``fully_shard`` (its ``contract`` decorator) records its own:
    torch's ``fully_shard.state(module)`` then returns it, and torch's composable registry lists ``fully_shard``
    for ``module`` (so torch's ``fully_shard`` refuses a second call on it, as on one of its own)."""
    # from its own module: ``torch.distributed.fsdp.fully_shard`` may be odcfsdp's (``patch_fsdp2``)
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard

    module.__dict__.setdefault(STATE_KEY, {})[torch_fully_shard.__wrapped__] = state
    module.__dict__.setdefault(REGISTRY_KEY, {})["fully_shard"] = RegistryItem()


# [implicit-events]: the catchers, each handing its event to the model's sink


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


__all__ = ["apply_to_tensors", "called_from", "default_store", "DTensorSpec", "EventGrad", "EventSink",
           "in_backward", "IncompatibleKeys", "inside_zero_grad", "install_optimizer_hooks",
           "is_traceable_wrapper_subclass", "local_of", "mark_parameter", "memory_snapshot",
           "optimizer_hooks_present", "phase_range", "profiler_enabled", "queue_end_of_backward",
           "record_memory_history", "register_foreach_types", "register_fully_shard_state", "set_last_lr", "set_local",
           "standard_gamma",
           "store_grad", "stored_grad", "TENSOR_GRAD", "TensorMeta", "TESTED_TORCH", "tree_leaves", "UNSHARDED",
           "ValuesOnRead", "version_of"]
