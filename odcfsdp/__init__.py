"""odcfsdp: fully sharded data parallel training with on-demand one-sided communication.

``ODCShard``, ``fully_shard``, ``EngineSettings``, ``ODCModule``, ``sharded``, ``patch_fsdp2``, ``optim`` and
``param_groups`` are imported when first used
(PEP 562), so that ``python -m odcfsdp.bundle`` runs where torch is not installed (the machine that downloads).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["EngineSettings", "ODCModule", "ODCShard", "fully_shard", "optim", "param_groups", "patch_fsdp2",
           "sharded", "__version__"]

_LAZY = {"ODCShard": ("sharding", "ODCShard"), "fully_shard": ("sharding", "fully_shard"),
         "ODCModule": ("sharding", "ODCModule"), "param_groups": ("optim", "param_groups"), "optim": ("optim", None),
         "EngineSettings": ("sharding", "EngineSettings"), "sharded": ("sharding", "sharded"),
         "patch_fsdp2": ("sharding", "patch_fsdp2")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'odcfsdp' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(f".{module}", __name__)
    return value if attr is None else getattr(value, attr)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
