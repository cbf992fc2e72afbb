"""Structured configs of a training run (Hydra), one dataclass per concern.

Groups: model, data, balance, optim, shard, checkpoint, run. The tree is
registered in Hydra's ConfigStore as ``train``; every field can be
overridden on the command line (``balance.kind=lb_micro model.size=1b``) and swept
with ``--multirun``. Experiment presets live as YAML in the repository's
``configs/`` folder (``+experiment=<name>``). ``validate`` checks the values Hydra
cannot (choices, ranges, combinations) and names the key and the allowed values.
``resolve`` makes the values that follow from others explicit (``data.source=auto`` is jsonl
when ``data.path`` is set); ``unused_key`` says which keys a run does not read, for the
command line's checks of its overrides ([cli-keys] in ``cli.py``). Both live in
``validation.py`` and are re-exported here.

Design note [config-docs]
-------------------------
Each field is documented by the string literal right below it, as torchtitan's job_config
does: the one help of the key (``--help`` prints its first sentence; ``odcfsdp.checks.field_docs``
reads them from the class's source), so keep it to what the key does. Type checkers see
every field with its type and default.

The ``shard`` group mirrors ``ODCShard``'s arguments ([shard-config] in
``shard_config.py``); ``model.name``'s values and the checks of the keys each model reads
come from the model specs ([model-specs] in ``odcfsdp/app/specs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..data.lengths import LengthConfig
from .shard_config import ShardConfig
from .sources import data_source
from .validation import OPTIMIZER_KEYS, unused_key, validate

__all__ = [
    "BalanceConfig", "CheckpointConfig", "DataConfig", "FieldsConfig", "LoraSettings", "ModelConfig",
    "OPTIMIZER_KEYS", "OptimConfig", "RunConfig", "ShardConfig", "TrainConfig", "checkpoint_dir", "config_from",
    "data_source", "register", "resolve", "unused_key", "validate",
]


@dataclass
class LoraSettings:
    """LoRA adapters through PEFT (``model.name=hf``): base weights frozen, only the adapters trained and pushed."""

    r: int = 0
    """adapter rank; 0: no LoRA (every weight is trained)"""
    alpha: float = 16.0
    """scale alpha / r of the adapters' product"""
    dropout: float = 0.0
    """dropout on the adapters' input"""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """names of the modules that get adapters"""
    export: str = "merged"
    """run.export_hf writes: merged (a plain model, adapters folded in) | adapter (PEFT files)"""


@dataclass
class ModelConfig:
    """Which model: our Llama at a named size, or a Hugging Face causal LM from a local directory."""

    name: str = "llama"
    """llama | hf: a spec of odcfsdp/app/specs (see [model-specs])"""
    size: str = "tiny"
    """llama: tiny | 150m | 1b | 3b | 8b | 14b"""
    overrides: dict[str, Any] = field(default_factory=dict)
    """any LlamaConfig field, e.g. {n_layers: 4}"""
    path: str | None = None
    """name=hf: a local pretrained checkpoint (config.json + safetensors) to fine-tune"""
    hf_config: str | None = None
    """name=hf: a local config.json (or its directory) to train from random weights"""
    activation_checkpointing: bool = False
    """recompute each decoder layer in backward (hf: HF's checkpointing)"""
    compile: bool = False
    """torch.compile each decoder layer (llama: its dense parts; needs whole-layer units)"""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """name=hf: train LoRA adapters instead"""


@dataclass
class FieldsConfig:
    """A data file's own column names for the format fields ([data-formats] in odcfsdp/data/formats.py)."""

    text: str | None = None
    """the column read as `text`"""
    messages: str | None = None
    """the column read as `messages` (a list of {role, content})"""
    conversations: str | None = None
    """the column read as ShareGPT's `conversations` (a list of {from, value})"""
    prompt: str | None = None
    """the column read as `prompt`, e.g. data.fields.prompt=question"""
    completion: str | None = None
    """the column read as `completion`, e.g. data.fields.completion=answer"""
    instruction: str | None = None
    """the column read as Alpaca's `instruction`"""
    input: str | None = None
    """the column read as Alpaca's `input`"""
    output: str | None = None
    """the column read as Alpaca's `output`"""
    system: str | None = None
    """the column read as `system` (a system prompt; sharegpt, alpaca)"""
    tools: str | None = None
    """the column read as `tools` (JSON schemas of the tools offered)"""

    def mapping(self) -> dict[str, str]:
        """Format field name -> the file's column, for the fields that are set."""
        return {name: column for name, column in vars(self).items() if column}


@dataclass
class DataConfig:
    """Where samples come from and how a global minibatch is cut into micro-batches."""

    source: str = "auto"
    """auto (jsonl when data.path is set, else synthetic) | synthetic | jsonl"""
    path: str | None = None
    """a JSONL file of samples (implies data.source=jsonl)"""
    format: str = "auto"
    """jsonl: auto (each record's fields) | messages | sharegpt | alpaca | prompt_completion | text"""
    fields: FieldsConfig = field(default_factory=FieldsConfig)
    """jsonl: the file's own column names (see FieldsConfig)"""
    tokenizer_path: str | None = None
    """jsonl: a local HF tokenizer (default: model.path's for name=hf, else bytes)"""
    eval_path: str | None = None
    """a held-out JSONL file, evaluated every run.eval_interval steps"""
    vocab_size: int = 256
    """synthetic: vocabulary of the Markov chain"""
    lengths: LengthConfig = field(default_factory=LengthConfig)
    """synthetic"""
    prompt_fraction: float = 0.2
    """synthetic: leading share of each sample without loss"""
    pool_tokens: int = 1 << 20
    """synthetic: tokens generated once, samples are windows of it"""
    batch_size: int = 16
    """samples per global minibatch (all ranks together)"""
    micro_batch_tokens: int = 512
    """cap on positions per packed micro-batch; longer samples are truncated"""


@dataclass
class BalanceConfig:
    """How each minibatch is split over ranks (see odcfsdp/data/balance.py)."""

    kind: str = "lb_mini"
    """none | lb_micro (equal micro-batch counts) | lb_mini (balanced cost; one-sided comm)"""
    cost_a: float | None = None
    """cost per s^2; None: from the model's FLOPs (times attention_cost_factor)"""
    cost_b: float | None = None
    """cost per s; None: from the model's FLOPs"""
    attention_cost_factor: float = 1.0
    """an attention FLOP's time over a matmul FLOP's (1.8 fitted on H200, cuDNN)"""


@dataclass
class OptimConfig:
    """A ``torch.optim`` optimizer by name over ``odcfsdp.param_groups`` and its schedule (warm-up, then constant or
    cosine). Any other key ``optim.<k>=v`` on the command line is the optimizer's keyword argument ``k`` (kept in
    ``optim.kwargs``): ``optim.name=SGD optim.momentum=0.9``."""

    name: str = "AdamW"
    """a torch.optim class with an element-wise step: AdamW | Adam | SGD | Adagrad | RMSprop | ..."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """the optimizer's other keyword arguments: {momentum: 0.9}"""
    lr: float = 1e-2
    """peak learning rate (the schedule scales it)"""
    weight_decay: float = 0.1
    """of matrices (not optim.no_decay's); decoupled in AdamW, plain L2 in SGD and Adam"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam-family moment decay rates"""
    eps: float = 1e-8
    """Adam-family denominator term"""
    max_norm: float | None = 1.0
    """clip the global gradient norm to this; None: no clipping (the norm is still logged)"""
    warmup_steps: int = 5
    """linear warm-up of the learning rate over this many steps"""
    schedule: str = "cosine"
    """after warm-up: constant | cosine (down to min_lr_ratio * lr at the last step)"""
    min_lr_ratio: float = 0.1
    """schedule=cosine: the final learning rate over the peak"""
    no_decay: list[str] = field(default_factory=lambda: ["*norm*", "*bias"])
    """parameter-name globs without decay"""
    fused: bool | None = None
    """torch's fused optimizer kernels, where the optimizer has them; None: on CUDA"""
    park_state: bool = True
    """keep the optimizer's state in host memory between steps (odcfsdp.optim.ParkedOptimizerState): 8 bytes per
    parameter and rank less on the GPU during forward and backward (AdamW), for copies over PCIe at each step;
    with park_fraction=null only what does not fit is parked (nothing while the run fits, nothing on CPU)"""
    park_fraction: float | None = None
    """park_state=true: the share of the state's bytes parked, in (0, 1] (the rest stays on the GPU); null: the
    least share that keeps the GPU's peak under optim.park_budget of its memory, from the measured peaks"""
    park_budget: float = 0.9
    """park_state=true, park_fraction=null: the share of the GPU's memory the peak may reach, in (0, 1]"""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints of the run (see odcfsdp/checkpoint)."""

    dir: str | None = None
    """where checkpoints go; default: <run.out_dir>/checkpoints"""
    interval: int = 0
    """save every this many steps (and at the last step); 0: never"""
    resume: str = "none"
    """none | auto (the latest complete checkpoint in dir, if any) | <checkpoint path>"""
    keep_last: int = 3
    """complete checkpoints kept; 0 keeps all"""


@dataclass
class RunConfig:
    """The run itself: length, seed, where it writes, how it is measured."""

    steps: int = 60
    """optimizer steps (global minibatches) of the run; the schedule spans them"""
    epochs: float | None = None
    """instead of run.steps: passes over the JSONL data (steps: ceil(epochs*samples/batch))"""
    stop_after: int | None = None
    """stop after this step (as if preempted); the schedule still spans `steps`"""
    seed: int = 0
    """model initialisation, data order and synthetic data"""
    out_dir: str = "runs/default"
    """under --multirun, unless set: each job's own Hydra directory"""
    overwrite: bool = False
    """start afresh in an out_dir that already holds a run (its metrics are replaced)"""
    world_size: int = 2
    """ranks started on this machine when not under torchrun (CPU)"""
    device: str = "auto"
    """auto | cpu | cuda"""
    peak_tflops: float | None = None
    """per device, for MFU; None: 989 on H100/H200, no MFU on CPU"""
    warmup_steps: int = 2
    """excluded from the run's summary throughput"""
    tensorboard: bool = False
    """also log to TensorBoard when it is installed"""
    gc_every: int = 50
    """Python's cycle collector runs every this many steps, between steps, automatic collection off (torchtitan's
    training.gc_freq, [step-gc]); 0: Python's automatic collection"""
    timeout_s: float = 300.0
    """a rank waiting this long at a meeting, or for a silent (stopped) rank, ends the run naming it"""
    on_nonfinite: str = "stop"
    """a non-finite loss or gradient norm: stop (non-zero exit) | skip (the minibatch)"""
    max_skipped: int = 3
    """on_nonfinite=skip: stop after this many non-finite minibatches in a row"""
    eval_interval: int = 0
    """evaluate the held-out loss on data.eval_path every this many steps (and at the end)"""
    export_hf: bool = False
    """at the end, write a Hugging Face directory (weights, configs, tokenizer) to <out_dir>/hf"""


@dataclass
class TrainConfig:
    """A training run (``python -m odcfsdp.train``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """the model (``model.*``)"""
    data: DataConfig = field(default_factory=DataConfig)
    """the samples and their micro-batches (``data.*``)"""
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """the split of each minibatch over ranks (``balance.*``)"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """the optimizer and its schedule (``optim.*``)"""
    shard: ShardConfig = field(default_factory=ShardConfig)
    """ODCShard's arguments (``shard.*``)"""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """sharded checkpoints (``checkpoint.*``)"""
    run: RunConfig = field(default_factory=RunConfig)
    """the run itself (``run.*``)"""


def register() -> None:
    """Register the config tree with Hydra (idempotent)."""
    ConfigStore.instance().store(name="train", node=TrainConfig)


def config_from(overrides: dict) -> TrainConfig:
    """A ``TrainConfig`` from nested override values (the defaults elsewhere), ``resolve``d."""
    return resolve(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), overrides)))


def checkpoint_dir(cfg: TrainConfig) -> Path:
    """Where the run's checkpoints go: ``checkpoint.dir``, else ``<run.out_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir or Path(cfg.run.out_dir) / "checkpoints")


def resolve(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the values that depend on others made explicit (``data.source=auto``); returns it."""
    cfg.data.source = data_source(cfg)
    return cfg
