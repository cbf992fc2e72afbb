"""Float8 training on one GPU: odcfsdp's float8 linears (torchao) against bf16 and against torchao + FSDP2 float8.

One process, our Llama with 8B-shaped layers (dim 4096, ffn 14336, 32 heads, 8 KV heads; ``--layers`` of them, a
small vocabulary so the linears dominate), compiled decoder layers (``--no-compile``: eager), AdamW, the same
batches for every method: fixed rows of a learnable synthetic sequence (a random permutation followed with
probability 0.9, else a random token). Methods:

* ``odc_bf16``: ``ODCShard(model, units=(DecoderLayer,))``, bf16 compute;
* ``odc_float8_tensorwise`` / ``odc_float8_rowwise``: the same with ``float8=`` ([float8] in
  ``odcfsdp/sharding/groups/float8.py``: torchao's ``Float8Linear``, bf16 rows gathered);
* ``odc_float8_gather``: tensorwise with ``float8_gather=True`` ([float8-gather]: the owners cast, float8 rows
  gathered, each layer's weight already cast);
* ``fsdp2_float8``: torchtitan's way: torchao's ``convert_to_float8_training`` (tensorwise, same layers) with
  ``enable_fsdp_float8_all_gather``, ``fully_shard`` per layer then the root (bf16 compute, fp32 reduce) on a
  process group of one rank, and ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step.

Each row: method, tokens_per_s and step_ms (mean over the steps after ``--warmup``, wall clock after a device
synchronise), peak_alloc_gib (``torch.cuda.max_memory_allocated`` over the method's run), the losses, and
loss_rel_gap: |mean loss - FSDP2 float8's| / FSDP2 float8's over the last tenth of the steps (at least one),
loss_rel_gap_max the largest per-step gap (at step loss_rel_gap_argmax), loss_rel_gap_window_max the largest gap
of the mean losses of WINDOW-step windows. ``--cpu``: a tiny CPU smoke run (the GPU check of ``ODCShard(float8=)``
is a GPU's; there the conversion is applied before wrapping, the same ``convert_float8_linears``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from benchmarks import harness

METHODS = ("odc_bf16", "odc_float8_tensorwise", "odc_float8_rowwise", "odc_float8_gather", "fsdp2_float8")
REFERENCE = "fsdp2_float8"


def parse(argv=None):
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="8B-shaped decoder layers")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192, help="small, so that the float8 linears dominate")
    p.add_argument("--batch", type=int, default=2, help="rows per step")
    p.add_argument("--seq", type=int, default=4096, help="tokens per row")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing (compilation)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="what parameters are gathered and computed in on CUDA (both methods)")
    p.add_argument("--no-compile", action="store_true", help="eager decoder layers")
    p.add_argument("--cpu", action="store_true", help="a CPU smoke run (tiny sizes)")
    p.add_argument("--profile", nargs="*", default=[], choices=METHODS,
                   help="methods that run one more step, not timed, under torch.profiler: the row's ``profile`` "
                        "holds its device time by kind of kernel, its top kernels and host operators")
    harness.add_common(p, out="results/fp8/local")
    args = p.parse_args(argv)
    args.command = harness.command(__name__, argv)
    return args


def _free_port() -> int:
    """A port no one listens on now (lanes of the GPU suite run side by side on one host)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def batches(vocab: int, steps: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches of ``batch`` rows of ``seq + 1`` tokens: follow a fixed random permutation with
    probability 0.9, else a uniformly random token (a learnable sequence: the loss falls from log(vocab))."""
    g = torch.Generator().manual_seed(seed)
    follow = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        rows = torch.empty(batch, seq + 1, dtype=torch.long)
        rows[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        jump = torch.rand(batch, seq, generator=g) > 0.9
        noise = torch.randint(0, vocab, (batch, seq), generator=g)
        for t in range(seq):
            rows[:, t + 1] = torch.where(jump[:, t], noise[:, t], follow[rows[:, t]])
        out.append(rows)
    return out


def build_model(args, compiled: bool):
    """Our Llama of the benchmark's shape, seeded alike for every method (fp32 values)."""
    from odcfsdp.models import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, ffn_dim=args.ffn, compile=compiled,
                      compile_backend="inductor")
    return Llama(cfg)


def wrap(method: str, model, device: torch.device, param_dtype: torch.dtype = torch.bfloat16):
    """The model as ``method`` trains it, and what runs after each optimizer step (FSDP2's scale precompute);
    ``param_dtype`` the dtype parameters are gathered and computed in on CUDA, for both."""
    from odcfsdp import ODCShard
    from odcfsdp.models.llama import DecoderLayer
    from odcfsdp.sharding.groups.float8 import convert_float8_linears, float8_eligible

    if method.startswith("odc"):
        gather = method == "odc_float8_gather"
        recipe = "tensorwise" if gather else method.removeprefix("odc_float8_") if "float8" in method else None
        if recipe and device.type != "cuda":  # the CPU smoke run: ODCShard(float8=) refuses CPU, the conversion not
            convert_float8_linears(model, recipe)  # (float8_gather takes layers converted before wrapping too)
            recipe = None
        dtype = param_dtype if device.type == "cuda" else None
        return ODCShard(model.to(device), units=(DecoderLayer,), float8=recipe, param_dtype=dtype,
                        float8_gather=gather), lambda: None
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"),
                                 enable_fsdp_float8_all_gather=device.type == "cuda")
    model = model.to(device)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: float8_eligible(m, fqn))
    from torch.distributed.device_mesh import init_device_mesh

    # the mesh on the run's device: FSDP2's default mesh is CUDA's wherever CUDA is, the CPU smoke run's too
    kwargs = {"mesh": init_device_mesh(device.type, (1,))}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype, torch.float32)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model, lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def compile_stats() -> dict:
    """What torch.compile did since ``torch._dynamo.utils.counters`` was last cleared: graphs compiled, graph
    breaks (and the most frequent reasons) and recompilations. A method whose layers stop compiling (a graph
    break on a tensor subclass, a guard failing every step) shows here before it shows in its speed."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": [r[:200] for r, _ in breaks.most_common(3)],
            "recompiles": sum(counters["recompiles"].values())}


def train(method: str, args, data: list[torch.Tensor], device: torch.device) -> dict:
    """Train ``method`` on ``data``: per-step losses (mean per token), the timed steps' seconds, the peak, what
    torch.compile did (``compile_stats``) and, for the methods of ``--profile``, one more step's profile."""
    from torch._dynamo.utils import counters

    from benchmarks.e2e_profile import kernel_summary, step_profiler
    from odcfsdp.models import causal_lm_loss

    counters.clear()
    model, after_step = wrap(method, build_model(args, compiled=not args.no_compile and device.type == "cuda"),
                             device, getattr(torch, args.param_dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=device.type == "cuda")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def step(rows: torch.Tensor) -> float:
        rows = rows.to(device)
        tokens = rows[:, 1:].numel()
        loss = causal_lm_loss(model(rows[:, :-1]), rows[:, 1:], tokens)  # bf16 parameters, no autocast, for both
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        after_step()
        return loss.item()  # a device sync: the step is done

    losses, step_s = [], []
    for rows in data:
        t0 = time.perf_counter()
        losses.append(step(rows))
        step_s.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    out = {"losses": losses, "step_s": step_s, "peak_alloc_gib": peak, "compile": compile_stats()}
    if method in args.profile:  # after the peak is read: the profiler's own buffers are not the method's
        with step_profiler() as prof:
            step(data[-1])
        out["profile"] = kernel_summary(prof)
    if hasattr(model, "close"):
        model.close()
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


WINDOW = 10  # steps per window of loss_rel_gap_window_max


def _window_gaps(losses: list[float], ref: list[float]) -> list[float]:
    """Relative gap of the mean losses of each window of ``WINDOW`` consecutive steps (the last may be shorter)."""
    out = []
    for i in range(0, min(len(losses), len(ref)), WINDOW):
        a, b = losses[i:i + WINDOW], ref[i:i + WINDOW]
        out.append(abs(sum(a) / len(a) - sum(b) / len(b)) / (sum(b) / len(b)))
    return out


def rows_of(runs: dict, args) -> list[dict]:
    """One row per method, its loss gap to FSDP2 float8 (when that ran) over the last tenth of the steps."""
    tail = max(1, len(next(iter(runs.values()))["losses"]) // 10)
    ref = runs.get(REFERENCE)
    out = []
    for method, r in runs.items():
        timed = r["step_s"][args.warmup:] or r["step_s"]
        step = sum(timed) / len(timed)
        row = {"method": method, "tokens_per_s": args.batch * args.seq / step, "step_ms": 1e3 * step,
               "peak_alloc_gib": r["peak_alloc_gib"], "final_loss": sum(r["losses"][-tail:]) / tail,
               "losses": r["losses"], "compile": r["compile"], **({"profile": r["profile"]} if "profile" in r else {})}
        if ref is not None:
            want = sum(ref["losses"][-tail:]) / tail
            row["loss_rel_gap"] = abs(row["final_loss"] - want) / want
            gaps = [abs(a - b) / b for a, b in zip(r["losses"], ref["losses"])]
            row["loss_rel_gap_max"] = max(gaps)
            row["loss_rel_gap_argmax"] = gaps.index(row["loss_rel_gap_max"])
            # per-step losses of two float8 implementations differ by rounding, which one noisy step amplifies:
            # "stays within" is read on the mean of each window of WINDOW steps
            row["loss_rel_gap_window_max"] = max(_window_gaps(r["losses"], ref["losses"]))
        out.append(row)
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    """The rows as a table, bf16 as the speed reference."""
    base = next((r["tokens_per_s"] for r in rows if r["method"] == "odc_bf16"), None)
    lines = [f"# fp8_bench ({meta['device']}, {meta['commit']}, {meta['date']})", "", f"`{meta['command']}`", "",
             "| method | tokens/s | vs odc_bf16 | step ms | peak GiB | final loss | loss gap to fsdp2_float8 "
             "| graphs / breaks / recompiles |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        gap = f"{r['loss_rel_gap']:.2%}" if "loss_rel_gap" in r else "-"
        c = r.get("compile")
        compiled = f"{c['unique_graphs']} / {c['graph_breaks']} / {c['recompiles']}" if c else "-"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.0f} | {ratio} | {r['step_ms']:.1f} | "
                     f"{r['peak_alloc_gib']:.2f} | {r['final_loss']:.4f} | {gap} | {compiled} |")
    for r in rows:
        if "profile" in r:
            kinds = ", ".join(f"{k} {ms:.1f}" for k, ms in r["profile"]["device_ms_by_kind"].items())
            lines += ["", f"{r['method']}, one profiled step: device ms by kind: {kinds}; busy "
                      f"{r['profile']['busy_ms']:.1f} ms; {r['profile']['kernel_launches']} launches"]
            lines += [f"- {k['ms']:.2f} ms x{k['calls']}: `{k['name']}`" for k in r["profile"]["top_kernels"][:8]]
        if r.get("compile", {}).get("graph_break_reasons"):
            lines += ["", f"{r['method']}: graph breaks: " + "; ".join(f"`{x}`" for x in r["compile"]["graph_break_reasons"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    """Run every method on the same batches; write fp8_bench.json / .md under ``--out``; return the data."""
    import torch.distributed as dist

    args = parse(argv)
    if args.cpu:
        args.dim, args.ffn, args.heads, args.kv_heads, args.vocab, args.seq = 64, 128, 4, 2, 96, 32
    device = torch.device("cpu" if args.cpu else "cuda")
    data = batches(args.vocab, args.steps, args.batch, args.seq)
    runs = {}
    for method in [m for m in args.methods if m.startswith("odc")]:  # one process, no process group
        runs[method] = train(method, args, data, device)
    if REFERENCE in args.methods:  # FSDP2 needs a process group: one rank
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        try:
            runs[REFERENCE] = train(REFERENCE, args, data, device)
        finally:
            dist.destroy_process_group()
    rows = rows_of(runs, args)
    meta = harness.meta(args.commit, args.command, harness.device_name(device),
                        args={k: v for k, v in vars(args).items() if k not in ("commit", "command", "out")})
    report = markdown(meta, rows)
    print(report)
    return harness.write_result(args.out, "fp8_bench", meta, rows, report)


if __name__ == "__main__":
    main()
