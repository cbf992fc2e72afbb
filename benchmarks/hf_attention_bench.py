"""Packed long-tailed rows through a Hugging Face Llama on one GPU: HF's attention implementations against
odcfsdp's per-document attention ([hf-document-attention] in odcfsdp/models/hf_attention.py).

    python -m benchmarks.hf_attention_bench --out results/hf_attention/<name> [--tokens 8192 32768]

1. builds a Llama-architecture model from a config (random bf16 weights on the GPU, HF's
   activation checkpointing, as long rows need) and registers odcfsdp's attention with transformers;
2. for each row length, packs documents of long-tailed lengths (log-uniform, seeded) into one row
   with per-document positions;
3. for each implementation (HF's ``sdpa`` and ``flex_attention``, which build their masks from
   the positions, and ``odc_documents``, which gets the lengths), the same weights, forward +
   backward of the summed cross-entropy: ``--warmup`` steps, then ``--iters`` timed steps taken
   in rotation over the implementations (wall time of a step, which ends in a sync), peak memory;
4. checks each implementation's loss and gradient norm against ``sdpa``'s, and writes
   ``hf_attention_bench.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch
import torch.nn.functional as F

from odcfsdp.models.hf_attention import (DOC_LENGTHS_KWARG, DOCUMENT_ATTENTION, lengths_given,
                                         register_document_attention)
from benchmarks import harness

SIZES = {"tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
         "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8)}


def document_lengths(tokens: int, shortest: int, seed: int) -> list[int]:
    """Log-uniform lengths in [shortest, tokens / 2] filling ``tokens`` (the last one cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], tokens
    while left:
        n = int(math.exp(math.log(shortest) + torch.rand((), generator=g).item() * math.log(tokens / 2 / shortest)))
        out.append(min(n, left))
        left -= out[-1]
    return out


def step(model, tokens, positions, lengths, impl: str) -> tuple[float, float]:
    """Forward + backward of the summed cross-entropy; (loss, gradient norm)."""
    model.config._attn_implementation = impl
    ours = impl == DOCUMENT_ATTENTION  # as HFCausalLM calls it: the lengths, and no masks built for them
    with lengths_given() if ours else contextlib.nullcontext():
        logits = model(input_ids=tokens[:, :-1], position_ids=positions[:, :-1], use_cache=False,
                       **({DOC_LENGTHS_KWARG: torch.tensor(lengths)} if ours else {})).logits
    loss = F.cross_entropy(logits[0].float(), tokens[0, 1:], reduction="sum")
    model.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    return loss.item(), norm.item()


def main(argv=None) -> None:
    """Time each implementation on packed rows of each length; write ``hf_attention_bench.json`` and ``.md``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common(p)  # --out (required), --commit
    p.add_argument("--size", default="1b", choices=sorted(SIZES))
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--impls", nargs="+", default=["sdpa", "flex_attention", DOCUMENT_ATTENTION])
    p.add_argument("--shortest", type=int, default=64, help="shortest document")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no memory figures)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    import transformers

    register_document_attention()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=max(args.tokens) + 1,
                                   rope_theta=500000.0, **SIZES[args.size])
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = []
    for n_tokens in args.tokens:
        lengths = document_lengths(n_tokens, args.shortest, seed=n_tokens)
        tokens = torch.randint(0, cfg.vocab_size, (1, n_tokens + 1), device=args.device)
        # documents of the n_tokens inputs; the extra last token is only a target
        positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(1, dtype=torch.long)])[None].to(args.device)
        found = {}
        for impl in args.impls:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                for _ in range(args.warmup):
                    loss, norm = step(model, tokens, positions, lengths, impl)
                found[impl] = dict(loss=loss, grad_norm=norm, ms=[], peak_gib=0.0)
            except Exception as e:  # noqa: BLE001 - out of memory, or an implementation this torch lacks: recorded
                found[impl] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                print(f"{n_tokens} tokens, {impl}: {found[impl]['error']}", flush=True)
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()
        live = [i for i in args.impls if "error" not in found[i]]
        for _ in range(args.iters):
            for impl in live:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step(model, tokens, positions, lengths, impl)  # ends in .item(): the GPU is done when it returns
                found[impl]["ms"].append((time.perf_counter() - start) * 1e3)
                if cuda:
                    found[impl]["peak_gib"] = max(found[impl]["peak_gib"], torch.cuda.max_memory_allocated() / 2**30)
        base = found.get("sdpa", {})
        for impl in live:
            r = found[impl]
            r["ms_median"] = sorted(r["ms"])[len(r["ms"]) // 2]
            r["tokens_per_s"] = n_tokens / r["ms_median"] * 1e3
            if "loss" in base:
                r["loss_rel_diff_vs_sdpa"] = abs(r["loss"] - base["loss"]) / abs(base["loss"])
                r["grad_norm_rel_diff_vs_sdpa"] = abs(r["grad_norm"] - base["grad_norm"]) / base["grad_norm"]
            print(f"{n_tokens} tokens ({len(lengths)} documents), {impl}: {r['ms_median']:.1f} ms, "
                  f"{r['tokens_per_s']:.0f} tokens/s, peak {r['peak_gib']:.1f} GiB", flush=True)
        rows.append(dict(tokens=n_tokens, documents=len(lengths), longest=max(lengths), results=found))

    meta = harness.meta(args.commit, harness.command(__name__, argv),
                        harness.device_name(args.device, 1 if cuda else None), torch=torch.__version__,
                        transformers=transformers.__version__, size=args.size, activation_checkpointing=True)
    lines = ["# Packed rows through a Hugging Face Llama: HF's attention vs odcfsdp's per-document attention", "",
             f"- device: {meta['device']}; date {meta['date']}; commit {meta['commit']}; torch {meta['torch']}, "
             f"transformers {meta['transformers']}",
             f"- command: `{meta['command']}`",
             f"- model: Llama {args.size} config, random {str(model.dtype).removeprefix('torch.')} weights, HF activation "
             "checkpointing; forward + backward "
             "of one packed row, median of the timed steps", "",
             "| tokens | documents (longest) | implementation | ms | tokens/s | vs sdpa | peak GiB | loss rel. diff vs sdpa |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base = row["results"].get("sdpa", {}).get("ms_median")
        for impl, r in row["results"].items():
            if "error" in r:
                lines.append(f"| {row['tokens']} | {row['documents']} ({row['longest']}) | {impl} | {r['error']} "
                             "| | | | |")
                continue
            speed = f"{base / r['ms_median']:.2f}x" if base else ""
            diff = f"{r['loss_rel_diff_vs_sdpa']:.1e}" if "loss_rel_diff_vs_sdpa" in r else ""
            lines.append(f"| {row['tokens']} | {row['documents']} ({row['longest']}) | {impl} | {r['ms_median']:.1f} "
                         f"| {r['tokens_per_s']:.0f} | {speed} | {r['peak_gib']:.1f} | {diff} |")
    harness.write_result(args.out, "hf_attention_bench", meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
