"""Flat-group sharding: layout, transports, groups and the ``ODCShard`` wrapper."""

from .group import FlatGroup, GroupState
from .layout import GroupLayout, ParamSlot, plan_groups
from .shard import ODCShard, TrainingPhase

__all__ = ["FlatGroup", "GroupLayout", "GroupState", "ODCShard", "ParamSlot", "TrainingPhase", "plan_groups"]
