"""The output projection + cross-entropy: fused (``linear_cross_entropy``) against the unfused path, same call.

For one micro-batch of ``--tokens`` rows (hidden ``--hidden``, vocabulary ``--vocab``, compute dtype
``--dtype``): forward + backward time (median of ``--repeat`` after a warm-up) and the peak memory above
what the inputs hold, of

- ``unfused``: ``causal_lm_loss(F.linear(h, W), t)``, what the models did before (full logits, their fp32
  copy and its gradient);
- ``fused``: ``linear_cross_entropy(h, W, t)`` ([linear-cross-entropy] in ``odcfsdp/models/loss.py``),

and the largest relative difference of the loss and of both gradients between them (where the unfused
path fits). Writes ``loss_bench.json`` and ``loss_bench.md`` under ``--out``.

    python -m benchmarks.loss_bench --tokens 65536 --hidden 4096 --vocab 128256 --out results/loss/<name>
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from odcfsdp.models.loss import causal_lm_loss, linear_cross_entropy

from benchmarks import harness

METHODS = {
    "unfused": lambda h, w, t: causal_lm_loss(F.linear(h, w), t),
    "fused": lambda h, w, t: linear_cross_entropy(h, w, t),
}


def run_method(name: str, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, repeat: int) -> dict:
    """Time and peak memory of ``name``'s forward + backward; its loss and gradients (None if out of memory)."""
    fn, cuda = METHODS[name], h.is_cuda
    times, out = [], None
    try:
        for i in range(repeat + 1):  # the first is a warm-up
            h.grad = w.grad = None
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            t0 = time.perf_counter()
            loss = fn(h, w, t) / t.numel()
            loss.backward()
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
            out = (loss.detach(), h.grad, w.grad)
    except torch.OutOfMemoryError:
        return {"method": name, "oom": True}
    return {"method": name, "oom": False, "ms": 1e3 * statistics.median(times),
            "peak_gib": None if peak is None else peak / 2**30, "_values": out}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def main(argv=None) -> dict:
    """Run both methods on one random micro-batch; write and return the report (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    harness.add_common(p)  # --out (required), --commit
    args = p.parse_args(argv)
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    h = torch.randn(1, args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden, device=device) * args.hidden ** -0.5).to(dtype).requires_grad_()
    t = torch.randint(0, args.vocab, (1, args.tokens), device=device)
    t[:, ::7] = -100  # some ignored positions, as prompts are
    rows = [run_method(m, h, w, t, args.repeat) for m in METHODS]
    got = {r["method"]: r.pop("_values", None) for r in rows}
    check = None
    if got["unfused"] is not None and got["fused"] is not None:
        check = {k: rel_diff(a, b) for k, a, b in zip(("loss", "grad_hidden", "grad_weight"), got["fused"],
                                                       got["unfused"])}
    if check:
        next(r for r in rows if r["method"] == "fused")["rel_diff_vs_unfused"] = check
    meta = harness.meta(args.commit, harness.command(__name__, argv), harness.device_name(device),
                        shape={"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype},
                        repeat=args.repeat)
    lines = report(rows, meta)
    data = harness.write_result(args.out, "loss_bench", meta, rows, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return data


def report(rows: list, meta: dict) -> list[str]:
    """The markdown's lines: one row per method, then the fused path's largest difference from the unfused one."""
    shape = meta["shape"]
    lines = [f"# Loss head: fused vs unfused ({meta['device']}, {meta['date']}, commit {meta['commit']})", "",
             f"`{meta['command']}`", "", f"Shape: {shape['tokens']} tokens, hidden {shape['hidden']}, vocabulary "
             f"{shape['vocab']}, {shape['dtype']}.", "",
             "| method | fwd+bwd ms | peak above inputs GiB |", "|---|---|---|"]
    for r in rows:
        peak = "-" if r["oom"] or r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {r['method']} | out of memory | |" if r["oom"]
                     else f"| {r['method']} | {r['ms']:.1f} | {peak} |")
    check = next((r["rel_diff_vs_unfused"] for r in rows if "rel_diff_vs_unfused" in r), None)
    if check:
        lines += ["", "Largest relative difference, fused vs unfused: " +
                  ", ".join(f"{k} {v:.2e}" for k, v in check.items())]
    return lines


if __name__ == "__main__":
    main()
