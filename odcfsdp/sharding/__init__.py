"""Flat-group sharding: layout, transports, groups and the ``ODCShard`` wrapper."""

from .group import FlatGroup, GroupState
from .lifecycle import StepLifecycle, TrainingPhase
from .layout import GroupLayout, ParamSlot, plan_groups
from .mesh import ShardMesh
from .param import ODCLocalParameter, ODCParameter, ShardedParam
from .protocol import GradState, StepEvent, StepProtocol
from .shard import ODCShard
from .shard_state import ShardState

__all__ = [
    "FlatGroup", "GradState", "GroupLayout", "GroupState", "ODCLocalParameter", "ODCParameter", "ODCShard",
    "ParamSlot", "ShardMesh", "ShardState", "ShardedParam", "StepEvent", "StepLifecycle", "StepProtocol",
    "TrainingPhase", "plan_groups",
]
