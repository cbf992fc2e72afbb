"""Every private torch API odcfsdp uses, in one place: a torch upgrade that moves one breaks here, and here only.

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
``torch.autograd.profiler.            ``profiler_enabled``: the ``odc::`` ranges cost nothing unless a
_is_profiler_enabled``                profiler records ([lifecycle])
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
====================================  ==============================================================

This package is the adapter between odcfsdp and torch's internals: this module names the private APIs, and
``events.py`` ([implicit-events]) catches torch's implicit events (``.grad`` reads and writes, optimizer steps,
``zero_grad``) through them and hands them to the minibatch. The explicit path is public: ``begin_minibatch``,
``end_minibatch`` and ``finish_minibatch``, with ``set_implicit_minibatch(False)`` turning the inference off.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.utils import _apply_to_tensors as apply_to_tensors
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys
from torch.optim import optimizer as _optimizer
from torch.optim.optimizer import _foreach_supported_types as _optim_foreach_types
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


def mark_parameter(t: torch.Tensor) -> None:
    """Make a DTensor (not built by ``nn.Parameter``) pass ``isinstance(t, nn.Parameter)``."""
    t._is_param = True


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` session is recording."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


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


__all__ = ["DTensorSpec", "IncompatibleKeys", "TENSOR_GRAD", "TESTED_TORCH", "TensorMeta", "apply_to_tensors",
           "called_from", "default_store", "in_backward", "standard_gamma",
           "is_traceable_wrapper_subclass", "local_of", "mark_parameter", "memory_snapshot", "optimizer_hooks_present",
           "profiler_enabled", "queue_end_of_backward", "record_memory_history", "register_foreach_types",
           "register_fully_shard_state", "set_last_lr", "set_local", "tree_leaves", "version_of"]

