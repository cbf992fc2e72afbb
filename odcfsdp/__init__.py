"""odcfsdp: fully sharded data parallel training with on-demand one-sided communication."""

from . import optim
from .optim import param_groups
from .sharding import ODCShard

__version__ = "0.1.0"
__all__ = ["ODCShard", "optim", "param_groups", "__version__"]
