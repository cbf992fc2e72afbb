"""The e2e bench's baselines, one wrapping each for our Llama and Hugging Face models: FSDP2 and DDP.

``fsdp2`` is what torchtitan does: ``fully_shard`` per decoder layer, then the root, with
``MixedPrecisionPolicy(bf16, fp32 reduce)`` on GPUs; the last layer stays gathered after forward
(backward starts with it, so resharding it would only gather it again at once). ``fsdp2_nosync`` is how
collective users live with several micro-batches: FSDP2 with gradient sync off until the last micro-batch
(``set_requires_gradient_sync(False)``: no reduce-scatter, unsharded gradients accumulate) and no reshard after
backward (``set_reshard_after_backward(False)``: no re-gather for the next micro-batch's forward), FSDP2's
documented recipe for gradient accumulation; it trades ZeRO-3's memory for ZeRO-2's. ``ddp`` keeps fp32
parameters, computes under bf16 autocast on GPUs and skips the all-reduce of non-final micro-batches.
Each returns (model, autocast context, loss scale, no_sync): all average gradients over ranks, so the
e2e bench's summed losses are scaled by the world size (see ``e2e_bench.wrap``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn


def fsdp2(model: nn.Module, layers: list[nn.Module], device: torch.device, offload: bool = False,
          nosync: bool = False, mesh=None):
    """FSDP2 over ``layers`` and the root (``offload``: ``CPUOffloadPolicy``, host masters and CPU step;
    ``nosync``: the micro-batches before the last neither reduce nor reshard, see ``fsdp2_no_sync``; ``mesh``: a
    2-D mesh (odcfsdp's ``hybrid_mesh``, "replicate" x "shard") makes it FSDP2's HSDP)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = device.type == "cuda"
    kwargs = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if cuda else {}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(model, **kwargs)
    no_sync = functools.partial(fsdp2_no_sync, model) if nosync else None
    return model, contextlib.nullcontext, float(dist.get_world_size()), no_sync


@contextlib.contextmanager
def fsdp2_no_sync(model):
    """Around a non-final micro-batch's forward and backward: no gradient reduce-scatter and no reshard after
    backward, for every FSDP module under ``model``; the last micro-batch (outside it) reduces and reshards."""
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def ddp(model: nn.Module, device: torch.device):
    """DDP with bf16 autocast on GPUs; ``no_sync`` for the micro-batches before the last."""
    from torch.nn.parallel import DistributedDataParallel

    cuda = device.type == "cuda"
    wrapped = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    return wrapped, autocast, float(dist.get_world_size()), wrapped.no_sync


def torchao_float8(model: nn.Module, recipe: str | None) -> None:
    """torchtitan's float8 for FSDP2: torchao's ``Float8Linear`` on the layers odcfsdp converts (``float8_eligible``),
    with float8 all-gather (``enable_fsdp_float8_all_gather``) where the recipe is tensorwise; before ``fsdp2``."""
    if not recipe:
        return
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from odcfsdp.sharding.groups.float8 import float8_eligible

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe),
                                 enable_fsdp_float8_all_gather=recipe == "tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=float8_eligible)


def float8_scales_after_step(opt: torch.optim.Optimizer, model: nn.Module, recipe: str | None) -> None:
    """With tensorwise float8 all-gather, ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step
    (one all-reduce of every weight's amax, as torchtitan does), inside the step's measured time."""
    if recipe == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        opt.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
