"""Checkpoint timing: save, load (same and different world size are the same code) and HF export of a Llama.

    torchrun --nproc-per-node=2 -m benchmarks.checkpoint_bench --size 1b --dir /tmp/ckpt --out results/checkpoint
    python -m benchmarks.checkpoint_bench --cpu-ranks 2 --size tiny --vocab 256 --seq 64 \
        --dir /tmp/ckpt --out /tmp/checkpoint   # CPU smoke run: gloo + shm

Builds the model on the meta device (no rank holds it whole), wraps it with the
nvshmem transport (``shm`` on CPU ranks), runs one training step so AdamW state exists,
then times ``save_checkpoint``, ``load_checkpoint`` (checksums verified) and ``export_hf``
and records bytes written. Between save and load every parameter and AdamW moment is
zeroed; after the load, each rank's sums of them must equal those at the save
(``load_restores_state``). Rank 0 writes ``checkpoint_bench.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from odcfsdp import ODCShard, param_groups
from odcfsdp.checkpoint import export_hf, load_checkpoint, save_checkpoint
from odcfsdp.models import Llama, causal_lm_loss, llama_config
from benchmarks import harness


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Seconds of a collective ``fn``, all ranks starting and ending together."""
    _sync()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    _sync()
    dist.barrier()
    return time.perf_counter() - t0


def state_sums(model, opt) -> torch.Tensor:
    """This rank's float64 sums of every parameter shard and AdamW moment (a fingerprint of its training state)."""
    sums = [p.to_local().double().sum() for p in model.parameters()]
    sums += [st[k].to_local().double().sum() if hasattr(st[k], "to_local") else st[k].double().sum()
             for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return torch.stack(sums).cpu()


def clobber(model, opt) -> None:
    """Zero every parameter and AdamW moment, so that only the load can bring them back."""
    with model.changing_parameters(), torch.no_grad():
        for p in model.parameters():
            p.zero_()
    for st in opt.state.values():
        st["exp_avg"].zero_()
        st["exp_avg_sq"].zero_()


def report(r: dict, m: dict) -> str:
    """The markdown of one run (``r``: its row, ``m``: its meta)."""
    return (f"# Checkpoint timing\n\n- {m['device']} ({m.get('comm', 'nvshmem')}), {m['date']}, commit {m['commit']}\n"
            f"- command: `{m['command']}`; files under {m['filesystem']}\n- model: Llama {m['size']}, "
            f"{m['params'] / 1e9:.2f}B parameters (fp32 masters + AdamW moments)\n\n"
            f"| operation | seconds | bytes | GB/s |\n|---|---|---|---|\n"
            f"| save (sharded, all ranks) | {r['save_s']:.2f} | {r['sharded_bytes']} | {r['save_gbps']:.2f} |\n"
            f"| load (checksums verified) | {r['load_s']:.2f} | {r['sharded_bytes']} | {r['load_gbps']:.2f} |\n"
            f"| export HF (bf16, rank 0 writes) | {r['export_hf_bf16_s']:.2f} | {r['hf_bytes']} | "
            f"{r['hf_bytes'] / r['export_hf_bf16_s'] / 1e9:.2f} |\n")


def parse(argv=None) -> argparse.Namespace:
    """The command line's arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dir", default="/tmp/odcfsdp_ckpt")
    parser.add_argument("--seq", type=int, default=2048, help="tokens of the one training step")
    harness.add_common(parser, out="results/checkpoint", cpu_ranks=True)  # --out, --commit, --cpu-ranks (shm)
    args = parser.parse_args(argv)
    args.command = harness.command(__name__, argv)
    return args


def main(argv=None) -> None:
    """Under torchrun on GPUs, or ``--cpu-ranks`` spawned CPU ranks: time save, load and export."""
    args = parse(argv)
    harness.run_benchmark_ranks(worker, args, args.cpu_ranks)


def worker(args, device: torch.device | None) -> None:
    """One rank's part (``device`` None: a CPU rank that ``spawn`` started)."""
    cpu = device is None
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    cfg = llama_config(args.size, args.vocab)
    with torch.device("meta"):
        inner = Llama(cfg)
    model = ODCShard(inner, comm="shm" if cpu else "nvshmem", device=device)
    with model.changing_parameters(), torch.no_grad():  # real values, without building the model anywhere
        for p in model.parameters():
            p.normal_(0, 0.02)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-4, fused=not cpu or None)
    x = torch.randint(0, args.vocab, (1, args.seq), device=device)
    causal_lm_loss(model(x), x).backward()
    opt.step()  # the optimizer has state to save
    opt.zero_grad()

    root = Path(args.dir)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    saved = state_sums(model, opt)
    save_s = timed(lambda: save_checkpoint(root / "sharded", model, opt, step=1))
    clobber(model, opt)
    load_s = timed(lambda: load_checkpoint(root / "sharded" / "step_00000001", model, opt))
    if not torch.equal(state_sums(model, opt), saved):
        raise AssertionError(f"rank {rank}: the loaded parameters / AdamW moments differ from the saved ones")
    export_s = timed(lambda: export_hf(model, root / "hf", dtype=torch.bfloat16))
    if rank == 0:
        sharded_bytes = dir_bytes(root / "sharded")
        hf_bytes = dir_bytes(root / "hf")
        command = args.command if cpu else args.command.replace("python -m", f"torchrun --nproc-per-node={world} -m", 1)
        meta = harness.meta(args.commit, command, harness.device_name("cpu" if cpu else device, world),
                            world_size=world, comm="shm" if cpu else "nvshmem", size=args.size,
                            params=cfg.num_params(), filesystem=str(root))
        row = {"save_s": save_s, "load_s": load_s, "export_hf_bf16_s": export_s, "load_restores_state": True,
               "sharded_bytes": sharded_bytes, "hf_bytes": hf_bytes,
               "save_gbps": sharded_bytes / save_s / 1e9, "load_gbps": sharded_bytes / load_s / 1e9}
        out = Path(args.out)
        harness.write_result(out, "checkpoint_bench", meta, [row], report(row, meta))
        print((out / "checkpoint_bench.md").read_text())
    model.close()


if __name__ == "__main__":
    main()
