"""Structured configs of a training run (Hydra), one dataclass per concern.

Groups: model, data, balance, optim, shard, checkpoint, run. The tree is
registered in Hydra's ConfigStore as ``train``; every field can be
overridden on the command line (``balance.kind=lb_micro model.size=1b``) and swept
with ``--multirun``. Experiment presets live as YAML in the repository's
``configs/`` folder (``+experiment=<name>``). ``validate`` checks the values Hydra
cannot (choices, ranges, combinations) and names the key and the allowed values.

The ``shard`` group is derived from ``ODCShard``'s arguments ([derived-shard-config] in
``shard_config.py``); ``model.name``'s values and the checks of the keys each model reads
come from the model specs ([model-specs] in ``odcfsdp/specs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from .checks import choice, positive
from .data.balance import BALANCERS
from .data.formats import FORMAT_CHOICES
from .data.lengths import KINDS as LENGTH_KINDS
from .data.lengths import LengthConfig
from .specs import model_specs
from .shard_config import OFFLOAD_CHOICES, ShardConfig
from .sharding.transport import COMM_CHOICES, capabilities


@dataclass
class LoraSettings:
    """LoRA adapters through PEFT (``model.name=hf``): base weights frozen, only the adapters trained and pushed."""

    r: int = 0  # adapter rank; 0: no LoRA (every weight is trained)
    alpha: float = 16.0  # scale alpha / r of the adapters' product
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    export: str = "merged"  # run.export_hf writes: merged (a plain model, adapters folded in) | adapter (PEFT files)


@dataclass
class ModelConfig:
    """Which model: our Llama at a named size, or a Hugging Face causal LM from a local directory."""

    name: str = "llama"  # llama | hf: a spec of odcfsdp/specs (see [model-specs])
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

    source: str = "synthetic"  # synthetic | jsonl
    path: str | None = None  # jsonl: the file
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

    kind: str = "lb_mini"  # none | lb_micro | lb_mini
    cost_a: float | None = None  # cost per s^2; None: from the model's FLOPs (times attention_cost_factor)
    cost_b: float | None = None  # cost per s; None: from the model's FLOPs
    attention_cost_factor: float = 1.0  # an attention FLOP's time over a matmul FLOP's (1.8 fitted on H200, cuDNN)


@dataclass
class OptimConfig:
    """``torch.optim.AdamW`` over ``odcfsdp.param_groups`` and its schedule (linear warm-up, then constant or cosine)."""

    lr: float = 1e-2
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_norm: float | None = 1.0
    warmup_steps: int = 5
    schedule: str = "cosine"  # constant | cosine
    min_lr_ratio: float = 0.1
    no_decay: list[str] = field(default_factory=lambda: ["*norm*", "*bias"])
    fused: bool | None = None  # torch's fused AdamW kernels; None: on CUDA


@dataclass
class CheckpointConfig:
    """Sharded checkpoints of the run (see odcfsdp/checkpoint)."""

    dir: str | None = None  # default: <run.out_dir>/checkpoints
    interval: int = 0  # save every this many steps (and at the last step); 0: never
    resume: str = "none"  # none | auto (the latest complete checkpoint in dir, if any) | <checkpoint path>
    keep_last: int = 3  # complete checkpoints kept; 0 keeps all


@dataclass
class RunConfig:
    """The run itself: length, seed, where it writes, how it is measured."""

    steps: int = 60
    stop_after: int | None = None  # stop after this step (as if preempted); the schedule still spans `steps`
    seed: int = 0
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
    """A ``TrainConfig`` from nested override values (the defaults elsewhere)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), overrides))


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
    choice("data.source", cfg.data.source, ("synthetic", "jsonl"))
    if cfg.data.source == "jsonl" and not cfg.data.path:
        raise ValueError("data.source=jsonl needs data.path=<file.jsonl>")
    choice("data.format", cfg.data.format, FORMAT_CHOICES)
    choice("data.lengths.kind", cfg.data.lengths.kind, LENGTH_KINDS)
    positive("data.batch_size", cfg.data.batch_size)
    positive("data.micro_batch_tokens", cfg.data.micro_batch_tokens)
    positive("data.vocab_size", cfg.data.vocab_size)
    choice("balance.kind", cfg.balance.kind, BALANCERS)
    choice("optim.schedule", cfg.optim.schedule, ("constant", "cosine"))
    positive("optim.lr", cfg.optim.lr, allow_zero=True)
    if len(cfg.optim.betas) != 2:
        raise ValueError(f"optim.betas must hold two values, got {list(cfg.optim.betas)}")
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
    if cfg.run.stop_after is not None:
        positive("run.stop_after", cfg.run.stop_after)
    positive("run.world_size", cfg.run.world_size)
    positive("run.eval_interval", cfg.run.eval_interval, allow_zero=True)
    choice("run.on_nonfinite", cfg.run.on_nonfinite, ("stop", "skip"))
    positive("run.timeout_s", cfg.run.timeout_s)
    positive("run.max_skipped", cfg.run.max_skipped)
    if cfg.run.eval_interval and not cfg.data.eval_path:
        raise ValueError("run.eval_interval needs data.eval_path=<held-out file.jsonl>")
    if cfg.data.eval_path and cfg.data.source != "jsonl":
        raise ValueError("data.eval_path needs data.source=jsonl (the held-out file is read with the same tokenizer)")
    choice("run.device", cfg.run.device, ("auto", "cpu", "cuda"))
    if not capabilities(cfg.shard.comm).uneven_micro_batches and cfg.balance.kind != "lb_micro":
        raise ValueError(
            f"shard.comm={cfg.shard.comm} needs equal micro-batch counts per rank: use balance.kind=lb_micro, "
            f"or a one-sided transport (shard.comm=auto) for balance.kind={cfg.balance.kind}"
        )
