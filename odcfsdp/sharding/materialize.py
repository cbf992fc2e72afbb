"""Models built on the meta device: put real parameters and buffers where the meta ones were.

A model built under ``torch.device("meta")`` has no values; its rows start at zero
and are filled by a load (``odcfsdp.checkpoint.load_hf`` / ``load_checkpoint``).
Buffers are created as zeros on the shard device and then each submodule's
``init_buffers()`` (if it has one) recomputes what it computes in ``__init__``
(rotary frequencies and the like).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def swap_params(root: nn.Module, new_by_old_id: dict[int, nn.Parameter]) -> None:
    """Put the parameters that replaced old ones (by ``id``) into every module that held them."""
    for mod in root.modules():
        for name, p in mod._parameters.items():
            if p is not None and id(p) in new_by_old_id:
                mod._parameters[name] = new_by_old_id[id(p)]


def materialize_buffers(root: nn.Module, device: torch.device) -> None:
    """Meta buffers become zeros on ``device``; then every ``init_buffers()`` recomputes its own."""
    for mod in root.modules():
        for name, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[name] = torch.zeros_like(buf, device=device)  # then init_buffers / a load
    for mod in root.modules():
        init = getattr(mod, "init_buffers", None)
        if callable(init):
            init()
