"""One view of a sharded model, whichever front door built it: ``sharded(model)``.

Design note [sharded-model]
---------------------------
``ODCShard(model)`` and ``fully_shard`` (per block, then the root) build the same ``ShardEngine``
([engine] in ``engine.py``); what reads or writes a sharded model as a whole (sharded checkpoints,
``load_hf`` and the Hugging Face exports, the memory breakdown) needs the engine and the module it
shards, not the front door. ``sharded(model)`` gives them as a ``ShardedModel``, with the names those
readers use: for an ``ODCShard``, the wrapper itself (it has every one); for a ``fully_shard``
module, a view over its model's engine (any unit of the model, or the root). Anything else is
refused in one line.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..runtime.engine import ShardEngine
from .odc_module import ODCModule
from .shard import ODCShard
from ..runtime.shard_state import persistent_buffers


class FullyShardedView:
    """``sharded(m)`` of a ``fully_shard`` module: its model's engine, under the names ``ODCShard`` gives it."""

    def __init__(self, engine: ShardEngine):
        self.engine = engine
        self.module = engine.root  # the root fully_shard was last called on
        engine.expose_on(self)

    @property
    def pending_pushes(self) -> int:
        """Gradient pushes of this rank whose minibatch has not finished (0 between minibatches)."""
        return self.minibatch.pending_pushes

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers by name (replicated on every rank; checkpoints keep them)."""
        return persistent_buffers(self.module)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameter values, keyed by name (collective)."""
        return self.shard_state.full_state_dict()


#: what ``sharded`` returns: either front door's model, under the same names
ShardedModel = ODCShard | FullyShardedView


def sharded(model: nn.Module) -> ShardedModel:
    """The sharded view of ``model`` ([sharded-model]): an ``ODCShard`` as it is, a ``fully_shard`` module (a block
    or the root) as its model's engine. Raises ``TypeError`` for a model neither sharded."""
    if isinstance(model, ODCShard):
        return model
    if isinstance(model, FullyShardedView):
        return model
    if isinstance(model, ODCModule):
        return FullyShardedView(model._odc_engine)
    raise TypeError(f"expected a model sharded by odcfsdp (ODCShard, or fully_shard called on it), got "
                    f"{type(model).__name__}")


def is_sharded(model: object) -> bool:
    """Whether ``sharded(model)`` accepts ``model``."""
    return isinstance(model, (ODCShard, FullyShardedView, ODCModule))


__all__ = ["FullyShardedView", "ShardedModel", "is_sharded", "sharded"]
