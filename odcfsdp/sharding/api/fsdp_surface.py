"""FSDP2's ``FSDPModule`` methods that concern its collectives, as ``fully_shard`` modules answer them.

Design note [fsdp-surface]
--------------------------
A ``fully_shard`` module is an instance of torch's ``FSDPModule`` (``ODC<Class>``'s bases are
``ODCModule``, then ``FSDPSurface``, then ``FSDPModule``, then the module's class), so code that looks
for a FSDP2 model (``isinstance(m, FSDPModule)``: accelerate, trainers, torch's pipelining) finds it.
None of ``FSDPModule``'s own methods is ever run on it: each is defined again, in ``ODCModule``
where it has an ODC meaning (``unshard``, ``reshard``, the reshard settings, prefetch, the divide
factor) and here otherwise, as one of three kinds, listed in ``FSDP_METHODS`` (capabilities as data:
docs/fsdp2.md is written from it and a test holds every ``FSDPModule`` method of the installed torch
to it):

1. *same*: FSDP2's behaviour, by ODC's means (the divide factor's old name, the post-optimizer event,
   the bound on gradient buffers in flight, the iteration state after an exception);
2. *moot*: the setting tunes a collective that ODC does not run, and the step's result is FSDP2's
   either way (every micro-batch's gradient is added into its owners' fp32 accumulators as it is
   produced, and the sum is read once at the sync): accepted, its argument checked, nothing changed;
3. *refused*: a hook into a collective ODC does not have, or a behaviour it cannot give: one line
   that says why and what to do instead, before anything changes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

#: every ``FSDPModule`` method and what a ``fully_shard`` module does with it ([fsdp-surface]): (kind, why)
FSDP_METHODS: dict[str, tuple[str, str]] = {
    "unshard": ("same", "gathers the unit's groups (async_op: on the gather stream, with a handle to wait on)"),
    "reshard": ("same", "frees the unit's gathered groups"),
    "set_reshard_after_forward": ("same", "per unit, as FSDP2's"),
    "set_reshard_after_backward": ("same", "per unit: kept gathered until the optimizer step's finish"),
    "set_modules_to_forward_prefetch": ("same", "explicit prefetch targets, on the gather stream"),
    "set_modules_to_backward_prefetch": ("same", "explicit prefetch targets, in backward"),
    "set_gradient_divide_factor": ("same", "the divisor of the summed gradients, applied once at the sync"),
    "set_reduce_scatter_divide_factor": ("same", "FSDP2's old name of set_gradient_divide_factor"),
    "set_post_optim_event": ("same", "the current stream waits for the event, so the step's publish and every "
                                     "later gather come after the optimizer's work"),
    "set_reduce_scatter_max_input_buffers": ("same", "bounds the sites whose gradient buffers wait for their "
                                                     "pushes (model.comm.pushes_in_flight; one model, one bound)"),
    "reset_iter_state": ("same", "after an exception mid-forward or mid-backward: every group resharded, the "
                                 "pass's unpushed gradient buffers dropped; gradients already pushed stay in the "
                                 "sum, so call opt.zero_grad() as FSDP2's recovery does"),
    "set_requires_gradient_sync": ("moot", "every micro-batch's gradient is added into its owners' accumulators "
                                           "as it is produced; the step sees the same sum either way"),
    "set_is_last_backward": ("moot", "no reduction waits at the end of a backward: the minibatch ends where its "
                                     "gradients are read"),
    "set_requires_all_reduce": ("moot", "HSDP replicas are summed once, at the sync, whatever the setting"),
    "set_force_sum_reduction_for_comms": ("moot", "pushes are sums already, divided once at the sync"),
    "set_reduce_scatter_unused_params": ("moot", "a group's gradient buffer is pushed whole, zeros for unused "
                                                 "parameters, and one-sided pushes cannot mismatch"),
    "set_separate_reduce_scatter_group": ("moot", "pushes run on a stream of their own and need no process group"),
    "set_allocate_memory_from_process_group_for_comm": ("moot", "no staging buffers: one-sided kernels read "
                                                                "rows and add gradients in place"),
    "set_symm_mem_for_comm": ("moot", "rows already live on the NVSHMEM symmetric heap (comm='nvshmem')"),
    "_set_unshard_async_op": ("moot", "gathers ahead of use already run on a side stream (prefetch)"),
    "set_custom_all_gather": ("refused", "odcfsdp gathers with its transport's one-sided kernels, not an "
                                         "all-gather a custom collective could replace: pick a transport (comm=)"),
    "set_custom_reduce_scatter": ("refused", "odcfsdp pushes gradients into their owners' accumulators with its "
                                             "transport's kernels, not a reduce-scatter a custom one could replace"),
    "set_all_reduce_hook": ("refused", "no per-unit reduce output exists to hook (gradients are summed in their "
                                       "owners' accumulators and read once): transform .grad before the optimizer "
                                       "step instead"),
    "set_unshard_in_backward": ("refused", "a unit is gathered again in backward with its gradient buffers; "
                                           "skipping that gather is not supported (True, the default, is accepted)"),
    "_get_fsdp_state": ("same", "the unit's ``UnitState`` (``fully_shard.state``), not FSDP2's ``FSDPState``: its "
                                "internals raise ``AttributeError`` saying so; its ``_pre_forward`` and "
                                "``_post_forward`` gather and hold the unit around a method registered with torch's "
                                "``register_fsdp_forward_method`` (Hugging Face's Trainer registers ``generate``)"),
    "_apply": ("refused", "moving or casting a sharded model detaches its shards: move or cast it before "
                          "fully_shard (to_empty(device=...) after a meta-device build is accepted)"),
}


def fsdp_methods_table() -> str:
    """docs/design.md's table of ``FSDPModule`` methods (markdown), generated from ``FSDP_METHODS``."""
    rows = ["| `FSDPModule` method | kind | on a `fully_shard` module |", "|---|---|---|"]
    for kind in ("same", "moot", "refused"):
        rows += [f"| `{name}` | {kind} | {why} |" for name, (k, why) in FSDP_METHODS.items() if k == kind]
    return "\n".join(rows)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} takes True or False, got {value!r}")


def _refuse(method: str):
    raise NotImplementedError(f"{method} is not supported by odcfsdp: {FSDP_METHODS[method][1]}")


class FSDPSurface(FSDPModule):
    """The ``FSDPModule`` methods ``ODCModule`` does not define ([fsdp-surface]): kinds *moot* and *refused*, and the
    *same* ones that need no unit's groups."""

    # -- same -------------------------------------------------------------------------------------------------
    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's old name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Order what comes after the optimizer step (the finish's publish, every later gather) after ``event``, as
        FSDP2 makes its next all-gather wait for it: the current stream waits for it (nothing to wait for on CPU)."""
        device = self._odc_engine.mesh.device
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(event)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Bound the sites whose gradient buffers may wait for their pushes ([streams] 2, ``pushes_in_flight``), as
        FSDP2 bounds its reduce-scatter inputs in flight; the bound is the model's (``recurse`` changes nothing)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be an int >= 1, got {max_input_buffers!r}")
        self._odc_engine.comm.pushes_in_flight = max_input_buffers

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: reshard every group and drop the pass's gradient buffers
        not pushed yet; the engine is idle again. Gradients already pushed stay in the minibatch's sum: call
        ``opt.zero_grad()`` next, as FSDP2's recovery does, to drop them."""
        self._odc_engine.reset_iter_state()

    # -- moot: accepted, checked, nothing to change ------------------------------------------------------------
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted ([fsdp-surface] moot): no reduction waits at the end of a backward."""
        _check_bool("set_is_last_backward", is_last_backward)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Accepted ([fsdp-surface] moot): HSDP replicas are summed once, at the sync."""
        _check_bool("set_requires_all_reduce", requires_all_reduce)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted ([fsdp-surface] moot): pushes are sums, divided once at the sync."""
        _check_bool("set_force_sum_reduction_for_comms", enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted ([fsdp-surface] moot): groups are pushed whole, zeros for unused parameters."""
        _check_bool("set_reduce_scatter_unused_params", reduce_scatter_unused_params)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted ([fsdp-surface] moot): pushes run on a stream of their own."""
        _check_bool("set_separate_reduce_scatter_group", enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted ([fsdp-surface] moot): there are no staging buffers to allocate."""
        _check_bool("set_allocate_memory_from_process_group_for_comm", enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted ([fsdp-surface] moot): rows live on the NVSHMEM symmetric heap already."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm takes backend='NCCL', got {backend!r}")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted ([fsdp-surface] moot): gathers ahead of use run on a side stream."""
        _check_bool("_set_unshard_async_op", async_op)

    # -- refused -------------------------------------------------------------------------------------------------
    def set_custom_all_gather(self, comm) -> None:
        """Refused ([fsdp-surface]): there is no all-gather to replace."""
        _refuse("set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm) -> None:
        """Refused ([fsdp-surface]): there is no reduce-scatter to replace."""
        _refuse("set_custom_reduce_scatter")

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Refused ([fsdp-surface]): there is no per-unit reduce output to hook."""
        _refuse("set_all_reduce_hook")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """True (the default) is accepted; False is refused ([fsdp-surface])."""
        _check_bool("set_unshard_in_backward", unshard_in_backward)
        if not unshard_in_backward:
            _refuse("set_unshard_in_backward")

    def _apply(self, fn, recurse: bool = True):
        """Refused ([fsdp-surface]): ``.to()``, ``.float()`` and the like would detach the shards."""
        _refuse("_apply")


__all__ = ["FSDPModule", "FSDPSurface", "FSDP_METHODS", "fsdp_methods_table"]
