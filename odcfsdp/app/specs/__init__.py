"""Model specs: what a training run needs to build each kind of model, by ``model.name``.

Design note [model-specs]
-------------------------
After torchtitan's ``TrainSpec``: each module of this package defines one ``SPEC = ModelSpec(...)``, found by
``model_specs()`` (``pkgutil``), so adding a model to ``python -m odcfsdp.train`` is one new file here and nothing
else: ``model.name``'s allowed values, its checks and the builder (``odcfsdp.app.builders``) all come from the
registry, with no branch on model names anywhere. A spec reads the run's config tree
(``odcfsdp.app.config.TrainConfig``) by attribute and does not import it (config imports the registry). Specs sit
above ``models/`` and ``checkpoint/`` (the hf spec loads pretrained weights with ``checkpoint.load_hf``) and below the
config. Its own hyper-parameters go in the generic ``model.*`` keys (``model.size``, ``model.overrides``,
``model.path``, ...). A spec module imports optional packages (``transformers``) only inside its functions: every spec
is imported to list the names.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn


@dataclass
class BuiltModel:
    """What a spec's ``build`` returns: the unwrapped model and what MFU, the balancers and ``ODCShard`` need.

    ``layers``, ``dim`` and ``matmul_params`` (parameters in matrix products per token) give
    the training FLOPs of a sequence (``CostModel.for_transformer``).
    """

    model: nn.Module
    layers: int
    dim: int
    matmul_params: int


def _no_tokenizer(cfg: Any) -> str | None:
    return None


def _from_scratch(cfg: Any) -> bool:
    return False


def _no_checks(cfg: Any) -> None:
    return None


def _unknown_size(cfg: Any, vocab_size: int) -> int | None:
    return None


@dataclass(frozen=True)
class ModelSpec:
    """One kind of model (``model.name=<name>``): how to check its keys, build it and finish it after wrapping.

    Attributes:
        name: the ``model.name`` value.
        build: ``build(cfg, vocab_size) -> BuiltModel``; the model is built on the device
            the caller's context says (the meta device when ``pretrained(cfg)``).
        validate: ``validate(cfg)`` raises ``ValueError`` (naming the key) for an invalid
            value of a key this model reads; called by ``odcfsdp.app.config.validate``.
        pretrained: ``pretrained(cfg)``: whether the weights are read from files after
            wrapping (then the model is built on the meta device: no rank holds all of it).
        finish: ``finish(wrapped, cfg, weights=...)``, steps after ``ODCShard`` wrapped the
            model (loading pretrained weights, starting adapters, compiling layers), or None;
            ``weights=False`` when a checkpoint load follows (no weights to read).
        tokenizer_path: ``tokenizer_path(cfg)``: the tokenizer the model comes with, used
            when ``data.tokenizer_path`` is not set (None: bytes).
        parameters: ``parameters(cfg, vocab_size)``: the model's parameter count from its config,
            without building it, or None where only the built model can tell (the launcher's
            memory check, ``odcfsdp.app.preflight``).
        lora: whether ``model.lora`` adapters (PEFT) are supported.
        reads: the ``model.*`` keys only this kind of model reads (``size``, ``path``, ...); an
            override of another spec's key is rejected as unused (``odcfsdp.app.config.unused_key``).
    """

    name: str
    build: Callable[[Any, int], BuiltModel]
    validate: Callable[[Any], None] = _no_checks
    pretrained: Callable[[Any], bool] = _from_scratch
    finish: Callable[..., None] | None = None
    tokenizer_path: Callable[[Any], str | None] = _no_tokenizer
    parameters: Callable[[Any, int], int | None] = _unknown_size
    lora: bool = False
    reads: tuple[str, ...] = ()


@functools.cache
def model_specs() -> dict[str, ModelSpec]:
    """Every spec of this package by name: each module's ``SPEC`` (modules named ``_*`` are skipped)."""
    specs: dict[str, ModelSpec] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"{module.__name__} must define SPEC = ModelSpec(...) (see [model-specs])")
        if spec.name in specs:
            raise ValueError(f"model.name={spec.name!r} is defined twice ({module.__name__} and another spec)")
        specs[spec.name] = spec
    return specs


def model_spec(name: str) -> ModelSpec:
    """The spec of ``model.name=name``; ``ValueError`` naming the registered names for another."""
    specs = model_specs()
    if name not in specs:
        raise ValueError(f"model.name={name!r} is not allowed; choose one of {tuple(specs)}")
    return specs[name]


__all__ = ["BuiltModel", "ModelSpec", "model_spec", "model_specs"]
