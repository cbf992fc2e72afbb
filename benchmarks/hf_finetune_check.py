"""Fine-tune a locally created Hugging Face Llama checkpoint through the CLI on GPUs, and check it.

    python -m benchmarks.hf_finetune_check --out results/hf_finetune/<name> --gpus 1 --size 1b
    python -m benchmarks.hf_finetune_check --out DIR --gpus 2 --size llama-1b --chats longtail --e2e E2E.json
    python -m benchmarks.hf_finetune_check --out /tmp/hf_finetune --cpu-ranks 2 --size micro --steps 2   # CPU smoke

1. creates a Llama-architecture checkpoint (random weights, bf16 safetensors sharded with an
   index, the test suite's byte-level BPE chat tokenizer) and a chat JSONL: ``--chats short``
   (short chats, every 8th a long one) or ``--chats longtail`` (lengths drawn like LongAlign's,
   1K-64K tokens: ``long_chats``; 64K-token micro-batches);
2. runs ``torchrun -m odcfsdp.train model.name=hf model.path=<it>`` with per-layer compile,
   activation checkpointing, a held-out evaluation and ``run.export_hf=true``;
3. checks, against plain transformers on one GPU (bf16, same samples, each on its own): the
   first step's loss (the pretrained model's loss on that minibatch) and that the export loads
   with ``from_pretrained`` and ``AutoTokenizer``;
4. writes ``hf_finetune_check.json`` / ``.md`` with the run's losses, tokens/s, MFU, peak memory
   (allocated and reserved), next to the e2e bench's figures for the same model (``--e2e``: an
   ``e2e_bench.json`` of ``--model hf:<size>``, e.g. gpu_suite's ``hf_finetune_longtail``).

On GPUs the training runs with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the
environment sets it (``--alloc-conf``): with lengths that change every micro-batch, the caching
allocator's fixed segments fragment (at 36694c9 the CLI's HF 1B run reserved 70.9 GiB for 28.4
allocated; 32.2 with expandable segments, speed unchanged). It is set here, in the launcher, not in
odcfsdp: the e2e bench measured it raising odc's reserved memory on fixed lengths (its ``--alloc-conf``).

``--cpu-ranks N`` runs the same steps on the CPU: an fp32 checkpoint (the ``micro`` size has a
512-token vocabulary), ``python -m odcfsdp.train`` starting N gloo ranks itself (shm transport,
no compile: inductor on CPU is a different compiler), short micro-batches, and the transformers
reference in fp32 on the CPU; a smoke run of the pipeline and its checks, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import harness
from benchmarks.e2e_hf import HF_SHAPES
from odcfsdp.data.lengths import LONGALIGN_BINS, LONGALIGN_WEIGHTS, LengthConfig, LengthDistribution
from tests.hf_fixtures import chat_records, save_tokenizer, write_jsonl

# LongAlign's 8K-64K spread with a 1K-8K bin in front (chats shorter than LongAlign's documents): 1K-64K tokens.
LONG_CHAT_BINS = [[1024, 8192], *[list(b) for b in LONGALIGN_BINS]]
LONG_CHAT_WEIGHTS = [0.2, *(0.8 * w for w in LONGALIGN_WEIGHTS)]

SIZES = {"tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2),
         "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8),
         "llama-1b": HF_SHAPES["llama-1b"][1],  # the e2e bench's --model hf:llama-1b (Llama-3.2-1B shapes)
         "micro": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)}  # for the CPU smoke run


def make_checkpoint(out: Path, size: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
    """A random Llama-architecture checkpoint of ``size`` (``dtype`` safetensors, sharded) and the chat tokenizer."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{"vocab_size": 32000, "max_position_embeddings": 8192, "bos_token_id": 0,
                                      "eos_token_id": 3, "pad_token_id": 1, "rope_theta": 500000.0, **SIZES[size]})
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    model.to(dtype).save_pretrained(out, max_shard_size="1GB" if size != "micro" else "200KB")
    save_tokenizer(out)


def long_tailed_chats(n: int) -> list[dict]:
    """Short arithmetic chats, every 8th one a long multi-turn conversation (a long tail of lengths)."""
    out = chat_records(n)
    for i in range(0, n, 8):
        turns = []
        for k in range(40 + 10 * (i % 5)):
            turns += [{"role": "user", "content": f"step {k}: add {k} to {i}"},
                      {"role": "assistant", "content": f"{i} plus {k} is {i + k}."}]
        out[i] = {"messages": turns}
    return out


def long_chats(n: int, tokenizer_dir: Path, cap: int, seed: int = 0) -> tuple[list[dict], list[int]]:
    """``n`` chats whose token counts are drawn like LongAlign's (``LONG_CHAT_BINS``, scaled by ``cap`` / 64K), and
    those target counts: a long user document and a question, then an answer of about a tenth of it (few turns:
    the CLI renders the chat template once per assistant turn)."""
    from odcfsdp.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    scale = cap / LONGALIGN_BINS[-1][1]
    lengths = LengthDistribution(LengthConfig(kind="histogram", weights=LONG_CHAT_WEIGHTS,
                                              bins=[[max(8, int(lo * scale)), max(8, int(hi * scale))]
                                                    for lo, hi in LONG_CHAT_BINS]), seed)

    def sentences(i: int, count: int, start: int = 0) -> str:
        return " ".join(f"{i} plus {k} is {i + k}." for k in range(start, start + count))

    per = len(tok.encode(sentences(7, 400))) / 400  # tokens per sentence, measured on this tokenizer
    out, want = [], []
    for i in range(n):
        target = lengths.sample(i)
        body = max(1, int(0.9 * target / per))
        body = max(1, int(body * 0.9 * target / len(tok.encode(sentences(i, body)))))  # longer numbers: more tokens
        out.append({"messages": [{"role": "user", "content": sentences(i, body) + f" what is {i} plus {body}?"},
                                 {"role": "assistant", "content": sentences(i, max(1, body // 9), body)}]})
        want.append(target)
    return out, want


def run_source(overrides: dict):
    """The run's config and its training samples, read as the CLI reads them (the chats tokenized once)."""
    from odcfsdp.app.builders import build_source
    from odcfsdp.app.config import config_from

    cfg = config_from(overrides)
    return cfg, build_source(cfg)[0]


def first_minibatch_loss(model_dir: Path, cfg, source, device: str = "cuda",
                         dtype: torch.dtype = torch.bfloat16) -> float:
    """transformers' loss of the pretrained model on the run's first minibatch (``dtype``, each sample alone)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    samples = [source[i].truncated(cfg.data.micro_batch_tokens + 1) for i in range(cfg.data.batch_size)]
    total, targets = 0.0, sum(s.n_targets for s in samples)
    with torch.no_grad():
        for s in samples:
            hidden = model.model(input_ids=s.tokens[:-1][None].to(device)).last_hidden_state[0]
            labels = torch.where(s.loss_mask[1:], s.tokens[1:], -100).to(device)
            for h, y in zip(hidden.split(4096), labels.split(4096)):  # the LM head in slices: no 64K x vocab logits
                total += F.cross_entropy(model.lm_head(h).float(), y, ignore_index=-100, reduction="sum").item()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return total / targets


def parse(argv=None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--size", default="1b", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--chats", default="short", choices=("short", "longtail"),
                   help="short chats (every 8th long), or lengths drawn like LongAlign's (1K-64K tokens)")
    p.add_argument("--e2e", type=Path, default=None, help="an e2e_bench.json of the same model: its figures are "
                   "reported next to the CLI's")
    p.add_argument("--alloc-conf", default="expandable_segments:True",
                   help="PYTORCH_CUDA_ALLOC_CONF for the GPU run unless the environment sets it ('' for none)")
    harness.add_common(p, cpu_ranks=True)  # --out (required), --commit, --cpu-ranks: a CPU smoke run (not torchrun)
    args = p.parse_args(argv)
    args.command = harness.command(__name__, argv)
    return args


def chat_tokens(source) -> dict:
    """The training chats' token counts as the CLI reads them (truncated to the micro-batch): min / median / max."""
    n = sorted(source.length(i) for i in range(source.num_samples))
    return {"count": len(n), "min": n[0], "median": n[len(n) // 2], "max": n[-1], "mean": sum(n) / len(n)}


def e2e_figures(path: Path) -> dict:
    """The e2e bench's runs of ``path`` (an ``e2e_bench.json``): model, GPUs and each run's speed and memory."""
    data = harness.load_result(path)  # "results" before the one schema
    keys = ("workload", "method", "balance", "tokens_per_s", "mfu", "peak_alloc_gib", "peak_reserved_gib")
    return {"file": str(path), "model": data["meta"].get("model"), "world_size": data["meta"]["world_size"],
            "alloc_conf": data["meta"]["args"].get("alloc_conf"), "runs": [{k: r[k] for k in keys}
                                                                           for r in data["rows"]]}


def speed_table(res: dict) -> list[str]:
    """The CLI's tokens/s, MFU and memory, with the e2e bench's runs of the same model under it (``--e2e``)."""
    def gib(a, r) -> str:
        return "-" if a is None else f"{a:.1f} / {r:.1f} ({r / a:.2f}x)"

    def pct(x) -> str:
        return "-" if x is None else f"{x:.1%}"

    s, c = res["summary"], res["chat_tokens"]
    out = ["", f"Chats: {res['chats']}, {c['count']} of {c['min']}-{c['max']} tokens (median {c['median']}, mean "
           f"{c['mean']:.0f}), micro-batches of {res['micro_batch_tokens']} tokens; "
           f"PYTORCH_CUDA_ALLOC_CONF={res['alloc_conf'] or '(default)'} for the CLI run.", "",
           "| run | tokens/s | MFU | peak allocated / reserved GiB (reserved / allocated) |", "|---|---|---|---|",
           f"| CLI (`odcfsdp.train`), {res['device']} | {s['tokens_per_s']:.0f} | {pct(s['mfu'])} | "
           f"{gib(s['peak_alloc_gib'], s['peak_reserved_gib'])} |"]
    e = res.get("e2e")
    for r in (e or {}).get("runs", []):
        out.append(f"| e2e bench, {e['model']} x {e['world_size']}: {r['workload']} {r['method']} {r['balance']} | "
                   f"{r['tokens_per_s']:.0f} | {pct(r['mfu'])} | {gib(r['peak_alloc_gib'], r['peak_reserved_gib'])} |")
    if e:
        out.append(f"\n(e2e bench: `{e['file']}`, PYTORCH_CUDA_ALLOC_CONF={e['alloc_conf'] or '(default)'}.)")
    return out


def main(argv=None) -> None:
    """Create the checkpoint and data, fine-tune through the CLI, check against transformers, write the report."""
    args = parse(argv)
    cpu = args.cpu_ranks > 0
    device, dtype, prec = ("cpu", torch.float32, "fp32") if cpu else ("cuda", torch.bfloat16, "bf16")
    out = Path(args.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    make_checkpoint(model_dir, args.size, device, dtype)
    long = args.chats == "longtail"
    cap = 256 if cpu else (65536 if long else 4096)  # micro-batch tokens: the longest chat fits
    batch = 4 * args.cpu_ranks if cpu else (8 if long else 16) * args.gpus
    chats, lengths = long_chats(batch * args.steps, model_dir, cap) if long else (long_tailed_chats(512), [])
    data = write_jsonl(work / "chat.jsonl", chats)
    held_out = write_jsonl(work / "held_out.jsonl", chat_records(32, seed=7))
    run_dir = work / "run"
    tree = {"model": {"name": "hf", "path": str(model_dir), "compile": not cpu, "activation_checkpointing": True},
            "data": {"source": "jsonl", "path": str(data), "eval_path": str(held_out),
                     "batch_size": batch, "micro_batch_tokens": cap},
            "optim": {"lr": 1e-4, "warmup_steps": 2},
            "run": {"steps": args.steps, "out_dir": str(run_dir), "export_hf": True,
                    "eval_interval": max(1, args.steps // 2)}}
    if cpu:
        tree["run"] |= {"device": "cpu", "world_size": args.cpu_ranks}
    cli = [f"{g}.{k}={str(v).lower() if isinstance(v, bool) else v}" for g, kv in tree.items() for k, v in kv.items()]
    launcher = [sys.executable] if cpu else ["torchrun", f"--nproc-per-node={args.gpus}"]
    command = [*launcher, "-m", "odcfsdp.train", *cli]
    env = dict(os.environ)
    if not cpu and args.alloc_conf:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", args.alloc_conf)
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        print(proc.stderr[-4000:])
        sys.exit(f"training failed with exit code {proc.returncode}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg, source = run_source(tree)
    want = first_minibatch_loss(model_dir, cfg, source, device, dtype)

    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=dtype)
    tok = transformers.AutoTokenizer.from_pretrained(run_dir / "hf")
    summary = json.loads((run_dir / "summary.json").read_text())
    meta = harness.meta(args.commit, args.command,
                        harness.device_name("cpu" if cpu else None, args.cpu_ranks if cpu else args.gpus),
                        train_command=" ".join(command), size=args.size, steps=args.steps,
                        params=sum(p.numel() for p in exported.parameters()), chats=args.chats,
                        micro_batch_tokens=cap, chat_tokens=chat_tokens(source), target_tokens=lengths,
                        alloc_conf=env.get("PYTORCH_CUDA_ALLOC_CONF", "") if not cpu else None,
                        e2e=e2e_figures(args.e2e) if args.e2e else None)
    row = {"losses": [r["loss"] for r in rows],
           "eval_losses": {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r},
           "first_loss_transformers": want, "first_loss_rel_diff": abs(rows[0]["loss"] - want) / want,
           "export_loads": True, "tokenizer_has_template": bool(tok.chat_template), "summary": summary}
    res = {**meta, **row}
    md = ["# Fine-tuning a Hugging Face checkpoint through the CLI", "",
          f"- device: {res['device']}; date {res['date']}; commit {res['commit']}",
          f"- command: `{res['command']}`",
          f"- training: `{res['train_command']}`",
          f"- model: Llama architecture, {res['params'] / 1e9:.2f}B parameters ({prec} safetensors, "
          "sharded with an index)", "", "| check | value |", "|---|---|",
          f"| first-step loss: odcfsdp / transformers ({prec}) | {rows[0]['loss']:.4f} / {want:.4f} "
          f"(rel. diff {res['first_loss_rel_diff']:.1e}) |",
          f"| losses by step | {', '.join(f'{x:.3f}' for x in res['losses'])} |",
          f"| held-out loss by step | {', '.join(f'{k}: {v:.3f}' for k, v in res['eval_losses'].items())} |",
          "| export loads with from_pretrained / AutoTokenizer (chat template) | yes / "
          f"{'yes' if res['tokenizer_has_template'] else 'no'} |", *speed_table(res)]
    harness.write_result(out, "hf_finetune_check", meta, [row], "\n".join(md) + "\n")
    print("\n".join(md))
    import shutil

    shutil.rmtree(work)


if __name__ == "__main__":
    main()
