"""End-to-end training throughput: odcfsdp vs PyTorch FSDP2 vs DDP, one invocation, the same GPUs.

    torchrun --nproc-per-node=2 -m benchmarks.e2e_bench --size 1b --out results/e2e --commit <sha>
    torchrun --nproc-per-node=2 -m benchmarks.e2e_bench --model hf:llama3-8b --methods odc hf_fsdp2 ...
    python -m benchmarks.e2e_bench --cpu-ranks 2 --size tiny --steps 2 --warmup 1   # CPU smoke run

Methods (each trains the same model from the same seed on the same micro-batches
with the same AdamW settings and clipping; warm-up steps are excluded):

* ``odc``: ``ODCShard(comm="auto", units=(DecoderLayer,))`` (nvshmem on GPUs, shm on CPU);
* ``odc_collective``: the same with ``comm="collective"`` (NCCL / gloo);
* ``fsdp2``: ``fully_shard`` per decoder layer (the last kept gathered) + root,
  ``MixedPrecisionPolicy(bf16, fp32 reduce)`` on GPUs, torchtitan's way (``e2e_baselines.py``);
* ``fsdp2_nosync``: the same with gradient sync off and no reshard after backward until the last
  micro-batch (how collective users accumulate over uneven counts, at ZeRO-2 memory);
* ``ddp``: ``DistributedDataParallel`` with bf16 autocast on GPUs.
* ``--model hf:<name>``: a Hugging Face model of real shapes; ``odc``, ``hf_fsdp2``, ``hf_ddp`` ([e2e-hf]).

Every method runs the same step, ``odcfsdp.loop.train_step`` (micro-batches, then
``clip_grad_norm_``, ``torch.optim.AdamW`` over ``param_groups``, fused on GPUs,
``zero_grad``); only the wrapping differs.

Workloads: ``balanced`` (every sample ``--seq`` tokens) and ``longtail`` (LongAlign-like
8K-64K lengths packed under ``--cap`` tokens). Collective methods need ``lb_micro``;
``odc`` runs with ``lb_mini`` and also ``lb_micro``. Reported per run: tokens/s, MFU,
peak allocated / reserved memory (plus the NVSHMEM heap for ``odc``), step-time
spread, per-rank compute vs optimizer-step time, and the loss of every step. Rank 0
writes ``e2e_bench.json``, ``e2e_bench.md`` and ``e2e_bench.png``. ``--memory-breakdown``
adds one step per method that attributes its peak to categories (``odcfsdp.memory``).

``--isolate`` (``python -m``, not torchrun) runs each (workload, method) in a process group of its own, one combined
result: no compile cache, torchao state or NVSHMEM heap size carries over from one method to the next.
The flags: ``benchmarks/e2e_args.py``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks import e2e_baselines, e2e_isolate, harness
from benchmarks.e2e_args import park_fit_budget, park_fraction, parse, pushes_in_flight
from benchmarks.e2e_hf import bench_model, decoder_layers
from benchmarks.e2e_profile import kernel_summary, step_profiler
from benchmarks.e2e_report import baseline, write_outputs
from benchmarks.timing import StepEvents
from odcfsdp import ODCShard, param_groups
from odcfsdp.data.balance import CostModel
from odcfsdp.data.lengths import LengthConfig, LengthDistribution, longalign_lengths
from odcfsdp.data.synthetic import SyntheticSFT
from odcfsdp.launch import init_torchrun, spawn
from odcfsdp.loop import StepGarbageCollection, gather_stats, plan_step, train_step
from odcfsdp.memory import known_tensors, memory_breakdown, peak_breakdown
from odcfsdp.mfu import mfu, peak_tflops
from odcfsdp.optim import ParkedOptimizerState, parking_of
from odcfsdp.optim.park_backward import wants_largest_last
from odcfsdp.sharding.placement.hsdp import hybrid_mesh
from odcfsdp.models.attention import warm_attention

NO_DECAY = ("*norm*",)
UNIT_GROUP_BYTES = 1 << 40  # the unit_groups variant: no byte budget, so each decoder layer is one group


def runs_for(workloads: list[str], methods: list[str], ablate: list[str] = (), variants: list[str] = (),
             only: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(workload, method, balancer) triples: collective methods need lb_micro; odc also runs lb_mini. Each ablation
    or variant adds an ``odc-<name>`` run with odc's first balancer (``offload`` also ``fsdp2-offload``).
    ``only`` (``--balancers``): the one-sided methods' balancers (collective methods keep lb_micro, their only one)."""
    out = []
    for w in workloads:
        for m in methods:
            one_sided = m == "odc" or m.startswith("odc-")  # odc-<variant> as a method: best_fit.py's candidates
            balancers = ("lb_mini", "lb_micro") if one_sided and w == "longtail" else ("lb_micro",)
            out += [(w, m, b) for b in balancers]
            if m == "odc":
                out += [(w, f"odc-{a}", balancers[0]) for a in (*ablate, *variants)]
            out += [(w, "fsdp2-offload", "lb_micro")] if m == "fsdp2" and "offload" in variants else []
    return [r for r in out if not only or r[2] in only or not (r[1] == "odc" or r[1].startswith("odc-"))]


def wrap(method: str, model: nn.Module, device: torch.device, args):
    """The method's model, its autocast context, the factor its losses are scaled by before backward, and
    (DDP) the context that skips the gradient all-reduce of non-final micro-batches.

    Every method divides each micro-batch loss by the minibatch's global target count, so the
    gradient the optimizer must see is the *sum* over ranks. odcfsdp is set to sum
    (``set_gradient_divide_factor(1.0)``: no division pass, the same gradients to the bit as before
    FSDP2-style averaging became ODCShard's default); FSDP2 and DDP average over ranks, so their
    losses are scaled by the world size before backward (else they would clip and step on a gradient
    N times smaller, and the runs would not train the same thing).
    """
    cuda = device.type == "cuda"
    if method.startswith("odc"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        levers = set(method.partition("-")[2].split("+"))  # an ablation, or variants joined by "+"
        # split_masters splits fp32 masters into bf16 rows: bf16 compute on the CPU too (its CPU run in CI)
        compute = torch.bfloat16 if cuda or "split_masters" in levers else torch.float32
        bf16_reduce = bool(levers & {"bf16_reduce", "lean"})
        group_bytes = UNIT_GROUP_BYTES if "unit_groups" in levers else args.group_bytes
        sharded = ODCShard(model, group_bytes, comm="collective" if method == "odc_collective" else "auto",
                           param_dtype=None if bf16_reduce else compute,
                           prefetch=0 if "prefetch0" in levers else args.prefetch,
                           overlap_push="no_overlap" not in levers,
                           units=() if "module_hooks" in levers else bench_model(args).units,
                           gather_masters=bool(levers & {"gather_masters", "lean"}),
                           split_masters="split_masters" in levers,
                           offload_policy=CPUOffloadPolicy(pin_memory=cuda) if "offload" in levers else None,
                           mp_policy=MixedPrecisionPolicy(compute, torch.bfloat16) if bf16_reduce else None,
                           float8=args.float8, float8_gather=args.float8_gather,
                           mesh=hybrid_mesh(args.replicas, device.type))
        if "unbounded_pushes" in levers:  # [streams] 2: buffers freed with record_stream, not one site in flight
            sharded.comm.pushes_in_flight = None
        if "zeroed_grads" in levers:  # [fresh-grads]' ablation: autograd adds into zeroed buffers, as before it
            for group in sharded.engine.groups:
                group._fresh_grads = False
        for n in filter(None, map(pushes_in_flight, levers)):  # pushesN: N sites in flight
            sharded.comm.pushes_in_flight = n
        sharded.set_gradient_divide_factor(1.0)  # sum over ranks: the loss is normalised by the global tokens
        return sharded, contextlib.nullcontext, 1.0, None
    if baseline(method) in ("fsdp2", "fsdp2-offload", "fsdp2_nosync"):  # torchtitan's way (e2e_baselines.py)
        e2e_baselines.torchao_float8(model, args.float8)
        return e2e_baselines.fsdp2(model, decoder_layers(model, bench_model(args).units), device,
                                   offload=method.endswith("offload"), nosync=method.endswith("_nosync"),
                                   mesh=hybrid_mesh(args.replicas, device.type))
    if baseline(method) == "ddp":
        return e2e_baselines.ddp(model, device)
    raise ValueError(f"unknown method {method!r}")


def optimizer_for(method: str, model: nn.Module, device: torch.device, args) -> torch.optim.Optimizer:
    """The same ``torch.optim.AdamW`` for every method: fused on GPUs (``-unfused``: torch's foreach kernels);
    odc's ``park`` variant keeps its state on the host between steps, ``parkNN`` NN percent of it ([parking]),
    ``parkfit`` (``parkfitNN``) the share that keeps the peak under 90% (NN%) of the GPU's memory ([park-fit]);
    with ``park_late`` none of it comes back under the last backward ([park-backward]); with ``park_at_once`` its
    copies out are queued all at once after the step, not a chunk at a time ([park-trickle])."""
    fused = device.type == "cuda" and not method.endswith("-unfused")
    opt = torch.optim.AdamW(param_groups(model, no_decay=NO_DECAY), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, fused=fused or None)
    levers = method.partition("-")[2].split("+") if method.startswith("odc") else []
    shares = [f for f in map(park_fraction, levers) if f]
    budgets = [b for b in map(park_fit_budget, levers) if b]
    if shares or budgets:  # a share set, else the one that fits the budget ([park-fit])
        ParkedOptimizerState(opt, max(shares) if shares else None, budget=min(budgets, default=0.9),
                             under_backward="park_late" not in levers, trickle="park_at_once" not in levers)
    return opt


@functools.lru_cache(maxsize=2)
def workload_source(workload: str, vocab: int, seed: int, pool: int, seq: int, cap: int,
                    per_micro: int = 1) -> tuple[SyntheticSFT, int]:
    """The workload's samples and packing cap; one token pool per workload and process, shared by its runs."""
    if workload == "balanced":
        lengths = LengthConfig(kind="fixed", min_len=seq + 1, max_len=seq + 1)
    else:  # LongAlign's 8K-64K spread, scaled so the longest sample just fits the cap
        lengths = longalign_lengths(cap)
    source = SyntheticSFT(vocab, LengthDistribution(lengths, seed), seed, pool_tokens=pool)
    return source, seq * per_micro if workload == "balanced" else cap


def run_one(workload: str, method: str, balance: str, args, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    source, cap = workload_source(workload, args.vocab, args.seed, args.pool, args.seq, args.cap,
                                  args.balanced_micro_samples)
    bm = bench_model(args)  # our Llama or an HF model (e2e_hf)
    flops = CostModel.for_transformer(bm.layers, bm.dim, bm.matmul_params)  # MFU
    cost = CostModel.for_transformer(bm.layers, bm.dim, bm.matmul_params, args.attention_cost_factor)
    gc.collect()  # the previous run's objects must be gone before this one is measured
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    leftover = torch.cuda.memory_allocated(device) / 2**30 if cuda else None
    if args.warm_attention:  # cuDNN attention plans for every document length of the run, built before any
        # method is timed (once per process; see [attention-kernels])
        all_steps = args.warmup + args.steps + (method in args.profile) + args.memory_breakdown
        warm_attention([source[i].truncated(cap + 1).n_inputs for i in range(all_steps * args.batch)],
                       bm.heads, bm.kv_heads, bm.head_dim, device, args.attention)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = bm.build()
    wrapped, autocast, loss_scale, no_sync = wrap(method, model, device, args)
    bm.finish(wrapped)  # HF models: per-layer compile after wrapping (the CLI's order)
    opt = optimizer_for(method, wrapped, device, args)
    if baseline(method).startswith("fsdp2"):
        e2e_baselines.float8_scales_after_step(opt, wrapped, args.float8)
    events = StepEvents()  # a slow step's GC pauses and recompiles, by step
    collector = StepGarbageCollection(args.gc_every).__enter__()  # [step-gc], every method alike
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

        drained = [0.0]  # seconds the last prepare waited for the device's side streams

        def prepare(step: int):  # this rank's share of minibatch ``step``; every rank starts its step together
            minibatch = plan_step(source, step, args.batch, cap, balance, cost, rank, world,
                                  largest_last=wants_largest_last(opt) and "park_largest_first" not in method)
            if isinstance(wrapped, ODCShard):
                wrapped.begin_minibatch(len(minibatch.mine))
            collector.step(step)  # between steps, untimed ([step-gc])
            t = time.perf_counter()
            if cuda:  # a step ends with its current stream: work left on side streams (ODCShard's accumulator
                torch.cuda.synchronize(device)  # zeroing, [streams] 5) is counted in the next step, not overlapped
            drained[0] = time.perf_counter() - t
            dist.barrier()
            return minibatch

        def train(minibatch):
            return train_step(wrapped, opt, None, minibatch, device, max_norm=1.0, loss_scale=loss_scale,
                              autocast=autocast, no_sync=no_sync)

        for step in range(n_steps + (method in args.profile)):  # a profiled step comes last, not counted
            prof = step_profiler() if step == n_steps else None
            minibatch = prepare(step)
            events.take()
            if prof is not None:
                prof.__enter__()
            out = train(minibatch)
            if prof is not None:
                prof.__exit__(None, None, None)
                try:
                    profile = dict(kernel_summary(prof), step_s=out["compute_s"] + out["step_s"])
                except Exception as e:  # noqa: BLE001 - a profiler API change must not lose the run's timings
                    profile = {"error": f"{type(e).__name__}: {e}"}
                continue
            my_sizes = minibatch.my_sizes()
            happened = events.take()
            table = gather_stats([out["loss"], out["compute_s"] + drained[0], out["step_s"], len(minibatch.mine),
                                  sum(my_sizes), sum(map(cost, my_sizes)), out["host_s"],
                                  sum(map(flops, my_sizes))], device)
            wall = (table[:, 1] + table[:, 2]).max().item()
            steps.append({"step": step + 1, "loss": table[:, 0].sum().item(), "grad_norm": out["grad_norm"],
                          "step_s": wall, "tokens": int(table[:, 4].sum()), "flops": table[:, 7].sum().item(),
                          "rank_compute_s": table[:, 1].tolist(), "rank_step_s": table[:, 2].tolist(),
                          "rank_micro_batches": [int(x) for x in table[:, 3]], "rank_cost": table[:, 5].tolist(),
                          "rank_host_s": table[:, 6].tolist(), **happened})  # rank 0's gc_s, compiled_frames
        measured = steps[args.warmup:]
        total_s = sum(s["step_s"] for s in measured)
        alloc = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None
        parked = [None] * world  # the share of the state each rank parked at the end ([park-fit] chooses its own)
        dist.all_gather_object(parked, getattr(parking_of(opt), "fraction", None))
        memory = None
        if args.memory_breakdown:  # after the peaks above were read: peak_breakdown resets them
            minibatch = prepare(n_steps + (method in args.profile))
            memory = memory_record(wrapped, opt, functools.partial(train, minibatch), device)
        result = {
            "workload": workload, "method": method, "balance": balance,
            "tokens_per_s": sum(s["tokens"] for s in measured) / total_s,
            "mfu": mfu(sum(s["flops"] for s in measured), total_s, peak, world),
            "peak_alloc_gib": alloc, "peak_reserved_gib": reserved, "nvshmem_heap_gib": heap / 2**30,
            "resident_after_wrap_gib": resident, "leftover_before_gib": leftover, "park_fraction_by_rank": parked,
            "step_s_mean": total_s / len(measured), "step_s_min": min(s["step_s"] for s in measured),
            "step_s_max": max(s["step_s"] for s in measured),
            "step_s_stdev": statistics.pstdev([s["step_s"] for s in measured]),
            # what the balancer achieved by the cost model: 1.0 = every rank had the same work
            "rank_cost_max_over_mean": sum(max(s["rank_cost"]) for s in measured)
            / sum(sum(s["rank_cost"]) / world for s in measured),
            **{key: [sum(s[key][r] for s in measured) for r in range(world)]
               # host: time to queue the forward/backward work (close to compute = launch-bound)
               for key in ("rank_compute_s", "rank_step_s", "rank_host_s")},
            "losses": [s["loss"] for s in steps], "steps": steps, "profile": profile, "memory_breakdown": memory,
            # [fresh-grads] on in some group (odc; zeroed_grads turns it off): None for the other methods
            "fresh_grads": (any(g._fresh_grads for g in wrapped.engine.groups)
                            if isinstance(wrapped, ODCShard) else None),
        }
    finally:  # the NVSHMEM heap must be freed even if the run failed, or the next run cannot get it
        events.close()
        collector.__exit__(None, None, None)
        if isinstance(wrapped, ODCShard):
            wrapped.close()
    del wrapped, model, opt
    return result


def memory_record(wrapped: nn.Module, opt: torch.optim.Optimizer, train, device: torch.device) -> dict | None:
    """``--memory-breakdown``: one more step (not counted), every rank's record gathered (rank order).

    CUDA: the step's peak by category (``odcfsdp.memory.peak_breakdown``, every method; odc adds its heap, outside
    torch's allocator). odc, on every device: ``memory_breakdown`` at the optimizer's step pre-hook (after the last
    backward and ``clip_grad_norm_``) and after the step. Other methods on CPU: nothing (no step is run).
    """
    odc = isinstance(wrapped, ODCShard)
    if device.type != "cuda" and not odc:
        return None
    points: dict = {}

    def before_step(*_args) -> None:  # a step pre-hook must return None
        points["before_step"] = memory_breakdown(wrapped, opt).as_dict()

    handle = opt.register_step_pre_hook(before_step) if odc else None
    try:
        peak = None
        if device.type == "cuda":
            now = memory_breakdown(wrapped, opt) if odc else None
            outside = {k: getattr(now, k) for k in now.outside_torch} if now is not None else {}
            peak = peak_breakdown(train, functools.partial(known_tensors, wrapped, opt), optimizer=opt, device=device,
                                  outside=outside)
        else:
            train()
    finally:
        if handle is not None:
            handle.remove()
    if odc:
        points["after_step"] = memory_breakdown(wrapped, opt).as_dict()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"peak": peak, "points": points})
    return {"ranks": gathered}


def main_worker(args) -> list[dict] | None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.cpu_ranks \
        else torch.device("cpu")
    results, failed, where = [], [], (harness.device_name(device), dist.get_world_size())
    if device.type == "cuda" and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        # NVSHMEM's heap is sized once per process, by the first model; the variants' fp32 rows need the most
        # (fp32 rows + fp32 accumulators: 8 bytes per parameter / N, plus slack for padding and NVSHMEM's own use).
        per_rank = -(-bench_model(args).params // dist.get_world_size())
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(int(per_rank * 8 * 1.05) + (256 << 20))
    for w, m, b in runs_for(args.workloads, args.methods, args.ablate, args.variants, args.balancers):
        try:
            results.append(run_one(w, m, b, args, device))
        except Exception as e:  # noqa: BLE001 - one method failing must not lose the others' results
            if not args.keep_going:
                raise
            failed.append({"workload": w, "method": m, "balance": b, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"[rank {dist.get_rank()}] {w}/{m}/{b} failed: {failed[-1]['error']}", flush=True)
            dist.barrier()  # the next run_one collects the failed run's memory before it measures
        if dist.get_rank() == 0:
            write_outputs(results, failed, args, *where, final=False)
    if dist.get_rank() == 0:
        write_outputs(results, failed, args, *where, final=True)
    return results


def main(argv=None) -> None:
    args = parse(argv)
    if args.alloc_conf:  # before the first CUDA allocation
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", args.alloc_conf)
    args.alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if args.isolate:  # no process group here: a child per (workload, method)
        e2e_isolate.run(args, runs_for(args.workloads, args.methods, args.ablate, args.variants, args.balancers))
    elif args.cpu_ranks:
        spawn(main_worker, args.cpu_ranks, args, timeout=3600)
    else:
        init_torchrun()
        try:
            main_worker(args)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
