"""One way into a model's sharded values: read and write this rank's shards, gather full values, change rows.

Design note [shard-state]
-------------------------
Checkpoints, Hugging Face import/export, ``state_dict`` / ``load_state_dict`` and
whole-model gathers all read or write the fp32 master rows ([masters]) through
``ShardState``, never through a group's tensors: where masters live (on the device
today; in host memory with an offload), and how their rows are laid out ([layout]),
is known here and in ``layout.py`` only. Reading:

* ``shards()``: this rank's shard of every parameter (flattened elements
  ``[lo, hi)`` of it), views of the masters, no communication;
* ``full_values()``: full values group by group (one all-gather of the masters per
  group, so at most one group's full values are in flight besides what the caller
  keeps); collective.

Writing happens only inside ``changing()`` (the minibatch's ``rows_changing``,
[step-protocol]: reshard, pushes complete, meeting, the change, then the masters are
published to the rows and every rank meets again), through ``write_targets()``:
each parameter's segment with its padding zeroed, and the ``[lo, hi)`` this rank
fills.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..groups.group import FlatGroup
from ..placement.layout import GroupLayout
from ..groups.param import ShardedParam
from .minibatch import Minibatch


def persistent_buffers(root: nn.Module) -> dict[str, torch.Tensor]:
    """``root``'s persistent buffers by name (replicated on every rank; checkpoints keep them)."""
    out = {}
    for prefix, mod in root.named_modules():
        for name, buf in mod._buffers.items():
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


class ShardState:
    """This rank's sharded values of a model and every way to read or change them (see [shard-state]).

    Args:
        groups: the model's groups.
        minibatch: its minibatch (changes of rows run inside its ``rows_changing``).
        aliases: every other name of a tied parameter -> its first name.
    """

    def __init__(self, groups: Sequence[FlatGroup], minibatch: Minibatch, aliases: dict[str, str]):
        self.groups = list(groups)
        self.minibatch = minibatch
        self.mesh = minibatch.mesh
        self.aliases = aliases
        self.params: list[ShardedParam] = [sp for g in self.groups for sp in g.params]

    @property
    def layouts(self) -> list[GroupLayout]:
        """The groups' layouts, in order."""
        return [g.layout for g in self.groups]

    def param_of(self, tensor: torch.Tensor) -> ShardedParam | None:
        """The ``ShardedParam`` whose shard ``tensor`` is, if it is one of this model's (None otherwise)."""
        sp = getattr(tensor, "_odc", None)
        return sp if sp is not None and sp.events is self.minibatch else None

    # -- reading --------------------------------------------------------------------------------------
    def shards(self) -> Iterator[tuple[ShardedParam, torch.Tensor]]:
        """(parameter, this rank's shard of it flattened: elements ``[lo, hi)``) for every parameter; views."""
        rank = self.mesh.rank
        for g in self.groups:
            master = g.read_master()
            for i, sp in enumerate(g.params):
                lo, hi = sp.slot.local_range(rank)
                yield sp, g.layout.segment(master, i)[: hi - lo]

    def full_values(self, trained_only: bool = False) -> Iterator[tuple[FlatGroup, dict[str, torch.Tensor]]]:
        """Per group, every parameter's full value (views of one gathered buffer, the masters' dtype); collective."""
        for g in self.groups:
            if trained_only and not g.layout.requires_grad:
                continue
            full = g.layout.unpack(self.mesh.all_gather_rows(g.read_master()))
            yield g, {s.name: g.layout.param_view(full, i) for i, s in enumerate(g.layout.slots)}
            del full  # gone before the next group's gather, if the caller let its views go

    def full_state_dict(self, trained_only: bool = False) -> dict[str, torch.Tensor]:
        """Full values in the parameters' own dtypes by name; tied ones under each name (collective)."""
        out: dict[str, torch.Tensor] = {}
        for g, values in self.full_values(trained_only):
            out.update({name: v.to(g.layout.dtype).clone() for name, v in values.items()})
        if not trained_only:
            for alias, name in self.aliases.items():
                out[alias] = out[name]
        return out

    # -- writing ----------------------------------------------------------------------------------------
    def changing(self):
        """Context in which masters may be written (collective; pending gradients are dropped)."""
        return self.minibatch.rows_changing()

    def write_targets(self, which: Callable[[str], bool] | None = None
                      ) -> Iterator[tuple[ShardedParam, int, int, torch.Tensor]]:
        """Inside ``changing()``: (parameter, lo, hi, where this rank's elements ``[lo, hi)`` of it go), its segment
        zeroed first, for every parameter whose name ``which`` accepts (default: all; the others stay as they are)."""
        rank = self.mesh.rank
        for g in self.groups:
            master = g.read_master()
            for i, sp in enumerate(g.params):
                if which is not None and not which(sp.name):
                    continue
                lo, hi = sp.slot.local_range(rank)
                segment = g.layout.segment(master, i)
                segment.zero_()  # padding past the shard stays zero
                yield sp, lo, hi, segment[: hi - lo]

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set every parameter from full values (collective: every rank passes the same values)."""
        expected = {s.name: s for lay in self.layouts for s in lay.slots}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected) - set(self.aliases))
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
        for name, s in expected.items():
            if tuple(state[name].shape) != s.shape:
                raise ValueError(f"parameter {name!r}: shape {tuple(state[name].shape)} in the state dict, {s.shape} "
                                 "in the model")
        with self.changing():
            for g in self.groups:
                g.load_full_([state[s.name].to(self.mesh.device) for s in g.layout.slots])

    def load_state_dict(self, root: nn.Module, state: dict[str, torch.Tensor],
                        strict: bool) -> tuple[list[str], list[str]]:
        """``load_state_dict`` of a wrapped model (collective); returns (missing keys, unexpected keys).

        Parameter values are this rank's shards (DTensors placed as the model's: ``Shard(0)``, HSDP
        ``(Replicate(), Shard(0))``) or full tensors; buffers are whole. Shapes are checked before anything changes.
        """
        params = {sp.name: sp for sp in self.params}
        buffers = persistent_buffers(root)
        value_of = {name: state[name] for name in params if name in state}
        for alias, name in self.aliases.items():
            if name not in value_of and alias in state:
                value_of[name] = state[alias]
        missing = sorted([n for n in params if n not in value_of] + [n for n in buffers if n not in state])
        unexpected = sorted(set(state) - set(params) - set(self.aliases) - set(buffers))
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(root).__name__}: missing keys {missing}, "
                               f"unexpected keys {unexpected}")
        for name, value in value_of.items():
            want = params[name].shape
            if tuple(value.shape) != tuple(want):
                raise RuntimeError(f"size mismatch for {name}: the state dict has shape {tuple(value.shape)}, the "
                                   f"model {tuple(want)}")
        with self.changing(), torch.no_grad():
            for name, value in value_of.items():
                sp = params[name]
                sp.local.copy_(_shard_of(value, sp, self.mesh.rank))
            for name, buf in buffers.items():
                if name in state:
                    buf.copy_(state[name])
        return missing, unexpected


def _shard_of(value: torch.Tensor, sp: ShardedParam, rank: int) -> torch.Tensor:
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


__all__ = ["ShardState", "persistent_buffers"]
