"""Optimizer helpers. ODCShard models train with any element-wise ``torch.optim`` optimizer; ``ParkedOptimizerState``
keeps its state in host memory between steps ([parking]); ``warmup_cosine`` is the learning-rate schedule."""

from .by_name import optimizer_class, optimizer_keywords
from .param_groups import DEFAULT_NO_DECAY, param_groups
from .parked import parked_copy, prefetch_parked, settle_parked, unparked
from .parking import ParkedOptimizerState, parking_of
from .schedule import warmup_cosine

__all__ = ["DEFAULT_NO_DECAY", "ParkedOptimizerState", "optimizer_class", "optimizer_keywords", "param_groups",
           "parked_copy", "parking_of", "prefetch_parked", "settle_parked", "unparked", "warmup_cosine"]
