"""The e2e bench's baselines, one wrapping each for our Llama and Hugging Face models: FSDP2 and DDP.

``fsdp2`` is what torchtitan does: ``fully_shard`` per decoder layer, then the root, with
``MixedPrecisionPolicy(bf16, fp32 reduce)`` on GPUs; the last layer stays gathered after forward
(backward starts with it, so resharding it would only gather it again at once). ``ddp`` keeps fp32
parameters, computes under bf16 autocast on GPUs and skips the all-reduce of non-final micro-batches.
Each returns (model, autocast context, loss scale, no_sync): both average gradients over ranks, so the
e2e bench's summed losses are scaled by the world size (see ``e2e_bench.wrap``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


def fsdp2(model: nn.Module, layers: list[nn.Module], device: torch.device, offload: bool = False):
    """FSDP2 over ``layers`` and the root (``offload``: ``CPUOffloadPolicy``, host masters and CPU step)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = device.type == "cuda"
    kwargs = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if cuda else {}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model, contextlib.nullcontext, float(dist.get_world_size()), None


def ddp(model: nn.Module, device: torch.device):
    """DDP with bf16 autocast on GPUs; ``no_sync`` for the micro-batches before the last."""
    from torch.nn.parallel import DistributedDataParallel

    cuda = device.type == "cuda"
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    return wrapped, autocast, float(dist.get_world_size()), wrapped.no_sync
