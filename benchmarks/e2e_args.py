"""``benchmarks/e2e_bench.py``'s command line: its flags, the ablations and memory variants of odc it can add, and
the checks that refuse a misfit in one line before any rank starts."""

from __future__ import annotations

import argparse
import sys

from benchmarks import e2e_isolate, harness
from benchmarks.e2e_hf import resolve_args
from odcfsdp.models.attention import ATTENTION_BACKENDS
from odcfsdp.loop import GC_EVERY_DEFAULT
from odcfsdp.sharding.groups.float8 import FLOAT8_GATHER_DEFAULT

DESCRIPTION = "End-to-end training throughput: odcfsdp vs PyTorch FSDP2 vs DDP, one invocation, the same GPUs."
ABLATIONS = ("prefetch0", "no_overlap", "unfused", "module_hooks")  # odc with one speed feature turned off
# odc with memory levers on: the fp32 masters gathered instead of bf16 rows ([gather-masters]), or held as the bf16
# rows plus 16 low bits inside a minibatch (split_masters, [split-masters]), bf16 gradient
# accumulators (mp_policy reduce_dtype, [precision]), both ("lean"), or CPUOffloadPolicy (host masters, CPU step;
# FSDP2 runs it too, as fsdp2-offload: the baseline an offloading user has); or with one lever off: pushes unbounded
# (each gradient buffer freed with record_stream, not one site in flight, [streams] 2), or N sites of them in flight
# (pushesN, N = 1-9); or autograd's gradients added into zeroed buffers, as before [fresh-grads] (zeroed_grads,
# its ablation); or one group per decoder
# layer (no group_bytes budget inside a unit: one gather and one push launch per layer instead of one per group);
# or the optimizer's state parked on the host between steps ([parking]): all of it (park), or a share (park60:
# the first 60% of its bytes), or the share that keeps the peak under 90% of the GPU's memory (parkfit, the CLI's
# default, [park-fit]) or under NN% of it (parkfit51: 51% of an H200 is 90% of an 80 GB H100); with park_late, all of
# the parked share comes back once the micro-batches are done, none under the last backward ([park-backward]); with
# park_at_once, its copies out are queued all at once after the step, not a chunk at a time by a helper thread
# ([park-trickle], the default); with park_largest_first, a rank's micro-batches run in the plan's order (largest
# first), not with the largest last ([park-backward] 0).
VARIANTS = ("gather_masters", "split_masters", "bf16_reduce", "lean", "offload", "unbounded_pushes", "pushesN",
            "zeroed_grads", "unit_groups", "park", "parkNN", "parkfit", "parkfitNN", "park_late", "park_at_once",
            "park_largest_first")


def _percent(lever: str, name: str, alone: float) -> float | None:
    """``alone`` for the lever ``name``, NN/100 for ``nameNN`` (01-99), else None."""
    if lever == name:
        return alone
    digits = lever[len(name):]
    if lever.startswith(name) and len(digits) == 2 and digits.isdigit() and digits != "00":
        return int(digits) / 100
    return None


def park_fraction(lever: str) -> float | None:
    """The share of the optimizer's state a ``park`` or ``parkNN`` lever parks (NN percent, 01-99); None otherwise."""
    return _percent(lever, "park", 1.0)


def park_fit_budget(lever: str) -> float | None:
    """The memory budget of a ``parkfit`` (0.9) or ``parkfitNN`` (NN percent, 01-99) lever; None otherwise."""
    return _percent(lever, "parkfit", 0.9)


def pushes_in_flight(lever: str) -> int | None:
    """N for a ``pushesN`` lever (N = 1-9 sites whose pushes the current stream may run ahead of, [streams] 2);
    None otherwise."""
    digit = lever.removeprefix("pushes")
    return int(digit) if lever.startswith("pushes") and len(digit) == 1 and digit in "123456789" else None


def variant(text: str) -> str:
    """A ``--variants`` entry: one of VARIANTS, or several joined by '+' (argparse's error names the bad one)."""
    levers = text.split("+")
    templates = {v for v in VARIANTS if v.endswith(("NN", "N"))}  # parkNN, parkfitNN, pushesN: the digits' places
    bad = [v for v in levers if v in templates or (v not in VARIANTS and park_fraction(v) is None
                                                   and park_fit_budget(v) is None and pushes_in_flight(v) is None)]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown variant {bad[0]!r} (choose from {', '.join(VARIANTS)})")
    for how in ("park_late", "park_at_once", "park_largest_first"):
        if how in levers and not any(park_fraction(v) or park_fit_budget(v) for v in levers):
            raise argparse.ArgumentTypeError(f"variant {text!r}: {how} says how parked state moves; add a park, "
                                             "parkNN or parkfit lever")
    bounds = [v for v in levers if v == "unbounded_pushes" or pushes_in_flight(v) is not None]
    if len(bounds) > 1:
        raise argparse.ArgumentTypeError(f"variant {text!r} sets the pushes in flight twice ({', '.join(bounds)}): "
                                         "give one")
    return text


def parse(argv=None) -> argparse.Namespace:
    """e2e_bench's arguments, checked: a misfit (flags that cannot go together, an unknown model) exits in one line
    before any rank starts."""
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--size", default="1b", help="our Llama's size (--model llama)")
    p.add_argument("--model", default="llama", help="llama (ours) or hf:<name>; --model-path: a local HF config")
    p.add_argument("--model-path", default=None)
    p.add_argument("--vocab", type=int, default=None, help="the data's vocabulary (default: an HF model's, else 32000)")
    p.add_argument("--workloads", nargs="+", default=["balanced", "longtail"])
    p.add_argument("--methods", nargs="+", default=None,
                   help="default: odc odc_collective fsdp2 ddp (also: fsdp2_nosync); HF: odc hf_fsdp2 "
                   "(also: hf_fsdp2_nosync, hf_ddp)")
    p.add_argument("--ablate", nargs="*", default=[], choices=ABLATIONS,
                   help="extra odc runs with one speed feature off (before/after measurements)")
    p.add_argument("--variants", nargs="*", default=[], type=variant,
                   help="extra odc runs with memory levers on (VARIANTS), several in one run joined by '+' "
                        "(gather_masters+unit_groups): " + ", ".join(VARIANTS))
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
    p.add_argument("--float8", default=None, choices=("tensorwise", "rowwise"),
                   help="odc and fsdp2 methods: torchao's float8 linears (fsdp2: float8 all-gather when tensorwise)")
    p.add_argument("--float8-gather", action=argparse.BooleanOptionalAction, default=FLOAT8_GATHER_DEFAULT,
                   help="odc: gather tensorwise float8 weights in float8 (ODCShard's default)")
    p.add_argument("--gc-every", type=int, default=GC_EVERY_DEFAULT,
                   help="every method: Python's automatic GC off, gc.collect(1) every N steps between steps, untimed "
                        "(torchtitan's training.gc_freq; [step-gc]); 0: Python's automatic collection")
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP: odc and FSDP2 shard over world/R ranks and replicate R times (a 2-D mesh, FSDP2's "
                        "HSDP); 1: fully sharded. ddp replicates over every rank either way (the reference)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    harness.add_common(p, out="results/e2e", cpu_ranks=True)
    p.add_argument("--profile", nargs="*", default=[],
                   help="methods that run one more step under torch.profiler, after the measured ones "
                        "(kernel time by kind)")
    p.add_argument("--memory-breakdown", action="store_true",
                   help="one more step per method, not counted: on CUDA its peak by category (every method; "
                        "odcfsdp.memory.peak_breakdown), and odc's memory_breakdown before and after the "
                        "optimizer step")
    p.add_argument("--keep-going", action="store_true", help="record a failing run and go on with the others")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=False,
                   help="each (workload, method) in a process group of its own, one combined result: no compile "
                        "cache, torchao state or NVSHMEM heap size carries over from one method to the next")
    p.add_argument("--balancers", nargs="+", default=None, choices=("lb_mini", "lb_micro"),
                   help="odc's runs with only these balancers (collective methods always run lb_micro)")
    p.add_argument("--alloc-conf", default="",
                   help="PYTORCH_CUDA_ALLOC_CONF for every method (unless already set), e.g. expandable_segments:True "
                        "(on 2x H200 at ea1195c it left FSDP2's reserved memory as it was but raised odc's from 13.7 "
                        "to 17.2 GiB: the prefetch stream grows a segment of its own)")
    args = p.parse_args(argv)
    if args.gc_every < 0:
        p.error(f"--gc-every must be >= 0 (0: Python's automatic collection), got {args.gc_every}")
    if args.replicas < 1 or (args.cpu_ranks and args.cpu_ranks % args.replicas):
        p.error(f"--replicas {args.replicas}: a divisor of the ranks ({args.cpu_ranks or 'the world'}), at least 1")
    if args.compile and "module_hooks" in args.ablate:
        p.error("--ablate module_hooks cannot run with --compile: compiled layers need whole-layer hooks")
    if problem := e2e_isolate.misfit(args) or resolve_args(args):  # --model's defaults (vocabulary, methods), misfits
        p.error(problem)
    args.command = harness.command("benchmarks.e2e_bench", argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # --isolate's children: these, then their own
    return args
