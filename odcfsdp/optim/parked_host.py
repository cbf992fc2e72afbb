"""The host side of a parked optimizer state ([parking] in ``parking.py``): which tensors a share parks, the
pinned buffers that hold them, and the copies ``state_dict()`` hands out."""

from __future__ import annotations

import torch

from ..torch_private import local_of


def share_of(found: list, fraction: float) -> list:
    """The first state tensors of ``found`` until their bytes reach ``fraction`` of all of them."""
    if fraction >= 1.0 or fraction <= 0.0:
        return found if fraction >= 1.0 else []
    goal, total, out = fraction * sum(local.nbytes for *_, local in found), 0, []
    for item in found:
        if total >= goal:
            break
        out.append(item)
        total += item[-1].nbytes
    return out


def host_buffers(found: list[tuple[tuple[int, str], torch.Tensor]]) -> dict[tuple[int, str], torch.Tensor]:
    """One host buffer per dtype (pinned for CUDA state), cut into one view per state tensor: pinned memory
    allocated tensor by tensor would be rounded up to powers of two by torch's host allocator."""
    by_dtype: dict[torch.dtype, int] = {}
    for _, local in found:
        by_dtype[local.dtype] = by_dtype.get(local.dtype, 0) + local.numel()
    pinned = any(local.is_cuda for _, local in found)
    flat = {dtype: torch.empty(n, dtype=dtype, pin_memory=pinned) for dtype, n in by_dtype.items()}
    out, offset = {}, dict.fromkeys(by_dtype, 0)
    for key, local in found:
        start = offset[local.dtype]
        out[key] = flat[local.dtype][start:start + local.numel()].view(local.shape)
        offset[local.dtype] = start + local.numel()
    return out


def host_value(value: torch.Tensor, host: torch.Tensor | None) -> torch.Tensor:
    """A copy of a parked state tensor's values on the host, a DTensor if ``value`` is one (on its mesh, as
    torch's ``get_optimizer_state_dict(cpu_offload=True)`` gives); ``value`` itself if it is not parked."""
    if host is None:
        return value
    copy = host.clone()
    if local_of(value) is value:
        return copy
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(copy, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                              stride=value.stride())
