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
3. absorbs the engines earlier calls built below it (the blocks'): each gathers its full values, is
   closed, and its modules get plain parameters with those values again (meta ones if the engine
   was built on the meta device: nothing to gather). So the blocks' own engines cost one gather of
   their parameters at set-up, and for a moment every rank holds the blocks' full values again, as
   before the first call (build the model on the meta device to never hold it whole). Everything
   that can refuse the call is checked before this step, so a refused call leaves the model as it
   was; settings made on a block since its call (``set_reshard_after_forward``, prefetch targets,
   the divide factor) are kept on the module and applied again to the new engine;
4. builds one engine over the module: the modules of earlier calls below it are its units (each one
   hook site, [hooks], whose groups hold no other unit's parameters), the module's remaining
   parameters are planned as its own groups, hooked module by module; ``mp_policy``'s input and
   output casts run at every unit's forward, as FSDP2's. ``reshard_after_forward``
   defaults to FSDP2's: True for a unit, False for the root's own groups (used again at once by
   backward). All calls of one engine must agree on the mesh, ``mp_policy`` and ``offload_policy``,
   since one engine has one of each. On CUDA a call that absorbs nothing runs on the ``collective``
   transport: NVSHMEM's heap is sized once, by the first engine on it, and must hold the whole
   model's rows, so the root's call, which absorbs the blocks', is the one that sizes it. A single
   call on a whole model (no blocks) thus runs on NCCL collectives, with equal micro-batch counts
   (``ODCShard(model)`` is the one-sided way to shard a model in one call);
5. records the call's ``UnitState`` on each of its modules where torch's ``fully_shard`` records its
   ``FSDPState``, so ``fully_shard.state(module)`` finds it, torch's as well as ours, and torch's
   ``fully_shard`` refuses a second call on the module as on one of its own. ``managed_modules()``
   and ``managed_params()`` are FSDP2's walk: the unit's submodules, not those of units below.

A list of modules (FSDP2's list form) is one unit over all of them: they share one ``UnitState``,
which owns their groups (a weight tied across them is one parameter, gathered at the first of their
forwards and freed after the last), and until a later call absorbs it their engine's root is a
``ModuleList`` of them. Each module becomes ``ODC<Class>``, an ``FSDPModule`` ([fsdp-surface] in
``fsdp_surface.py``), and ``to_empty`` after a meta-device build works as FSDP2's ([meta-init] in
``materialize.py``).

After a torchtitan script's calls, one engine owns the model: a minibatch costs the same two
meetings as ``ODCShard``'s, micro-batch counts may differ per rank, and the standard loop, DCP and
``clip_grad_norm_`` work as with FSDP2. ``ODCModule``'s methods are FSDP2's ``FSDPModule`` methods that
have an ODC meaning (see each); ``set_requires_gradient_sync`` is accepted and changes nothing, since
every micro-batch's gradient is added into its owners' fp32 accumulators as it is produced: with
sync off until the last micro-batch (FSDP2's way to accumulate), the step sees the same sum.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ...torch_private import register_fully_shard_state
from ..runtime.arguments import check_params, check_reshard_after_forward, compute_dtype, shard_device
from ..runtime.engine import ShardEngine
from ..runtime.engine_settings import EngineSettings
from ..groups.float8_rows import Float8Gather
from ..runtime.hooks import unit_of
from ..placement.mesh import ShardMesh
from .odc_module import ODCModule, UnitState, UnshardHandle, apply_prefetch, odc_class, state_of
from ..groups.precision import policy_param_dtype, resolve_precision


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | None = None,
                shard_placement_fn=None, mp_policy=None, offload_policy=None, ignored_params=None,
                dp_mesh_dims=None, settings: EngineSettings | None = None) -> nn.Module:
    """Shard ``module``'s parameters in place, as FSDP2's ``fully_shard``, on ODC's engine ([fully-shard]).

    Call it on each block, then on the root. After each call the module's parameters are this rank's shards
    (DTensors, ``Shard(0)``; the fp32 masters, whatever the model's dtype), its class is ``ODC<Class>`` with
    ``ODCModule``'s methods, and it is returned. The root's call gathers every unit's rows into one engine, so
    ranks meet once per minibatch and may run different numbers of micro-batches.

    Args:
        module: the module to shard (a block, then the whole model), or FSDP2's list of modules: one unit over
            all of them (weights tied across modules: the embedding and the output head), whose list is returned.
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
        settings: the engine's own settings beyond FSDP2's arguments (``EngineSettings``: group bytes, prefetch,
            gather_masters, the float8 gather, the meeting timeout, overlapped pushes); None: their defaults, those
            of ``ODCShard``. Every call of one model passes equal ones.
    """
    modules = _unit_modules(module)
    if shard_placement_fn is not None:
        raise ValueError("shard_placement_fn is not supported: odcfsdp packs parameters into flat groups sharded "
                         "row by row (padding, no divisibility rules), so there is no per-parameter placement")
    if dp_mesh_dims is not None:
        raise ValueError("dp_mesh_dims is not supported: pass a 1-D mesh, or a 2-D (replicate, shard) mesh for HSDP")
    if reshard_after_forward is not None:
        check_reshard_after_forward(reshard_after_forward)
    if settings is not None and not isinstance(settings, EngineSettings):
        raise TypeError(f"settings must be an odcfsdp.EngineSettings, got {type(settings).__name__}")
    settings = UnitState(mesh, reshard_after_forward, mp_policy, offload_policy, set(ignored_params or ()),
                            engine=settings or EngineSettings())
    # FSDP2's list form: one unit over several modules (weights tied across them), under a container that is the
    # engine's root until a later call absorbs it
    root = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
    below = [m for m in root.modules() if m not in modules and m is not root and isinstance(m, ODCModule)]
    ignored_all = set().union(settings.ignored, *(m._odc_settings.ignored for m in below))
    _check_before_absorbing(root, below, settings, ignored_all)
    absorbed = [r for r in dict.fromkeys(m._odc_settings.engine_root for m in below)
                if r is not None and "_odc_engine_owned" in r.__dict__]
    for engine_root in absorbed:
        _absorb(engine_root)
    named = [(n, p) for n, p in root.named_parameters() if p not in ignored_all]
    kind = _mesh_kind(settings)
    if any(not p.is_meta and p.device.type != kind for _, p in named):  # a CPU-built root over units already moved
        _move_to(root, [(n, p) for n, p in named if not p.is_meta], kind)  # (before the one-device check)
    check_params(named)
    for m in {root, *modules}:
        m._odc_settings = settings
    try:
        engine = _build(root, named, settings, below if root in modules else [*below, *modules], bool(absorbed))
    except BaseException:
        for m in {root, *modules}:  # the modules stay plain; the units below keep plain values for the next try
            del m._odc_settings
        for m in below:
            m._odc_settings.engine_root = None
        raise
    settings.modules = modules
    for m in modules:
        m.__class__ = odc_class(type(m))
        register_fully_shard_state(m, settings)  # torch's fully_shard.state(m) finds the unit ([fully-shard] 5)
    root.__dict__["_odc_engine_owned"] = engine
    for m in [*below, *modules]:
        m._odc_settings.engine_root = root
    return module


fully_shard.state = state_of  # FSDP2's ``fully_shard.state(module)``


def _unit_modules(module) -> list[nn.Module]:
    """The modules of one call: ``module`` itself, or FSDP2's list of modules (one unit over all of them)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("fully_shard takes an nn.Module or a non-empty list of them (one unit over several), got "
                        f"{type(module).__name__}")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard's list of modules holds one module twice: list each once")
    for m in modules:
        if isinstance(m, ODCModule):
            raise ValueError(f"fully_shard was called on this {type(m).__name__} already: call it once per module")
    return modules


def _check_before_absorbing(module: nn.Module, below: list, settings: UnitState, ignored: set) -> None:
    """Whatever can refuse the call, refused before step 3 changes anything ([fully-shard] 1)."""
    for m in below:
        _check_same(m._odc_settings, settings)
    named = [(n, p) for n, p in module.named_parameters() if p not in ignored]
    if not named:
        raise ValueError(f"{type(module).__name__} has no parameters to shard")
    for name, p in named:
        if p.dim() == 0:
            raise ValueError(f"parameter {name!r} is 0-dimensional; parameters are sharded on dim 0 (as FSDP2 "
                             "shards them): make it shape (1,)")
        if not p.dtype.is_floating_point:
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be sharded")
        if getattr(p, "_odc", None) is None and not p.is_meta and p.numel() and not p.untyped_storage().nbytes():
            # the original tensor of a parameter an earlier call sharded, still registered here: a tie across units
            raise ValueError(f"parameter {name!r} is tied to a parameter of a module an earlier fully_shard call "
                             "sharded, so this one no longer holds its values: put every module that uses it in one "
                             "unit, fully_shard([module_a, module_b]) (FSDP2's list form), or call fully_shard on a "
                             "module that holds every use of them")


def _policy(value, default_cls):
    return default_cls() if value is None else value


def _check_same(inner: UnitState, outer: UnitState) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    defaults = {"mp_policy": MixedPrecisionPolicy, "offload_policy": OffloadPolicy}
    for what in ("mesh", "mp_policy", "offload_policy", "engine"):
        a, b = getattr(inner, what), getattr(outer, what)
        if what in defaults:  # None is FSDP2's default policy
            a, b = _policy(a, defaults[what]), _policy(b, defaults[what])
        if a is not b and a != b:
            raise ValueError(f"fully_shard calls of one model must share {what}: a module below was given {a!r}, "
                             f"this call {b!r} (odcfsdp runs one engine per model)")


def _absorb(root: nn.Module) -> None:
    """Step 3 of [fully-shard]: close ``root``'s engine and give its modules plain parameters with their values."""
    engine = root.__dict__.pop("_odc_engine_owned")
    slots = {s.name: (lay, s) for lay in engine.layouts for s in lay.slots}
    on_meta = root._odc_settings.built_on_meta
    full = {} if on_meta else engine.shard_state.full_state_dict()  # collective, like every call
    engine.close()
    made: dict[str, nn.Parameter] = {}
    for name in [*slots, *engine.aliases]:
        canonical = engine.aliases.get(name, name)
        if canonical not in made:
            lay, slot = slots[canonical]
            value = (torch.empty(slot.shape, dtype=lay.dtype, device="meta") if on_meta
                     else full[canonical].to(engine.mesh.device))
            made[canonical] = nn.Parameter(value, requires_grad=lay.requires_grad)
        prefix, _, leaf = name.rpartition(".")
        root.get_submodule(prefix)._parameters[leaf] = made[canonical]


def _transport(device: torch.device, absorbs: bool) -> str:
    """Step 4's transport: NVSHMEM's heap is sized once, by the first engine on it, so a call that absorbs nothing (a
    block, before its root) runs on ``collective`` on CUDA, and the call that absorbs the blocks' engines sizes the
    heap for the whole model. Elsewhere (``shm`` on CPU) every engine is ``auto``'s."""
    return "collective" if device.type == "cuda" and not absorbs else "auto"


def _move_to(module: nn.Module, named, kind: str) -> torch.device:
    """Move ``module``'s parameters (in place: they keep their identity) and buffers to the mesh's device, as FSDP2
    moves the states it manages before sharding them ([fully-shard] 4)."""
    device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    with torch.no_grad():
        for _, p in named:
            p.data = p.data.to(device)
        for mod in module.modules():
            for name, buf in mod._buffers.items():
                if buf is not None and buf.device != device:
                    mod._buffers[name] = buf.to(device)
    return device


def _mesh_kind(settings: UnitState) -> str:
    """As FSDP2: the mesh's device type (the default mesh's: CUDA where there is one)."""
    return settings.mesh.device_type if settings.mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")


def _build(module: nn.Module, named, settings: UnitState, below: list, absorbs: bool) -> ShardEngine:
    """Step 4 of [fully-shard]: one engine over ``module``, the modules ``below`` hooked as units."""
    on_meta = named[0][1].is_meta
    kind = _mesh_kind(settings)
    device = None
    if on_meta:
        device = torch.device(kind)
    elif any(p.device.type != kind for _, p in named):  # built elsewhere (CPU, under an NCCL-only process group)
        device = _move_to(module, named, kind)
    device = shard_device(named, device)
    wanted = policy_param_dtype(settings.mp_policy, None)
    param_dtype = compute_dtype(named, device, wanted or named[0][1].dtype)
    units = set(below)
    unit = unit_of(module, lambda m: m in units)

    def owner_of(name: str) -> UnitState | None:  # a list's modules share one unit: their settings
        found = unit(name)
        return None if found is None else found._odc_settings

    ours = settings.engine
    mesh = ShardMesh(device, None, settings.mesh, timeout_s=ours.timeout)
    precision = resolve_precision(settings.mp_policy, param_dtype)
    late_rows = Float8Gather.of(module, named) if ours.float8_gather else None
    engine = ShardEngine(module, named, device=device, mesh=mesh, param_dtype=param_dtype, precision=precision,
                         settings=ours, comm=_transport(device, absorbs), reshard_after_forward=True,
                         offload_policy=settings.offload_policy, is_unit=lambda m: m in units, owner_of=owner_of,
                         late_rows=late_rows)
    engine.register_casts(below)  # FSDP2 casts at every fully_shard module's forward
    settings.built_on_meta = on_meta
    for g in engine.groups:
        g.owner = owner_of(g.layout.slots[0].name) or settings  # outside every unit: the call's own
        g.reshard_after_forward = (g.owner.reshard_after_forward if g.owner.reshard_after_forward is not None
                                   else g.owner is not settings)
        g.reshard_after_backward = g.owner.reshard_after_backward
    for m in dict.fromkeys([*below, module]):  # settings made on the units since their calls
        if m._odc_settings.divide_factor is not None:
            engine.minibatch.set_divide_factor(m._odc_settings.divide_factor)
        for backward, targets in m._odc_settings.prefetch.items():
            apply_prefetch(m, engine, targets, backward)
    return engine


__all__ = ["EngineSettings", "ODCModule", "UnshardHandle", "fully_shard"]
