"""Causal attention kernels of PyTorch on this GPU: forward + backward time by backend and length.

    python -m benchmarks.attention_bench --out results/attention --commit <sha>
    python -m benchmarks.attention_bench --device cpu --lengths 128 --heads 4 --kv-heads 2 --dim 16 \
        --backends flash math --iters 2 --out /tmp/attention   # CPU smoke run

The decoder runs attention outside its compiled parts, through
``scaled_dot_product_attention``; which backend it picks decides a large share of the
step on long documents. This script times forward + backward of causal grouped-query
attention (the 1B model's heads: 32 query, 8 key/value, head dim 64) for each backend
PyTorch offers here, at the lengths of the balanced (4K) and long-tailed (8K-64K)
workloads, and checks each one's output and gradients against flash attention. For
backends that build a plan per new shape (cuDNN) it also reports the first call at a
new length. Grouped heads go inside the kernel where the backend accepts
``enable_gqa``; otherwise keys and values are repeated first (and that copy is timed
with it). Writes ``attention_bench.json`` and ``.md``.

``--device cpu`` runs the same harness on PyTorch's CPU kernels (flash has a CPU
implementation; ``math``, the unfused reference, can be added with ``--backends``; cuDNN
and efficient are recorded as not run), timed with the wall clock: a smoke run of the
harness, its checks and its report, not a measurement of the GPU kernels.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.timing import timed
from benchmarks import harness

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
GPU_BACKENDS = ["flash", "cudnn", "efficient"]  # the default: the fused kernels a GPU offers


def attention(backend: str, q, k, v, gqa: bool):
    """Causal attention through one SDPA backend; grouped heads in the kernel (``gqa``) or by repeating k and v."""
    if not gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    with sdpa_kernel([BACKENDS[backend]]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa and q.shape[1] != k.shape[1])


def inputs(s: int, heads: int, kv_heads: int, dim: int, seed: int, device: str = "cuda"):
    """Random bf16 q, k, v (requiring grad) and an output gradient of one sequence of ``s`` tokens."""
    g = torch.Generator(device=device).manual_seed(seed)
    make = lambda h: torch.randn(1, h, s, dim, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    return make(heads), make(kv_heads), make(kv_heads), torch.randn(1, heads, s, dim, device=device,
                                                                     dtype=torch.bfloat16, generator=g)


def fwd_bwd(backend, q, k, v, dout, gqa):
    """One forward + backward (gradients into q, k, v); returns the output."""
    q.grad = k.grad = v.grad = None
    out = attention(backend, q, k, v, gqa)
    out.backward(dout)
    return out


def causal_flops(s: int, heads: int, dim: int) -> float:
    """Forward + backward matmul FLOPs of causal attention (half the square; backward 2.5x forward)."""
    return 3.5 * 2 * 2 * s * s * heads * dim / 2


def run(args) -> list[dict]:
    """One row per (length, backend, grouped heads in kernel or not): timings and the error against flash."""
    rows = []
    for s in args.lengths:
        q, k, v, dout = inputs(s, args.heads, args.kv_heads, args.dim, seed=s, device=args.device)
        ref = fwd_bwd("flash", q, k, v, dout, gqa=True).detach()
        ref_grads = [t.grad.detach().clone() for t in (q, k, v)]
        for backend in args.backends:
            for gqa in (True, False):
                label = f"{backend}{'' if gqa else ' (repeated kv)'}"
                row = {"backend": backend, "gqa_in_kernel": gqa, "length": s}
                try:
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    first = timed(lambda: fwd_bwd(backend, q, k, v, dout, gqa), 1, cuda=args.device != "cpu")[0]
                    out = fwd_bwd(backend, q, k, v, dout, gqa).detach()
                    err = max([((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()]
                              + [((t.grad.float() - r.float()).abs().max() / r.float().abs().max()).item()
                                 for t, r in zip((q, k, v), ref_grads)])
                    times = timed(lambda: fwd_bwd(backend, q, k, v, dout, gqa), args.iters, cuda=args.device != "cpu")
                    ms = statistics.median(times)
                    row |= {"ok": True, "first_call_ms": first, "ms": ms, "ms_min": min(times), "ms_max": max(times),
                            "tflops": causal_flops(s, args.heads, args.dim) / ms / 1e9, "max_rel_err_vs_flash": err}
                except RuntimeError as e:  # a backend that does not take these inputs here
                    row |= {"ok": False, "error": str(e).splitlines()[0][:300]}
                rows.append(row)
                print(label, s, {k_: v_ for k_, v_ in row.items() if k_ not in ("backend", "length")}, flush=True)
        del q, k, v, dout
    return rows


def report(rows: list[dict], meta: dict) -> str:
    """The markdown table of ``rows`` (speed relative to flash with grouped heads in the kernel)."""
    lines = ["# Causal attention forward + backward by backend", "",
             f"- device: {meta['device']}; date {meta['date']}; commit {meta['commit']}; torch {meta['torch']}",
             f"- command: `{meta['command']}`",
             f"- heads {meta['heads']} query / {meta['kv_heads']} key-value, head dim {meta['dim']}, batch 1, bf16; "
             "median of the timed calls; TFLOP/s counts causal attention's matmuls (backward 2.5x forward); "
             "error: max |x - flash| / max |flash| over the output and the three gradients; first call: the first "
             "forward + backward at that length (a per-shape plan is built there)", "",
             "| backend | grouped heads | length | ms | TFLOP/s | vs flash | first call ms | max rel err |",
             "|---|---|---|---|---|---|---|---|"]
    flash = {r["length"]: r["ms"] for r in rows if r.get("ok") and r["backend"] == "flash" and r["gqa_in_kernel"]}
    for r in rows:
        how = "in kernel" if r["gqa_in_kernel"] else "repeated kv"
        if not r.get("ok"):
            lines.append(f"| {r['backend']} | {how} | {r['length']} | - | - | - | - | not run: {r['error'][:120]} |")
            continue
        speed = f"{flash[r['length']] / r['ms']:.2f}x" if r["length"] in flash else "-"  # flash not timed there
        lines.append(f"| {r['backend']} | {how} | {r['length']} | {r['ms']:.2f} | {r['tflops']:.0f} | "
                     f"{speed} | {r['first_call_ms']:.1f} | {r['max_rel_err_vs_flash']:.1e} |")
    return "\n".join(lines) + "\n"


def parse(argv=None) -> argparse.Namespace:
    """The command line's arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    p.add_argument("--backends", nargs="+", default=GPU_BACKENDS, choices=list(BACKENDS))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    harness.add_common(p, out="results/attention")  # --out, --commit
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a smoke run of the harness on PyTorch's CPU kernels (wall-clock timing)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    """Time every backend at every length; write ``attention_bench.json`` and ``.md`` under ``--out``."""
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("attention_bench needs a CUDA GPU (or --device cpu for a smoke run)")
    rows = run(args)
    device = harness.device_name("cuda") if args.device == "cuda" else "cpu (smoke run, wall clock)"
    meta = harness.meta(args.commit, harness.command(__name__, argv), device, torch=torch.__version__,
                        heads=args.heads, kv_heads=args.kv_heads, dim=args.dim)
    text = report(rows, meta)
    harness.write_result(args.out, "attention_bench", meta, rows, text)
    print(text)


if __name__ == "__main__":
    main()
