"""Models built on the meta device: real buffers where the meta ones were.

A model built under ``torch.device("meta")`` has no values; its rows start at zero
and are filled by a load (``odcfsdp.checkpoint.load_hf`` / ``load_checkpoint``), and
its parameters are replaced by real ones as they are sharded ([params]). Buffers are created as zeros on the shard device and then each submodule's
``init_buffers()`` (if it has one) recomputes what it computes in ``__init__``
(rotary frequencies and the like).
"""

from __future__ import annotations

import torch
import torch.nn as nn


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
