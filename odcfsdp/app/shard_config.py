"""``ShardConfig``, the ``shard`` group of the config tree: ``ODCShard``'s own arguments as config keys.

Design note [shard-config]
--------------------------
``ShardConfig`` is written out, an ordinary dataclass that type checkers see: each field is an
argument of ``ODCShard.__init__`` of the same name, with its default and a docstring (its ``--help``
line, [config-docs] in ``config.py``) that repeats the argument's entry in the ``Args:`` section of
``ODCShard``'s docstring; the engine's own options have none here: both their help and
``ODCShard``'s entries are ``EngineSettings``' field docstrings, their one source.
``shard_arguments`` hands every key back to ``ODCShard`` as the argument of the same name.
``tests/test_config.py`` holds the two lists together: the fields are exactly the configurable
arguments (names, order and defaults), each documented in ``ODCShard``'s docstring, so a new keyword
argument of ``ODCShard`` fails that test until it has its field here. The exceptions are the three
tables below:

* ``RUNTIME``: arguments that are runtime objects, not config keys; ``build_sharded_model``
  passes them;
* ``CONVERSIONS``: keys whose value is not the argument itself (a dtype's name, class names);
* ``CONFIG_ONLY``: config-only keys (``replicas``, which becomes ``mesh=``).

Hydra's structured configs hold int, float, bool, str, Optional, List and Dict; an argument
of another type needs a row in ``RUNTIME`` or ``CONVERSIONS``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Callable, List, Optional

import torch

from ..sharding.runtime.engine_settings import EngineSettings

# ODCShard arguments that are runtime objects, not config keys, and where the builder gets them.
RUNTIME: dict[str, str] = {
    "module": "the model, built from model.*",
    "process_group": "not passed: mesh= names the ranks",
    "mesh": "from shard.replicas (odcfsdp.sharding.placement.hsdp.hybrid_mesh)",
    "device": "the run's device, for a model built on the meta device",
    "timeout": "run.timeout_s (the watchdog is the run's, not the sharding's)",
}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """A key whose config value is not the argument itself.

    ``to_config``: the argument's default -> the key's default (the default ``ShardConfig``
    writes out; ``tests/test_config.py`` checks it); ``to_argument(value, built)``: the key's
    value -> the argument (``built``: the model spec's ``BuiltModel``).
    """

    to_config: Callable[[Any], Any]
    to_argument: Callable[[Any, Any], Any]


def unit_classes(model: torch.nn.Module, names) -> tuple[type, ...]:
    """The module classes named by ``shard.units``, looked up among the model's own modules.

    With no names, a Hugging Face model's decoder layers (its ``_no_split_modules``), else none.
    """
    if not names:
        layers = getattr(model, "decoder_layer_classes", None)
        return layers() if layers is not None else ()
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    missing = sorted(set(names) - set(by_name))
    if missing:
        raise ValueError(f"shard.units names {missing}, which the model has no module of; its classes: "
                         f"{sorted(by_name)}")
    return tuple(by_name[n] for n in names)


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _dtype(name: str | None):
    return getattr(torch, name) if name else None


@dataclasses.dataclass
class MixedPrecisionConfig:
    """``shard.mp_policy``: FSDP2's ``MixedPrecisionPolicy`` as config keys (dtype names; see [precision])."""

    param_dtype: Optional[str] = None
    """compute dtype (also shard.param_dtype; give one)"""
    reduce_dtype: Optional[str] = None
    """gradient accumulators' dtype: bfloat16 halves them; None: fp32"""
    output_dtype: Optional[str] = None
    """the model's floating outputs are cast to it"""
    cast_forward_inputs: bool = True
    """the model's floating inputs are cast to param_dtype (when set)"""


def _policy(settings: MixedPrecisionConfig, built):
    """A ``MixedPrecisionPolicy`` from ``shard.mp_policy`` (None when it sets no dtype)."""
    dtypes = {k: _dtype(getattr(settings, k)) for k in ("param_dtype", "reduce_dtype", "output_dtype")}
    if not any(dtypes.values()):
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(**dtypes, cast_forward_inputs=settings.cast_forward_inputs)


OFFLOAD_CHOICES = (None, "cpu", "cpu_unpinned")


def _offload(name: str | None, built):
    """``shard.offload_policy``: None (no offload), ``cpu`` (pinned host memory) or ``cpu_unpinned``."""
    if name not in OFFLOAD_CHOICES:
        raise ValueError(f"shard.offload_policy={name!r} is not allowed; choose one of {OFFLOAD_CHOICES}")
    if name is None:
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=name == "cpu")


#: ``shard.float8``'s values: a torchao recipe, or none (``none`` on the command line, ``null`` in YAML)
FLOAT8_CHOICES = (None, "none", "tensorwise", "rowwise")


def _float8(name: str | None, built) -> str | None:
    """``shard.float8``: the recipe ODCShard takes, None for ``none``."""
    return None if name in (None, "none") else name


CONVERSIONS: dict[str, Conversion] = {
    "param_dtype": Conversion(_dtype_name, lambda name, built: _dtype(name)),
    "offload_policy": Conversion(lambda policy: None, _offload),
    "mp_policy": Conversion(lambda policy: MixedPrecisionConfig(), _policy),
    "float8": Conversion(lambda recipe: recipe, _float8),
    "units": Conversion(lambda classes: [c.__name__ for c in classes],
                        lambda names, built: unit_classes(built.model, names)),
}

#: Config-only keys of ``ShardConfig``: not arguments of ODCShard (``build_sharded_model`` reads them).
CONFIG_ONLY = ("replicas",)


def args_help(doc: str) -> dict[str, str]:
    """The entries of a Google-style docstring's ``Args:`` section by name, each joined into one line."""
    lines = inspect.cleandoc(doc).splitlines()
    if "Args:" not in lines:
        return {}
    entries: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Args:") + 1:]:
        if line.strip() and not line.startswith(" "):
            break  # the next section
        entry = re.match(r" {4}(\w+): ?(.*)", line)
        if entry:
            name = entry[1]
            entries[name] = entry[2].strip()
        elif name and line.strip():
            entries[name] += " " + line.strip()
    return entries


@dataclasses.dataclass
class ShardConfig:
    """Arguments of ``ODCShard`` as config keys, each passed as the argument of the same name (see [shard-config]).
    The engine's own options (``group_bytes``, ``prefetch``, ``overlap_push``, ``gather_masters``, ``float8_gather``)
    take their help from ``EngineSettings``, where each is documented once (``_field_docs_from``)."""

    _field_docs_from = EngineSettings

    group_bytes: int = 32 << 20
    comm: str = "auto"
    """transport: ``"auto"`` (``nvshmem`` on CUDA, ``shm`` on CPU), ``"shm"``, ``"nvshmem"`` (one-sided: ranks meet
    only between the minibatch's last backward and the next forward, where the loop reads and consumes the gradients,
    and may run different numbers of micro-batches) or ``"collective"`` (all-gather / reduce-scatter; equal
    micro-batch counts required)."""
    reshard_after_forward: bool = True
    """free a group after its last use in forward and gather it again in backward (less memory); keep it until
    backward if False."""
    param_dtype: Optional[str] = None
    """dtype parameters are computed (and communicated) in; bf16 on CUDA and the parameters' own dtype elsewhere when
    None. (a dtype's name: float32 | bfloat16 | float16)"""
    prefetch: int = 1
    overlap_push: bool = True
    units: List[str] = dataclasses.field(default_factory=list)
    """module classes whose instances are hooked as a whole (all parameters of their subtree gathered before their
    forward, e.g. the decoder layer class); other modules that own parameters are hooked one by one. (class names,
    e.g. [DecoderLayer]; none: the model's default units, an HF model's decoder layers)"""
    gather_masters: bool = False
    split_masters: bool = False
    offload_policy: Optional[str] = None
    """FSDP2's ``CPUOffloadPolicy(pin_memory=True)``: fp32 masters, and so the optimizer's state and step, in host
    memory ([offload] in ``group.py``). (cpu: CPUOffloadPolicy(pin_memory=True); cpu_unpinned: pin_memory=False;
    none: no offload)"""
    mp_policy: MixedPrecisionConfig = dataclasses.field(default_factory=MixedPrecisionConfig)
    """FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` (as above), ``reduce_dtype`` (the gradient accumulators'
    dtype, e.g. bf16; fp32 by default), ``output_dtype`` and ``cast_forward_inputs`` at the model's forward (see
    [precision] in ``precision.py``). (keys param_dtype, reduce_dtype, output_dtype: dtype names;
    cast_forward_inputs)"""
    float8: Optional[str] = None
    """``"tensorwise"`` or ``"rowwise"``: convert the model's linears to torchao's float8 training first (not the
    output head, nor a linear whose dims are not multiples of 16); needs torchao (``pip install odcfsdp[fp8]``) and a
    GPU of compute capability 8.9+ ([float8] in ``float8.py``). (tensorwise | rowwise; none: no float8)"""
    float8_gather: bool = True
    replicas: Optional[int] = None
    """HSDP: copies of the model, each sharded over world / replicas ranks, combined once per minibatch; 1: full
    sharding over every rank; None: one shard group per node (torchrun's LOCAL_WORLD_SIZE), else 1. Becomes
    ODCShard's mesh= (see [hsdp])."""


def shard_arguments(shard, built) -> dict[str, Any]:
    """``ODCShard``'s keyword arguments from ``cfg.shard``: every key, converted where ``CONVERSIONS`` says.

    The config-only keys (``CONFIG_ONLY``) and the runtime arguments (``RUNTIME``) are the builder's.
    """
    out = {}
    for f in dataclasses.fields(ShardConfig):
        if f.name in CONFIG_ONLY:
            continue
        value = getattr(shard, f.name)
        out[f.name] = CONVERSIONS[f.name].to_argument(value, built) if f.name in CONVERSIONS else value
    return out

