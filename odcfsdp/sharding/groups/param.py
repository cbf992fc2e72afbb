"""One parameter of an ODCShard model: its sharded and unsharded forms, where it is registered, its gradient.

Design note [params]
--------------------
Outside forward and backward, every module holds, in place of each of its
parameters, this rank's shard of it, as FSDP2 does: a DTensor with the parameter's
global shape and a ``Shard(0)`` placement (``ODCParameter``), whose local tensor is a
view of the group's fp32 master row ([layout]); in a single process without
torch.distributed, a plain ``nn.Parameter`` view of the master
(``ODCLocalParameter``). Reading, printing or computing with it is safe, and any
torch optimizer updates it in place, which is updating the master.

The model's original parameter object becomes the unsharded form; an optimizer built
from it (before wrapping) is refused at its first step ([optimizer-events]).

While its group is unsharded the modules hold the *unsharded* parameter instead: a
view of the group's parameter-major buffer in ``param_dtype`` ([storage-resize] in
``group.py``), the tensor forward and autograd use. ``FlatGroup.to_unsharded`` and
``to_sharded`` swap every registration (a tied parameter has several module/name
pairs) of the group's parameters; so code in a module's forward sees full values,
and code outside sees shards.

The sharded parameter's ``.grad`` is a property: this rank's fp32 accumulator rows,
as a DTensor of the same placement, made complete and attached when first read
after the minibatch's backward passes ([grad-protocol] in ``protocol.py``). This
tier knows nothing of that protocol: reads and writes of ``.grad`` are *events*, caught by
the adapter's ``EventGrad`` ([implicit-events] in ``torch_private.py``) and handed to
the sink the parameter was given (``events``: its model's ``Minibatch``), which decides what they mean.
A sharded parameter that receives a gradient through autograd (it was used in a
computation outside its module's forward) raises: that gradient would bypass the
accumulators.

Design note [requires-grad]
---------------------------
A parameter trained when the model was sharded (``trainable``: its group has an accumulator) may
be frozen and unfrozen between steps through its sharded form, as with FSDP2
(``p.requires_grad_(False)``, e.g. a layer frozen part way through training): it is *trained* while
its sharded form requires grad. Its unsharded form follows at its next gather, so autograd computes
no gradient for it while frozen (its slice of the group's gradient buffer stays zero, and zeros are
what it pushes), and at the sync it gets no ``.grad``: the optimizer skips it, as FSDP2's, and the
minibatch finishes once every parameter trained *now* is consumed. A parameter frozen when sharded
has no accumulator: unfreezing it is refused at the next forward, in one line.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..placement.layout import GroupLayout
from ...torch_private import (UNSHARDED, DTensorSpec, EventGrad, EventSink, TensorMeta, ValuesOnRead, local_of,
                              mark_parameter, register_foreach_types, set_local, store_grad, stored_grad)


class ODCParameter(EventGrad, DTensor):
    """A parameter of an ``ODCShard`` model outside forward: this rank's dim-0 shard as a DTensor.

    Its local tensor is a view of the group's master row; ``.grad`` is this rank's
    reduced gradient shard (see [params] and [grad-protocol]).
    """


class ODCLocalParameter(EventGrad, nn.Parameter):
    """An ``ODCShard`` parameter outside forward in a single process without torch.distributed (see [params])."""


# torch.optim and clip_grad_norm_ pick their multi-tensor (foreach / fused) kernels by exact type; DTensor registers
# itself the same way (torch/distributed/tensor/__init__.py). Without this, defaults fall back to a loop per tensor.
register_foreach_types(ODCParameter, ODCLocalParameter)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def shard_placements(device_mesh) -> tuple:
    """A shard's DTensor placements: ``(Shard(0),)``, or ``(Replicate(), Shard(0))`` on a 2-D HSDP mesh ([hsdp])."""
    return (Shard(0),) if device_mesh.ndim == 1 else (Replicate(), Shard(0))


def as_global(local: torch.Tensor, shape: tuple[int, ...], device_mesh, requires_grad: bool = False,
              cls: type = DTensor) -> torch.Tensor:
    """``local`` (a rank's dim-0 shard) as a ``cls`` DTensor of global ``shape`` (itself without a mesh)."""
    if device_mesh is None:
        return local
    meta = TensorMeta(torch.Size(shape), _contiguous_strides(shape), local.dtype)
    spec = DTensorSpec(device_mesh, shard_placements(device_mesh), meta)
    return cls(local, spec, requires_grad=requires_grad)


class ShardedParam:
    """One parameter of a flat group (FSDP2's ``FSDPParam`` tier): its two forms and its registrations.

    Args:
        layout: its group's layout; ``index``: its slot there.
        buffer: the group's parameter-major unsharded buffer (``param_dtype``).
        master: this rank's master row of the group (the shard is a view of it).
        accumulator: this rank's gradient accumulator row (None for a frozen group).
        rank: this rank (which shard it holds).
        original: the model's parameter object. It becomes the unsharded parameter (a
            view of the group's unsharded buffer), unless it is on the meta device, which
            cannot be re-pointed: then a new parameter replaces it.
        registrations: every (module, attribute name) it is registered under.
        device_mesh: the mesh of the DTensor shards (None: one process, plain tensors).
        position: its place in the model's parameter order (``.grad`` passes are told apart by it).
        wrap: makes the unsharded form from its view of ``buffer`` (a float8 weight's ``Float8TrainingTensor``,
            [float8-gather] in ``float8.py``); None: the original parameter viewing the buffer.
    """

    def __init__(self, layout: GroupLayout, index: int, buffer: torch.Tensor, master: torch.Tensor,
                 accumulator: torch.Tensor | None, rank: int, original: nn.Parameter,
                 registrations: list[tuple[nn.Module, str]], device_mesh, position: int,
                 wrap: Callable[[torch.Tensor], torch.Tensor] | None = None):
        slot = layout.slots[index]
        self.name = slot.name
        self.position = position
        self.trainable = original.requires_grad  # has an accumulator view: may be trained ([requires-grad])
        self.registrations = registrations
        self.events: EventSink | None = None  # where .grad reads and writes go: the model's Minibatch, once built
        self.index = index
        self._device_mesh = device_mesh
        view = layout.param_view(buffer, index)
        unsharded = original
        if wrap is not None:
            # A tensor subclass cannot become the original parameter's .data: a new parameter (as FSDP2's
            # unsharded float8 parameter), whose subclass holds the view; the original is refused to optimizers too.
            unsharded = nn.Parameter(wrap(view), requires_grad=original.requires_grad)
            if self.trainable:
                UNSHARDED[id(original)] = original
            self._original = original
            # Its values are in the master now: keep the object (it is refused to optimizers by id), not its full
            # values (the whole model's, on every rank, while anything held it: this object, a user's list).
            original.data = torch.empty(0, dtype=original.dtype, device=original.device)
        else:
            if original.is_meta:
                # Not nn.Parameter(view): that would share the buffer's version counter (see
                # [storage-resize]); .data assignment gives the parameter its own.
                unsharded = nn.Parameter(view.new_empty(0), requires_grad=original.requires_grad)
            unsharded.data = view
        self.unsharded: nn.Parameter = unsharded
        self.slot = slot
        self.shape = slot.shape
        self.local = local = layout.local_view(master, index, rank)
        self._on_read: ValuesOnRead | None = None  # the DTensor's local while held ([split-masters] 3), made once
        self._make_whole: Callable[[], None] | None = None
        if device_mesh is None:
            sharded = ODCLocalParameter(local, requires_grad=self.trainable)
        else:
            sharded = as_global(local, slot.shape, device_mesh, self.trainable, ODCParameter)
            mark_parameter(sharded)  # isinstance(sharded, nn.Parameter), as nn.Parameter(dtensor) marks it
        sharded._odc = self
        self.sharded = sharded
        self.grad_view = (as_global(layout.local_view(accumulator, index, rank), slot.shape, device_mesh)
                          if self.trainable else None)
        if self.trainable:  # an optimizer over the parameters as they were before wrapping is refused
            UNSHARDED[id(unsharded)] = unsharded  # ([optimizer-events])
        # The hook lives in C++, where the garbage collector cannot see a cycle through it: it holds the name only.
        self._hook = (sharded.register_post_accumulate_grad_hook(functools.partial(_used_while_sharded, self.name))
                      if self.trainable else None)

    @property
    def trained(self) -> bool:
        """Trained now: it was trained when wrapped (so its group has an accumulator) and its sharded form still
        requires grad ([requires-grad]: it may be frozen and unfrozen between steps, as with FSDP2)."""
        return self.trainable and self.sharded.requires_grad

    # -- registrations ---------------------------------------------------------------------------
    def to_unsharded(self) -> None:
        """Every module that holds this parameter now holds the unsharded (full-value) form, which requires grad as
        the sharded one does now."""
        if self.trainable and self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        for mod, attr in self.registrations:
            mod._parameters[attr] = self.unsharded

    def to_sharded(self) -> None:
        """Every module that holds this parameter now holds this rank's shard."""
        for mod, attr in self.registrations:
            mod._parameters[attr] = self.sharded

    def problem(self, param_dtype: torch.dtype) -> str | None:
        """What the user changed about this parameter after wrapping, if anything (None: intact)."""
        if not all((held := mod._parameters.get(attr)) is self.sharded or held is self.unsharded
                   for mod, attr in self.registrations):
            return "was replaced after ODCShard wrapped the model"
        local = local_of(self.sharded)  # the DTensor's local tensor (no autograd op)
        if self.held:  # its values are held elsewhere for now ([split-masters] 3): the view stays its own
            local = self.local
        if (tuple(self.sharded.shape) != self.shape or local.data_ptr() != self.local.data_ptr()
                or tuple(self.unsharded.shape) != self.shape or self.unsharded.dtype != param_dtype):
            return "had its data reassigned after wrapping"
        if not self.trainable and (self.sharded.requires_grad or self.unsharded.requires_grad):
            return ("was frozen when the model was sharded, so its group has no gradient accumulator: unfreeze it "
                    "before sharding (a parameter trained then may be frozen and unfrozen between steps)")
        return None

    # -- values held elsewhere ([split-masters] 3) ------------------------------------------------------
    def hold(self, make_whole: Callable[[], None]) -> None:
        """The master's storage is about to be freed: the shard's DTensor points at a tensor whose first operation
        calls ``make_whole`` (which must ``unhold``) and runs on the view of the master, so a read, a print or a
        write of the shard works instead of touching freed memory. (A plain parameter, one process without
        torch.distributed, cannot be re-pointed: it keeps its view.)"""
        if isinstance(self.sharded, DTensor):
            if self._on_read is None:  # made once: a split holds every shard each step
                self._make_whole, self._on_read = make_whole, ValuesOnRead(self.local, self._read_whole)
            set_local(self.sharded, self._on_read)

    @property
    def held(self) -> bool:
        """Whether the shard's DTensor points at its ``ValuesOnRead`` now (``hold``)."""
        return self._on_read is not None and local_of(self.sharded) is self._on_read

    def _read_whole(self) -> torch.Tensor:
        if self.held:
            self._make_whole()
        return self.local

    def unhold(self) -> None:
        """The master is whole again: the shard's DTensor points at its view of it."""
        if self.held:
            set_local(self.sharded, self.local)

    # -- gradient ----------------------------------------------------------------------------------
    @property
    def attached(self) -> torch.Tensor | None:
        """The sharded parameter's ``.grad`` as stored (no protocol involved)."""
        return stored_grad(self.sharded)

    def attach_grad(self, layout: GroupLayout | None = None, row: torch.Tensor | None = None, rank: int = 0) -> None:
        """Point ``.grad`` at this rank's accumulator shard, or at its shard of ``row`` (a row-shaped copy of the
        accumulator in the masters' dtype, with ``layout`` and ``rank``: see [precision])."""
        grad = self.grad_view if row is None else as_global(layout.local_view(row, self.index, rank), self.shape,
                                                            self._device_mesh)
        store_grad(self.sharded, grad)

    def detach_grad(self) -> None:
        """Drop the sharded parameter's ``.grad`` (no event)."""
        store_grad(self.sharded, None)

    def assign_grad(self, value: torch.Tensor) -> None:
        """Store ``value`` as the sharded parameter's ``.grad`` (no event), as plain PyTorch keeps an assigned one."""
        store_grad(self.sharded, value)

    def release(self) -> None:
        """The wrapper is closing and its rows are about to be freed: drop the hook and the gradient, point the shard
        (which an optimizer may still hold) at an empty tensor, and leave a meta-device parameter of the same shape
        in every registration, so that using the model now fails instead of reading freed memory."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.detach_grad()
        UNSHARDED.pop(id(self.unsharded), None)
        if (original := getattr(self, "_original", None)) is not None:
            UNSHARDED.pop(id(original), None)
        empty = torch.empty(0, dtype=self.local.dtype, device=self.local.device)
        if isinstance(self.sharded, DTensor):
            set_local(self.sharded, empty)
        else:
            self.sharded.data = empty
        self.local = self.grad_view = None
        released = nn.Parameter(torch.empty(self.shape, dtype=self.unsharded.dtype, device="meta"),
                                requires_grad=self.trainable)
        for mod, attr in self.registrations:
            mod._parameters[attr] = released


def _used_while_sharded(name: str, param: torch.Tensor) -> None:
    store_grad(param, None)
    raise RuntimeError(
        f"parameter {name!r} got a gradient while sharded: it was used outside its module's forward. "
        "ODCShard gathers a parameter only while its module runs; call the module instead, hook the parent "
        "as a whole (units=...), or use reshard_after_forward=False"
    )
