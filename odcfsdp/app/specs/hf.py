"""``model.name=hf``: a Hugging Face causal LM from a local directory (``model.path`` or ``model.hf_config``).

``transformers`` (and ``peft``, for ``model.lora``) is an optional extra: it is imported
only when a model is built, never to list the specs.
"""

from __future__ import annotations

from . import BuiltModel, ModelSpec


def build(cfg, vocab_size: int) -> BuiltModel:
    """``HFCausalLM`` of ``model.path`` (its weights loaded after wrapping) or ``model.hf_config`` (random weights).

    A pretrained model is built wherever the caller's device context says (the meta device
    in ``build_sharded_model``); ``model.lora`` wraps it in PEFT adapters.
    """
    from ...models.hf import HFCausalLM

    m = cfg.model
    model = HFCausalLM(m.path or m.hf_config, None if m.path else vocab_size)
    if m.path and vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but {m.path} has a vocabulary of "
                         f"{model.config.vocab_size}: use the checkpoint's own tokenizer (data.tokenizer_path)")
    if m.activation_checkpointing:
        model.enable_activation_checkpointing()
    lora = m.lora
    if lora.r:
        model.add_lora(lora.r, lora.alpha, lora.dropout, lora.target_modules)
    c = model.config
    return BuiltModel(model, layers=c.num_hidden_layers, dim=c.hidden_size, matmul_params=model.matmul_params())


def validate(cfg) -> None:
    """Exactly one of ``model.path`` and ``model.hf_config``."""
    if bool(cfg.model.path) == bool(cfg.model.hf_config):
        raise ValueError("model.name=hf needs one of model.path=<local pretrained checkpoint directory> (fine-tune "
                         "its weights) or model.hf_config=<local config.json> (random weights)")


def pretrained(cfg) -> bool:
    """A checkpoint to fine-tune (``model.path``): built on the meta device, each rank reads only its slices."""
    return bool(cfg.model.path)


def finish(model, cfg, *, weights: bool = True) -> None:
    """After wrapping: the pretrained weights and initial LoRA adapters, then ``model.compile``'s per-layer compile."""
    if cfg.model.path and weights:
        from ...checkpoint import load_hf

        load_hf(model, cfg.model.path)  # base weights; LoRA adapters are in no file: start them as PEFT does
        if cfg.model.lora.r:
            model.load_state_dict(model.module.initial_adapters(cfg.run.seed), strict=False)
    if cfg.model.compile:
        if not model.units:
            raise ValueError("model.compile=true needs decoder-layer units (shard.units): none were found")
        for layer in (m for m in model.module.modules() if isinstance(m, model.units)):
            layer.compile()


def tokenizer_path(cfg) -> str | None:
    """The pretrained model's own tokenizer (``model.path``), if any."""
    return cfg.model.path


SPEC = ModelSpec(name="hf", build=build, validate=validate, pretrained=pretrained, finish=finish,
                 tokenizer_path=tokenizer_path, lora=True, reads=("path", "hf_config", "lora"))
