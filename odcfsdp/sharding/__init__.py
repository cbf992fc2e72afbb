"""Flat-group sharding: layout, transports, groups, the engine, the ``ODCShard`` wrapper and ``fully_shard``."""

from .engine import ShardEngine
from .engine_settings import EngineSettings
from .fsdp2_patch import patch_fsdp2
from .fully_shard import ODCModule, fully_shard
from .group import FlatGroup, GroupState
from .lifecycle import StepLifecycle, TrainingPhase
from .layout import GroupLayout, ParamSlot, plan_groups
from .mesh import ShardMesh
from .param import ODCLocalParameter, ODCParameter, ShardedParam
from .minibatch import Minibatch
from .protocol import GradState, StepEvent
from .shard import ODCShard
from .shard_state import ShardState
from .sharded_model import FullyShardedView, is_sharded, sharded

__all__ = [
    "EngineSettings", "FullyShardedView", "is_sharded", "patch_fsdp2", "sharded",
    "FlatGroup", "GradState", "GroupLayout", "GroupState", "Minibatch", "ODCLocalParameter", "ODCModule",
    "ODCParameter", "ODCShard", "ParamSlot", "ShardEngine", "ShardMesh", "ShardState", "ShardedParam", "StepEvent",
    "StepLifecycle", "TrainingPhase", "fully_shard", "plan_groups",
]
