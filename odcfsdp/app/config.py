"""Structured configs of a training run (Hydra), one dataclass per concern.

Groups: model, data, balance, optim, shard, checkpoint, run. The tree is
registered in Hydra's ConfigStore as ``train``; every field can be
overridden on the command line (``balance.kind=lb_micro model.size=1b``) and swept
with ``--multirun``. Experiment presets live as YAML in the repository's
``configs/`` folder (``+experiment=<name>``). ``validate`` checks the values Hydra
cannot (choices, ranges, combinations) and names the key and the allowed values.
``resolve`` makes the values that follow from others explicit (``data.source=auto`` is jsonl
when ``data.path`` is set); ``unused_key`` says which keys a run does not read, for the
command line's checks of its overrides ([cli-keys] in ``cli.py``). Each field's trailing
comment is its one-line help (``--help`` prints it), so keep it to what the key does.

The ``shard`` group is derived from ``ODCShard``'s arguments ([derived-shard-config] in
``shard_config.py``); ``model.name``'s values and the checks of the keys each model reads
come from the model specs ([model-specs] in ``odcfsdp/app/specs``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..checks import choice, did_you_mean, in_range, positive
from ..data.balance import BALANCERS
from ..data.formats import FORMAT_CHOICES
from ..data.lengths import KINDS as LENGTH_KINDS
from ..data.lengths import LengthConfig
from ..optim import optimizer_class, optimizer_keywords
from .specs import model_specs
from .shard_config import OFFLOAD_CHOICES, ShardConfig
from ..sharding.transport import COMM_CHOICES, capabilities


@dataclass
class LoraSettings:
    """LoRA adapters through PEFT (``model.name=hf``): base weights frozen, only the adapters trained and pushed."""

    r: int = 0  # adapter rank; 0: no LoRA (every weight is trained)
    alpha: float = 16.0  # scale alpha / r of the adapters' product
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # names of the modules that get adapters
    export: str = "merged"  # run.export_hf writes: merged (a plain model, adapters folded in) | adapter (PEFT files)


@dataclass
class ModelConfig:
    """Which model: our Llama at a named size, or a Hugging Face causal LM from a local directory."""

    name: str = "llama"  # llama | hf: a spec of odcfsdp/app/specs (see [model-specs])
    size: str = "tiny"  # llama: tiny | 150m | 1b | 3b | 8b
    overrides: dict[str, Any] = field(default_factory=dict)  # any LlamaConfig field, e.g. {n_layers: 4}
    path: str | None = None  # name=hf: a local pretrained checkpoint (config.json + safetensors) to fine-tune
    hf_config: str | None = None  # name=hf: a local config.json (or its directory) to train from random weights
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (hf: HF's checkpointing)
    compile: bool = False  # torch.compile each decoder layer (llama: its dense parts; needs whole-layer units)
    lora: LoraSettings = field(default_factory=LoraSettings)  # name=hf: train LoRA adapters instead


@dataclass
class FieldsConfig:
    """A data file's own column names for the format fields ([data-formats] in odcfsdp/data/formats.py)."""

    text: str | None = None  # the column read as `text`
    messages: str | None = None  # the column read as `messages` (a list of {role, content})
    conversations: str | None = None  # the column read as ShareGPT's `conversations` (a list of {from, value})
    prompt: str | None = None  # the column read as `prompt`, e.g. data.fields.prompt=question
    completion: str | None = None  # the column read as `completion`, e.g. data.fields.completion=answer
    instruction: str | None = None  # the column read as Alpaca's `instruction`
    input: str | None = None  # the column read as Alpaca's `input`
    output: str | None = None  # the column read as Alpaca's `output`
    system: str | None = None  # the column read as `system` (a system prompt; sharegpt, alpaca)
    tools: str | None = None  # the column read as `tools` (JSON schemas of the tools offered)

    def mapping(self) -> dict[str, str]:
        """Format field name -> the file's column, for the fields that are set."""
        return {name: column for name, column in vars(self).items() if column}


@dataclass
class DataConfig:
    """Where samples come from and how a global minibatch is cut into micro-batches."""

    source: str = "auto"  # auto (jsonl when data.path is set, else synthetic) | synthetic | jsonl
    path: str | None = None  # a JSONL file of samples (implies data.source=jsonl)
    format: str = "auto"  # jsonl: auto (each record's fields) | messages | sharegpt | alpaca | prompt_completion | text
    fields: FieldsConfig = field(default_factory=FieldsConfig)  # jsonl: the file's own column names (see FieldsConfig)
    tokenizer_path: str | None = None  # jsonl: a local HF tokenizer (default: model.path's for name=hf, else bytes)
    eval_path: str | None = None  # a held-out JSONL file, evaluated every run.eval_interval steps
    vocab_size: int = 256  # synthetic: vocabulary of the Markov chain
    lengths: LengthConfig = field(default_factory=LengthConfig)  # synthetic
    prompt_fraction: float = 0.2  # synthetic: leading share of each sample without loss
    pool_tokens: int = 1 << 20  # synthetic: tokens generated once, samples are windows of it
    batch_size: int = 16  # samples per global minibatch (all ranks together)
    micro_batch_tokens: int = 512  # cap on positions per packed micro-batch; longer samples are truncated


@dataclass
class BalanceConfig:
    """How each minibatch is split over ranks (see odcfsdp/data/balance.py)."""

    kind: str = "lb_mini"  # none | lb_micro (equal micro-batch counts) | lb_mini (balanced cost; one-sided comm)
    cost_a: float | None = None  # cost per s^2; None: from the model's FLOPs (times attention_cost_factor)
    cost_b: float | None = None  # cost per s; None: from the model's FLOPs
    attention_cost_factor: float = 1.0  # an attention FLOP's time over a matmul FLOP's (1.8 fitted on H200, cuDNN)


#: ``optim`` keys that are keyword arguments of the optimizer (passed when its class takes them), not loop settings.
OPTIMIZER_KEYS = ("lr", "weight_decay", "betas", "eps", "fused")


@dataclass
class OptimConfig:
    """A ``torch.optim`` optimizer by name over ``odcfsdp.param_groups`` and its schedule (warm-up, then constant or
    cosine). Any other key ``optim.<k>=v`` on the command line is the optimizer's keyword argument ``k`` (kept in
    ``optim.kwargs``): ``optim.name=SGD optim.momentum=0.9``."""

    name: str = "AdamW"  # a torch.optim class with an element-wise step: AdamW | Adam | SGD | Adagrad | RMSprop | ...
    kwargs: dict[str, Any] = field(default_factory=dict)  # the optimizer's other keyword arguments: {momentum: 0.9}
    lr: float = 1e-2  # peak learning rate (the schedule scales it)
    weight_decay: float = 0.1  # of matrices (not optim.no_decay's); decoupled in AdamW, plain L2 in SGD and Adam
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # Adam-family moment decay rates
    eps: float = 1e-8  # Adam-family denominator term
    max_norm: float | None = 1.0  # clip the global gradient norm to this; None: no clipping (the norm is still logged)
    warmup_steps: int = 5  # linear warm-up of the learning rate over this many steps
    schedule: str = "cosine"  # after warm-up: constant | cosine (down to min_lr_ratio * lr at the last step)
    min_lr_ratio: float = 0.1  # schedule=cosine: the final learning rate over the peak
    no_decay: list[str] = field(default_factory=lambda: ["*norm*", "*bias"])  # parameter-name globs without decay
    fused: bool | None = None  # torch's fused optimizer kernels, where the optimizer has them; None: on CUDA


@dataclass
class CheckpointConfig:
    """Sharded checkpoints of the run (see odcfsdp/checkpoint)."""

    dir: str | None = None  # where checkpoints go; default: <run.out_dir>/checkpoints
    interval: int = 0  # save every this many steps (and at the last step); 0: never
    resume: str = "none"  # none | auto (the latest complete checkpoint in dir, if any) | <checkpoint path>
    keep_last: int = 3  # complete checkpoints kept; 0 keeps all


@dataclass
class RunConfig:
    """The run itself: length, seed, where it writes, how it is measured."""

    steps: int = 60  # optimizer steps (global minibatches) of the run; the schedule spans them
    epochs: float | None = None  # instead of run.steps: passes over the JSONL data (steps: ceil(epochs*samples/batch))
    stop_after: int | None = None  # stop after this step (as if preempted); the schedule still spans `steps`
    seed: int = 0  # model initialisation, data order and synthetic data
    out_dir: str = "runs/default"  # under --multirun, unless set: each job's own Hydra directory
    overwrite: bool = False  # start afresh in an out_dir that already holds a run (its metrics are replaced)
    world_size: int = 2  # ranks started on this machine when not under torchrun (CPU)
    device: str = "auto"  # auto | cpu | cuda
    peak_tflops: float | None = None  # per device, for MFU; None: 989 on H100/H200, no MFU on CPU
    warmup_steps: int = 2  # excluded from the run's summary throughput
    tensorboard: bool = False  # also log to TensorBoard when it is installed
    timeout_s: float = 300.0  # a rank waiting this long at a meeting, or for a silent (stopped) rank, ends the run naming it
    on_nonfinite: str = "stop"  # a non-finite loss or gradient norm: stop (non-zero exit) | skip (the minibatch)
    max_skipped: int = 3  # on_nonfinite=skip: stop after this many non-finite minibatches in a row
    eval_interval: int = 0  # evaluate the held-out loss on data.eval_path every this many steps (and at the end)
    export_hf: bool = False  # at the end, write a Hugging Face directory (weights, configs, tokenizer) to <out_dir>/hf


@dataclass
class TrainConfig:
    """A training run (``python -m odcfsdp.train``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


def register() -> None:
    """Register the config tree with Hydra (idempotent)."""
    ConfigStore.instance().store(name="train", node=TrainConfig)


def config_from(overrides: dict) -> TrainConfig:
    """A ``TrainConfig`` from nested override values (the defaults elsewhere), ``resolve``d."""
    return resolve(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), overrides)))


def checkpoint_dir(cfg: TrainConfig) -> Path:
    """Where the run's checkpoints go: ``checkpoint.dir``, else ``<run.out_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir or Path(cfg.run.out_dir) / "checkpoints")


def data_source(cfg: TrainConfig) -> str:
    """The data source the run reads: ``data.source``, where ``auto`` is jsonl when ``data.path`` is set."""
    if cfg.data.source == "auto":
        return "jsonl" if cfg.data.path else "synthetic"
    return cfg.data.source


def resolve(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the values that depend on others made explicit (``data.source=auto``); returns it."""
    cfg.data.source = data_source(cfg)
    return cfg


def _optimizer_checks(o: OptimConfig) -> None:
    """``optim.name`` is a torch.optim optimizer that takes every key of ``optim.kwargs``."""
    cls = optimizer_class(o.name)
    takes = optimizer_keywords(cls)
    named = {f.name for f in fields(OptimConfig)}
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


def validate(cfg: TrainConfig) -> None:
    """Raise ``ValueError`` naming the key and the allowed values for anything invalid."""
    specs = model_specs()
    choice("model.name", cfg.model.name, sorted(specs, key=lambda n: (n != ModelConfig.name, n)))  # default first
    specs[cfg.model.name].validate(cfg)  # the keys this model reads (model.size, model.path, ...)
    positive("model.lora.r", cfg.model.lora.r, allow_zero=True)
    choice("model.lora.export", cfg.model.lora.export, ("merged", "adapter"))
    if cfg.model.lora.r and not specs[cfg.model.name].lora:
        raise ValueError(f"model.lora.r > 0 needs model.name={'|'.join(n for n, s in specs.items() if s.lora)} "
                         "(adapters through PEFT)")
    choice("data.source", cfg.data.source, ("auto", "synthetic", "jsonl"))
    if cfg.data.source == "synthetic" and cfg.data.path:
        raise ValueError(f"data.path={cfg.data.path!r} is not read with data.source=synthetic: drop data.source "
                         "(a data.path means jsonl) or drop data.path")
    if cfg.data.source == "jsonl" and not cfg.data.path:
        raise ValueError("data.source=jsonl needs data.path=<file.jsonl>")
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
        if data_source(cfg) != "jsonl":
            raise ValueError("run.epochs needs a JSONL data.path (synthetic data has no end): use run.steps")
    if cfg.run.stop_after is not None:
        positive("run.stop_after", cfg.run.stop_after)
    positive("run.world_size", cfg.run.world_size)
    positive("run.eval_interval", cfg.run.eval_interval, allow_zero=True)
    choice("run.on_nonfinite", cfg.run.on_nonfinite, ("stop", "skip"))
    positive("run.timeout_s", cfg.run.timeout_s, allow_inf=True)  # inf: no watchdog
    positive("run.warmup_steps", cfg.run.warmup_steps, allow_zero=True)
    if not str(cfg.run.out_dir).strip():
        raise ValueError("run.out_dir is empty: give the directory the run writes to (default runs/default)")
    positive("run.max_skipped", cfg.run.max_skipped)
    if cfg.run.eval_interval and not cfg.data.eval_path:
        raise ValueError("run.eval_interval needs data.eval_path=<held-out file.jsonl>")
    if cfg.data.eval_path and data_source(cfg) != "jsonl":
        raise ValueError("data.eval_path needs data.source=jsonl (the held-out file is read with the same tokenizer)")
    choice("run.device", cfg.run.device, ("auto", "cpu", "cuda"))
    if not capabilities(cfg.shard.comm).uneven_micro_batches and cfg.balance.kind != "lb_micro":
        raise ValueError(
            f"shard.comm={cfg.shard.comm} needs equal micro-batch counts per rank: use balance.kind=lb_micro, "
            f"or a one-sided transport (shard.comm=auto) for balance.kind={cfg.balance.kind}"
        )


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def unused_key(cfg: TrainConfig, key: str) -> tuple[str, bool] | None:
    """Why the run ``cfg`` does not read ``key`` (a dotted config key), and whether that is an error; None when it
    reads it.

    An error (the command line refuses the override): a key of another kind of run, which can
    only be a mistake (``model.size`` of an HF model, ``optim.betas`` of SGD, ``data.vocab_size``
    of JSONL data). Not an error (the command line reports it and goes on): a setting of a mode
    that is off (``model.lora.alpha`` with ``model.lora.r=0``, ``optim.min_lr_ratio`` with a
    constant schedule, ``run.max_skipped`` with ``run.on_nonfinite=stop``), which a sweep over
    the mode holds on purpose.
    """
    source, name = data_source(cfg), cfg.model.name
    if source != "synthetic" and any(_under(key, f"data.{k}") for k in
                                     ("vocab_size", "lengths", "prompt_fraction", "pool_tokens")):
        return "it shapes synthetic data and this run reads data.path", True
    if source == "synthetic" and any(_under(key, f"data.{k}") for k in ("tokenizer_path", "format", "fields")):
        return "synthetic data is not read from a file (set data.path to train on a JSONL file)", True
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
    if key == "run.max_skipped" and cfg.run.on_nonfinite != "skip":
        return "only run.on_nonfinite=skip reads it", False
    return None
