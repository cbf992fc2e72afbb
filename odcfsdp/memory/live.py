"""``memory_breakdown``: an ``ODCShard`` model's bytes by category at the moment of the call, from its live tensors
(every byte counted once); ``known_tensors``: the tensors ``peak_breakdown`` recognises by address. Categories and
[memory-model]: ``odcfsdp/memory/__init__.py``."""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from ..sharding.api.sharded_model import is_sharded, sharded
from ..torch_private import is_traceable_wrapper_subclass


@dataclass
class MemoryBreakdown:
    """Bytes per category of one rank at one moment (see the module's docstring); None: not measured (CPU)."""

    masters: int
    rows: int
    accumulators: int
    heap_other: int
    heap: int
    optimizer_state: int
    unsharded_params: int
    grad_buffers: int
    outside_torch: tuple[str, ...]  # categories that live outside torch's allocator (on the heap)
    torch_allocated: int | None = None
    activations_and_other: int | None = None
    allocator_slack: int | None = None

    def as_dict(self) -> dict:
        return {**asdict(self), "outside_torch": list(self.outside_torch)}


class _Claims:
    """Byte ranges counted so far (sorted, disjoint): each byte is counted once, by the first category claiming it."""

    def __init__(self):
        self._iv: list[tuple[int, int]] = []

    def claim(self, lo: int, hi: int) -> int:
        """Mark ``[lo, hi)`` counted; return how many of its bytes were not counted before."""
        if hi <= lo:
            return 0
        iv = self._iv
        i = bisect.bisect_right(iv, (lo, float("inf"))) - 1
        if i < 0 or iv[i][1] < lo:
            i += 1
        covered, new_lo, new_hi, j = 0, lo, hi, i
        while j < len(iv) and iv[j][0] <= hi:
            a, b = iv[j]
            covered += max(0, min(b, hi) - max(a, lo))
            new_lo, new_hi, j = min(new_lo, a), max(new_hi, b), j + 1
        iv[i:j] = [(new_lo, new_hi)]
        return hi - lo - covered


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a tensor's bytes: a wrapper subclass's inner tensors, recursively (a DTensor's
    local tensor, torchao's float8 weight wrapper's ``_tensor``, a ``Float8TrainingTensor``'s data and scale),
    any other tensor itself. A wrapper has no storage of its own: asking for its data pointer raises."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()  # names; not all are tensors (torch 2.13's DTensor lists its mesh)
        return [x for a in attrs if isinstance(inner := getattr(t, a), torch.Tensor) for x in _plain(inner)]
    return [t]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding most of a tensor's bytes (``_plain``'s largest; the tensor itself when plain)."""
    return max(_plain(t), key=lambda x: x.numel() * x.element_size(), default=t)


def plain_tensors(ts) -> list[torch.Tensor]:
    """``ts`` (None entries skipped) as the plain tensors holding their bytes (``_plain``)."""
    return [x for t in ts if t is not None for x in _plain(t)]


def span(t: torch.Tensor | None) -> tuple[int, int] | None:
    """The bytes ``[lo, hi)`` a tensor's elements occupy, within its storage's allocated bytes (None: no bytes)."""
    if t is None:
        return None
    t = _local(t)
    if t.is_meta or t.numel() == 0:
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:  # a freed unsharded buffer ([storage-resize])
        return None
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    hi = min(lo + extent * t.element_size(), storage.data_ptr() + storage.nbytes())
    return (lo, hi) if hi > lo else None


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (DTensors: their local tensors)."""
    if optimizer is None:
        return []
    return plain_tensors(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def odc_tensors(model: nn.Module, optimizer=None) -> dict[str, list[torch.Tensor]]:
    """A sharded model's tensors by category (an ``ODCShard`` or a ``fully_shard`` model), in the order they are
    counted (see ``memory_breakdown``)."""
    model = sharded(model)
    groups = [g for g in model.groups if g.row is not None]
    device = groups[0].row.device if groups else None
    return {
        "rows": [g.row for g in groups],
        "accumulators": [g.accumulator for g in groups if g.accumulator is not None],
        "masters": [g.master for g in groups if g.master is not g.row] + _split_low_bits_held(model),
        "optimizer_state": [t for t in optimizer_tensors(optimizer) if t.device == device],
        "unsharded_params": [g.unsharded for g in groups],
        "grad_buffers": [t for g in groups for t in g.pending_grads()],
    }


def _split_low_bits_held(model) -> list[torch.Tensor]:
    """The low bits a split master is held as inside a minibatch ([split-masters]): the masters' category."""
    split = getattr(getattr(model, "minibatch", None), "split", None)
    return split.low_bits() if split is not None else []


def memory_breakdown(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryBreakdown:
    """Bytes per category of a sharded model (an ``ODCShard`` or a ``fully_shard`` model) on this rank now (see the
    module's docstring); no communication."""
    if not is_sharded(model):
        raise TypeError(f"memory_breakdown takes a model sharded by odcfsdp (ODCShard or fully_shard), got "
                        f"{type(model).__name__}")
    model = sharded(model)
    claims, tensors = _Claims(), odc_tensors(model, optimizer)
    counted = {cat: sum(claims.claim(*s) for t in plain_tensors(ts) if (s := span(t)) is not None)
               for cat, ts in tensors.items()}
    heap = int(getattr(model.transport, "heap_bytes", 0) or 0)
    outside = ("rows", "accumulators", "heap_other") if heap else ()
    out = MemoryBreakdown(**counted, heap=heap, heap_other=heap - counted["rows"] - counted["accumulators"] if heap
                          else 0, outside_torch=outside)
    device = model.groups[0].row.device if model.groups and model.groups[0].row is not None else None
    if device is not None and device.type == "cuda":
        out.torch_allocated = torch.cuda.memory_allocated(device)
        host = {k for k, ts in tensors.items() if ts and all(t.device.type == "cpu" for t in ts)}  # offloaded
        inside = sum(v for k, v in counted.items() if k not in outside and k not in host)
        out.activations_and_other = out.torch_allocated - inside
        out.allocator_slack = torch.cuda.memory_reserved(device) - out.torch_allocated
    return out


def known_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, list[torch.Tensor]]:
    """Tensors ``peak_breakdown`` recognises by address: an ``ODCShard`` model's categories, or any other model's
    parameters (``masters``: FSDP2's sharded fp32 parameters, DDP's full ones), gradients and optimizer state."""
    if is_sharded(model):
        return odc_tensors(model, optimizer)
    params = list(model.parameters())
    return {"masters": plain_tensors(params),
            "gradients": plain_tensors(p.grad for p in params),
            "optimizer_state": optimizer_tensors(optimizer)}


__all__ = ["MemoryBreakdown", "known_tensors", "memory_breakdown", "odc_tensors", "optimizer_tensors", "span"]
