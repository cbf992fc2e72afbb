"""Export a training checkpoint as a Hugging Face model directory.

    python -m odcfsdp.export <checkpoint dir> <out dir> [--dtype bfloat16] [--tokenizer <local dir>]

The checkpoint's manifest holds the run's configuration: the model is rebuilt from it
on the meta device (one process; the checkpoint is resharded onto it), its saved
parameters are loaded, and ``export_pretrained`` writes config.json,
generation_config.json, safetensors (sharded with an index past ``--max-shard-gib``)
and the tokenizer's files (the run's tokenizer unless ``--tokenizer`` says otherwise),
so ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, export_pretrained, load_checkpoint, read_manifest


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: torch.dtype | None = None,
                      tokenizer: str | None = None, max_shard_bytes: int = 5 << 30, lora: str | None = None) -> Path:
    """Write the Hugging Face directory of ``checkpoint`` (a ``save_checkpoint`` directory) to ``out_dir``.

    ``lora`` (merged | adapter) overrides the run's ``model.lora.export`` for a LoRA run.
    """
    from .builders import build_sharded_model, tokenizer_path, vocab_size
    from .config import config_from

    manifest = read_manifest(Path(checkpoint))
    if not manifest.get("config"):
        raise CheckpointError(f"{checkpoint}: the manifest holds no run configuration (saved outside "
                              "`python -m odcfsdp.train`); export from Python with "
                              "odcfsdp.checkpoint.export_pretrained")
    cfg = config_from(manifest["config"])
    cfg.model.compile = False
    cfg.shard.comm = "auto"
    cfg.run.device = "cpu"
    model, _, _ = build_sharded_model(cfg, vocab_size(cfg), torch.device("cpu"), weights=False)
    try:
        load_checkpoint(checkpoint, model)
        return export_pretrained(model, out_dir, tokenizer_path=tokenizer or tokenizer_path(cfg), dtype=dtype,
                                 max_shard_bytes=max_shard_bytes, lora=lora or cfg.model.lora.export)
    finally:
        model.close()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m odcfsdp.export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint directory (step_XXXXXXXX) written by the training run")
    p.add_argument("out_dir", help="where to write the Hugging Face model directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast every tensor (default: the trained fp32 values, exactly)")
    p.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer (default: the run's)")
    p.add_argument("--lora", choices=("merged", "adapter"), default=None,
                   help="a LoRA run: adapters folded into the weights, or the adapters alone (default: the run's)")
    p.add_argument("--max-shard-gib", type=float, default=5.0, help="split the weights into files of this size")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, dtype=getattr(torch, args.dtype) if args.dtype else None,
                                tokenizer=args.tokenizer, max_shard_bytes=int(args.max_shard_gib * 2**30),
                                lora=args.lora)
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {out}", file=sys.stderr)
    return 0


def _console() -> None:
    """Console-script entry point (``odcfsdp-export``)."""
    sys.exit(main())


if __name__ == "__main__":
    _console()
