"""Training entry point: ``python -m odcfsdp.train [key=value ...]`` (Hydra).

With no arguments it trains a tiny Llama on synthetic Markov-chain tokens with 2
CPU ranks that it starts itself (gloo), and prints progress. Under ``torchrun`` it
uses the ranks torchrun started.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from . import optim
from .data.synthetic import MarkovTokens
from .launch import spawn
from .models import Llama, LlamaConfig, causal_lm_loss
from .sharding import ODCShard


@dataclass
class ShardConfig:
    """How the model is sharded (arguments of ``ODCShard``)."""

    group_bytes: int = 32 << 20
    comm: str = "auto"
    reshard_after_forward: bool = True
    param_dtype: str | None = None  # "float32", "bfloat16"; None: bf16 on CUDA, fp32 on CPU


@dataclass
class OptimConfig:
    """AdamW hyper-parameters."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_norm: float = 1.0
    warmup_steps: int = 5


@dataclass
class TrainConfig:
    """A training run."""

    model: LlamaConfig = field(default_factory=lambda: LlamaConfig(vocab_size=256, dim=64, n_layers=2))
    shard: ShardConfig = field(default_factory=ShardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 40
    micro_batches: int = 2
    batch_size: int = 4
    seq_len: int = 64
    seed: int = 0
    world_size: int = 2  # ranks to start on CPU when not under torchrun
    out_dir: str = "runs/default"


ConfigStore.instance().store(name="train", node=TrainConfig)


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"shard.param_dtype={name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return getattr(torch, name)


def train(cfg: TrainConfig) -> list[dict]:
    """Run ``cfg`` on the current process group; return rank 0's per-step metrics."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = Llama(cfg.model)
    model = ODCShard(
        model,
        cfg.shard.group_bytes,
        comm=cfg.shard.comm,
        reshard_after_forward=cfg.shard.reshard_after_forward,
        param_dtype=_dtype(cfg.shard.param_dtype),
    )
    o = cfg.optim
    opt = optim.AdamW(
        model, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
        no_decay=["*norm*"], lr_lambda=lambda s: min(1.0, (s + 1) / max(1, o.warmup_steps)),
    )
    data = MarkovTokens(cfg.model.vocab_size, seed=cfg.seed)
    out_dir = Path(cfg.out_dir)
    metrics: list[dict] = []
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    per_step = world * cfg.micro_batches * cfg.batch_size
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        tokens = per_step * cfg.seq_len
        loss_sum = torch.zeros((), device=device)
        for m in range(cfg.micro_batches):
            first = ((step * world + rank) * cfg.micro_batches + m) * cfg.batch_size
            seqs = torch.stack([data.sample(cfg.seq_len + 1, first + b) for b in range(cfg.batch_size)]).to(device)
            loss = causal_lm_loss(model(seqs[:, :-1]), seqs[:, 1:], tokens)
            loss.backward()
            loss_sum += loss.detach()
        lr = opt.lr
        norm = opt.step(max_norm=o.max_norm)
        if world > 1:
            dist.all_reduce(loss_sum)
        dt = time.perf_counter() - t0
        row = {"step": step + 1, "loss": loss_sum.item(), "grad_norm": norm.item(), "lr": lr,
               "tokens": tokens, "tokens_per_s": tokens / dt, "time_s": time.perf_counter() - t_start}
        metrics.append(row)
        if rank == 0:
            _progress(row, cfg.steps)
    if rank == 0:
        print(file=sys.stderr)
        with open(out_dir / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in metrics)
        print(f"wrote {out_dir / 'metrics.jsonl'}: loss {metrics[0]['loss']:.3f} -> {metrics[-1]['loss']:.3f} "
              f"(chain entropy {data.entropy_rate():.3f})")
    model.close()
    return metrics


def _progress(row: dict, total: int) -> None:
    width = 30
    done = int(width * row["step"] / total)
    bar = "#" * done + "-" * (width - done)
    print(f"\r[{bar}] {row['step']}/{total} loss {row['loss']:.4f} "
          f"gnorm {row['grad_norm']:.3f} {row['tokens_per_s']:.0f} tok/s", end="", file=sys.stderr, flush=True)


def _train_worker(cfg_dict: dict) -> list[dict]:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg_dict))
    return train(cfg)


@hydra.main(version_base="1.3", config_name="train", config_path=None)
def _hydra_main(cfg) -> None:
    if "RANK" in os.environ:  # started by torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            train(OmegaConf.to_object(cfg))
        finally:
            dist.destroy_process_group()
    elif cfg.world_size > 1:
        spawn(_train_worker, cfg.world_size, OmegaConf.to_container(cfg), timeout=24 * 3600)
    else:
        train(OmegaConf.to_object(cfg))


def main() -> None:
    """Console-script entry point (``odcfsdp-train``)."""
    _hydra_main()


if __name__ == "__main__":
    main()
