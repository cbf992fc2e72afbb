"""``ShardConfig``, the ``shard`` group of the config tree, derived from ``ODCShard``'s own arguments.

Design note [derived-shard-config]
----------------------------------
``ODCShard.__init__``'s signature and the ``Args:`` section of ``ODCShard``'s docstring are
the one definition of the sharding knobs. Every argument becomes a key ``shard.<name>`` with
the argument's default, its annotation as the key's type and its Args entry as help text
(the field's ``metadata["help"]``, one line), and ``shard_arguments`` hands every key back
to ``ODCShard`` as the argument of the same name. A new keyword argument of ``ODCShard``
(with its Args line) is thus a command-line override (``shard.<name>=...``) that reaches
the wrapper, with no edit anywhere else. The exceptions are the three tables below:

* ``RUNTIME``: arguments that are runtime objects, not config keys; ``build_sharded_model``
  passes them;
* ``CONVERSIONS``: keys whose value is not the argument itself (a dtype's name, class names);
* ``EXTRA``: config-only keys (``replicas``, which becomes ``mesh=``).

Hydra's structured configs hold int, float, bool, str, Optional, List and Dict; an argument
of another type needs a row in ``RUNTIME`` or ``CONVERSIONS``, and importing this module
says so (as it does for an argument without an Args entry, or a table row naming no argument).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
from typing import Any, Callable, Dict, List, Optional

import torch

from ..sharding.shard import ODCShard

# ODCShard arguments that are runtime objects, not config keys, and where the builder gets them.
RUNTIME: dict[str, str] = {
    "module": "the model, built from model.*",
    "process_group": "not passed: mesh= names the ranks",
    "mesh": "from shard.replicas (odcfsdp.sharding.hsdp.hybrid_mesh)",
    "device": "the run's device, for a model built on the meta device",
    "timeout": "run.timeout_s (the watchdog is the run's, not the sharding's)",
}


@dataclasses.dataclass(frozen=True)
class Conversion:
    """A key whose config value is not the argument itself.

    ``type``: the key's type (one Hydra holds); ``to_config``: the argument's default -> the
    key's default; ``to_argument(value, built)``: the key's value -> the argument (``built``:
    the model spec's ``BuiltModel``); ``note``: appended to the help text.
    """

    type: Any
    to_config: Callable[[Any], Any]
    to_argument: Callable[[Any, Any], Any]
    note: str = ""


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

    param_dtype: Optional[str] = None  # compute dtype (also shard.param_dtype; give one)
    reduce_dtype: Optional[str] = None  # gradient accumulators' dtype: bfloat16 halves them; None: fp32
    output_dtype: Optional[str] = None  # the model's floating outputs are cast to it
    cast_forward_inputs: bool = True  # the model's floating inputs are cast to param_dtype (when set)


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


CONVERSIONS: dict[str, Conversion] = {
    "param_dtype": Conversion(
        Optional[str], _dtype_name, lambda name, built: _dtype(name), "(a dtype's name: float32 | bfloat16 | float16)"),
    "offload_policy": Conversion(
        Optional[str], lambda policy: None, _offload,
        "(cpu: CPUOffloadPolicy(pin_memory=True); cpu_unpinned: pin_memory=False; none: no offload)"),
    "mp_policy": Conversion(
        MixedPrecisionConfig, lambda policy: MixedPrecisionConfig(), _policy,
        "(keys param_dtype, reduce_dtype, output_dtype: dtype names; cast_forward_inputs)"),
    "units": Conversion(
        List[str], lambda classes: [c.__name__ for c in classes],
        lambda names, built: unit_classes(built.model, names),
        "(class names, e.g. [DecoderLayer]; none: the model's default units, an HF model's decoder layers)"),
}

# Config-only keys: name -> (type, default, help).
EXTRA: dict[str, tuple[Any, Any, str]] = {
    "replicas": (Optional[int], None, "HSDP: copies of the model, each sharded over world / replicas ranks, combined "
                 "once per minibatch; 1: full sharding over every rank; None: one shard group per node (torchrun's "
                 "LOCAL_WORLD_SIZE), else 1. Becomes ODCShard's mesh= (see [hsdp])."),
}

_PLAIN = (int, float, bool, str)


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


def _config_type(name: str, annotation, namespace: dict) -> Any:
    """The Hydra type of a plain argument's annotation (a string: shard.py has postponed annotations)."""
    t = eval(annotation, namespace) if isinstance(annotation, str) else annotation  # noqa: S307 (our own source)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t in _PLAIN:
        return t
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        if inner in _PLAIN:
            return Optional[inner]
    if origin in (list, tuple) and args and args[0] in _PLAIN and (origin is list or args[1:] in ((), (...,))):
        return List[args[0]]
    if origin is dict and args and args[0] is str and args[1] in _PLAIN:
        return Dict[str, args[1]]
    raise TypeError(f"ODCShard's argument {name}: {annotation} is not a config type (int, float, bool, str, "
                    "Optional, list or dict of those): add it to RUNTIME or CONVERSIONS in odcfsdp/app/shard_config.py")


def _field(default, help_text: str) -> dataclasses.Field:
    if isinstance(default, (list, tuple, dict)):  # mutable: each config gets its own copy
        copy = dict if isinstance(default, dict) else list
        return dataclasses.field(default_factory=lambda: copy(default), metadata={"help": help_text})
    if dataclasses.is_dataclass(default):  # a nested group of keys
        return dataclasses.field(default_factory=lambda: dataclasses.replace(default), metadata={"help": help_text})
    return dataclasses.field(default=default, metadata={"help": help_text})


def _derive_shard_config() -> type:
    """``ShardConfig`` from ``ODCShard``'s signature and docstring, the tables above and ``EXTRA``."""
    params = dict(inspect.signature(ODCShard.__init__).parameters)
    params.pop("self")
    for table in (RUNTIME, CONVERSIONS):
        unknown = sorted(set(table) - set(params))
        if unknown:
            raise TypeError(f"odcfsdp/app/shard_config.py names {unknown}, which are not arguments of ODCShard")
    helps = {**args_help(ODCShard.__doc__ or ""), **args_help(ODCShard.__init__.__doc__ or "")}  # class or __init__
    stripped = ODCShard.__doc__ is None  # python -OO strips docstrings: no help texts then, and no check
    namespace = vars(sys.modules[ODCShard.__module__])
    fields = []
    for name, p in params.items():
        if name in RUNTIME:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty:
            raise TypeError(f"ODCShard's argument {name} needs a default to be a config key (or a row in RUNTIME)")
        if name not in helps and not stripped:
            raise TypeError(f"ODCShard's argument {name} has no entry in the Args: section of ODCShard's docstring "
                            "(it is the key's help text)")
        conversion = CONVERSIONS.get(name)
        if conversion is not None:
            help_text = f"{helps.get(name, '')} {conversion.note}".strip()
            fields.append((name, conversion.type, _field(conversion.to_config(p.default), help_text)))
        else:
            fields.append((name, _config_type(name, p.annotation, namespace), _field(p.default, helps.get(name, ""))))
    for name, (typ, default, help_text) in EXTRA.items():
        if name in params:
            raise TypeError(f"EXTRA's key {name} is also an argument of ODCShard")
        fields.append((name, typ, _field(default, help_text)))
    cls = dataclasses.make_dataclass("ShardConfig", fields, namespace={
        "__doc__": "Arguments of ``ODCShard``, derived from its signature and docstring (see [derived-shard-config]); "
                   "each field's ``metadata['help']`` is its one-line help."})
    cls.__module__ = __name__  # pickled and looked up by name, as a class written here would be
    return cls


ShardConfig = _derive_shard_config()


def shard_arguments(shard, built) -> dict[str, Any]:
    """``ODCShard``'s keyword arguments from ``cfg.shard``: every derived key, converted where ``CONVERSIONS`` says.

    The config-only keys (``EXTRA``) and the runtime arguments (``RUNTIME``) are the builder's.
    """
    out = {}
    for f in dataclasses.fields(ShardConfig):
        if f.name in EXTRA:
            continue
        value = getattr(shard, f.name)
        out[f.name] = CONVERSIONS[f.name].to_argument(value, built) if f.name in CONVERSIONS else value
    return out

