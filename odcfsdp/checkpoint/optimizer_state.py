"""A sharded checkpoint's optimizer entry: the optimizer's parameter groups, its scalar states, and this rank's shards
of its element-wise state tensors (``sharded.py`` writes and reads them)."""

from __future__ import annotations

import torch

from ..optim.parked import parked_copy
from ..sharding.api.sharded_model import ShardedModel
from ..torch_private import local_of
from .manifest import CheckpointError


def jsonable(value):
    """A hyper-parameter as JSON (tensors as numbers, tuples as lists); None if it has no JSON form."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [jsonable(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None


def optimizer_params(model: ShardedModel, optimizer) -> list[list]:
    """The optimizer's parameter groups as lists of the model's ``ShardedParam``s (every parameter must be the
    model's)."""
    groups = []
    for group in optimizer.param_groups:
        sps = []
        for p in group["params"]:
            sp = model.shard_state.param_of(p)
            if sp is None:
                raise CheckpointError("the optimizer holds a parameter that is not one of the model's shards; build it "
                                      "from the ODCShard model's parameters (e.g. odcfsdp.param_groups(model))")
            sps.append(sp)
        groups.append(sps)
    return groups


def optimizer_tensors(model: ShardedModel, optimizer, copy: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest entry, {file key: this rank's shard}) of the optimizer's state (no shards without ``copy``).

    Per-parameter states are scalars or tensors of the parameter's shape (element-wise
    optimizers), stored sharded like the parameter; any other tensor state (Adafactor's
    row and column factors) has no shard layout here, so it is refused, the same on every
    rank (the shapes agree), before the save starts. State parked in host memory between steps
    ([parking]) is read from its host copies, and stays parked.
    """
    groups = optimizer_params(model, optimizer)
    scalars, keys, tensors = {}, set(), {}
    for sps in groups:
        for sp in sps:
            for key, value in optimizer.state.get(sp.sharded, {}).items():
                if isinstance(value, torch.Tensor) and tuple(value.shape) == sp.shape and value.dim() > 0:
                    if copy:
                        host = parked_copy(optimizer, value)
                        local = host if host is not None else local_of(value).detach()
                        tensors[f"{sp.name}/{key}"] = local.reshape(-1).to("cpu", copy=True)
                    keys.add(key)
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    raise CheckpointError(
                        f"{type(optimizer).__name__} state {key!r} of {sp.name} has shape {tuple(value.shape)}, "
                        f"not the parameter's {sp.shape}: sharded checkpoints hold element-wise optimizer state "
                        "only (AdamW, Adam, SGD, RMSprop, Adagrad, ...); save the model alone (optimizer=None) "
                        "for this one")
                else:
                    scalars.setdefault(sp.name, {})[key] = jsonable(value)
    entry = {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "param_groups": [{**{k: jsonable(v) for k, v in g.items() if k != "params"},
                          "params": [sp.name for sp in sps]} for g, sps in zip(optimizer.param_groups, groups)],
        "tensor_states": sorted(keys), "scalar_states": scalars,
    }
    return entry, tensors
