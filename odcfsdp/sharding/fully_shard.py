"""``fully_shard``: FSDP2's entry point, on the engine ``ODCShard`` uses.

Design note [fully-shard]
-------------------------
A FSDP2 script calls ``fully_shard`` on each block, then on the root, and after each call the
module's parameters are this rank's shards (DTensors): the optimizer can be built over them. ODC's
ranks meet once per minibatch for the whole model, so one engine ([engine] in ``engine.py``) must
own every unit. A call:

1. checks its arguments: what has no ODC meaning is refused in one line (``shard_placement_fn``,
   ``dp_mesh_dims``, an int ``reshard_after_forward``), and so is a second call on one module;
2. swaps the module's class for ``ODC<Class>`` (``ODCModule``'s methods over the module's own), as
   FSDP2 swaps in ``FSDP<Class>``, and records the call's settings on it;
3. absorbs the engines earlier calls built below it (the blocks'): each gathers its full values
   (one engine at a time, so at most one block's), is closed, and its modules get plain parameters
   again. The blocks' own engines thus cost one gather of their parameters at set-up;
4. builds one engine over the module: the modules of earlier calls below it are its units (each one
   hook site, [hooks], whose groups hold no other unit's parameters), the module's remaining
   parameters are planned as its own groups, hooked module by module. ``reshard_after_forward``
   defaults to FSDP2's: True for a unit, False for the root's own groups (used again at once by
   backward). All calls of one engine must agree on the mesh, ``mp_policy`` and ``offload_policy``,
   since one engine has one of each. On CUDA a call that absorbs nothing runs on the ``collective``
   transport: NVSHMEM's heap is sized once, by the first engine on it, and must hold the whole
   model's rows, so the root's call, which absorbs the blocks', is the one that sizes it. A single
   call on a whole model (no blocks) thus runs on NCCL collectives, with equal micro-batch counts
   (``ODCShard(model)`` is the one-sided way to shard a model in one call).

After a torchtitan script's calls, one engine owns the model: a minibatch costs the same two
meetings as ``ODCShard``'s, micro-batch counts may differ per rank, and the standard loop, DCP and
``clip_grad_norm_`` work as with FSDP2. ``ODCModule``'s methods are FSDP2's ``FSDPModule`` methods that
have an ODC meaning (see each); ``set_requires_gradient_sync`` is accepted and changes nothing, since
every micro-batch's gradient is added into its owners' fp32 accumulators as it is produced: with
sync off until the last micro-batch (FSDP2's way to accumulate), the step sees the same sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .arguments import check_params, check_reshard_after_forward, compute_dtype, shard_device
from .engine import ShardEngine
from .mesh import ShardMesh
from .precision import policy_param_dtype, resolve_precision

GROUP_BYTES = 32 << 20  # ODCShard's default group budget


@dataclass
class UnitSettings:
    """One ``fully_shard`` call's settings, kept on its module."""

    mesh: Any
    reshard_after_forward: bool | None
    mp_policy: Any
    offload_policy: Any
    ignored: set = field(default_factory=set)
    requires_gradient_sync: bool = True
    engine_root: nn.Module | None = None  # the module whose engine this unit belongs to


class UnshardHandle:
    """What ``ODCModule.unshard(async_op=True)`` returns: ``wait()`` makes the gathered values usable."""

    def __init__(self, groups):
        self._groups = groups

    def wait(self) -> None:
        """Block the current stream until the gathers are done."""
        for g in self._groups:
            g.wait_ready()


class ODCModule:
    """The methods ``fully_shard`` adds to a module's class: FSDP2's ``FSDPModule`` methods that have an ODC
    meaning. Each acts on this module's own unit (``recurse``: and every unit below it)."""

    def __new__(cls, *args, **kwargs):
        # As FSDP2's FSDPModule: constructing ODC<Class> directly builds a plain Class.
        orig_cls = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    # -- which engine and groups --------------------------------------------------------------------------
    @property
    def _odc_engine(self) -> ShardEngine:
        return self._odc_settings.engine_root.__dict__["_odc_engine_owned"]

    def _odc_groups(self, recurse: bool = False) -> list:
        engine = self._odc_engine
        mods = [m for m in self.modules() if isinstance(m, ODCModule)] if recurse else [self]
        owners = {id(m) for m in mods}
        return [g for g in engine.groups if id(g.owner) in owners]

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
        for g in self._odc_groups(recurse):
            g.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free this unit's parameters after backward (True), or keep them gathered until the optimizer step's
        finish ([lifecycle] 10), saving the next micro-batch's gathers for their memory."""
        if not isinstance(reshard_after_backward, bool):
            raise ValueError(f"reshard_after_backward must be True or False, got {reshard_after_backward!r}")
        for g in self._odc_groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Accepted, and changes nothing: every micro-batch's gradient is added into its owners' accumulators as
        it is produced, with no collective to put off, so a step sees the same sum either way ([fully-shard])."""
        if not isinstance(requires_gradient_sync, bool):
            raise ValueError(f"requires_gradient_sync must be True or False, got {requires_gradient_sync!r}")
        for m in (self.modules() if recurse else [self]):
            if isinstance(m, ODCModule):
                m._odc_settings.requires_gradient_sync = requires_gradient_sync

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the gradients summed over ranks and micro-batches by ``factor`` (default: the data-parallel
        ranks, so ``.grad`` is the mean; 1.0 keeps the sum). One factor serves the whole engine."""
        self._odc_engine.lifecycle.set_divide_factor(factor)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this unit's forward starts, gather ``modules``' units ahead (instead of the recorded order's next
        sites, [prefetch])."""
        self._set_prefetch(modules, backward=False)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """When this unit's backward starts, gather ``modules``' units ahead (instead of the recorded order's)."""
        self._set_prefetch(modules, backward=True)

    def _set_prefetch(self, modules, backward: bool) -> None:
        engine = self._odc_engine
        site = engine.driver.site_of.get(self)
        if site is None:
            raise ValueError(f"{type(self).__name__} has no parameters of its own to gather, so no forward of it "
                             "starts a prefetch; set the prefetch on a unit that has")
        targets = []
        for m in modules:
            if not isinstance(m, ODCModule) or m._odc_engine is not engine or m not in engine.driver.site_of:
                raise ValueError(f"can only prefetch fully_shard modules of the same model, got {type(m).__name__}")
            targets += engine.driver.site_of[m]
        engine.lifecycle.prefetch.set_explicit(site, targets, backward)

    # -- state dicts: through the engine, so rows follow the values --------------------------------------
    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        """The module's state dict: parameters are this rank's shards (DTensors), as FSDP2's."""
        if "_odc_engine_owned" in self.__dict__:
            self._odc_engine.reshard_all()  # a group kept for backward would otherwise show its unsharded form
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Set parameters and buffers from a state dict of shards or full values (collective at the root)."""
        if "_odc_engine_owned" not in self.__dict__:
            raise RuntimeError("load_state_dict on a fully_shard unit: load the root's state dict (the module the "
                               "last fully_shard call was on), so every rank's rows change together")
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the shards: values are copied into them")
        from torch.nn.modules.module import _IncompatibleKeys

        return _IncompatibleKeys(*self._odc_engine.shard_state.load_state_dict(self, state_dict, strict))


_CLASSES: dict[type, type] = {}


def _odc_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ODC{cls.__name__}", (ODCModule, cls), {})
    return _CLASSES[cls]


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | None = None,
                shard_placement_fn=None, mp_policy=None, offload_policy=None, ignored_params=None,
                dp_mesh_dims=None) -> nn.Module:
    """Shard ``module``'s parameters in place, as FSDP2's ``fully_shard``, on ODC's engine ([fully-shard]).

    Call it on each block, then on the root. After each call the module's parameters are this rank's shards
    (DTensors, ``Shard(0)``), its class is ``ODC<Class>`` with ``ODCModule``'s methods, and it is returned. The
    root's call gathers every unit's rows into one engine, so ranks meet once per minibatch and may run
    different numbers of micro-batches.

    Args:
        module: the module to shard (a block, then the whole model).
        mesh: a 1-D ``DeviceMesh`` to shard over, or 2-D ``("replicate", "shard")`` for HSDP; the default
            process group when None. Every call of one model uses the same.
        reshard_after_forward: free this unit's parameters after forward (True) or keep them for backward
            (False); None: FSDP2's default, True for a block and False for the root. An int is refused.
        shard_placement_fn: must be None: parameters are packed into flat groups sharded row by row, not placed
            one by one.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (``param_dtype`` None: the parameters' own dtype).
        offload_policy: FSDP2's ``OffloadPolicy`` / ``CPUOffloadPolicy``.
        ignored_params: parameters left alone: not sharded, not reduced (as FSDP2's).
        dp_mesh_dims: must be None.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if isinstance(module, ODCModule):
        raise ValueError(f"fully_shard was called on this {type(module).__name__} already: call it once per module")
    if shard_placement_fn is not None:
        raise ValueError("shard_placement_fn is not supported: odcfsdp packs parameters into flat groups sharded "
                         "row by row (padding, no divisibility rules), so there is no per-parameter placement")
    if dp_mesh_dims is not None:
        raise ValueError("dp_mesh_dims is not supported: pass a 1-D mesh, or a 2-D (replicate, shard) mesh for HSDP")
    if reshard_after_forward is not None:
        check_reshard_after_forward(reshard_after_forward)
    ignored = set(ignored_params or ())
    settings = UnitSettings(mesh, reshard_after_forward, mp_policy, offload_policy, ignored)
    below = [m for m in module.modules() if m is not module and isinstance(m, ODCModule)]
    for m in below:
        _check_same(m._odc_settings, settings)
    absorbed = list(dict.fromkeys(m._odc_settings.engine_root for m in below))
    for root in absorbed:
        _absorb(root)
    ignored_all = set().union(ignored, *(m._odc_settings.ignored for m in below))
    named = [(n, p) for n, p in module.named_parameters() if p not in ignored_all]
    if not named:
        raise ValueError(f"{type(module).__name__} has no parameters to shard")
    check_params(named)
    module._odc_settings = settings
    try:
        engine = _build(module, named, settings, set(below), bool(absorbed))
    except BaseException:
        del module._odc_settings  # the module stays as it was (the units below keep plain parameters)
        raise
    module.__class__ = _odc_class(type(module))
    module.__dict__["_odc_engine_owned"] = engine
    units = [*below, module]
    for m in units:
        m._odc_settings.engine_root = module
    return module


def _check_same(inner: UnitSettings, outer: UnitSettings) -> None:
    for what in ("mesh", "mp_policy", "offload_policy"):
        a, b = getattr(inner, what), getattr(outer, what)
        if a is not b and a != b:
            raise ValueError(f"fully_shard calls of one model must share {what}: a module below was given {a!r}, "
                             f"this call {b!r} (odcfsdp runs one engine per model)")


def _absorb(root: nn.Module) -> None:
    """Step 3 of [fully-shard]: close ``root``'s engine and give its modules plain parameters with their values."""
    engine = root.__dict__.pop("_odc_engine_owned")
    trained = {s.name: lay.requires_grad for lay in engine.layouts for s in lay.slots}
    full = engine.shard_state.full_state_dict()  # collective, like every call
    engine.close()
    made: dict[str, nn.Parameter] = {}
    for name, value in full.items():
        canonical = engine.aliases.get(name, name)
        if canonical not in made:
            made[canonical] = nn.Parameter(value.to(engine.mesh.device), requires_grad=trained[canonical])
        prefix, _, leaf = name.rpartition(".")
        root.get_submodule(prefix)._parameters[leaf] = made[canonical]


def _transport(device: torch.device, absorbs: bool) -> str:
    """Step 4's transport: NVSHMEM's heap is sized once, by the first engine on it, so a call that absorbs nothing (a
    block, before its root) runs on ``collective`` on CUDA, and the call that absorbs the blocks' engines sizes the
    heap for the whole model. Elsewhere (``shm`` on CPU) every engine is ``auto``'s."""
    return "collective" if device.type == "cuda" and not absorbs else "auto"


def _build(module: nn.Module, named, settings: UnitSettings, units: set, absorbs: bool) -> ShardEngine:
    """Step 4 of [fully-shard]: one engine over ``module``, ``units`` hooked as a whole."""
    on_meta = named[0][1].is_meta
    device = None
    if on_meta:  # as FSDP2: the mesh's device type, the current device of it
        kind = settings.mesh.device_type if settings.mesh is not None else (
            "cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(kind)
    device = shard_device(named, device)
    wanted = policy_param_dtype(settings.mp_policy, None)
    param_dtype = compute_dtype(named, device, wanted or named[0][1].dtype)
    prefixes = {prefix: m for prefix, m in module.named_modules() if m in units}

    def owner_of(name: str) -> nn.Module:
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            m = prefixes.get(".".join(parts[:k]))
            if m is not None:
                return m
        return module

    mesh = ShardMesh(device, None, settings.mesh) if settings.mesh is not None else ShardMesh(device)
    engine = ShardEngine(module, named, device=device, mesh=mesh, param_dtype=param_dtype,
                         precision=resolve_precision(settings.mp_policy, param_dtype), group_bytes=GROUP_BYTES,
                         comm=_transport(device, absorbs), reshard_after_forward=True, prefetch=1, overlap_push=True,
                         gather_masters=False, offload_policy=settings.offload_policy,
                         is_unit=lambda m: m in units, owner_of=owner_of)
    for g in engine.groups:
        g.owner = owner_of(g.layout.slots[0].name)
        own = g.owner._odc_settings.reshard_after_forward
        g.reshard_after_forward = own if own is not None else g.owner is not module
    return engine


__all__ = ["ODCModule", "UnshardHandle", "fully_shard"]
