"""The pieces of a training run, built from its config: data source, model, sharded model, optimizer, device.

``odcfsdp.app.trainer.train`` calls these in order; ``odcfsdp.export`` rebuilds a run's
sharded model with them, and tests build the same data and optimizer as a run.
"""

from __future__ import annotations

import torch

from ..data.balance import CostModel
from ..optim import ParkedOptimizerState, optimizer_class, optimizer_keywords, param_groups
from ..optim.schedule import warmup_cosine
from ..sharding import ODCShard
from ..sharding.placement.hsdp import hybrid_mesh
from ..sharding.transport import capabilities
from .config import OPTIMIZER_KEYS, TrainConfig
from .shard_config import shard_arguments
from .sources import jsonl_source, source_of, tokenizer_path
from .specs import BuiltModel, model_spec

__all__ = ["build_optimizer", "build_sharded_model", "build_source", "cost_models", "jsonl_source",
           "optimizer_arguments", "pick_device", "tokenizer_path", "vocab_size"]


def build_source(cfg: TrainConfig):
    """The sample source and its vocabulary size, as the run's data source builds them ([data-sources])."""
    return source_of(cfg).build(cfg)


def vocab_size(cfg: TrainConfig) -> int:
    """The vocabulary the run's data uses (``build_source``'s, without reading the data)."""
    return source_of(cfg).vocab_size(cfg)


def cost_models(cfg: TrainConfig, built: BuiltModel) -> tuple[CostModel, CostModel]:
    """The model's training FLOPs per sequence (for MFU) and the balancers' cost model.

    Both are ``a * s**2 + b * s``; the balancers' one weighs attention by
    ``balance.attention_cost_factor`` unless ``balance.cost_a`` / ``cost_b`` set it.
    """
    flops = CostModel.for_transformer(built.layers, built.dim, built.matmul_params)
    b = cfg.balance
    timed = CostModel.for_transformer(built.layers, built.dim, built.matmul_params, b.attention_cost_factor)
    return flops, CostModel(b.cost_a if b.cost_a is not None else timed.a,
                            b.cost_b if b.cost_b is not None else timed.b)


def build_sharded_model(cfg: TrainConfig, vocab: int, device: torch.device, *, weights: bool = True):
    """``model.name``'s model wrapped in ``ODCShard`` as ``cfg.shard`` says; with its FLOPs and cost models.

    The model comes from its spec ([model-specs] in ``odcfsdp/app/specs``). A pretrained
    one (a Hugging Face ``model.path``) is built on the meta device, so no rank holds the full
    model, and the spec's ``finish`` has each rank read only its slices of the files
    (``weights=False`` skips that read, for a checkpoint load that follows).
    """
    spec = model_spec(cfg.model.name)
    torch.manual_seed(cfg.run.seed)  # every rank builds the same initial model
    pretrained = spec.pretrained(cfg)
    with torch.device("meta" if pretrained else device):
        built = spec.build(cfg, vocab)
    flops, cost = cost_models(cfg, built)
    s = cfg.shard  # every key but replicas is an ODCShard argument ([shard-config]); the rest is runtime
    spans_hosts = capabilities(s.comm, device.type).spans_hosts
    model = ODCShard(built.model, **shard_arguments(s, built), device=device if pretrained else None,
                     timeout=cfg.run.timeout_s, mesh=hybrid_mesh(s.replicas, device.type, spans_hosts=spans_hosts))
    # The trainer divides each micro-batch's loss by the minibatch's global target count (``loop.train_step``), the
    # exact normalisation when ranks' token shares differ: the gradient it wants is the sum over ranks, not
    # ODCShard's default (FSDP2's) mean over them.
    model.set_gradient_divide_factor(1.0)
    if spec.finish is not None:
        spec.finish(model, cfg, weights=weights)
    return model, flops, cost


def optimizer_arguments(cfg: TrainConfig, device: torch.device, cls: type[torch.optim.Optimizer]) -> dict:
    """The keyword arguments of ``cls`` (``optim.name``'s class): the ``optim`` keys it takes, then ``optim.kwargs``.

    ``fused`` defaults to torch's fused kernels on CUDA (None otherwise: torch's own choice).
    """
    o = cfg.optim
    takes = optimizer_keywords(cls)
    named = {k: getattr(o, k) for k in OPTIMIZER_KEYS} | {
        "betas": tuple(o.betas), "fused": (device.type == "cuda" if o.fused is None else o.fused) or None}
    return {**{k: v for k, v in named.items() if k in takes}, **o.kwargs}


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, device: torch.device):
    """``optim.name``'s ``torch.optim`` class over ``param_groups`` (no decay for ``optim.no_decay``) and its
    ``LambdaLR`` schedule (default: ``torch.optim.AdamW``); with ``optim.park_state`` (the default) its state is
    kept on the host between steps where it does not fit on the GPU ([park-fit]), or ``optim.park_fraction`` of it."""
    o = cfg.optim
    cls = optimizer_class(o.name)
    opt = cls(param_groups(model, no_decay=list(o.no_decay)), **optimizer_arguments(cfg, device, cls))
    if o.park_state and not (cfg.shard.offload_policy and o.park_fraction is None):  # offloaded: on the host
        # its hooks park the state after each step ([parking]); the share that fits unless one is set ([park-fit])
        ParkedOptimizerState(opt, o.park_fraction, budget=o.park_budget)
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
