"""``model.name=llama``: our Llama-style decoder at a named size (``model.size``, ``model.overrides``)."""

from __future__ import annotations

from ..checks import choice
from ..models.llama import LLAMA_SIZES, Llama, llama_config
from . import BuiltModel, ModelSpec


def build(cfg, vocab_size: int) -> BuiltModel:
    """``Llama`` of ``model.size`` over the data's vocabulary; ``model.overrides`` sets any ``LlamaConfig`` field."""
    lcfg = llama_config(cfg.model.size, vocab_size, **{
        "activation_checkpointing": cfg.model.activation_checkpointing, "compile": cfg.model.compile,
        **cfg.model.overrides})
    return BuiltModel(Llama(lcfg), layers=lcfg.n_layers, dim=lcfg.dim, matmul_params=lcfg.matmul_params())


def validate(cfg) -> None:
    """``model.size`` is a named size; ``model.compile`` needs whole-layer units."""
    choice("model.size", cfg.model.size, LLAMA_SIZES)
    # Llama compiles its layers' dense parts itself (LlamaConfig.compile), so it needs no finish step.
    if cfg.model.compile and "DecoderLayer" not in cfg.shard.units:
        raise ValueError("model.compile=true needs shard.units=[DecoderLayer] (compiled layers must find all their "
                         "parameters gathered when they start)")


SPEC = ModelSpec(name="llama", build=build, validate=validate, reads=("size", "overrides"))
