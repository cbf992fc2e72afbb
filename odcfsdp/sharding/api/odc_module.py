"""``ODCModule``: what ``fully_shard`` adds to a module's class ([fully-shard] in ``fully_shard.py``).

FSDP2's ``FSDPModule`` methods that have an ODC meaning, over the groups of one unit. A setting made
before the root's call (on a block whose engine the root's call absorbs) is kept in the unit's
``UnitState`` and applied again to the engine that owns the unit in the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ..runtime.arguments import check_reshard_after_forward
from ..runtime.engine import ShardEngine
from ..runtime.engine_settings import EngineSettings
from .fsdp_surface import FSDPModule, FSDPSurface
from .minibatch_control import MinibatchControl


@dataclass(eq=False)
class UnitState:
    """One ``fully_shard`` call's state, kept on its modules: the call's settings, those set on its modules since,
    and the modules themselves. ``fully_shard.state(module)`` returns it, torch's ``fully_shard.state`` too, as
    FSDP2's returns its ``FSDPState``; a list's modules share one."""

    mesh: Any
    reshard_after_forward: bool | None
    mp_policy: Any
    offload_policy: Any
    ignored: set = field(default_factory=set)
    reshard_after_backward: bool = True
    divide_factor: float | None = None
    prefetch: dict = field(default_factory=dict)  # backward (bool) -> the modules to gather ahead
    built_on_meta: bool = False  # its engine planned a meta model (absorbing gives meta parameters back)
    engine_root: nn.Module | None = None  # the module whose engine this unit belongs to
    engine: EngineSettings = field(default_factory=EngineSettings)  # the engine's own settings (fully_shard's)
    modules: list = field(default_factory=list, repr=False)  # the call's modules (one, or FSDP2's list)

    def __getattr__(self, name: str):
        # only for names the dataclass lacks: FSDP2's FSDPState internals (_fsdp_param_group, _state_ctx, ...)
        raise AttributeError(f"odcfsdp's UnitState has no {name!r}: it is not FSDP2's FSDPState (one ODC engine "
                             "serves the whole model; its settings, managed_modules() and managed_params() are here)")

    def managed_modules(self) -> list[nn.Module]:
        """The modules this unit manages, found as FSDP2 finds them: its modules and their submodules, in
        ``modules()`` order, without descending into a module of another ``fully_shard`` call (that unit's)."""
        seen: set[int] = set()
        out: list[nn.Module] = []

        def visit(m: nn.Module) -> None:
            if id(m) in seen or (isinstance(m, ODCModule) and m._odc_settings is not self):
                return
            seen.add(id(m))
            out.append(m)
            for child in m.children():
                visit(child)

        for m in self.modules:
            visit(m)
        return out

    def managed_params(self) -> list[nn.Parameter]:
        """The parameters this unit shards: those of its managed modules, each once, less ``ignored_params``."""
        found = {id(p): p for m in self.managed_modules() for p in m.parameters(recurse=False)}
        return [p for p in found.values() if p not in self.ignored]


    # -- what torch's register_fsdp_forward_method calls on FSDP2's state around a registered method ----------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Gather ``module``'s unit before a method other than ``forward`` runs and hold it until the method returns
        (the method may read the unit's parameters directly between the forwards it calls, as Hugging Face's
        ``generate`` reads the embedding; a forward without grad would otherwise free them)."""
        module.unshard()
        for g in module._odc_groups():
            g.held += 1
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Free the unit's groups after the method, as its forward's post-hook would: those whose
        ``reshard_after_forward`` is True (not the root's own, by default: used again at once)."""
        for g in module._odc_groups():
            g.held -= 1
            if g.reshard_after_forward and not g.held:
                g.to_sharded()
        return output


def state_of(module: nn.Module) -> UnitState | None:
    """``fully_shard.state(module)``: the ``UnitState`` of the call that sharded ``module``; None for a module no
    call sharded (a submodule inside a unit, or a plain module), as FSDP2's."""
    return module.__dict__.get("_odc_settings") if isinstance(module, ODCModule) else None


class UnshardHandle:
    """What ``ODCModule.unshard(async_op=True)`` returns: ``wait()`` makes the gathered values usable."""

    def __init__(self, groups):
        self._groups = groups

    def wait(self) -> None:
        """Block the current stream until the gathers are done."""
        for g in self._groups:
            g.wait_ready()


class ODCModule(MinibatchControl, FSDPSurface):
    """The methods ``fully_shard`` adds to a module's class: FSDP2's ``FSDPModule`` methods that have an ODC
    meaning (the others: ``FSDPSurface``, [fsdp-surface]). Each acts on this module's own unit (``recurse``: and
    every unit below it). A ``fully_shard`` module is an ``FSDPModule``, as FSDP2's are."""

    def __new__(cls, *args, **kwargs):
        # As FSDP2's FSDPModule: constructing ODC<Class> directly builds a plain Class.
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def to_empty(self, *, device, recurse: bool = True):  # type: ignore[override]
        """After a meta-device build ([meta-init] in ``materialize.py``): the shards already live on ``device``
        (another device is refused), meta buffers become real, and what the model's initialisation writes into the
        shards next is published at the next forward. Returns the module, as ``nn.Module.to_empty``."""
        self._odc_engine.to_empty(device)
        return self

    def _control_minibatch(self):  # MinibatchControl's: the model's one minibatch, whichever unit is asked
        return self._odc_engine.minibatch

    def _control_lifecycle(self):  # MinibatchControl's: the model's one lifecycle, whichever unit is asked
        return self._odc_engine.lifecycle

    def _get_fsdp_state(self) -> UnitState:
        """This unit's ``UnitState``, as FSDP2's ``_get_fsdp_state`` returns its ``FSDPState``: torch's
        ``register_fsdp_forward_method(module, name)`` runs its ``_pre_forward``/``_post_forward`` around the
        method, so the method may read the unit's parameters directly."""
        return self._odc_settings

    def __deepcopy__(self, memo):
        raise TypeError("a fully_shard module cannot be deep-copied (its parameters are this rank's shards, bound to "
                        "the model's engine): copy the model before fully_shard, as with FSDP2")

    # -- which engine and groups --------------------------------------------------------------------------
    @property
    def _odc_engine(self) -> ShardEngine:
        root = self._odc_settings.engine_root
        engine = None if root is None else root.__dict__.get("_odc_engine_owned")
        if engine is None:
            raise RuntimeError(f"this {type(self).__name__}'s model is not sharded: the fully_shard call on its root "
                               "failed; call it again")
        return engine

    def _odc_units(self, recurse: bool) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, ODCModule)] if recurse else [self]

    def _odc_groups(self, recurse: bool = False) -> list:
        owners = {id(m._odc_settings) for m in self._odc_units(recurse)}  # a list's modules share theirs
        return [g for g in self._odc_engine.groups if id(g.owner) in owners]

    # -- FSDPModule's methods ----------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's parameters now (not recursive), as FSDP2's; they stay until ``reshard()`` or their
        use in forward is over. With ``async_op`` the gather is queued and the returned handle's ``wait()``
        makes it usable."""
        groups = self._odc_groups()
        for g in groups:
            g.to_unsharded(ahead=async_op)
        handle = UnshardHandle(groups)
        if not async_op:
            handle.wait()
            return None
        return handle

    def reshard(self) -> None:
        """Free this unit's gathered parameters (the modules hold their shards again)."""
        for g in self._odc_groups():
            g.to_sharded()

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free this unit's parameters after their last use in forward (True) or keep them for backward."""
        check_reshard_after_forward(reshard_after_forward)
        for m in self._odc_units(recurse):
            m._odc_settings.reshard_after_forward = reshard_after_forward
        for g in self._odc_groups(recurse):
            g.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free this unit's parameters after backward (True), or keep them gathered until the optimizer step's
        finish ([lifecycle] 10), saving the next micro-batch's gathers for their memory."""
        if not isinstance(reshard_after_backward, bool):
            raise ValueError(f"reshard_after_backward must be True or False, got {reshard_after_backward!r}")
        for m in self._odc_units(recurse):
            m._odc_settings.reshard_after_backward = reshard_after_backward
        for g in self._odc_groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Accepted, and changes nothing: every micro-batch's gradient is added into its owners' accumulators as
        it is produced, with no collective to put off, so a step sees the same sum either way ([fully-shard])."""
        if not isinstance(requires_gradient_sync, bool):
            raise ValueError(f"requires_gradient_sync must be True or False, got {requires_gradient_sync!r}")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the gradients summed over ranks and micro-batches by ``factor`` (default: the data-parallel
        ranks, so ``.grad`` is the mean; 1.0 keeps the sum). One factor serves the whole engine."""
        engine = self._odc_engine
        engine.minibatch.set_divide_factor(factor)
        self._odc_settings.divide_factor = float(factor)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this unit's forward starts, gather ``modules``' units ahead (instead of the recorded order's next
        sites, [prefetch])."""
        self._set_prefetch(list(modules), backward=False)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this unit's backward starts, gather ``modules``' units ahead (instead of the recorded order's)."""
        self._set_prefetch(list(modules), backward=True)

    def _set_prefetch(self, modules: list[nn.Module], backward: bool) -> None:
        self._odc_settings.prefetch[backward] = modules
        apply_prefetch(self, self._odc_engine, modules, backward)

    # -- state dicts: through the engine, so rows follow the values --------------------------------------
    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        """The module's state dict: parameters are this rank's shards (DTensors), as FSDP2's."""
        if "_odc_engine_owned" in self.__dict__:
            self._odc_engine.reshard_all()  # a group kept for backward would otherwise show its unsharded form
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Set parameters and buffers from a state dict of shards or full values (collective at the root).
        ``assign=True`` (accelerate's loader after a meta-device build passes it) copies too: peers read the shards
        one-sidedly, so they keep their identity, and the values are the state dict's either way."""
        if "_odc_engine_owned" not in self.__dict__:
            raise RuntimeError("load_state_dict on a fully_shard unit: load the root's state dict (the module the "
                               "last fully_shard call was on), so every rank's rows change together")
        from ...torch_private import IncompatibleKeys as _IncompatibleKeys

        return _IncompatibleKeys(*self._odc_engine.shard_state.load_state_dict(self, state_dict, strict))


def apply_prefetch(module: nn.Module, engine: ShardEngine, modules: list[nn.Module], backward: bool) -> None:
    """Gather ``modules``' sites ahead when ``module``'s site starts (in backward if ``backward``)."""
    site = engine.driver.site_of.get(module)
    if site is None:
        raise ValueError(f"{type(module).__name__} has no parameters of its own to gather, so no forward of it "
                         "starts a prefetch; set the prefetch on a unit that has")
    targets = []
    for m in modules:
        if not isinstance(m, ODCModule) or m not in engine.driver.site_of:
            raise ValueError(f"can only prefetch fully_shard modules of the same model, got {type(m).__name__}")
        targets += engine.driver.site_of[m]
    engine.lifecycle.prefetch.set_explicit(site, targets, backward)


_CLASSES: dict[type, type] = {}


def odc_class(cls: type) -> type:
    """``ODC<cls>``: ``ODCModule``'s methods over ``cls``'s (made once per class); an ``FSDPModule``, whose original
    class sits at ``_orig_cls_mro_index`` in its MRO, as in FSDP2's ``FSDP<cls>``."""
    if cls not in _CLASSES:
        made = type(f"ODC{cls.__name__}", (ODCModule, cls), {})
        made._orig_cls_mro_index = made.__mro__.index(FSDPModule) + 1
        _CLASSES[cls] = made
    return _CLASSES[cls]


__all__ = ["ODCModule", "UnitState", "UnshardHandle", "apply_prefetch", "odc_class"]
