"""One rank's optimizer step at real shard sizes: FSDP2's and odcfsdp's, against HBM bandwidth.

    python -m benchmarks.optim_bench --sizes 1b 8b --world 2 --out results/optim/<name> --commit <sha>
    python -m benchmarks.optim_bench --sizes tiny --iters 2 --warmup 1   # CPU smoke run

The optimizer step touches only the rank's own rows, so one GPU measures it exactly: the shard
shapes are those of rank 0 of ``--world`` ranks (``ceil(dim0 / N)`` rows of every parameter,
FSDP2's dim-0 sharding), packed into flat groups of ``--group-bytes`` as ODCShard packs them.
The global-norm all-reduce (one scalar) is left out: it is the same for every variant.

Variants, each timed by CUDA events (medians of ``--iters`` steps after ``--warmup``; twice as many for the
odc variants, see below):

* ``fsdp2``: what FSDP2's training loop runs: ``clip_grad_norm_`` (foreach norm, then a multiply
  of every gradient) and ``torch.optim.AdamW(fused=True)`` over one fp32 tensor per parameter;
* ``fsdp2_dtensor``: the same on DTensor parameters (a 1-rank mesh): FSDP2's dispatch overhead;
* ``odc_torch``: ``fsdp2_dtensor`` plus what ODCShard adds after a torch optimizer's step:
  publishing the fp32 masters into the bf16 rows peers read, and zeroing the fp32 accumulators
  (on CUDA on a side stream, under the next forward, as ODCShard does: [streams] 5);
* ``odc_gather_masters``: ``odc_torch`` with ``gather_masters=True``: peers read the masters, nothing
  is published ([gather-masters]);
* ``odc_split_masters``: ``odc_torch`` with ``split_masters=True``: the masters joined from their rows and low
  bits before the step and split again after it (where ODCShard splits them, at the next minibatch's first forward,
  the pass is on the same path: [split-masters]);
* ``odc_lean``: that plus bf16 accumulators (``mp_policy`` reduce_dtype): at the sync the bf16
  accumulator is cast into fp32 ``.grad``, after the step the bf16 accumulator is zeroed ([precision]).

Every timed step is followed by a stand-in of the next forward (``--forward-ms`` of back-to-back
bf16 matmuls, compute-bound like a decoder layer's), for every variant alike: what is timed is the
step's cost on the training loop's path: the step itself (events on the current stream, the
gradient refill before it not counted, queued behind a stand-in of the backward's tail so that
the host's dispatch overlaps GPU work as in training) plus, for an odc variant, what its zeroing on the side
stream slows the stand-in by: the variant alternates steps with and without the zeroing, and the
stand-in's median time with it less its median time without (0 if that is below 0). On CPU, or with
``--forward-ms 0``, there is no side stream and no stand-in: the zeroing is in the step, and the
host's dispatch shows in the events when it is slower than the GPU.

"bytes/param" counts the minimum traffic of each variant on the step's path (every tensor read or
written once per pass; ``+4`` is the zeroing under the forward); GB/s = those bytes / time, set
against a device-to-device copy measured in the same call.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from odcfsdp.models.llama import Llama, llama_config
from odcfsdp.sharding.groups.split_master import join_low_bits, split_low_bits

from benchmarks import timing
from benchmarks import harness, provenance

ALIGN = 8  # elements: ODCShard's segments start and end on 16 bytes of bf16 (and 32 of fp32)
HP = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
BYTES_PER_PARAM = {  # minimum traffic per parameter (fp32 master/grad/moments, bf16 row)
    "fsdp2": 4 + 8 + 16 + 12,  # norm reads g; clip reads and writes g; AdamW reads p g m v, writes p m v
    "fsdp2_dtensor": 4 + 8 + 16 + 12,
    "odc_torch": 4 + 8 + 16 + 12 + 6,  # + publish (read p, write row)
    "odc_gather_masters": 4 + 8 + 16 + 12,  # nothing published
    "odc_split_masters": 4 + 8 + 16 + 12 + 6 + 16,  # + publish, the join (read 4, write 4) and the split (4, 4)
    "odc_lean": 4 + 8 + 16 + 12 + 6,  # + cast the bf16 accumulator into fp32 .grad
}
ZERO_BYTES = {"odc_torch": 4, "odc_gather_masters": 4, "odc_split_masters": 4, "odc_lean": 2}  # zeroing the accumulator (under the forward)


def shard_shapes(size: str, vocab: int, world: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape of rank 0's shard) of every parameter of the named Llama."""
    with torch.device("meta"):
        model = Llama(llama_config(size, vocab))
    return [(n, (-(-p.shape[0] // world), *p.shape[1:])) for n, p in model.named_parameters()]


def plan(shapes, world: int, group_bytes: int) -> list[list[tuple[str, int, int]]]:
    """Groups of (name, offset in the group's row, numel), as ODCShard packs them (bf16 unsharded bytes)."""
    groups, cur, used = [], [], 0
    for name, shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        seg = -(-numel // ALIGN) * ALIGN
        nbytes = 2 * world * seg
        if cur and used + nbytes > group_bytes:
            groups.append(cur)
            cur, used = [], 0
        cur.append((name, sum(s for _, _, s in cur), seg))
        used += nbytes
    groups.append(cur)
    return [[(n, off, seg) for n, off, seg in g] for g in groups]


def forward_standin(device, ms: float):
    """A function queueing about ``ms`` of compute-bound bf16 matmuls (a decoder layer's kind of work), standing in
    for the forward that follows a step; None on CPU or for ``ms`` <= 0."""
    if device.type != "cuda" or ms <= 0:
        return None
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    w, y = torch.randn_like(x), torch.empty_like(x)
    one = statistics.median(timing.timed(lambda: torch.mm(x, w, out=y), 5, 2))  # CUDA only
    reps = max(1, round(ms / one))

    def standin():
        for _ in range(reps):
            torch.mm(x, w, out=y)
    return standin


def copy_bandwidth(device, nbytes: int) -> float:
    """GB/s of a device-to-device copy (read + write counted), the roofline of these memory-bound passes."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = statistics.median(timing.timed(lambda: dst.copy_(src), 10, 3, cuda=device.type == "cuda"))
    del src, dst
    return 2 * nbytes / ms / 1e6


def one_rank_mesh(device):
    """A one-rank ``DeviceMesh`` (initialising a one-process group if there is none)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return init_device_mesh(device.type, (1,))


def run_size(size: str, args, device) -> dict:
    """Every variant's step timings at one model size (rank 0's shards of ``args.world`` ranks)."""
    shapes = shard_shapes(size, args.vocab, args.world)
    groups = plan(shapes, args.world, args.group_bytes)
    shape_of = dict(shapes)
    row_len = [sum(seg for _, _, seg in g) for g in groups]
    total = sum(row_len)
    gen = torch.Generator(device=device).manual_seed(0)

    def normal():
        return torch.empty(total, dtype=torch.float32, device=device).normal_(0, 0.02, generator=gen)

    master, grad_src = normal(), normal()
    acc = grad_src.clone()
    acc16 = grad_src.to(torch.bfloat16)  # odc_lean's accumulator; ``acc`` is then its fp32 copy (.grad)
    rows = master.to(torch.bfloat16)
    starts = [sum(row_len[:k]) for k in range(len(groups))]

    def param_views(buf):
        out = []
        for k, g in enumerate(groups):
            for name, off, _ in g:
                shape = shape_of[name]
                n = 1
                for d in shape:
                    n *= d
                out.append(buf[starts[k] + off : starts[k] + off + n].view(shape))
        return out

    def group_views(buf):
        return [buf[s : s + n] for s, n in zip(starts, row_len)]

    no_decay = [len(shape_of[name]) == 1 for g in groups for name, _, _ in g]
    results = {}

    # -- torch's optimizer ------------------------------------------------------------------------
    def torch_variant(name, dtensor):
        params = [torch.nn.Parameter(v) for v in param_views(master)]
        grads = param_views(acc)
        if dtensor:
            from torch.distributed.tensor import DTensor, Replicate

            mesh = one_rank_mesh(device)
            params = [torch.nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False))
                      for p in params]
            grads = [DTensor.from_local(g, mesh, [Replicate()], run_check=False) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        decay = [p for p, nd in zip(params, no_decay) if not nd]
        keep = [p for p, nd in zip(params, no_decay) if nd]
        opt = torch.optim.AdamW([{"params": decay}, {"params": keep, "weight_decay": 0.0}], lr=HP["lr"],
                                betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], weight_decay=HP["weight_decay"],
                                fused=device.type == "cuda" or None)
        publish = name in ("odc_torch", "odc_split_masters")
        split = name == "odc_split_masters"
        row_views, master_views, acc_views = group_views(rows), group_views(master), group_views(acc)
        acc16_views = group_views(acc16)
        zeroed = acc16_views if name == "odc_lean" else acc_views

        # every step sees a full gradient (a zeroed accumulator would make the step trivial); odc_lean's are in its
        # bf16 accumulator, which the sync casts into ``acc``
        stale = torch.zeros((), dtype=torch.int32, device=device)
        if split:  # from rows published from these masters (the variants before stepped them without publishing)
            torch._foreach_copy_(row_views, master_views)
        lows = [split_low_bits(m, row, stale) for row, m in zip(row_views, master_views)] if split else []
        refill = functools.partial((acc16 if name == "odc_lean" else acc).copy_, grad_src)
        current = torch.cuda.current_stream(device) if device.type == "cuda" else None

        marks = timing.Marks(device)
        overlaps = aside is not None and name.startswith("odc")  # zeroing under the stand-in

        def step(zero_aside: bool):
            refill()
            if standin is not None:  # the backward's tail: the host queues the step while the GPU is busy, as in
                standin()            # training, so the step's time is the GPU's and not the host's dispatch
            marks.mark("start")
            if split:  # the sync's join: every master whole again from its row and low bits
                for row, low, m in zip(row_views, lows, master_views):
                    join_low_bits(row, low, m)
                lows.clear()
            if name == "odc_lean":  # the sync: .grad is the bf16 accumulator cast to fp32
                torch._foreach_copy_(acc_views, acc16_views)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if publish:
                torch._foreach_copy_(row_views, master_views)
            if split:  # the next minibatch's first forward splits them again (the same stream, the same path)
                lows.extend(split_low_bits(m, row, stale) for row, m in zip(row_views, master_views))
            if aside is None and name.startswith("odc"):  # no stand-in forward to overlap: zeroed in the step
                torch._foreach_zero_(zeroed)
            marks.mark("stepped")
            if aside is None:
                return
            if zero_aside:  # ODCShard's zeroing: on its push stream, after the step read the gradients
                aside.wait_stream(current)
                with torch.cuda.stream(aside):
                    torch._foreach_zero_(zeroed)
            standin()  # the next forward
            current.wait_stream(aside)  # the forward ends for the path once the zeroing beside it has too
            marks.mark("forward")

        # An odc variant alternates steps with and without the zeroing beside the forward (the refill rewrites the
        # gradients either way): the same step before both, so the GPU's clocks are in the same state when the
        # forward starts, and the forward's median difference is what the zeroing costs the path.
        step_ms, forward_ms = [], {True: [], False: []}
        for i in range(args.warmup + args.iters * (2 if overlaps else 1)):
            zero_aside = overlaps and i % 2 == 0
            step(zero_aside)
            t = marks.read()
            if i >= args.warmup:
                step_ms.append(t["stepped"] - t["start"])
                forward_ms[zero_aside].append(t.get("forward", t["stepped"]) - t["stepped"])
        del opt, params, grads
        slowdown = statistics.median(forward_ms[True]) - statistics.median(forward_ms[False]) if overlaps else 0.0
        return step_ms, slowdown

    standin = forward_standin(device, args.forward_ms)
    aside = torch.cuda.Stream(device) if standin is not None else None  # nothing to overlap: zeroed in the step
    for name, dtensor in (("fsdp2", False), ("fsdp2_dtensor", True), ("odc_torch", True),
                          ("odc_gather_masters", True), ("odc_split_masters", True), ("odc_lean", True)):
        if name in args.variants:
            results[name] = torch_variant(name, dtensor)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    out = {"size": size, "world": args.world, "params_on_rank": total, "groups": len(groups), "variants": {}}
    for name, (ms, slowdown) in results.items():
        # on the path: the step, plus what the zeroing beside the next forward slows that forward by (a measured
        # difference below zero is noise: it adds nothing, and is kept in the JSON as measured)
        slow = max(0.0, slowdown)
        med = statistics.median(ms) + slow
        on_path = BYTES_PER_PARAM[name] + (0 if aside else ZERO_BYTES.get(name, 0))
        out["variants"][name] = {
            "ms_median": med, "ms_min": min(ms) + slow, "ms_max": max(ms) + slow,
            "step_ms_median": statistics.median(ms), "forward_slowdown_ms": slow,
            "forward_slowdown_ms_measured": slowdown, "bytes_per_param": on_path,
            "zero_bytes_per_param_aside": ZERO_BYTES.get(name, 0) if aside else 0,
            "gb_per_s": on_path * total / med / 1e6,
        }
    return out


def report(res: list[dict], meta: dict) -> str:
    """The markdown table of ``res``."""
    lines = ["# Optimizer step on one rank's shards", "",
             f"- device: {meta['device']}; date {meta['date']}; commit {meta['commit']}",
             f"- command: `{meta['command']}`",
             f"- shards of rank 0 of {meta['world']} ranks (dim-0), groups of {meta['group_bytes'] >> 20} MiB; "
             f"copy bandwidth measured in the same call: {meta['copy_gb_s']:.0f} GB/s (read + write)",
             "- every timed step is followed by a stand-in of the next forward "
             f"({meta.get('forward_ms', 0):g} ms of bf16 matmuls, odc's accumulator zeroing overlapping it); ms: "
             "median of the steps, plus for odc what the zeroing slowed the stand-in by ('slowed': its median with "
             "the zeroing less its median without, alternate steps of the same variant; 0 if below); GB/s: the "
             "variant's minimum traffic on the step's path / time (+N: bytes zeroed under the forward)", "",
             "| size | params on rank | variant | ms (min-max) | slowed | bytes/param | GB/s | % of copy | vs fsdp2 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        base = r["variants"].get("fsdp2", {}).get("ms_median")
        for name, v in r["variants"].items():
            ratio = f"{v['ms_median'] / base:.2f}x" if base else "-"
            aside = f" +{v['zero_bytes_per_param_aside']}" if v.get("zero_bytes_per_param_aside") else ""
            lines.append(f"| {r['size']} | {r['params_on_rank'] / 1e9:.2f}B | {name} | {v['ms_median']:.1f} "
                         f"({v['ms_min']:.1f}-{v['ms_max']:.1f}) | {v['forward_slowdown_ms']:.1f} | "
                         f"{v['bytes_per_param']}{aside} | "
                         f"{v['gb_per_s']:.0f} | "
                         f"{v['gb_per_s'] / meta['copy_gb_s']:.0%} | {ratio} |")
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    """The command line's arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["1b", "8b"])
    p.add_argument("--world", type=int, default=2, help="ranks the model is sharded over (rank 0's shards are timed)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--group-bytes", type=int, default=32 << 20)
    p.add_argument("--variants", nargs="+", default=list(BYTES_PER_PARAM), choices=list(BYTES_PER_PARAM))
    p.add_argument("--forward-ms", type=float, default=50.0,
                   help="length of the stand-in forward after every step (CUDA; 0: none)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--commit", default=provenance.default_commit())
    return p.parse_args(argv)


def main(argv=None) -> None:
    """Time every variant at every size on this process's device; write the report (and files under ``--out``)."""
    import torch.distributed as dist

    args = parse(argv)
    had_group = dist.is_initialized()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    meta = harness.meta(args.commit, harness.command(__name__, argv), harness.device_name(device), world=args.world,
                        group_bytes=args.group_bytes, forward_ms=args.forward_ms if device.type == "cuda" else 0,
                        copy_gb_s=copy_bandwidth(device, 4 << 30 if device.type == "cuda" else 64 << 20))
    res = []
    for size in args.sizes:
        res.append(run_size(size, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(report(res, meta), flush=True)
    if args.out:
        harness.write_result(args.out, "optim_bench", meta, res, report(res, meta))
    if dist.is_initialized() and not had_group:  # one_rank_mesh's group: leave the caller's process as it was
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
