"""Communication microbenchmark: ODC gather / scatter-accumulate vs NCCL, in one run on the same GPUs.

    torchrun --nproc-per-node=2 -m benchmarks.comm_bench --out results/comm --commit <sha>
    python -m benchmarks.comm_bench --cpu-ranks 2 --sizes-mib 1 --iters 9   # CPU smoke run: shm vs gloo

For each group size (bf16 bytes of the unsharded group, shaped like a Llama block:
q, k, v, o, gate, up, down) it times, per rank, with CUDA events (median of
``--iters`` after warm-up, a barrier before each launch so ranks start together):

* gather: ``NvshmemTransport.gather`` (one Triton kernel: fetch + unpack) for several
  (block, warps) settings vs ``CollectiveTransport.gather`` (NCCL
  all_gather_into_tensor + copy-out into the parameter-major buffer);
* scatter-accumulate: ``NvshmemTransport.scatter_accumulate`` (remote fp32 atomics)
  for several settings vs ``CollectiveTransport.scatter_accumulate`` (copy-in to fp32
  rank-major + NCCL reduce_scatter_tensor in fp32 + add into the accumulator).

Every variant's result is checked against the collective path first: gathered
parameters equal to the bit (only the parameters' elements: the unsharded buffer's
unused tails between parameters are written by neither), accumulators within fp32
rounding. On CPU (``--cpu-ranks``) the same harness compares the ``shm`` transport
with ``collective`` over gloo, timed with the wall clock. Bandwidth is given as
*bus* GB/s, the bytes that cross the interconnect per rank ((N-1)/N x group bytes,
the NCCL-tests convention) and as *algorithm* GB/s (group bytes / time). p10 / p90 are
``statistics.quantiles``' (exclusive method): with fewer than 9 iterations they extrapolate
beyond the observed times (even below zero). Writes
``comm_bench.json`` and ``comm_bench.md`` under ``--out`` (rank 0).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from odcfsdp.sharding.placement.layout import plan_groups
from odcfsdp.sharding.placement.mesh import ShardMesh
from odcfsdp.sharding.transport import make_transport
from odcfsdp.sharding.transport.collective import CollectiveTransport

from benchmarks.timing import elapsed_ms
from benchmarks import harness, provenance

BLOCK_SHAPE = {"q": 1.0, "k": 0.25, "v": 0.25, "o": 1.0, "gate": 2.75, "up": 2.75, "down": 2.75}
GATHER_VARIANTS = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]
SCATTER_VARIANTS = [(1024, 4), (2048, 4), (4096, 8)]


def block_layout(group_bytes: int, world: int):
    """One group's layout holding a Llama block's weights (``BLOCK_SHAPE``) of ``group_bytes`` bf16 bytes."""
    elems = group_bytes // 2
    total = sum(BLOCK_SHAPE.values())
    named = [
        (k, torch.empty(max(1, int(elems * v / total)), dtype=torch.float32, requires_grad=True))
        for k, v in BLOCK_SHAPE.items()
    ]
    (layout,) = plan_groups(named, world, 1 << 62, torch.bfloat16)
    return layout


def _elapsed_us(fn, launches: int = 1) -> float:
    """Microseconds ``launches`` calls of ``fn`` take: CUDA events on GPUs, the wall clock on CPU."""
    return elapsed_ms(fn, torch.cuda.is_available() and torch.cuda.is_initialized(), launches) * 1e3


def time_op(fn, iters: int, warmup: int = 3) -> list[float]:
    """Per-launch times in microseconds, ranks aligned by a barrier before each."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(_elapsed_us(fn))
    return times


def time_pipelined(fn, launches: int = 10, repeats: int = 5) -> float:
    """Microseconds per launch when ``launches`` run back to back (median over ``repeats``)."""
    per = []
    for _ in range(repeats):
        dist.barrier()
        per.append(_elapsed_us(fn, launches) / launches)
    return statistics.median(per)


def measure(fn, iters: int, group_bytes: int, world: int) -> dict:
    """Aligned (a barrier before each launch) and pipelined (back to back) timings of ``fn``."""
    times = time_op(fn, iters)
    med = statistics.median(times)
    q = statistics.quantiles(times, n=10)
    pipe = time_pipelined(fn)
    bus = (world - 1) / world * group_bytes / 1e3
    return {
        "median_us": med, "p10_us": q[0], "p90_us": q[-1],
        "bus_gbps": bus / med, "alg_gbps": group_bytes / med / 1e3,
        "pipelined_us": pipe, "pipelined_bus_gbps": bus / pipe,
    }


def same_params(layout, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two parameter-major buffers hold the same parameters (the unused tails between them are ignored)."""
    return all(torch.equal(layout.param_view(got, i), layout.param_view(want, i)) for i in range(len(layout.slots)))


def bench_size(group_bytes: int, rank: int, world: int, device: torch.device, iters: int) -> dict:
    """Check, then time, every gather and scatter-accumulate variant at one group size."""
    layout = block_layout(group_bytes, world)
    mesh = ShardMesh(device)
    odc = make_transport("auto", mesh)  # nvshmem on GPUs, shm on CPU
    nccl = CollectiveTransport(mesh)
    for t in (odc, nccl):
        t.setup([layout], torch.bfloat16, [torch.float32])
    gen = torch.Generator(device=device).manual_seed(rank)
    row = torch.randn(layout.row_len, device=device, generator=gen).to(torch.bfloat16)
    odc.rows[0].copy_(row)
    nccl.rows[0].copy_(row)
    _sync(device)
    dist.barrier()
    out = {"group_bytes": group_bytes, "row_len": layout.row_len, "gather": {}, "scatter": {}}

    # -- gather ------------------------------------------------------------------------
    want = torch.empty(layout.unsharded_numel, dtype=torch.bfloat16, device=device)
    nccl.gather(0, want)
    got = torch.full_like(want, float("nan"))
    out["gather"]["nccl_allgather+copyout"] = measure(lambda: nccl.gather(0, got), iters, group_bytes, world)
    tunable = hasattr(odc, "tune")  # nvshmem's Triton kernels
    for block, warps in GATHER_VARIANTS if tunable else [(None, None)]:
        name = f"odc_b{block}_w{warps}" if tunable else f"odc_{odc.name}"
        if tunable:
            odc.tune(block, warps, odc.scatter_block, odc.scatter_warps)
        got.fill_(float("nan"))
        odc.gather(0, got)
        _sync(device)
        if not same_params(layout, got, want):
            raise AssertionError(f"ODC gather ({name}) differs from NCCL at {group_bytes} bytes")
        out["gather"][name] = measure(lambda: odc.gather(0, got), iters, group_bytes, world)
    if tunable:
        odc.gather_mode = "copy_engine"
        got.fill_(float("nan"))
        odc.gather(0, got)
        _sync(device)
        if not same_params(layout, got, want):
            raise AssertionError(f"ODC copy-engine gather differs from NCCL at {group_bytes} bytes")
        out["gather"]["odc_copy_engine"] = measure(lambda: odc.gather(0, got), iters, group_bytes, world)

    # -- scatter-accumulate --------------------------------------------------------------
    grad = torch.randn(layout.unsharded_numel, device=device, generator=gen).to(torch.bfloat16)
    nccl.accumulators[0].zero_()
    nccl.scatter_accumulate(0, grad)
    want_acc = nccl.accumulators[0].clone()
    out["scatter"]["nccl_copyin+reducescatter"] = measure(
        lambda: nccl.scatter_accumulate(0, grad), iters, group_bytes, world)
    for block, warps in SCATTER_VARIANTS if tunable else [(None, None)]:
        name = f"odc_b{block}_w{warps}" if tunable else f"odc_{odc.name}"
        if tunable:
            odc.tune(odc.gather_block, odc.gather_warps, block, warps)
        scatter = lambda: odc.scatter_accumulate(0, grad)  # noqa: E731
        settle(odc, device)  # peers' earlier timed launches may still be adding into our accumulator
        odc.accumulators[0].zero_()
        settle(odc, device)
        scatter()
        settle(odc, device)
        if not torch.allclose(odc.accumulators[0], want_acc, rtol=1e-6, atol=1e-6):
            raise AssertionError(f"ODC scatter ({name}) differs at {group_bytes} bytes")
        dist.barrier()  # the timed pushes below add into peers' accumulators: only once every rank has checked
        out["scatter"][name] = measure(scatter, iters, group_bytes, world)
    odc.close()
    nccl.close()
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settle(transport, device: torch.device) -> None:
    """Every rank's pushes so far are complete and visible (the step protocol's quiesce + a barrier)."""
    _sync(device)
    transport.quiesce()
    dist.barrier()


def best(entries: dict, prefix: str, key: str = "bus_gbps") -> tuple[str, dict]:
    """The fastest (highest ``key``) entry whose name starts with ``prefix``."""
    name = max((k for k in entries if k.startswith(prefix)), key=lambda k: entries[k][key])
    return name, entries[name]


def _table(results: list[dict], key: str, us: str) -> list[str]:
    lines = [
        "| group (bf16) | ODC gather | NCCL all-gather + copy-out | ratio | ODC scatter-acc | "
        "NCCL copy-in + reduce-scatter (fp32) | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        gname, g = best(r["gather"], "odc", key)
        sname, s = best(r["scatter"], "odc", key)
        ng, ns = r["gather"]["nccl_allgather+copyout"], r["scatter"]["nccl_copyin+reducescatter"]
        lines.append(
            f"| {r['group_bytes'] >> 20} MiB | {g[key]:.0f} GB/s ({gname[4:]}) | {ng[key]:.0f} GB/s | "
            f"{ng[us] / g[us]:.2f}x | {s[key]:.0f} GB/s ({sname[4:]}) | {ns[key]:.0f} GB/s | {ns[us] / s[us]:.2f}x |"
        )
    return lines


def report(results: list[dict], meta: dict) -> str:
    """The markdown report of ``results`` (rank 0's figures)."""
    lines = [
        "# Communication microbenchmark: ODC vs NCCL",
        "",
        f"- device: {meta['device']} x {meta['world_size']}",
        f"- date: {meta['date']}  commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- torch {meta['torch']}, triton {meta['triton']}; rank 0's figures",
        "- GB/s are *bus* GB/s: (N-1)/N x group bytes per launch, the bytes that cross NVLink per rank"
        " (algorithm GB/s, group bytes / time, are in the JSON). Best ODC variant per row, named in brackets.",
        "",
        f"## One launch at a time (a barrier before each; median of {meta['iters']})",
        "",
        "This is how a training step issues them: one group per layer.",
        "",
        *_table(results, "bus_gbps", "median_us"),
        "",
        "## Back to back (10 launches between two events; median of 5)",
        "",
        *_table(results, "pipelined_bus_gbps", "pipelined_us"),
    ]
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    """The command line's arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default="results/comm")
    parser.add_argument("--commit", default=provenance.default_commit())
    parser.add_argument("--cpu-ranks", type=int, default=0, help="spawn this many gloo ranks on the CPU (shm vs gloo)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """Under torchrun on GPUs, or ``--cpu-ranks`` spawned CPU ranks: run the benchmark, rank 0 writes the files."""
    args = parse(argv)
    harness.run_benchmark_ranks(worker, args, args.cpu_ranks)


def worker(args, device: torch.device | None) -> None:
    """One rank's part of the benchmark (``device`` None: a CPU rank that ``spawn`` started)."""
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(3 * max(args.sizes_mib) << 20))
    results = []
    for mib in args.sizes_mib:
        res = bench_size(mib << 20, rank, world, device, args.iters)
        results.append(res)
        if rank == 0:
            g, s = best(res["gather"], "odc")[1], best(res["scatter"], "odc")[1]  # noqa: F841
            nccl_g = res["gather"]["nccl_allgather+copyout"]["bus_gbps"]
            nccl_s = res["scatter"]["nccl_copyin+reducescatter"]["bus_gbps"]
            print(f"{mib:4d} MiB  gather odc {g['bus_gbps']:6.0f} nccl {nccl_g:6.0f}"
                  f" | scatter odc {s['bus_gbps']:6.0f} nccl {nccl_s:6.0f} GB/s", flush=True)
    if rank == 0:
        try:
            import triton
            triton_version = triton.__version__
        except ImportError:
            triton_version = "-"
        cpu = device.type == "cpu"
        command = (f"python -m benchmarks.comm_bench --cpu-ranks {world}" if cpu else
                   f"torchrun --nproc-per-node={world} -m benchmarks.comm_bench") + f" --iters {args.iters}"
        meta = harness.meta(args.commit, command, harness.device_name(device), world_size=world, iters=args.iters,
                            torch=torch.__version__, triton=triton_version)
        harness.write_result(args.out, "comm_bench", meta, results, report(results, meta))
        print(report(results, meta))
    dist.barrier()


if __name__ == "__main__":
    main()
