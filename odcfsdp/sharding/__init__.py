"""Flat-group sharding, in five subpackages, lowest first: ``placement`` (the ranks and the flat group layout),
``transport`` (how rows move), ``groups`` (the groups and their parameters), ``runtime`` (the engine, one step's
lifecycle, the minibatch) and ``api`` (``ODCShard``, ``fully_shard``). The names users need are re-exported here."""

from .runtime.engine import ShardEngine
from .runtime.engine_settings import EngineSettings
from .api.fsdp2_patch import patch_fsdp2
from .api.fully_shard import ODCModule, fully_shard
from .groups.group import FlatGroup, GroupState
from .runtime.lifecycle import StepLifecycle, TrainingPhase
from .placement.layout import GroupLayout, ParamSlot, plan_groups
from .placement.mesh import ShardMesh
from .groups.param import ODCLocalParameter, ODCParameter, ShardedParam
from .runtime.minibatch import Minibatch
from .runtime.protocol import GradState, StepEvent
from .api.shard import ODCShard
from .runtime.shard_state import ShardState
from .api.sharded_model import FullyShardedView, is_sharded, sharded

__all__ = [
    "EngineSettings", "FullyShardedView", "is_sharded", "patch_fsdp2", "sharded",
    "FlatGroup", "GradState", "GroupLayout", "GroupState", "Minibatch", "ODCLocalParameter", "ODCModule",
    "ODCParameter", "ODCShard", "ParamSlot", "ShardEngine", "ShardMesh", "ShardState", "ShardedParam", "StepEvent",
    "StepLifecycle", "TrainingPhase", "fully_shard", "plan_groups",
]
