"""The run loop: ``train(cfg)`` on the current process group, resuming, the run's summary.

Each step is ``odcfsdp.loop``'s (the standard PyTorch loop: micro-batches, then
``clip_grad_norm_``, the ``optim.name`` optimizer (AdamW by default), the LR schedule, ``zero_grad``); per-rank
compute and wait times, the loss and the throughput are gathered once afterwards and
written by rank 0. The pieces come from ``odcfsdp.app.builders``; starting ranks and the
command line are ``odcfsdp.train``'s. SIGTERM, SIGHUP or SIGINT during the loop stops every rank after
the same step with a checkpoint (``_StopFlag``; a second SIGINT ends at once). A checkpoint that fails its
checks on resume is named with the newest intact one before it (``odcfsdp/checkpoint/verify.py``).
"""

from __future__ import annotations

import errno
import json
import math
import resource
import shutil
import signal
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from .builders import build_optimizer, build_sharded_model, build_source, jsonl_source, pick_device, tokenizer_path
from ..checkpoint import (
    CheckpointError, NonFiniteStateError, export_pretrained, latest_checkpoint, load_checkpoint, read_manifest,
    save_checkpoint,
)
from ..checkpoint.verify import resume_instead
from .config import TrainConfig, checkpoint_dir, resolve, validate
from ..interrupts import Interrupted, install, leave_hung_up_terminal, restore
from ..loop import StepGarbageCollection, evaluate, gather_stats, plan_step, train_step
from ..optim.park_backward import wants_largest_last
from .metrics import MetricsWriter, ProgressBar, json_safe
from .resume_setup import apply_hyperparameters, fresh_hyperparameters
from ..mfu import mfu, peak_tflops
from ..sharding import ODCShard


class NonFiniteError(RuntimeError):
    """A run stopped at a non-finite loss or gradient norm (``run.on_nonfinite``), or at a save refused because an
    update made a parameter or an optimizer state non-finite."""


def train(cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` on the current process group; return the per-step metrics (on every rank)."""
    validate(resolve(cfg))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = pick_device(cfg)
    source, vocab = build_source(cfg)
    if rank == 0 and getattr(source, "truncation_note", None):
        print(source.truncation_note, file=sys.stderr)
    if cfg.run.epochs is not None:  # the schedule, the bar and the end all read run.steps: set it once, here
        cfg.run.steps = math.ceil(cfg.run.epochs * source.num_samples / cfg.data.batch_size)
        if rank == 0:
            print(f"run.epochs={cfg.run.epochs:g} over {source.num_samples} samples of {cfg.data.path} at "
                  f"data.batch_size={cfg.data.batch_size}: {cfg.run.steps} step{'s' * (cfg.run.steps != 1)}",
                  file=sys.stderr)
    if rank == 0 and cfg.optim.warmup_steps >= cfg.run.steps:
        print(f"note: optim.warmup_steps={cfg.optim.warmup_steps} >= the run's {cfg.run.steps} steps: the learning "
              f"rate never reaches optim.lr={cfg.optim.lr:g} (lower optim.warmup_steps)", file=sys.stderr)
    model, flops, cost = build_sharded_model(cfg, vocab, device)
    if model.mesh.replicas > 1 and rank == 0:
        print(f"hybrid sharding: {model.mesh.replicas} replicas x {model.world_size} ranks "
              f"(shard.replicas; comm={model.transport.name} within a replica)", file=sys.stderr)
    held_out = None
    if cfg.data.eval_path:
        held_out = jsonl_source(cfg, cfg.data.eval_path, source.tokenizer)  # the tokenizer build_source loaded
    opt, sched = build_optimizer(cfg, model, device)
    peak = peak_tflops(device, cfg.run.peak_tflops)
    ck = cfg.checkpoint
    ck_dir = checkpoint_dir(cfg)
    start = resume(cfg, ck_dir, model, opt, sched)

    if rank == 0 and start == 0:
        _clear_outputs(Path(cfg.run.out_dir))
    writer = MetricsWriter(cfg.run.out_dir, cfg.run.tensorboard, first_step=start + 1) if rank == 0 else None
    if writer:
        (writer.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    bar = ProgressBar(cfg.run.steps, first_step=start + 1) if rank == 0 else None
    cap, batch = cfg.data.micro_batch_tokens, cfg.data.batch_size
    metrics = []
    end = min(cfg.run.steps, cfg.run.stop_after or cfg.run.steps)
    nonfinite: list[int] = []  # steps whose update was not applied
    in_a_row, stopped, preempted, signum = 0, None, None, 0
    terminate = _StopFlag()  # SIGTERM / Ctrl-C: finish this step, checkpoint, exit cleanly (every rank alike)
    with StepGarbageCollection(cfg.run.gc_every) as collector:  # [step-gc]: no full collection inside a step
        for step in range(start, end):
            minibatch = plan_step(source, step, batch, cap, cfg.balance.kind, cost, rank, world,
                                  largest_last=wants_largest_last(opt))  # [park-backward] 0
            model.begin_minibatch(len(minibatch.mine))  # the collective transport checks equal counts here
            lr = sched.get_last_lr()[0]
            out = train_step(model, opt, sched, minibatch, device, max_norm=cfg.optim.max_norm)
            my_sizes = minibatch.my_sizes()
            table = gather_stats([out["loss"], out["compute_s"], model.sync_wait_s, len(minibatch.mine),
                                  sum(my_sizes), sum(map(flops, my_sizes)), out["compute_s"] + out["step_s"],
                                  float(terminate.signum)],
                                 model.mesh.device, model.mesh.everyone.group)  # the stop flag rides along: no meeting
            row = _step_row(step, out, table, minibatch.global_targets, lr, peak, world, device)
            in_a_row = 0 if out["finite"] else in_a_row + 1
            if not out["finite"]:
                row["nonfinite"] = True
                nonfinite.append(step + 1)
                if cfg.run.on_nonfinite == "stop" or in_a_row >= cfg.run.max_skipped:
                    stopped = _nonfinite_message(cfg, row, in_a_row)
            every = cfg.run.eval_interval
            if held_out is not None and not stopped and ((every and (step + 1) % every == 0) or step + 1 == end):
                row["eval_loss"] = evaluate(model, held_out, cap, device, rank, world, model.mesh.everyone.group)
            metrics.append(row)
            collector.step(step + 1)
            if writer:
                writer.write(row)
                _show(bar, row)
            if stopped:  # no checkpoint of this step, no export: the weights are the last finite update's
                break
            if table[:, 7].max().item() > 0 and step + 1 < end:  # a rank got SIGTERM / SIGINT: all stop after it
                preempted, signum = step + 1, int(table[:, 7].max().item())  # SIGTERM (15) names a mix of both
            if (ck.interval and ((step + 1) % ck.interval == 0 or step + 1 == end)) or preempted:  # resumable
                try:
                    save_checkpoint(ck_dir, model, opt, step=step + 1, scheduler=sched, keep_last=ck.keep_last or None,
                                    config=OmegaConf.to_container(OmegaConf.structured(cfg)),
                                    extra={"samples_consumed": (step + 1) * batch})
                except NonFiniteStateError as e:  # a finite norm, a non-finite update (optim.lr too large): stop here
                    stopped = str(e)
                    break
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
        _write_summary(writer, metrics, cfg, nonfinite, stopped, preempted, signum)
    model.close()
    if stopped:
        raise NonFiniteError(stopped)
    if preempted and rank == 0:
        print(f"{_stopped_by(signum)} after step {preempted}: checkpoint saved in {ck_dir}; continue with "
              "checkpoint.resume=auto", file=sys.stderr)
    return metrics


def _step_row(step: int, out: dict, table: torch.Tensor, targets: int, lr: float, peak: float | None, world: int,
              device: torch.device) -> dict:
    """The metrics of one step from ``train_step``'s output and every rank's gathered statistics (``table``)."""
    step_wall = table[:, 6].max().item()
    tokens = int(table[:, 4].sum())
    alloc, reserved = _peak_memory_gib(device)
    return {
        "step": step + 1, "loss": table[:, 0].sum().item(), "grad_norm": out["grad_norm"], "lr": lr,
        "tokens": tokens, "target_tokens": targets, "step_s": step_wall,
        "tokens_per_s": tokens / step_wall, "mfu": mfu(table[:, 5].sum().item(), step_wall, peak, world),
        "peak_alloc_gib": alloc, "peak_reserved_gib": reserved,
        "rank_compute_s": table[:, 1].tolist(), "rank_wait_s": table[:, 2].tolist(),
        "rank_micro_batches": [int(x) for x in table[:, 3].tolist()],
    }


def _nonfinite_message(cfg: TrainConfig, row: dict, in_a_row: int) -> str:
    """The one line a run that stops at a non-finite step ends with (``NonFiniteError``, the summary's ``stopped``)."""
    return (f"step {row['step']}: non-finite loss or gradient norm (loss {row['loss']}, grad norm "
            f"{row['grad_norm']}); the update was not applied and the run stops"
            + (f" after {in_a_row} such minibatches in a row (run.max_skipped)"
               if cfg.run.on_nonfinite == "skip" else
               " (run.on_nonfinite=skip skips such minibatches instead)"))


#: what a run writes into run.out_dir besides metrics.jsonl and config.yaml (which are rewritten as it goes)
OUTPUTS = ("summary.json", "error.log", "loss.png", "ranks.png", "hf")


def _clear_outputs(out_dir: Path) -> None:
    """A run that starts at step 0 (``run.overwrite=true`` over an old one) leaves nothing of the old run behind:
    no summary, plots or export that would describe it (checkpoints stay: saving moves later steps aside)."""
    for name in OUTPUTS:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _show(bar: ProgressBar, row: dict) -> None:
    """``bar.update(row)``, unless the terminal hung up (EIO): then output goes to /dev/null from here on, and the
    step goes on to the checkpoint that the terminal's SIGHUP, on its way to this rank, asks for."""
    try:
        bar.update(row)
    except OSError as e:
        if e.errno != errno.EIO:
            raise
        leave_hung_up_terminal()


def _stopped_by(signum: int) -> str:
    """How a run stopped by a signal says so: ``terminated (SIGTERM)``, ``hung up (SIGHUP, terminal closed)`` or
    ``interrupted (SIGINT, Ctrl-C)``."""
    return {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP, terminal closed)"}.get(
        signum, "interrupted (SIGINT, Ctrl-C)")


def _write_summary(writer: MetricsWriter, metrics: list[dict], cfg: TrainConfig, nonfinite: list[int],
                   stopped: str | None, preempted: int | None, signum: int) -> None:
    """Rank 0 at the end: ``summary.json`` next to the metrics, and one line saying what the run did.

    The summary says which steps this invocation ran against the steps asked for, and why it
    ended where it did (``end``), apart from the steps its throughput figures cover.
    """
    last = metrics[-1]["step"]
    end = ("stopped: " + stopped if stopped else f"{_stopped_by(signum)} after step {preempted}" if preempted
           else f"run.stop_after={cfg.run.stop_after}" if last < cfg.run.steps else "completed run.steps")
    summary = {"steps_requested": cfg.run.steps, "first_step": metrics[0]["step"], "last_step": last,
               "steps_run": len(metrics), "end": end,
               **summarize(metrics, cfg.run.warmup_steps), "nonfinite_steps": nonfinite, "stopped": stopped,
               "preempted_after_step": preempted}
    (writer.out_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=1, allow_nan=False))
    print(f"wrote {writer.path}: loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f}, "
          f"{summary['tokens_per_s']:.0f} tokens/s after warm-up"
          + (f", {len(nonfinite)} non-finite minibatch(es) skipped" if nonfinite else ""), file=sys.stderr)


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
    fresh = fresh_hyperparameters(opt)  # this run's config's: applied over the loaded ones ([resume-setup] 2)
    try:
        saved_schedule = read_manifest(path).get("scheduler") is not None
        manifest = load_checkpoint(path, model, opt, scheduler=sched if saved_schedule else None)
    except CheckpointError as e:  # a damaged checkpoint: the error names the one to resume from instead
        raise CheckpointError(f"{e}{resume_instead(path)}") from e
    if not saved_schedule:  # a version-1 checkpoint: the schedule is a function of the step, so set it there
        sched.last_epoch = manifest["step"] - 1
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
            warnings.simplefilter("ignore")
            sched.step()
    apply_hyperparameters(opt, sched, fresh)
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
        "timed_steps": len(rows),
        "timed_steps_are": (f"steps {rows[0]['step']}-{rows[-1]['step']}: the throughput figures leave out the first "
                            f"{len(metrics) - len(rows)} step(s) of this invocation (run.warmup_steps: compilation, "
                            "allocator and cache warm-up)"),
        "tokens_per_s": sum(r["tokens"] for r in rows) / sum(step_s),
        "mfu": (sum(r["mfu"] * r["step_s"] for r in rows) / sum(step_s)) if rows[0]["mfu"] is not None else None,
        "step_s_mean": sum(step_s) / len(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s),
        "final_loss": metrics[-1]["loss"], "peak_alloc_gib": max(r["peak_alloc_gib"] for r in metrics),
        "peak_reserved_gib": max(r["peak_reserved_gib"] for r in metrics),
    }


class _StopFlag:
    """Records the first SIGTERM (what schedulers send before preempting), SIGHUP (a closed terminal) or SIGINT
    (Ctrl-C) instead of dying at once.

    The run stops after the step every rank is in (the flag rides on the step's statistics) and
    saves a checkpoint. A second SIGINT ends at once (``Interrupted``). A signal this process
    ignores stays ignored. After SIGHUP, output to the terminal that hung up goes to /dev/null (a
    write there fails) and a later SIGHUP is ignored (a closed terminal may send two). Main thread
    only (Python's signal handlers live there).
    """

    def __init__(self):
        self.signum = 0
        self._previous = install(self._set, keep_ignored=True)

    def _set(self, sig, _frame) -> None:
        if sig == signal.SIGHUP:
            leave_hung_up_terminal()
        if self.signum and sig == signal.SIGINT:  # Ctrl-C twice
            raise Interrupted(sig, again=True)
        self.signum = self.signum or sig

    def restore(self) -> None:
        restore(self._previous)
        self._previous = []
        if self.signum == signal.SIGHUP:
            install(signal.SIG_IGN, (signal.SIGHUP,))


def _peak_memory_gib(device: torch.device) -> tuple[float, float]:
    """Peak allocated and reserved memory (GiB) of ``device``; on CPUs the process's peak resident size, twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return rss, rss
