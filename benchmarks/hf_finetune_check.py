"""Fine-tune a locally created Hugging Face Llama checkpoint through the CLI on GPUs, and check it.

    python benchmarks/hf_finetune_check.py --out results/hf_finetune/<name> --gpus 1 --size 1b
    python benchmarks/hf_finetune_check.py --out /tmp/hf_finetune --cpu-ranks 2 --size micro --steps 2   # CPU smoke

1. creates a Llama-architecture checkpoint (random weights, bf16 safetensors sharded with an
   index, the test suite's byte-level BPE chat tokenizer) and a chat JSONL of varied lengths;
2. runs ``torchrun -m odcfsdp.train model.name=hf model.path=<it>`` with per-layer compile,
   activation checkpointing, a held-out evaluation and ``run.export_hf=true``;
3. checks, against plain transformers on one GPU (bf16, same samples, each on its own): the
   first step's loss (the pretrained model's loss on that minibatch) and that the export loads
   with ``from_pretrained`` and ``AutoTokenizer``;
4. writes ``hf_finetune_check.json`` / ``.md`` with the run's losses, tokens/s, MFU, peak memory.

``--cpu-ranks N`` runs the same steps on the CPU: an fp32 checkpoint (the ``micro`` size has a
512-token vocabulary), ``python -m odcfsdp.train`` starting N gloo ranks itself (shm transport,
no compile: inductor on CPU is a different compiler), short micro-batches, and the transformers
reference in fp32 on the CPU; a smoke run of the pipeline and its checks, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_fixtures import chat_records, save_tokenizer, write_jsonl  # noqa: E402

SIZES = {"tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2),
         "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8),
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


def first_minibatch_loss(model_dir: Path, overrides: dict, device: str = "cuda",
                         dtype: torch.dtype = torch.bfloat16) -> float:
    """transformers' loss of the pretrained model on the run's first minibatch (``dtype``, each sample alone)."""
    import transformers

    from odcfsdp.builders import build_source
    from odcfsdp.config import config_from

    cfg = config_from(overrides)
    source, _ = build_source(cfg)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    samples = [source[i].truncated(cfg.data.micro_batch_tokens + 1) for i in range(cfg.data.batch_size)]
    total, targets = 0.0, sum(s.n_targets for s in samples)
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=s.tokens[:-1][None].to(device)).logits[0].float()
            labels = torch.where(s.loss_mask[1:], s.tokens[1:], -100).to(device)
            total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return total / targets


def main(argv=None) -> None:
    """Create the checkpoint and data, fine-tune through the CLI, check against transformers, write the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--size", default="1b", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--commit", default=os.environ.get("ODC_COMMIT", "unknown"))
    p.add_argument("--cpu-ranks", type=int, default=0, help="a CPU smoke run on this many gloo ranks (not torchrun)")
    args = p.parse_args(argv)
    cpu = args.cpu_ranks > 0
    device, dtype, prec = ("cpu", torch.float32, "fp32") if cpu else ("cuda", torch.bfloat16, "bf16")
    out = Path(args.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    make_checkpoint(model_dir, args.size, device, dtype)
    data = write_jsonl(work / "chat.jsonl", long_tailed_chats(512))
    held_out = write_jsonl(work / "held_out.jsonl", chat_records(32, seed=7))
    run_dir = work / "run"
    tree = {"model": {"name": "hf", "path": str(model_dir), "compile": not cpu, "activation_checkpointing": True},
            "data": {"source": "jsonl", "path": str(data), "eval_path": str(held_out),
                     "batch_size": 4 * args.cpu_ranks if cpu else 16 * args.gpus,
                     "micro_batch_tokens": 256 if cpu else 4096},
            "optim": {"lr": 1e-4, "warmup_steps": 2},
            "run": {"steps": args.steps, "out_dir": str(run_dir), "export_hf": True,
                    "eval_interval": max(1, args.steps // 2)}}
    if cpu:
        tree["run"] |= {"device": "cpu", "world_size": args.cpu_ranks}
    cli = [f"{g}.{k}={str(v).lower() if isinstance(v, bool) else v}" for g, kv in tree.items() for k, v in kv.items()]
    launcher = [sys.executable] if cpu else ["torchrun", f"--nproc-per-node={args.gpus}"]
    command = [*launcher, "-m", "odcfsdp.train", *cli]
    proc = subprocess.run(command, capture_output=True, text=True)
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        print(proc.stderr[-4000:])
        sys.exit(f"training failed with exit code {proc.returncode}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = first_minibatch_loss(model_dir, tree, device, dtype)

    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=dtype)
    tok = transformers.AutoTokenizer.from_pretrained(run_dir / "hf")
    summary = json.loads((run_dir / "summary.json").read_text())
    res = {"device": f"cpu x {args.cpu_ranks}" if cpu else f"{torch.cuda.get_device_name()} x {args.gpus}",
           "date": datetime.date.today().isoformat(), "commit": args.commit,
           "command": " ".join(["python", "benchmarks/hf_finetune_check.py",
                                *(sys.argv[1:] if argv is None else argv)]),
           "train_command": " ".join(command), "params": sum(p.numel() for p in exported.parameters()),
           "losses": [r["loss"] for r in rows], "eval_losses": {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r},
           "first_loss_transformers": want, "first_loss_rel_diff": abs(rows[0]["loss"] - want) / want,
           "export_loads": True, "tokenizer_has_template": bool(tok.chat_template), "summary": summary}
    (out / "hf_finetune_check.json").write_text(json.dumps(res, indent=1))
    md = ["# Fine-tuning a Hugging Face checkpoint through the CLI", "",
          f"- device: {res['device']}; date {res['date']}; commit {res['commit']}", f"- command: `{res['command']}`",
          f"- training: `{res['train_command']}`",
          f"- model: Llama architecture, {res['params'] / 1e9:.2f}B parameters ({prec} safetensors, "
          "sharded with an index)", "", "| check | value |", "|---|---|",
          f"| first-step loss: odcfsdp / transformers ({prec}) | {rows[0]['loss']:.4f} / {want:.4f} "
          f"(rel. diff {res['first_loss_rel_diff']:.1e}) |",
          f"| losses by step | {', '.join(f'{x:.3f}' for x in res['losses'])} |",
          f"| held-out loss by step | {', '.join(f'{k}: {v:.3f}' for k, v in res['eval_losses'].items())} |",
          f"| tokens/s after warm-up | {summary['tokens_per_s']:.0f} |",
          f"| MFU | {summary['mfu'] if summary['mfu'] is None else format(summary['mfu'], '.1%')} |",
          f"| peak allocated / reserved GiB | {summary['peak_alloc_gib']:.1f} / {summary['peak_reserved_gib']:.1f} |",
          "| export loads with from_pretrained / AutoTokenizer (chat template) | yes / "
          f"{'yes' if res['tokenizer_has_template'] else 'no'} |"]
    (out / "hf_finetune_check.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    import shutil

    shutil.rmtree(work)


if __name__ == "__main__":
    main()
