"""What keeps a wrapped model attached to its shards: refusals of what would detach it, with the supported way.

Design note [transparent-wrapper]
---------------------------------
The wrapper stands for the model the way FSDP2's ``fully_shard`` leaves it: its
parameters, buffers and state-dict keys carry the wrapped model's names (no
``module.`` prefix), ``state_dict()`` holds this rank's shards as DTensors (what
``torch.distributed.checkpoint`` saves), and attributes it does not have itself
(``config``, ``generate``, ...) are the wrapped model's. What would silently detach
the model from its shards is refused with an error that names the supported way:
moving or casting it (``.to()``, ``.double()``: on the wrapper or any submodule),
wrapping it in ``DistributedDataParallel`` (which Accelerate does), and a Hugging Face
``save_pretrained`` without a full ``state_dict`` (it would write one rank's shards; with
one, as Hugging Face's Trainer saves an FSDP2 model, it writes those values).
"""

from __future__ import annotations

import functools
import types

import torch.nn as nn
from torch.distributed.tensor import DTensor

MOVE_ERROR = ("ODCShard does not support .to()/.cuda()/.float() and the like after wrapping; move or cast "
              "the model before wrapping it (param_dtype= sets the compute dtype)")


def _refuse_apply(module: nn.Module, fn, recurse: bool = True):
    """Bound as ``_apply`` of every submodule of a wrapped model: moving or casting it would detach its shards."""
    raise RuntimeError(MOVE_ERROR)


def _save_pretrained_given_full_values(original, *args, state_dict=None, **kwargs):
    """Set as ``save_pretrained`` of every Hugging Face model inside a wrapped one: on its own it would write this
    rank's shards, so it takes only a full state dict gathered by the caller (Hugging Face's Trainer passes
    ``accelerator.get_state_dict(model)``: full values on the main process)."""
    if state_dict is None or any(isinstance(v, DTensor) for v in state_dict.values()):
        raise RuntimeError("save_pretrained of a wrapped model would write this rank's shards: export the full "
                           "weights with odcfsdp.checkpoint.export_hf(wrapped, out_dir) (collective: config.json, "
                           "generation_config.json, safetensors), pass state_dict= full values (torch's "
                           "get_model_state_dict with full_state_dict=True), or train with run.export_hf=true")
    return original(*args, state_dict=state_dict, **kwargs)


def refuse_detaching(module: nn.Module) -> None:
    """Every submodule of ``module`` refuses ``.to()``-like moves and casts, and a Hugging Face model's
    ``save_pretrained`` without a full state dict (it would write one rank's shards)."""
    for mod in module.modules():
        mod._apply = types.MethodType(_refuse_apply, mod)
        original = getattr(mod, "save_pretrained", None)
        if callable(original):
            mod.save_pretrained = functools.partial(_save_pretrained_given_full_values, original)


__all__ = ["MOVE_ERROR", "refuse_detaching"]
