"""Models built on the meta device: real buffers where the meta ones were.

A model built under ``torch.device("meta")`` has no values; its rows start at zero
and are filled by a load (``odcfsdp.checkpoint.load_hf`` / ``load_checkpoint``), and
its parameters are replaced by real ones as they are sharded ([params]).

Design note [meta-buffers]
--------------------------
Buffers come in two kinds, and a load restores only one of them:

1. *persistent* buffers are in state dicts and weight files: they become zeros on the
   shard device here, and the load fills them (``load_hf`` reads those its files hold);
2. *computed* buffers (``persistent=False``: rotary frequencies and the like) are in no
   file; a module computes them in ``__init__``, which on the meta device computed
   nothing. They are recomputed here, in this order of preference: the module's own
   ``init_buffers()``; else, for a module built from a ``config`` (every Hugging Face
   rotary embedding), a fresh instance ``type(module)(module.config)`` on the device,
   whose buffers replace the meta ones. A computed buffer that neither way rebuilds is
   an error naming it: zeros there would give wrong outputs without any error.

Design note [meta-init]
-----------------------
FSDP2's way to build a model too large for one device, which torchtitan, accelerate and verl follow:

1. ``with torch.device("meta"): model = build()``: shapes, no values;
2. ``fully_shard(block)`` per block, then ``fully_shard(model)``: the plan needs shapes only, so the
   rows and masters are allocated on the mesh's device (zeros) and no rank ever holds a full block;
   buffers are made real here ([meta-buffers]);
3. ``model.to_empty(device=...)``: the shards already live there, so nothing moves (another device is
   refused in one line); a buffer still on meta becomes real;
4. ``model.init_weights()`` (or any in-place initialisation of the parameters): it writes this rank's
   shards (DTensors over the masters), as it writes FSDP2's, so each rank initialises its own rows;
5. the first forward after ``to_empty`` publishes every master to its row around one meeting (the
   step protocol's ``rows_changing``) before anything is gathered, so every rank must run that forward
   (a rank with no micro-batch in the first minibatch meets the others at a different point, and every
   rank raises the same error). A load instead of an initialisation (``load_state_dict``,
   ``set_model_state_dict``, ``load_hf``, a DCP checkpoint) publishes at once, and nothing is left to do.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _computed_meta_buffers(mod: nn.Module) -> list[str]:
    return [name for name, buf in mod._buffers.items()
            if buf is not None and buf.is_meta and name in mod._non_persistent_buffers_set]


def _rebuild_from_config(mod: nn.Module, device: torch.device) -> bool:
    config = getattr(mod, "config", None)
    if config is None:
        return False
    try:
        with torch.device(device):
            fresh = type(mod)(config)
    except TypeError:  # not built from its config alone
        return False
    for name, buf in fresh.named_buffers(recurse=False):
        mod._buffers[name] = buf.to(device)
    return True


def materialize_buffers(root: nn.Module, device: torch.device) -> None:
    """Meta buffers become real ones on ``device`` (see [meta-buffers]); raises for a computed one it cannot rebuild."""
    computed = {mod: _computed_meta_buffers(mod) for mod in root.modules()}
    for mod in root.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros_like(buf, device=device)  # then init_buffers / a load
    for mod in root.modules():
        init = getattr(mod, "init_buffers", None)
        if callable(init):
            init()
        elif computed[mod] and not _rebuild_from_config(mod, device):
            where = next(n for n, m in root.named_modules() if m is mod) or type(mod).__name__
            raise ValueError(
                f"{where}: computed buffers {computed[mod]} of {type(mod).__name__} cannot be rebuilt after building "
                "on the meta device (no init_buffers() method, not constructible from a config): give the class an "
                "init_buffers() that recomputes them, or build the model on a real device")
