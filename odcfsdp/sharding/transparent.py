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
and wrapping it in ``DistributedDataParallel`` (which Accelerate does).
"""

from __future__ import annotations

import types

import torch.nn as nn

MOVE_ERROR = ("ODCShard does not support .to()/.cuda()/.float() and the like after wrapping; move or cast "
              "the model before wrapping it (param_dtype= sets the compute dtype)")


def _refuse_apply(module: nn.Module, fn, recurse: bool = True):
    """Bound as ``_apply`` of every submodule of a wrapped model: moving or casting it would detach its shards."""
    raise RuntimeError(MOVE_ERROR)


def _refuse_save_pretrained(*args, **kwargs):
    """Set as ``save_pretrained`` of every Hugging Face model inside a wrapped one: it would write shards."""
    raise RuntimeError("save_pretrained of a wrapped model would write this rank's shards: export the full weights "
                       "with odcfsdp.checkpoint.export_hf(wrapped, out_dir) (collective: config.json, "
                       "generation_config.json, safetensors), or train with run.export_hf=true")


def refuse_detaching(module: nn.Module) -> None:
    """Every submodule of ``module`` refuses ``.to()``-like moves and casts, and a Hugging Face model's
    ``save_pretrained`` (it would write one rank's shards)."""
    for mod in module.modules():
        mod._apply = types.MethodType(_refuse_apply, mod)
        if callable(getattr(mod, "save_pretrained", None)):
            mod.save_pretrained = _refuse_save_pretrained


__all__ = ["MOVE_ERROR", "refuse_detaching"]
