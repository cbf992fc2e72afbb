"""Optimizer helpers. ODCShard models train with any element-wise ``torch.optim`` optimizer."""

from .by_name import optimizer_class, optimizer_keywords
from .param_groups import DEFAULT_NO_DECAY, param_groups

__all__ = ["DEFAULT_NO_DECAY", "optimizer_class", "optimizer_keywords", "param_groups"]
