"""Sharded optimizers: each rank updates the rows it owns."""

from .adamw import AdamW

__all__ = ["AdamW"]
