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
