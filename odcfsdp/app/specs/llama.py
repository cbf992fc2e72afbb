"""``model.name=llama``: our Llama-style decoder at a named size (``model.size``, ``model.overrides``)."""

from __future__ import annotations

from ...checks import choice
from ...models.llama import LLAMA_SIZES, Llama, LlamaConfig, llama_config
from . import BuiltModel, ModelSpec


def _config(cfg, vocab_size: int) -> LlamaConfig:
    """The ``LlamaConfig`` a run builds: ``model.size`` over ``vocab_size``, with ``model.overrides``."""
    return llama_config(cfg.model.size, vocab_size, **{
        "activation_checkpointing": cfg.model.activation_checkpointing, "compile": cfg.model.compile,
        **cfg.model.overrides})


def build(cfg, vocab_size: int) -> BuiltModel:
    """``Llama`` of ``model.size`` over the data's vocabulary; ``model.overrides`` sets any ``LlamaConfig`` field."""
    lcfg = _config(cfg, vocab_size)
    return BuiltModel(Llama(lcfg), layers=lcfg.n_layers, dim=lcfg.dim, matmul_params=lcfg.matmul_params())


def parameters(cfg, vocab_size: int) -> int:
    """How many parameters the run's model has (from its config; nothing is built)."""
    return _config(cfg, vocab_size).num_params()


def validate(cfg) -> None:
    """``model.size`` is a named size and ``model.overrides`` make a valid ``LlamaConfig`` (known fields, heads that
    divide the width); ``model.compile`` needs whole-layer units."""
    choice("model.size", cfg.model.size, LLAMA_SIZES)
    try:  # a config is a few integers: check it here rather than let every rank fail building the model
        _config(cfg, cfg.data.vocab_size)
    except (TypeError, ValueError) as e:
        message = str(e) if str(e).startswith("model.") else f"model.overrides: {e}"
        raise ValueError(f"{message} (model.size={cfg.model.size}, overrides {dict(cfg.model.overrides)})") from None
    # Llama compiles its layers' dense parts itself (LlamaConfig.compile), so it needs no finish step.
    if cfg.model.compile and "DecoderLayer" not in cfg.shard.units:
        raise ValueError("model.compile=true needs shard.units=[DecoderLayer] (compiled layers must find all their "
                         "parameters gathered when they start)")


SPEC = ModelSpec(name="llama", build=build, validate=validate, parameters=parameters, reads=("size", "overrides"))
