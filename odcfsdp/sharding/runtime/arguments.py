"""Checks of what ``ODCShard`` is given: the model's parameters, the device, the compute dtype.

Each check raises an error that names the supported way, before anything is allocated.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def check_params(named: list[tuple[str, nn.Parameter]]) -> None:
    """No parameter sharded already (a model is wrapped once), all on one device, all floating point."""
    wrapped = [name for name, p in named if getattr(p, "_odc", None) is not None]
    if wrapped:  # its parameters are another wrapper's shards: a second wrapper would shard the shards
        raise ValueError(f"the model is wrapped already: parameter {wrapped[0]!r} is an ODCShard's shard; wrap a "
                         "model once and keep using that wrapper")
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
    for name, p in named:
        if not p.dtype.is_floating_point:
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be sharded")


def check_reshard_after_forward(value) -> None:
    """``reshard_after_forward`` is a bool. FSDP2's int (after forward, keep the parameters resharded within a
    smaller group, gathered again from it in backward) has no ODC meaning yet: a one-sided gather reads every rank
    of the shard group's rows, and no smaller group holds a copy to read from."""
    if not isinstance(value, bool):
        raise ValueError(f"reshard_after_forward={value!r}: only True or False; FSDP2's int (a copy kept within a "
                         "smaller group after forward) is not supported, since ODC gathers from every rank of the "
                         "shard group: use False to keep the gathered parameters, or a 2-D mesh (HSDP) for smaller "
                         "shard groups")


def check_units(units, module: nn.Module) -> tuple[type[nn.Module], ...]:
    """``units`` as a tuple of ``nn.Module`` classes of which ``module`` has an instance (an empty tuple: none)."""
    units = tuple(units)
    if not all(isinstance(u, type) and issubclass(u, nn.Module) for u in units):
        raise TypeError(f"units must be nn.Module subclasses, got {units!r}")
    if units and not any(isinstance(m, units) for m in module.modules()):
        raise ValueError(f"no module of the model is one of units={[u.__name__ for u in units]}")
    return units


def check_numbers(prefetch, timeout) -> None:
    """``prefetch`` is an int >= 0 (groups gathered ahead) and ``timeout`` a number of seconds > 0."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (groups gathered ahead), got {prefetch!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")


def shard_device(named: list[tuple[str, nn.Parameter]], device) -> torch.device:
    """Where rows live: ``device`` (needed for a meta model, else the parameters' own), a CUDA index filled in."""
    on_meta = named[0][1].is_meta
    if on_meta and device is None:
        raise ValueError("the model is on the meta device: pass device= (where its shards should live)")
    if device is not None and not on_meta and torch.device(device) != named[0][1].device:
        raise ValueError(f"device={device} differs from the parameters' device {named[0][1].device}; "
                         "move the model first (or build it on the meta device)")
    device = torch.device(device) if device is not None else named[0][1].device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def compute_dtype(named: list[tuple[str, nn.Parameter]], device: torch.device, param_dtype) -> torch.dtype:
    """``param_dtype``, or bf16 on CUDA / the parameters' one dtype elsewhere."""
    if param_dtype is None:
        dtypes = {p.dtype for _, p in named}
        if device.type != "cuda" and len(dtypes) > 1:
            raise ValueError(
                f"parameters have mixed dtypes {sorted(map(str, dtypes))}; pass param_dtype= to "
                "compute them all in one dtype"
            )
        param_dtype = torch.bfloat16 if device.type == "cuda" else named[0][1].dtype
    if not param_dtype.is_floating_point:
        raise ValueError(f"param_dtype must be a floating dtype, got {param_dtype}")
    return param_dtype


def registrations(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) each parameter object is registered under, by the parameter's id."""
    regs: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                regs.setdefault(id(p), []).append((mod, attr))
    return regs


def intact_problem(module: nn.Module, params, param_entries: int, param_dtype: torch.dtype) -> str | None:
    """What the user changed about a wrapped model's parameters since wrapping (None: intact)."""
    entries = sum(p is not None for m in module.modules() for p in m._parameters.values())
    if entries != param_entries:
        return (f"the wrapped model now has {entries} parameter entries, ODCShard planned {param_entries}: "
                "parameters must not be added or removed after wrapping")
    for sp in params:
        problem = sp.problem(param_dtype)
        if problem:
            return (f"parameter {sp.name!r} {problem}"
                    + ("; change parameters before wrapping (or load values with load_state_dict)"
                       if "replaced" in problem else ""))
    return None


def offload_target(offload_policy, mesh, gather_masters: bool) -> tuple[torch.device | None, bool]:
    """Where masters (and so optimizer state) live under ``offload_policy``: (host device or None, pinned).

    See [offload] in ``group.py``. FSDP2's ``OffloadPolicy()`` means no offload; ``CPUOffloadPolicy`` puts the
    masters in host memory (pinned if asked and CUDA is there to pin for).
    """
    if offload_policy is None:
        return None, False
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be a torch.distributed.fsdp.OffloadPolicy (e.g. CPUOffloadPolicy()), got "
                        f"{type(offload_policy).__name__}")
    if not isinstance(offload_policy, CPUOffloadPolicy):
        return None, False
    if gather_masters:
        raise ValueError("gather_masters=True needs the masters where peers read them (the device's heap); "
                         "offload_policy=CPUOffloadPolicy() keeps them in host memory: choose one")
    import torch.distributed as dist

    backend = str(dist.get_backend(mesh.group)) if mesh.distributed and mesh.world_size > 1 else "gloo"
    if mesh.device.type == "cuda" and "gloo" not in backend:
        raise ValueError(f"offload_policy=CPUOffloadPolicy() reduces host tensors (the gradient norm, full state "
                         f"dicts), which the process group's backend {backend!r} cannot: init_process_group("
                         "'cuda:nccl,cpu:gloo'), as odcfsdp.launch does")
    return torch.device("cpu"), bool(offload_policy.pin_memory and mesh.device.type == "cuda")
