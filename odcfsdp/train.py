"""Training entry point: ``python -m odcfsdp.train [key=value ...]`` (Hydra; see ``odcfsdp/config.py``).

With no arguments it trains a tiny Llama on long-tailed synthetic SFT data with 2
CPU ranks that it starts itself (gloo + the shm transport), prints a progress bar
and writes ``runs/default/metrics.jsonl``. Under ``torchrun`` it uses the ranks
torchrun started (NCCL + nvshmem on GPUs).

Each step is ``odcfsdp.loop``'s (the standard PyTorch loop: micro-batches, then
``clip_grad_norm_``, ``torch.optim.AdamW``, the LR schedule, ``zero_grad``); per-rank
compute and wait times, the loss and the throughput are gathered once afterwards and
written by rank 0.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
import warnings
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from .checkpoint import (
    CheckpointError, export_pretrained, latest_checkpoint, load_checkpoint, load_hf, read_manifest, save_checkpoint,
)
from .config import TrainConfig, register, validate
from .data.balance import CostModel
from .data.jsonl import JsonlSource
from .data.lengths import LengthDistribution
from .data.synthetic import SyntheticSFT
from .data.tokenizer import load_tokenizer
from .launch import init_torchrun, spawn
from .loop import evaluate, gather_stats, plan_step, train_step
from .metrics import MetricsWriter, ProgressBar, json_safe
from .mfu import mfu, peak_tflops
from .models.llama import Llama, llama_config
from .optim import param_groups
from .preflight import preflight
from .schedule import warmup_cosine
from .sharding import ODCShard
from .sharding.hsdp import hybrid_mesh
from .sharding.transport import is_one_sided

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


# -- building blocks ---------------------------------------------------------------------------
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


def _device(cfg: TrainConfig) -> torch.device:
    want = cfg.run.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("run.device=cuda but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _peak_memory_gib(device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return rss, rss


# -- the loop -------------------------------------------------------------------------------------
def train(cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` on the current process group; return the per-step metrics (on every rank)."""
    validate(cfg)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = _device(cfg)
    source, vocab = build_source(cfg)
    model, flops, cost = build_sharded_model(cfg, vocab, device)
    if model.mesh.replicas > 1 and rank == 0:
        print(f"hybrid sharding: {model.mesh.replicas} replicas x {model.world_size} ranks "
              f"(shard.replicas; comm={model.transport.name} within a replica)", file=sys.stderr)
    held_out = None
    if cfg.data.eval_path:
        held_out = JsonlSource(cfg.data.eval_path, load_tokenizer(tokenizer_path(cfg)), cfg.data.micro_batch_tokens + 1)
    opt, sched = build_optimizer(cfg, model, device)
    peak = peak_tflops(device, cfg.run.peak_tflops)
    ck = cfg.checkpoint
    ck_dir = Path(ck.dir or Path(cfg.run.out_dir) / "checkpoints")
    start = resume(cfg, ck_dir, model, opt, sched)

    writer = MetricsWriter(cfg.run.out_dir, cfg.run.tensorboard, first_step=start + 1) if rank == 0 else None
    if writer:
        (writer.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    bar = ProgressBar(cfg.run.steps, first_step=start + 1) if rank == 0 else None
    cap, batch = cfg.data.micro_batch_tokens, cfg.data.batch_size
    metrics = []
    end = min(cfg.run.steps, cfg.run.stop_after or cfg.run.steps)
    nonfinite: list[int] = []  # steps whose update was not applied
    in_a_row, stopped, preempted = 0, None, None
    terminate = _TerminationFlag()  # SIGTERM: finish this step, checkpoint, exit cleanly (every rank alike)
    for step in range(start, end):
        minibatch = plan_step(source, step, batch, cap, cfg.balance.kind, cost, rank, world)
        model.begin_minibatch(len(minibatch.mine))  # the collective transport checks equal counts here
        lr = sched.get_last_lr()[0]
        out = train_step(model, opt, sched, minibatch, device, max_norm=cfg.optim.max_norm)
        my_sizes = minibatch.my_sizes()
        table = gather_stats([out["loss"], out["compute_s"], model.sync_wait_s, len(minibatch.mine),
                              sum(my_sizes), sum(map(flops, my_sizes)), out["compute_s"] + out["step_s"],
                              float(terminate.raised)],
                             model.mesh.device, model.mesh.everyone.group)  # the termination flag rides along: no extra meeting
        step_wall = table[:, 6].max().item()
        tokens = int(table[:, 4].sum())
        alloc, reserved = _peak_memory_gib(device)
        row = {
            "step": step + 1, "loss": table[:, 0].sum().item(), "grad_norm": out["grad_norm"], "lr": lr,
            "tokens": tokens, "target_tokens": minibatch.global_targets, "step_s": step_wall,
            "tokens_per_s": tokens / step_wall, "mfu": mfu(table[:, 5].sum().item(), step_wall, peak, world),
            "peak_alloc_gib": alloc, "peak_reserved_gib": reserved,
            "rank_compute_s": table[:, 1].tolist(), "rank_wait_s": table[:, 2].tolist(),
            "rank_micro_batches": [int(x) for x in table[:, 3].tolist()],
        }
        in_a_row = 0 if out["finite"] else in_a_row + 1
        if not out["finite"]:
            row["nonfinite"] = True
            nonfinite.append(step + 1)
            if cfg.run.on_nonfinite == "stop" or in_a_row >= cfg.run.max_skipped:
                stopped = (f"step {step + 1}: non-finite loss or gradient norm (loss {row['loss']}, grad norm "
                           f"{out['grad_norm']}); the update was not applied and the run stops"
                           + (f" after {in_a_row} such minibatches in a row (run.max_skipped)"
                              if cfg.run.on_nonfinite == "skip" else
                              " (run.on_nonfinite=skip skips such minibatches instead)"))
        if held_out is not None and not stopped and ((step + 1) % cfg.run.eval_interval == 0 or step + 1 == end):
            row["eval_loss"] = evaluate(model, held_out, cap, device, rank, world, model.mesh.everyone.group)
        metrics.append(row)
        if writer:
            writer.write(row)
            bar.update(row)
        if stopped:  # no checkpoint of this step, no export: the weights are the last finite update's
            break
        if table[:, 7].max().item() > 0 and step + 1 < end:  # some rank got SIGTERM: all stop after this step
            preempted = step + 1
        if (ck.interval and ((step + 1) % ck.interval == 0 or step + 1 == end)) or (preempted and ck.dir):
            save_checkpoint(ck_dir, model, opt, step=step + 1, scheduler=sched, keep_last=ck.keep_last or None,
                            config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                            extra={"samples_consumed": (step + 1) * batch})
        if preempted:
            break
    terminate.restore()
    if cfg.run.export_hf and not stopped and not preempted:
        out = Path(cfg.run.out_dir) / "hf"
        export_pretrained(model, out, tokenizer_path=tokenizer_path(cfg), lora=cfg.model.lora.export)  # collective
        if rank == 0:
            print(f"exported the trained model to {out}", file=sys.stderr)
    if writer and metrics:
        bar.close()
        writer.close()
        summary = {**summarize(metrics, cfg.run.warmup_steps), "nonfinite_steps": nonfinite, "stopped": stopped,
                   "preempted_after_step": preempted}
        (writer.out_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=1, allow_nan=False))
        print(f"wrote {writer.path}: loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}, "
              f"{summary['tokens_per_s']:.0f} tokens/s after warm-up"
              + (f", {len(nonfinite)} non-finite minibatch(es) skipped" if nonfinite else ""), file=sys.stderr)
    model.close()
    if stopped:
        raise NonFiniteError(stopped)
    if preempted and rank == 0:
        saved = f"checkpoint saved in {ck_dir}; continue with checkpoint.resume=auto" if (
            ck.dir or ck.interval) else "no checkpoint (set checkpoint.dir to save one on SIGTERM)"
        print(f"terminated (SIGTERM) after step {preempted}: {saved}", file=sys.stderr)
    return metrics


def resume(cfg: TrainConfig, ck_dir: Path, model: ODCShard, opt, sched) -> int:
    """Load the checkpoint ``checkpoint.resume`` asks for; return the step to continue from."""
    spec = cfg.checkpoint.resume
    if spec == "none":
        return 0
    path = latest_checkpoint(ck_dir) if spec == "auto" else Path(spec)
    if path is None:
        return 0  # auto with nothing saved yet: a fresh start
    if (path / "config.json").is_file() and not (path / "manifest.json").is_file():
        raise CheckpointError(f"checkpoint.resume={spec} is a Hugging Face model directory, not a training checkpoint: "
                              f"fine-tune it with model.name=hf model.path={spec}")
    saved_schedule = read_manifest(path).get("scheduler") is not None
    manifest = load_checkpoint(path, model, opt, scheduler=sched if saved_schedule else None)
    if not saved_schedule:  # a version-1 checkpoint: the schedule is a function of the step, so set it there
        sched.last_epoch = manifest["step"] - 1
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
            warnings.simplefilter("ignore")
            sched.step()
    expected = manifest["step"] * cfg.data.batch_size
    if manifest.get("extra", {}).get("samples_consumed", expected) != expected:
        raise CheckpointError(f"{path}: saved after {manifest['extra']['samples_consumed']} samples, but "
                              f"data.batch_size={cfg.data.batch_size} puts step {manifest['step']} at {expected}")
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        print(f"resumed from {path} at step {manifest['step']}", file=sys.stderr)
    return manifest["step"]


def summarize(metrics: list[dict], warmup: int) -> dict:
    """Throughput and timing of the steps after ``warmup``."""
    rows = metrics[warmup:] or metrics
    step_s = [r["step_s"] for r in rows]
    return {
        "steps": len(rows), "tokens_per_s": sum(r["tokens"] for r in rows) / sum(step_s),
        "mfu": (sum(r["mfu"] * r["step_s"] for r in rows) / sum(step_s)) if rows[0]["mfu"] is not None else None,
        "step_s_mean": sum(step_s) / len(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s),
        "final_loss": metrics[-1]["loss"], "peak_alloc_gib": max(r["peak_alloc_gib"] for r in metrics),
        "peak_reserved_gib": max(r["peak_reserved_gib"] for r in metrics),
    }


# -- process set-up -------------------------------------------------------------------------------
def config_from(overrides: dict) -> TrainConfig:
    """A ``TrainConfig`` from nested override values (the defaults elsewhere)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), overrides))


class _TerminationFlag:
    """Records SIGTERM (what schedulers send before preempting) instead of dying at once (main thread only)."""

    def __init__(self):
        self.raised = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._set)

    def _set(self, _sig, _frame) -> None:
        self.raised = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


class RankError(RuntimeError):
    """A spawned rank failed; the message is one line naming the rank (the traceback goes to the run dir)."""


class NonFiniteError(RuntimeError):
    """A run stopped at a non-finite loss or gradient norm (``run.on_nonfinite``)."""


def _train_worker(cfg_dict: dict) -> list[dict] | NonFiniteError:
    try:
        return train(config_from(cfg_dict))
    except NonFiniteError as e:  # every rank stops at the same step: hand the parent the message, not a traceback
        return e


def run(cfg: TrainConfig) -> None:
    """Start ranks as needed (torchrun's, or spawned locally) and train."""
    validate(cfg)
    if "RANK" in os.environ:  # started by torchrun
        init_torchrun(use_cuda=cfg.run.device != "cpu" and torch.cuda.is_available())
        try:
            train(cfg)
        finally:
            dist.destroy_process_group()
    elif cfg.run.world_size > 1:
        cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
        try:
            results = spawn(_train_worker, cfg.run.world_size, OmegaConf.to_container(OmegaConf.structured(cfg)),
                            backend="nccl" if cuda else "gloo", timeout=7 * 24 * 3600, forward=(signal.SIGTERM,))
        except RuntimeError as e:  # a rank failed: one line here, the whole report in the run dir
            log = Path(cfg.run.out_dir) / "error.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(str(e))
            lines = [line for line in str(e).splitlines() if line.strip()]
            raise RankError(f"{lines[0].rstrip(':')}: {lines[-1].strip()} (traceback in {log})") from None
        if isinstance(results[0], NonFiniteError):
            raise results[0]
    else:
        train(cfg)


def _multirun_job_dir(cfg: TrainConfig) -> None:
    """Under ``--multirun``, a job without its own ``run.out_dir`` override writes to its Hydra job directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return
    if not any(o.split("=")[0].lstrip("+~") == "run.out_dir" for o in hc.overrides.task):
        cfg.run.out_dir = hc.runtime.output_dir
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"job {hc.job.num} ({' '.join(hc.overrides.task) or 'defaults'}) -> {cfg.run.out_dir}", file=sys.stderr)


@hydra.main(version_base="1.3", config_name="train", config_path=None)
def _hydra_main(cfg) -> None:
    cfg = OmegaConf.to_object(cfg)
    _multirun_job_dir(cfg)
    try:
        validate(cfg)
        preflight(cfg, torchrun="RANK" in os.environ)
    except ValueError as e:  # a configuration error: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        run(cfg)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    except RankError as e:
        print(f"\nerror: {e}", file=sys.stderr)  # after a progress bar that may be mid-line
        sys.exit(1)


def main() -> None:
    """Console-script entry point (``odcfsdp-train``)."""
    register()
    defaults = ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled",
                "hydra/hydra_logging=disabled"]
    if CONFIGS_DIR.is_dir():  # source checkout: experiment presets under configs/
        defaults.append(f"hydra.searchpath=[file://{CONFIGS_DIR}]")
    args = sys.argv[1:]
    given = {a.split("=")[0] for a in args}
    extra = [d for d in defaults if d.split("=")[0] not in given]
    # Hydra wants the overrides contiguous: put ours right before the user's first one.
    first = next((i for i, a in enumerate(args) if "=" in a and not a.startswith("-")), len(args))
    sys.argv[1:] = args[:first] + extra + args[first:]
    _hydra_main()


if __name__ == "__main__":
    main()
