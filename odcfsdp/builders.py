"""The pieces of a training run, built from its config: data source, model, sharded model, optimizer, device.

``odcfsdp.trainer.train`` calls these in order; ``odcfsdp.export`` rebuilds a run's
sharded model with them, and tests build the same data and optimizer as a run.
"""

from __future__ import annotations

import torch

from .checkpoint import load_hf
from .config import TrainConfig
from .data.balance import CostModel
from .data.jsonl import JsonlSource
from .data.lengths import LengthDistribution
from .data.synthetic import SyntheticSFT
from .data.tokenizer import load_tokenizer
from .models.llama import Llama, llama_config
from .optim import param_groups
from .schedule import warmup_cosine
from .sharding import ODCShard
from .sharding.mesh import hybrid_mesh
from .sharding.transport import is_one_sided


def build_source(cfg: TrainConfig):
    """The sample source and its vocabulary size."""
    d = cfg.data
    if d.source == "synthetic":
        lengths = LengthDistribution(d.lengths, cfg.run.seed)
        return SyntheticSFT(d.vocab_size, lengths, cfg.run.seed, d.pool_tokens, d.prompt_fraction), d.vocab_size
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    return JsonlSource(d.path, tokenizer, d.micro_batch_tokens + 1, cfg.run.seed), tokenizer.vocab_size


def vocab_size(cfg: TrainConfig) -> int:
    """The vocabulary the run's data uses (``build_source``'s, without reading the data)."""
    return cfg.data.vocab_size if cfg.data.source == "synthetic" else load_tokenizer(tokenizer_path(cfg)).vocab_size


def tokenizer_path(cfg: TrainConfig) -> str | None:
    """``data.tokenizer_path``, or the pretrained model's own directory (``model.path``), or None (bytes)."""
    return cfg.data.tokenizer_path or (cfg.model.path if cfg.model.name == "hf" else None)


def build_model(cfg: TrainConfig, vocab_size: int) -> tuple[torch.nn.Module, CostModel, CostModel]:
    """The unwrapped model, its training FLOPs per sequence (for MFU) and the balancers' cost model.

    Both are ``a * s**2 + b * s``; the balancers' one weighs attention by
    ``balance.attention_cost_factor`` unless ``balance.cost_a`` / ``cost_b`` set it.
    A pretrained Hugging Face model (``model.path``) is built wherever the caller's
    device context says (the meta device in ``train``); its weights are loaded after wrapping.
    """
    if cfg.model.name == "hf":
        from .models.hf import HFCausalLM

        model = HFCausalLM(cfg.model.path or cfg.model.hf_config, None if cfg.model.path else vocab_size)
        if cfg.model.path and vocab_size > model.config.vocab_size:
            raise ValueError(f"the tokenizer has {vocab_size} tokens but {cfg.model.path} has a vocabulary of "
                             f"{model.config.vocab_size}: use the checkpoint's own tokenizer (data.tokenizer_path)")
        if cfg.model.activation_checkpointing:
            model.enable_activation_checkpointing()
        lora = cfg.model.lora
        if lora.r:
            model.add_lora(lora.r, lora.alpha, lora.dropout, lora.target_modules)
        c = model.config
        dim, layers = c.hidden_size, c.num_hidden_layers
        matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    else:
        lcfg = llama_config(cfg.model.size, vocab_size, **{
            "activation_checkpointing": cfg.model.activation_checkpointing, "compile": cfg.model.compile,
            **cfg.model.overrides})
        model = Llama(lcfg)
        dim, layers, matmul = lcfg.dim, lcfg.n_layers, lcfg.matmul_params()
    flops = CostModel.for_transformer(layers, dim, matmul)
    b = cfg.balance
    timed = CostModel.for_transformer(layers, dim, matmul, b.attention_cost_factor)
    return model, flops, CostModel(b.cost_a if b.cost_a is not None else timed.a,
                                   b.cost_b if b.cost_b is not None else timed.b)


def build_sharded_model(cfg: TrainConfig, vocab: int, device: torch.device, *, weights: bool = True):
    """``build_model`` wrapped in ``ODCShard`` as ``cfg.shard`` says, with the pretrained weights if any.

    A pretrained Hugging Face model (``model.path``) is built on the meta device, so no
    rank holds the full model, and each rank reads only its slices of the files
    (``weights=False`` skips that read, for a checkpoint load that follows).
    """
    torch.manual_seed(cfg.run.seed)  # every rank builds the same initial model
    pretrained = cfg.model.name == "hf" and bool(cfg.model.path)
    with torch.device("meta" if pretrained else device):
        model, flops, cost = build_model(cfg, vocab)
    s = cfg.shard
    units = unit_classes(model, s.units)
    model = ODCShard(model, s.group_bytes, comm=s.comm, reshard_after_forward=s.reshard_after_forward,
                     param_dtype=getattr(torch, s.param_dtype) if s.param_dtype else None, prefetch=s.prefetch,
                     overlap_push=s.overlap_push, units=units, device=device if pretrained else None,
                     timeout=cfg.run.timeout_s, mesh=hybrid_mesh(s.replicas, device.type, is_one_sided(s.comm)))
    if pretrained and weights:
        load_hf(model, cfg.model.path)  # base weights; LoRA adapters are in no file: start them as PEFT does
        if cfg.model.lora.r:
            model.load_state_dict(model.module.initial_adapters(cfg.run.seed), strict=False)
    if cfg.model.compile and cfg.model.name == "hf":  # our Llama compiles its layers' dense parts itself
        if not units:
            raise ValueError("model.compile=true needs decoder-layer units (shard.units): none were found")
        for layer in (m for m in model.module.modules() if isinstance(m, units)):
            layer.compile()
    return model, flops, cost


def unit_classes(model: torch.nn.Module, names) -> tuple[type, ...]:
    """The module classes named by ``shard.units``, looked up among the model's own modules.

    With no names, a Hugging Face model's decoder layers (its ``_no_split_modules``).
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


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, device: torch.device):
    """``torch.optim.AdamW`` over ``param_groups`` (no decay for ``optim.no_decay``) and its ``LambdaLR`` schedule."""
    o = cfg.optim
    fused = device.type == "cuda" if o.fused is None else o.fused
    opt = torch.optim.AdamW(param_groups(model, no_decay=list(o.no_decay)), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                            weight_decay=o.weight_decay, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(o.warmup_steps, cfg.run.steps, o.schedule, o.min_lr_ratio))
    return opt, sched


def pick_device(cfg: TrainConfig) -> torch.device:
    """The device ``run.device`` names: this rank's current GPU (``auto`` where CUDA is available), else the CPU."""
    want = cfg.run.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("run.device=cuda but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
