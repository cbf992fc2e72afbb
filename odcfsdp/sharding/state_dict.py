"""Whole-model values: gather every parameter's full value, or set them all (collective).

Full values are rebuilt from every rank's master row (an all-gather per group, so at
most one group's full values are in flight besides the result); setting them runs
inside the step protocol's ``rows_changing`` ([step-protocol]), as any change of
rows does.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .group import FlatGroup
from .mesh import ShardMesh
from .protocol import StepProtocol


def persistent_buffers(root: nn.Module) -> dict[str, torch.Tensor]:
    """``root``'s persistent buffers by name (replicated on every rank; checkpoints keep them)."""
    out = {}
    for prefix, mod in root.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def gather_full(groups: Sequence[FlatGroup], mesh: ShardMesh, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """Full parameter values (from the master rows) by name; tied parameters under each name (collective)."""
    out: dict[str, torch.Tensor] = {}
    for g in groups:
        full = g.layout.unpack(mesh.all_gather_rows(g.read_master()))
        for i, s in enumerate(g.layout.slots):
            out[s.name] = g.layout.param_view(full, i).to(g.layout.dtype).clone()
    for alias, name in aliases.items():
        out[alias] = out[name]
    return out


def load_full(groups: Sequence[FlatGroup], protocol: StepProtocol, aliases: dict[str, str],
              state: dict[str, torch.Tensor]) -> None:
    """Set every parameter from full values (collective: every rank passes the same values)."""
    expected = {s.name: s for g in groups for s in g.layout.slots}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - set(aliases))
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for name, s in expected.items():
        if tuple(state[name].shape) != s.shape:
            raise ValueError(f"parameter {name!r}: shape {tuple(state[name].shape)} in the state dict, {s.shape} in the model")
    with protocol.rows_changing():
        for g in groups:
            g.load_full_([state[s.name].to(protocol.mesh.device) for s in g.layout.slots])


def _shard_of(value: torch.Tensor, sp, rank: int) -> torch.Tensor:
    """This rank's shard of ``value``: a matching DTensor's local tensor, or the rows of a full tensor."""
    if isinstance(value, DTensor):
        local = value.to_local()
        # Decided from what every rank sees alike (mesh, placements, global shape): a choice that hung on the
        # local shape could differ between ranks of uneven shards and leave some in full_tensor() alone.
        if isinstance(sp.sharded, DTensor) and value.device_mesh == sp.sharded.device_mesh and \
                value.placements == sp.sharded.placements and value.shape == sp.sharded.shape:
            if tuple(local.shape) != tuple(sp.local.shape):
                raise ValueError(f"{sp.name}: this rank's shard has shape {tuple(local.shape)}, the model's "
                                 f"{tuple(sp.local.shape)}: a DTensor sharded differently on the same mesh")
            return local
        value = value.full_tensor()  # another placement or mesh size: reshard through the full value
    lo, hi = sp.slot.local_range(rank)
    return value.detach().reshape(-1)[lo:hi].view(sp.local.shape)


def load_sharded(groups: Sequence[FlatGroup], protocol: StepProtocol, aliases: dict[str, str], root: nn.Module,
                 state: dict[str, torch.Tensor], strict: bool) -> tuple[list[str], list[str]]:
    """``load_state_dict`` of a wrapped model (collective); returns (missing keys, unexpected keys).

    Parameter values are this rank's shards (DTensors placed as the model's: ``Shard(0)``, HSDP ``(Replicate(), Shard(0))``) or
    full tensors; buffers are whole. Shapes are checked before anything changes.
    """
    params = {sp.name: (g, sp) for g in groups for sp in g.params}
    buffers = persistent_buffers(root)
    value_of = {name: state[name] for name in params if name in state}
    for alias, name in aliases.items():
        if name not in value_of and alias in state:
            value_of[name] = state[alias]
    missing = sorted([n for n in params if n not in value_of] + [n for n in buffers if n not in state])
    unexpected = sorted(set(state) - set(params) - set(aliases) - set(buffers))
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(root).__name__}: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    for name, value in value_of.items():
        want = params[name][1].shape
        if tuple(value.shape) != tuple(want):
            raise RuntimeError(f"size mismatch for {name}: the state dict has shape {tuple(value.shape)}, the model "
                               f"{tuple(want)}")
    with protocol.rows_changing(), torch.no_grad():
        rank = protocol.mesh.rank
        for name, value in value_of.items():
            sp = params[name][1]
            sp.local.copy_(_shard_of(value, sp, rank))
        for name, buf in buffers.items():
            if name in state:
                buf.copy_(state[name])
    return missing, unexpected
