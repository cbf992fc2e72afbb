"""``patch_fsdp2()``: code that calls torch's ``fully_shard`` through its module gets odcfsdp's.

accelerate's FSDP2 plugin (``fsdp_version=2``), and with it TRL's trainers and every script built on
``Accelerator``, imports ``fully_shard`` from ``torch.distributed.fsdp`` when it prepares a model. One call
before that points the name at ``odcfsdp.fully_shard``::

    import odcfsdp
    odcfsdp.patch_fsdp2()            # then Accelerator(...) / SFTTrainer(...) as before
    ...
    undo = odcfsdp.patch_fsdp2()
    undo()                           # torch's own again

Everything accelerate does around the call keeps working, because ``fully_shard`` keeps FSDP2's contract
([fully-shard], [fsdp-surface], [meta-init]): its blocks, then the embedding and the tail (a list unit, weights
tied), then the root; a meta-device build filled by broadcasting rank 0's values into ``load_state_dict(...,
assign=True)``; ``isinstance(m, FSDPModule)``; the optimizer switched to the sharded parameters by name.
Code that imported the name before the call keeps torch's.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed.fsdp as _fsdp

from .fully_shard import fully_shard

_TORCH_FULLY_SHARD = _fsdp.fully_shard


def patch_fsdp2() -> Callable[[], None]:
    """Make ``torch.distributed.fsdp.fully_shard`` odcfsdp's ``fully_shard`` (idempotent); returns the undo."""
    _fsdp.fully_shard = fully_shard

    def undo() -> None:
        _fsdp.fully_shard = _TORCH_FULLY_SHARD

    return undo


__all__ = ["patch_fsdp2"]
