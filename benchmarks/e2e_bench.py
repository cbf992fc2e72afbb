"""End-to-end training throughput: odcfsdp vs PyTorch FSDP2 vs DDP, one invocation, the same GPUs.

    torchrun --nproc-per-node=2 benchmarks/e2e_bench.py --size 1b --out results/e2e --commit <sha>
    python benchmarks/e2e_bench.py --cpu-ranks 2 --size tiny --steps 2 --warmup 1   # CPU smoke run

Methods (each trains the same model from the same seed on the same micro-batches
with the same AdamW settings and clipping; warm-up steps are excluded):

* ``odc``: ``ODCShard(comm="auto", units=(DecoderLayer,))`` (nvshmem on GPUs, shm on CPU);
* ``odc_collective``: the same with ``comm="collective"`` (NCCL / gloo);
* ``fsdp2``: ``fully_shard`` per decoder layer + root, ``MixedPrecisionPolicy(bf16, fp32
  reduce)`` on GPUs;
* ``ddp``: ``DistributedDataParallel`` with bf16 autocast on GPUs.

Every method runs the same step, ``odcfsdp.loop.train_step`` (micro-batches, then
``clip_grad_norm_``, ``torch.optim.AdamW`` over ``param_groups``, fused on GPUs,
``zero_grad``); only the wrapping differs.

Workloads: ``balanced`` (every sample ``--seq`` tokens) and ``longtail`` (LongAlign-like
8K-64K lengths packed under ``--cap`` tokens). Collective methods need ``lb_micro``;
``odc`` runs with ``lb_mini`` and also ``lb_micro``. Reported per run: tokens/s, MFU,
peak allocated / reserved memory (plus the NVSHMEM heap for ``odc``), step-time
spread, per-rank compute vs optimizer-step time, and the loss of every step. Rank 0
writes ``e2e_bench.json``, ``e2e_bench.md`` and ``e2e_bench.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from odcfsdp import ODCShard, param_groups
from odcfsdp.data.balance import CostModel
from odcfsdp.data.lengths import LONGALIGN_BINS, LengthConfig, LengthDistribution
from odcfsdp.data.synthetic import SyntheticSFT
from odcfsdp.launch import init_torchrun, spawn
from odcfsdp.loop import gather_stats, plan_step, train_step
from odcfsdp.mfu import mfu, peak_tflops
from odcfsdp.models import Llama, llama_config
from odcfsdp.models.attention import ATTENTION_BACKENDS, warm_attention
from odcfsdp.models.llama import DecoderLayer

NO_DECAY = ("*norm*",)


ABLATIONS = ("prefetch0", "no_overlap", "unfused", "module_hooks")  # odc with one speed feature turned off


def runs_for(workloads: list[str], methods: list[str], ablate: list[str] = ()) -> list[tuple[str, str, str]]:
    """(workload, method, balancer) triples: collective methods need lb_micro; odc also runs lb_mini.

    Each ablation adds an ``odc-<ablation>`` run with odc's first balancer.
    """
    out = []
    for w in workloads:
        for m in methods:
            balancers = ("lb_mini", "lb_micro") if m == "odc" and w == "longtail" else ("lb_micro",)
            out += [(w, m, b) for b in balancers]
            if m == "odc":
                out += [(w, f"odc-{a}", balancers[0]) for a in ablate]
    return out


def wrap(method: str, model: nn.Module, device: torch.device, args):
    """The method's model, its autocast context, the factor its losses are scaled by before backward, and
    (DDP) the context that skips the gradient all-reduce of non-final micro-batches.

    Every method divides each micro-batch loss by the minibatch's global target count, so the
    gradient the optimizer must see is the *sum* over ranks. odcfsdp sums; FSDP2 and DDP average
    over ranks, so their losses are scaled by the world size before backward (else they would
    clip and step on a gradient N times smaller, and the runs would not train the same thing).
    """
    cuda = device.type == "cuda"
    if method.startswith("odc"):
        ablation = method.partition("-")[2]
        sharded = ODCShard(model, args.group_bytes, comm="collective" if method == "odc_collective" else "auto",
                           param_dtype=torch.bfloat16 if cuda else torch.float32,
                           prefetch=0 if ablation == "prefetch0" else args.prefetch,
                           overlap_push=ablation != "no_overlap",
                           units=() if ablation == "module_hooks" else (DecoderLayer,))
        return sharded, contextlib.nullcontext, 1.0, None
    if method == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
        kwargs = {"mp_policy": mp} if mp else {}
        for layer in model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model, contextlib.nullcontext, float(dist.get_world_size()), None
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
        return wrapped, autocast, float(dist.get_world_size()), wrapped.no_sync
    raise ValueError(f"unknown method {method!r}")


def optimizer_for(method: str, model: nn.Module, device: torch.device, args) -> torch.optim.Optimizer:
    """The same ``torch.optim.AdamW`` for every method: fused on GPUs (``-unfused``: torch's foreach kernels)."""
    fused = device.type == "cuda" and not method.endswith("-unfused")
    return torch.optim.AdamW(param_groups(model, no_decay=NO_DECAY), lr=args.lr, betas=(0.9, 0.95),
                             weight_decay=0.1, fused=fused or None)


@functools.lru_cache(maxsize=2)
def workload_source(workload: str, vocab: int, seed: int, pool: int, seq: int, cap: int,
                    per_micro: int = 1) -> tuple[SyntheticSFT, int]:
    """The workload's samples and packing cap; one token pool per workload and process, shared by its runs."""
    if workload == "balanced":
        lengths = LengthConfig(kind="fixed", min_len=seq + 1, max_len=seq + 1)
    else:  # LongAlign's 8K-64K spread, scaled so the longest sample just fits the cap
        scale = (cap + 1) / LONGALIGN_BINS[-1][1]
        lengths = LengthConfig(kind="histogram", bins=[[max(2, int(lo * scale)), int(hi * scale)]
                                                       for lo, hi in LONGALIGN_BINS])
    source = SyntheticSFT(vocab, LengthDistribution(lengths, seed), seed, pool_tokens=pool)
    return source, seq * per_micro if workload == "balanced" else cap


def run_one(workload: str, method: str, balance: str, args, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    source, cap = workload_source(workload, args.vocab, args.seed, args.pool, args.seq, args.cap,
                                  args.balanced_micro_samples)
    cfg = llama_config(args.size, args.vocab, activation_checkpointing=args.activation_checkpointing,
                       compile=bool(args.compile), compile_backend=args.compile or "inductor",
                       attention_backend=args.attention)
    flops = CostModel.for_transformer(cfg.n_layers, cfg.dim, cfg.matmul_params())  # MFU
    cost = CostModel.for_transformer(cfg.n_layers, cfg.dim, cfg.matmul_params(), args.attention_cost_factor)
    gc.collect()  # the previous run's objects must be gone before this one is measured
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
    if args.warm_attention:  # cuDNN attention plans for every document length of the run, built before any
        # method is timed (once per process; see [attention-kernels])
        all_steps = args.warmup + args.steps + (method in args.profile)
        warm_attention([source[i].truncated(cap + 1).n_inputs for i in range(all_steps * args.batch)],
                       cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, device, cfg.attention_backend)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = Llama(cfg)
    wrapped, autocast, loss_scale, no_sync = wrap(method, model, device, args)
    opt = optimizer_for(method, wrapped, device, args)
    try:
        if cuda:  # after wrapping: building the full model first is the same for every method, not counted
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
        heap = getattr(getattr(wrapped, "transport", None), "heap_bytes", 0)
        peak = peak_tflops(device)
        steps = []
        profile = None
        n_steps = args.warmup + args.steps
        for step in range(n_steps + (method in args.profile)):  # a profiled step comes last, not counted
            prof = step_profiler() if step == n_steps else None
            minibatch = plan_step(source, step, args.batch, cap, balance, cost, rank, world)
            if isinstance(wrapped, ODCShard):
                wrapped.begin_minibatch(len(minibatch.mine))
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()
            if prof is not None:
                prof.__enter__()
            out = train_step(wrapped, opt, None, minibatch, device, max_norm=1.0, loss_scale=loss_scale,
                             autocast=autocast, no_sync=no_sync)
            if prof is not None:
                prof.__exit__(None, None, None)
                try:
                    profile = dict(kernel_summary(prof), step_s=out["compute_s"] + out["step_s"])
                except Exception as e:  # noqa: BLE001 - a profiler API change must not lose the run's timings
                    profile = {"error": f"{type(e).__name__}: {e}"}
                continue
            my_sizes = minibatch.my_sizes()
            table = gather_stats([out["loss"], out["compute_s"], out["step_s"], len(minibatch.mine), sum(my_sizes),
                                  sum(map(cost, my_sizes)), out["host_s"], sum(map(flops, my_sizes))], device)
            wall = (table[:, 1] + table[:, 2]).max().item()
            steps.append({"step": step + 1, "loss": table[:, 0].sum().item(), "grad_norm": out["grad_norm"],
                          "step_s": wall, "tokens": int(table[:, 4].sum()), "flops": table[:, 7].sum().item(),
                          "rank_compute_s": table[:, 1].tolist(), "rank_step_s": table[:, 2].tolist(),
                          "rank_micro_batches": [int(x) for x in table[:, 3]], "rank_cost": table[:, 5].tolist(),
                          "rank_host_s": table[:, 6].tolist()})
        measured = steps[args.warmup:]
        total_s = sum(s["step_s"] for s in measured)
        alloc = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None
        result = {
            "workload": workload, "method": method, "balance": balance,
            "tokens_per_s": sum(s["tokens"] for s in measured) / total_s,
            "mfu": mfu(sum(s["flops"] for s in measured), total_s, peak, world),
            "peak_alloc_gib": alloc, "peak_reserved_gib": reserved, "nvshmem_heap_gib": heap / 2**30,
            "resident_after_wrap_gib": resident, "leftover_before_gib": leftover,
            "step_s_mean": total_s / len(measured), "step_s_min": min(s["step_s"] for s in measured),
            "step_s_max": max(s["step_s"] for s in measured),
            "step_s_stdev": statistics.pstdev([s["step_s"] for s in measured]),
            # what the balancer achieved by the cost model: 1.0 = every rank had the same work
            "rank_cost_max_over_mean": sum(max(s["rank_cost"]) for s in measured)
            / sum(sum(s["rank_cost"]) / world for s in measured),
            **{key: [sum(s[key][r] for s in measured) for r in range(world)]
               # host: time to queue the forward/backward work (close to compute = launch-bound)
               for key in ("rank_compute_s", "rank_step_s", "rank_host_s")},
            "losses": [s["loss"] for s in steps], "steps": steps, "profile": profile,
        }
    finally:  # the NVSHMEM heap must be freed even if the run failed, or the next run cannot get it
        if isinstance(wrapped, ODCShard):
            wrapped.close()
    del wrapped, model, opt
    return result


def step_profiler():
    """A torch profiler for one extra step of the methods named by ``--profile`` (kernel time by kind)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if torch.cuda.is_available()
                   else [ProfilerActivity.CPU])


KERNEL_KINDS = (  # (kind, substrings of kernel names), first match wins
    ("odc gather", ("gather_rows", "gather_get")), ("odc scatter-accumulate", ("scatter_accumulate",)),
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")), ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
    ("memcpy / memset", ("Memcpy", "Memset")),
)


def kernel_summary(prof, top: int = 12) -> dict:
    """Device time of one profiled step by kind of kernel, the time any kernel ran, and the top kernels (this rank)."""
    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    # "nccl:..." entries are annotations spanning NCCL's kernels, which are listed themselves.
    events = [e for e in prof.key_averages()
              if str(e.device_type).endswith("CUDA") and device_us(e) > 0 and not e.key.startswith("nccl:")]
    by_kind: dict[str, float] = {}
    for e in events:
        kind = next((k for k, keys in KERNEL_KINDS if any(x in e.key for x in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + device_us(e) / 1e3
    events.sort(key=lambda e: -device_us(e))
    # Where the host's time goes: operators (and launch calls) by their own CPU time, and how many
    # kernels the step launched (each costs host time, however small the kernel).
    host = sorted((e for e in prof.key_averages() if not str(e.device_type).endswith("CUDA")),
                  key=lambda e: -e.self_cpu_time_total)
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                     "cuLaunchKernelEx", "cudaLaunchKernelExC"))
    return {"device_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "busy_ms": busy_ms(prof), "kernel_launches": launches,
            "top_kernels": [{"name": e.key[:120], "ms": device_us(e) / 1e3, "calls": e.count} for e in events[:top]],
            "top_host_ops": [{"name": e.key[:120], "self_ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                             for e in host[:2 * top]]}


def busy_ms(prof) -> float:
    """Milliseconds in which at least one kernel ran on this rank's device (the union over streams)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start
                   and not e.name.startswith("nccl:"))
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def report(results: list[dict], meta: dict) -> str:
    lines = [
        "# End-to-end training: odcfsdp vs PyTorch FSDP2 vs DDP", "",
        f"- device: {meta['device']} x {meta['world_size']}; date {meta['date']}; commit {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- model: Llama {meta['size']} ({meta['params'] / 1e9:.2f}B); {meta['steps']} measured steps after "
        f"{meta['warmup']} warm-up; {meta['batch']} samples per minibatch; balanced: "
        f"{meta['args'].get('balanced_micro_samples', 1)} sample(s) of {meta['args'].get('seq')} tokens per micro-batch; "
        f"PYTORCH_CUDA_ALLOC_CONF={meta['args'].get('alloc_conf') or '(default)'}",
        "- memory: torch's peak allocated / reserved per rank during training (reset after wrapping; building "
        "the full fp32 model first is the same for every method and not counted); odc adds its NVSHMEM heap "
        "(rows + fp32 accumulators), which lives outside torch's allocator",
        "- DDP keeps fp32 parameters and computes under bf16 autocast; odc and FSDP2 compute with bf16 "
        "parameters and reduce gradients in fp32",
        f"- attention kernels (every method): {meta['args'].get('attention', 'flash')}; "
        f"decoder layers compiled (every method): {meta['args'].get('compile') or 'no'}; activation checkpointing "
        f"(every method): {'yes' if meta['args'].get('activation_checkpointing') else 'no'}; odc hooks whole decoder "
        "layers (`units`) unless the run is `odc-module_hooks`",
        "- rank cost max/mean: the balancer's result by the cost model (a*s^2 + b*s): the busiest rank's work over "
        "the mean, over the measured steps (1.00 = perfectly balanced); compute s per rank: forward/backward time "
        "summed over the measured steps; host-issue s: the part of it until the host had queued the last kernel "
        "(close to compute s: the host, not the GPU, sets the pace); optimizer-step s: the step including the wait "
        "for the other ranks",
        "", "| workload | method | balance | tokens/s | vs fsdp2 | MFU | peak alloc GiB (+heap) | step s (min-max) | "
        "rank cost max/mean | compute s per rank | host-issue s per rank | optimizer-step s per rank | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["workload"]: r["tokens_per_s"] for r in results if r["method"] == "fsdp2"}
    for r in results:
        ratio = f"{r['tokens_per_s'] / base[r['workload']]:.2f}x" if r["workload"] in base else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = "-" if r["peak_alloc_gib"] is None else f"{r['peak_alloc_gib']:.1f} (+{r['nvshmem_heap_gib']:.1f})"
        lines.append(
            f"| {r['workload']} | {r['method']} | {r['balance']} | {r['tokens_per_s']:.0f} | {ratio} | {mfu} | {mem} | "
            f"{r['step_s_mean']:.2f} ({r['step_s_min']:.2f}-{r['step_s_max']:.2f}) | {r['rank_cost_max_over_mean']:.3f} | "
            f"{', '.join(f'{x:.1f}' for x in r['rank_compute_s'])} | "
            f"{', '.join(f'{x:.1f}' for x in r.get('rank_host_s', []))} | {', '.join(f'{x:.2f}' for x in r['rank_step_s'])} | "
            f"{r['losses'][-1]:.4f} |")
    for f in meta.get("failed", []):
        lines.append(f"\n- FAILED {f['workload']} / {f['method']} / {f['balance']}: `{f['error'][:300]}`")
    profiled = [r for r in results if (r.get("profile") or {}).get("device_ms_by_kind")]  # GPU kernels only
    if profiled:
        kinds = sorted({k for r in profiled for k in r["profile"]["device_ms_by_kind"]})
        lines += ["", "## Where the device time goes (rank 0, one profiled step, ms of kernel time)", "",
                  "busy s: time in which any kernel ran (union over streams); for the rest of the profiled step the "
                  "GPU idled (waiting for the host to launch work, or for another rank). The profiler slows the host, "
                  "so the profiled step is longer than the measured ones.", "",
                  "| workload | method | balance | profiled step s | busy s | " + " | ".join(kinds) + " |",
                  "|---|---|---|---|---|" + "---|" * len(kinds)]
        for r in profiled:
            by = r["profile"]["device_ms_by_kind"]
            busy = r["profile"].get("busy_ms")
            lines.append(f"| {r['workload']} | {r['method']} | {r['balance']} | {r['profile']['step_s']:.2f} | "
                         f"{'-' if busy is None else f'{busy / 1e3:.2f}'} | " + " | ".join(f"{by.get(k, 0):.0f}" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def chart(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = sorted({r["workload"] for r in results})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        rows = [r for r in results if r["workload"] == w]
        ax.bar([f"{r['method']}\n{r['balance']}" for r in rows], [r["tokens_per_s"] for r in rows])
        ax.set_title(f"{w}: tokens/s (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_worker(args) -> list[dict] | None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.cpu_ranks \
        else torch.device("cpu")
    results, failed = [], []
    for w, m, b in runs_for(args.workloads, args.methods, args.ablate):
        try:
            results.append(run_one(w, m, b, args, device))
        except Exception as e:  # noqa: BLE001 - one method failing must not lose the others' results
            if not args.keep_going:
                raise
            failed.append({"workload": w, "method": m, "balance": b, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"[rank {dist.get_rank()}] {w}/{m}/{b} failed: {failed[-1]['error']}", flush=True)
            dist.barrier()  # the next run_one collects the failed run's memory before it measures
        if dist.get_rank() == 0:
            write_outputs(results, failed, args, device, final=False)
    if dist.get_rank() == 0:
        write_outputs(results, failed, args, device, final=True)
    return results


def write_outputs(results: list[dict], failed: list[dict], args, device: torch.device, final: bool) -> None:
    """JSON + markdown (+ PNG at the end) under ``--out``, rewritten after every run: a cut-off run keeps its part."""
    cfg = llama_config(args.size, args.vocab)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world_size": dist.get_world_size(), "date": datetime.date.today().isoformat(), "commit": args.commit,
            "command": args.command, "size": args.size, "params": cfg.num_params(), "steps": args.steps,
            "warmup": args.warmup, "batch": args.batch, "args": vars(args), "complete": final, "failed": failed}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e_bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "e2e_bench.md").write_text(report(results, meta))
    if final:
        chart(results, out / "e2e_bench.png")
        print(report(results, meta))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="1b")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--workloads", nargs="+", default=["balanced", "longtail"])
    p.add_argument("--methods", nargs="+", default=["odc", "odc_collective", "fsdp2", "ddp"])
    p.add_argument("--ablate", nargs="*", default=[], choices=ABLATIONS,
                   help="extra odc runs with one speed feature off (before/after measurements)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="samples per global minibatch")
    p.add_argument("--seq", type=int, default=4096, help="balanced workload: tokens per sample")
    p.add_argument("--cap", type=int, default=65536, help="longtail workload: tokens per packed micro-batch")
    p.add_argument("--balanced-micro-samples", type=int, default=1,
                   help="balanced workload: samples packed into one micro-batch (one row, attention per sample)")
    p.add_argument("--pool", type=int, default=1 << 20, help="synthetic token pool (samples are windows of it)")
    p.add_argument("--group-bytes", type=int, default=32 << 20)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--compile", nargs="?", const="inductor", default="",
                   help="torch.compile every method's decoder layers (dense parts; attention stays eager) with this "
                        "backend (inductor when given without one); the warm-up steps absorb compilation")
    p.add_argument("--attention", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention kernels for every method (auto: cuDNN on Hopper, documents padded to buckets)")
    p.add_argument("--no-warm-attention", dest="warm_attention", action="store_false",
                   help="do not build cuDNN attention plans before the runs (the first method meeting a length pays)")
    p.add_argument("--attention-cost-factor", type=float, default=1.0,
                   help="the balancers' weight of an attention FLOP against a matmul FLOP (1.8 fitted on 2x H200 "
                        "with cuDNN attention from n2_longtail_cudnn_compiled_d89966a); MFU always counts plain FLOPs")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/e2e")
    p.add_argument("--commit", default=os.environ.get("ODC_COMMIT", "unknown"))
    p.add_argument("--profile", nargs="*", default=[],
                   help="methods that run one more step under torch.profiler, after the measured ones (kernel time by kind)")
    p.add_argument("--keep-going", action="store_true", help="record a failing run and go on with the others")
    p.add_argument("--alloc-conf", default="",
                   help="PYTORCH_CUDA_ALLOC_CONF for every method (unless already set), e.g. expandable_segments:True "
                        "(on 2x H200 at ea1195c it left FSDP2's reserved memory as it was but raised odc's from 13.7 "
                        "to 17.2 GiB: the prefetch stream grows a segment of its own)")
    p.add_argument("--cpu-ranks", type=int, default=0, help="spawn this many gloo ranks on the CPU instead")
    args = p.parse_args(argv)
    if args.compile and "module_hooks" in args.ablate:
        p.error("--ablate module_hooks cannot run with --compile: compiled layers need whole-layer hooks")
    args.command = "benchmarks/e2e_bench.py " + " ".join(argv if argv is not None else os.sys.argv[1:])
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.alloc_conf:  # before the first CUDA allocation
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", args.alloc_conf)
    args.alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if args.cpu_ranks:
        spawn(main_worker, args.cpu_ranks, args, timeout=3600)
        return
    init_torchrun()
    try:
        main_worker(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
