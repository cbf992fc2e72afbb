"""The checks of a training run's config (``odcfsdp.app.config`` re-exports them): ``validate`` checks the values
Hydra cannot (choices, ranges, combinations) and names the key and the allowed values; ``unused_key`` says which
keys a run does not read ([cli-keys] in ``cli.py``). What depends on the data source comes from its registration
([data-sources] in ``sources.py``).

The config is read by attribute (this module sits below ``config``, which imports it).
"""

from __future__ import annotations

import math
import os
from dataclasses import fields

from ..checks import choice, did_you_mean, in_range, positive
from ..data.balance import BALANCERS
from ..data.formats import FORMAT_CHOICES
from ..data.lengths import KINDS as LENGTH_KINDS
from ..optim import optimizer_class, optimizer_keywords
from ..sharding.transport import COMM_CHOICES, capabilities
from .shard_config import FLOAT8_CHOICES, OFFLOAD_CHOICES
from .sources import SOURCES, source_choices, source_of
from .specs import model_specs

#: ``optim`` keys that are keyword arguments of the optimizer (passed when its class takes them), not loop settings.
OPTIMIZER_KEYS = ("lr", "weight_decay", "betas", "eps", "fused")


def _optimizer_checks(o) -> None:
    """``optim.name`` is a torch.optim optimizer that takes every key of ``optim.kwargs``."""
    cls = optimizer_class(o.name)
    takes = optimizer_keywords(cls)
    named = {f.name for f in fields(o)}
    for key in o.kwargs:
        if key in named:
            raise ValueError(f"optim.kwargs.{key} repeats the key optim.{key}: set optim.{key} instead")
        if key not in takes:
            hint = did_you_mean(key, sorted(named - {"kwargs"} | set(takes)), prefix="optim.")
            raise ValueError(f"optim.{key} is not a key of optim nor an argument of torch.optim.{o.name}: {hint}"
                             f"its arguments are {takes}")


def _length_checks(lengths) -> None:
    """Synthetic sample lengths: positive bounds in order, a finite spread."""
    positive("data.lengths.min_len", lengths.min_len)
    positive("data.lengths.max_len", lengths.max_len)
    if lengths.min_len > lengths.max_len:
        raise ValueError(f"data.lengths.min_len={lengths.min_len} must be <= data.lengths.max_len={lengths.max_len}")
    positive("data.lengths.median", lengths.median)
    positive("data.lengths.sigma", lengths.sigma, allow_zero=True)
    if any(not math.isfinite(w) or w < 0 for w in lengths.weights) or not sum(lengths.weights) > 0:
        raise ValueError(f"data.lengths.weights={list(lengths.weights)} must be finite, >= 0 and not all 0")


def validate(cfg) -> None:
    """Raise ``ValueError`` naming the key and the allowed values for anything invalid."""
    specs = model_specs()
    choice("model.name", cfg.model.name, sorted(specs, key=lambda n: (n != type(cfg.model).name, n)))  # default first
    specs[cfg.model.name].validate(cfg)  # the keys this model reads (model.size, model.path, ...)
    positive("model.lora.r", cfg.model.lora.r, allow_zero=True)
    choice("model.lora.export", cfg.model.lora.export, ("merged", "adapter"))
    if cfg.model.lora.r and not specs[cfg.model.name].lora:
        raise ValueError(f"model.lora.r > 0 needs model.name={'|'.join(n for n, s in specs.items() if s.lora)} "
                         "(adapters through PEFT)")
    choice("data.source", cfg.data.source, source_choices())
    if cfg.data.source != "auto":  # auto is by definition what the keys given mean
        SOURCES[cfg.data.source].validate(cfg)
    choice("data.format", cfg.data.format, FORMAT_CHOICES)
    choice("data.lengths.kind", cfg.data.lengths.kind, LENGTH_KINDS)
    positive("data.batch_size", cfg.data.batch_size)
    if cfg.data.micro_batch_tokens < 2:  # one position predicts nothing: a micro-batch needs an input and a target
        raise ValueError(f"data.micro_batch_tokens={cfg.data.micro_batch_tokens!r} must be >= 2")
    positive("data.vocab_size", cfg.data.vocab_size)
    positive("data.pool_tokens", cfg.data.pool_tokens)
    in_range("data.prompt_fraction", cfg.data.prompt_fraction, 0, 1, hi_open=True)
    _length_checks(cfg.data.lengths)
    choice("balance.kind", cfg.balance.kind, BALANCERS)
    for key in ("cost_a", "cost_b"):
        if getattr(cfg.balance, key) is not None:
            positive(f"balance.{key}", getattr(cfg.balance, key), allow_zero=True)
    positive("balance.attention_cost_factor", cfg.balance.attention_cost_factor)
    _optimizer_checks(cfg.optim)
    choice("optim.schedule", cfg.optim.schedule, ("constant", "cosine"))
    positive("optim.lr", cfg.optim.lr, allow_zero=True)
    positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    positive("optim.eps", cfg.optim.eps, allow_zero=True)
    if cfg.optim.max_norm is not None:
        positive("optim.max_norm", cfg.optim.max_norm)
    positive("optim.warmup_steps", cfg.optim.warmup_steps, allow_zero=True)
    in_range("optim.min_lr_ratio", cfg.optim.min_lr_ratio, 0, 1)
    if len(cfg.optim.betas) != 2:
        raise ValueError(f"optim.betas must hold two values, got {list(cfg.optim.betas)}")
    for i, beta in enumerate(cfg.optim.betas):
        in_range(f"optim.betas[{i}]", beta, 0, 1, hi_open=True)
    choice("shard.comm", cfg.shard.comm, COMM_CHOICES)
    choice("shard.offload_policy", cfg.shard.offload_policy, OFFLOAD_CHOICES)
    if cfg.shard.offload_policy and cfg.shard.gather_masters:
        raise ValueError("shard.gather_masters=true keeps the masters where peers read them; shard.offload_policy "
                         "moves them to host memory: choose one")
    if cfg.shard.split_masters:  # [split-masters]: fp32 masters on the device, split into bf16 rows and low bits
        import torch  # "auto" is CUDA where there is one

        cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
        # None: bf16 on CUDA, the parameters' own dtype on the CPU (fp32)
        dtype = cfg.shard.param_dtype or cfg.shard.mp_policy.param_dtype or ("bfloat16" if cuda else None)
        if cfg.shard.gather_masters or cfg.shard.offload_policy or dtype != "bfloat16":
            raise ValueError("shard.split_masters=true splits fp32 masters on the device into bf16 rows and low bits: "
                             "it needs shard.param_dtype=bfloat16 (the default on CUDA), and neither "
                             "shard.gather_masters nor shard.offload_policy")
    if cfg.shard.offload_policy and cfg.optim.park_state and cfg.optim.park_fraction is not None:
        raise ValueError("optim.park_fraction parks the optimizer's state on the host between steps; with "
                         "shard.offload_policy=cpu it lives there already: leave optim.park_fraction unset")
    if cfg.optim.park_fraction is not None and not 0.0 < cfg.optim.park_fraction <= 1.0:
        raise ValueError(f"optim.park_fraction={cfg.optim.park_fraction}: the share of the optimizer's state parked "
                         "on the host is in (0, 1] (null: the share that fits, measured)")
    if not 0.0 < cfg.optim.park_budget <= 1.0:
        raise ValueError(f"optim.park_budget={cfg.optim.park_budget}: the share of the GPU's memory the peak may "
                         "reach is in (0, 1]")
    choice("shard.float8", cfg.shard.float8, FLOAT8_CHOICES)
    choice("shard.param_dtype", cfg.shard.param_dtype, (None, "float32", "bfloat16", "float16"))
    positive("shard.group_bytes", cfg.shard.group_bytes)
    positive("shard.prefetch", cfg.shard.prefetch, allow_zero=True)
    if cfg.shard.replicas is not None:
        positive("shard.replicas", cfg.shard.replicas)
        if "RANK" not in os.environ and cfg.run.world_size % cfg.shard.replicas:
            raise ValueError(f"shard.replicas={cfg.shard.replicas} must divide run.world_size={cfg.run.world_size} "
                             "(every replica shards over the same number of ranks)")
    positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    positive("checkpoint.keep_last", cfg.checkpoint.keep_last, allow_zero=True)
    if not cfg.checkpoint.resume:
        raise ValueError("checkpoint.resume must be none, auto or a checkpoint path")
    positive("run.steps", cfg.run.steps)
    if cfg.run.epochs is not None:
        positive("run.epochs", cfg.run.epochs)
        if not source_of(cfg).finite:
            raise ValueError("run.epochs needs a JSONL data.path (synthetic data has no end): use run.steps")
    if cfg.run.stop_after is not None:
        positive("run.stop_after", cfg.run.stop_after)
    positive("run.world_size", cfg.run.world_size)
    positive("run.eval_interval", cfg.run.eval_interval, allow_zero=True)
    positive("run.gc_every", cfg.run.gc_every, allow_zero=True)
    choice("run.on_nonfinite", cfg.run.on_nonfinite, ("stop", "skip"))
    positive("run.timeout_s", cfg.run.timeout_s, allow_inf=True)  # inf: no watchdog
    positive("run.warmup_steps", cfg.run.warmup_steps, allow_zero=True)
    if not str(cfg.run.out_dir).strip():
        raise ValueError("run.out_dir is empty: give the directory the run writes to (default runs/default)")
    positive("run.max_skipped", cfg.run.max_skipped)
    if cfg.run.eval_interval and not cfg.data.eval_path:
        raise ValueError("run.eval_interval needs data.eval_path=<held-out file.jsonl>")
    if cfg.data.eval_path and not source_of(cfg).held_out:
        takes = "|".join(n for n, s in SOURCES.items() if s.held_out)
        raise ValueError(f"data.eval_path needs data.source={takes} (the held-out file is read with the same "
                         "tokenizer)")
    choice("run.device", cfg.run.device, ("auto", "cpu", "cuda"))
    if not capabilities(cfg.shard.comm).uneven_micro_batches and cfg.balance.kind != "lb_micro":
        raise ValueError(
            f"shard.comm={cfg.shard.comm} needs equal micro-batch counts per rank: use balance.kind=lb_micro, "
            f"or a one-sided transport (shard.comm=auto) for balance.kind={cfg.balance.kind}"
        )


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def unused_key(cfg, key: str) -> tuple[str, bool] | None:
    """Why the run ``cfg`` does not read ``key`` (a dotted config key), and whether that is an error; None when it
    reads it.

    An error (the command line refuses the override): a key of another kind of run, which can
    only be a mistake (``model.size`` of an HF model, ``optim.betas`` of SGD, ``data.vocab_size``
    of JSONL data). Not an error (the command line reports it and goes on): a setting of a mode
    that is off (``model.lora.alpha`` with ``model.lora.r=0``, ``optim.min_lr_ratio`` with a
    constant schedule, ``run.max_skipped`` with ``run.on_nonfinite=stop``), which a sweep over
    the mode holds on purpose.
    """
    source, name = source_of(cfg), cfg.model.name
    others = {k for s in SOURCES.values() if s is not source for k in s.reads} - set(source.reads)
    if any(_under(key, f"data.{k}") for k in others):
        return source.unread, True
    specs = model_specs()
    model_key = key.split(".")[1] if key.startswith("model.") and key.count(".") else None
    if model_key in {k for s in specs.values() for k in s.reads} - set(specs[name].reads):
        readers = "|".join(n for n, s in specs.items() if model_key in s.reads)
        return f"only model.name={readers} reads it, this run has model.name={name}", True
    if key.startswith("optim.") and key.split(".")[1] in OPTIMIZER_KEYS:
        arg = key.split(".")[1]
        if arg not in optimizer_keywords(optimizer_class(cfg.optim.name)):
            return f"torch.optim.{cfg.optim.name} takes no argument {arg!r}", True
    if key.startswith("model.lora.") and key != "model.lora.r" and not cfg.model.lora.r:
        return "LoRA is off (model.lora.r > 0 turns it on)", False
    if key == "optim.min_lr_ratio" and cfg.optim.schedule != "cosine":
        return "only optim.schedule=cosine reads it", False
    if key in ("optim.park_fraction", "optim.park_budget") and not cfg.optim.park_state:
        return "only optim.park_state=true reads it", False
    if key == "optim.park_budget" and cfg.optim.park_fraction is not None:
        return "only optim.park_fraction=null (the share that fits) reads it", False
    if key == "run.max_skipped" and cfg.run.on_nonfinite != "skip":
        return "only run.on_nonfinite=skip reads it", False
    return None
