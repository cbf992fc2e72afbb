"""Flat-group sharding: layout, transports, groups and the ``ODCShard`` wrapper."""

from .group import FlatGroup, GroupState
from .hooks import TrainingPhase
from .layout import GroupLayout, ParamSlot, plan_groups
from .mesh import ShardMesh
from .protocol import StepProtocol
from .shard import ODCShard

__all__ = [
    "FlatGroup", "GroupLayout", "GroupState", "ODCShard", "ParamSlot", "ShardMesh", "StepProtocol", "TrainingPhase",
    "plan_groups",
]
