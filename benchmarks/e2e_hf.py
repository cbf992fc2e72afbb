"""The e2e benchmark's models: our Llama (``--size``) or a Hugging Face model (``--model hf:<name>``), and the
HF baselines ``hf_fsdp2`` and ``hf_ddp``.

Design note [e2e-hf]
--------------------
``--model hf:<name>`` builds ``odcfsdp.models.hf.HFCausalLM`` (transformers' own model classes,
random weights) from a config of the real shapes in ``HF_SHAPES`` (or ``--model-path``: the config of
a local checkpoint; its weights are not read, the timing does not depend on them). It is built as our
Llama is: fp32 on the GPU, then wrapped (fp32 masters for every method; bf16 compute). Every method
calls it through ``odcfsdp.loop.train_step``, as the CLI does: one packed row per micro-batch, positions
restarting per document and the documents' lengths, which reach ``odc_documents``, the repo's
per-document attention registered with transformers (``hf_attention``: flash / cuDNN per document, no
S x S mask), so odc and the HF baselines run the same attention kernel and the same loss.

Methods on an HF model: ``odc`` (``ODCShard``, units = the model's decoder-layer classes; lb_mini and
lb_micro on long-tailed data, as for our Llama), ``hf_fsdp2`` and ``hf_ddp``. ``hf_fsdp2`` is what a
skilled HF user runs on FSDP2 (the recipe of torchtitan / accelerate's FSDP2 plugin):

* ``fully_shard`` per decoder layer, then the root; ``MixedPrecisionPolicy(bf16, fp32 reduce)``;
* the last decoder layer is not resharded after forward (backward needs it at once; torchtitan does
  the same); the root keeps its parameters too (FSDP2's default for the root);
* packed rows with per-document attention from positions + document lengths (no padding, no dense
  mask: what HF's flash-attention varlen path does, on the kernel ``odc`` uses);
* ``--compile``: each decoder layer compiled (``nn.Module.compile``, as the CLI's spec does), FSDP2's
  hooks and the attention run eagerly around the compiled code; ``--activation-checkpointing``: HF's
  gradient checkpointing of every decoder layer (non-reentrant);
* LB-Micro (equal micro-batch counts per rank, as collectives need); torch's fused AdamW.

The attention kernel is the best one available on the GPU host for long-tailed packed rows: HF's
``flash_attention_2`` (flash-attn's varlen kernel) needs the ``flash-attn`` package, which the host has
not and cannot download; of what transformers offers there, ``flex_attention`` (one kernel over a
document mask) was 1.03x, 1.21x and 1.35x slower than ``odc_documents`` on rows of 8K, 32K and 64K
tokens, and ``sdpa`` 1.58x-5.87x slower (``results/hf_attention/h100_cc8d2f7/``, one H100), so every
method runs ``odc_documents``.

Not done: FSDP2's explicit forward prefetch (``set_modules_to_forward_prefetch``): the next layer's
all-gather is issued by its own pre-forward hook, early enough while the host runs ahead of the GPU
(the profiled step's busy time shows whether it did); gradient accumulation without reduce-scatter
(``set_requires_gradient_sync(False)``) would hold every layer's unsharded fp32 gradients, which an 8B
model on 2 GPUs cannot. ``hf_ddp``: ``DistributedDataParallel`` with bf16 autocast and ``no_sync`` for
non-final micro-batches (1B: an 8B model's fp32 replicas with their AdamW states do not fit).
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


import torch
import torch.nn as nn

from odcfsdp.models import Llama, llama_config
from odcfsdp.models.llama import DecoderLayer

# Shapes of released models (their config.json); random weights. "tiny" is for CPU tests.
HF_SHAPES: dict[str, tuple[str, dict]] = {
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,  # Llama-3.1-8B
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                                rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,  # Qwen2.5-7B
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1e6,
                                 rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=131072,
                                 use_sliding_window=False)),
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,  # Llama-3.2-1B
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                               rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, max_position_embeddings=65536)),
}
HF_METHODS = ("hf_fsdp2", "hf_fsdp2_nosync", "hf_ddp")


def hf_config(name: str):
    """transformers' config of ``HF_SHAPES[name]`` (``LlamaConfig`` / ``Qwen2Config``)."""
    import transformers

    if name not in HF_SHAPES:
        raise ValueError(f"--model hf:{name} is not one of {['hf:' + n for n in HF_SHAPES]}; or pass --model-path")
    arch, fields = HF_SHAPES[name]
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return cls(**fields, bos_token_id=0, eos_token_id=1, pad_token_id=None)


def resolve_args(args) -> str | None:
    """Fill ``--model``'s defaults into ``args`` (``--vocab``, ``--methods``); one line on what does not fit, or None.

    An HF model's data vocabulary is its own (our Llama's: 32000); its methods are ``odc`` and the
    HF baselines (``fsdp2`` / ``ddp`` are our Llama's: the same wrapping on different models).
    """
    hf = args.model.startswith("hf:") or bool(args.model_path)
    if args.model != "llama" and not args.model.startswith("hf:"):
        return f"--model {args.model!r}: give llama or hf:<name> ({', '.join(HF_SHAPES)})"
    if args.model.startswith("hf:") and not args.model_path and args.model[3:] not in HF_SHAPES:
        return f"--model {args.model}: not one of {['hf:' + n for n in HF_SHAPES]}; or give --model-path"
    if args.model_path and not (Path(args.model_path) / "config.json").is_file():
        return f"--model-path {args.model_path}: no config.json there (a local Hugging Face model directory)"
    args.methods = args.methods or (["odc", "hf_fsdp2"] if hf else ["odc", "odc_collective", "fsdp2", "ddp"])
    wrong = [m for m in args.methods if (m in ("fsdp2", "fsdp2_nosync", "ddp") if hf else m in HF_METHODS)]
    if wrong:
        return (f"--methods {' '.join(wrong)} do not apply to {'an HF' if hf else 'our Llama'} model: use "
                + ("hf_fsdp2 / hf_ddp" if hf else "fsdp2 / ddp, or --model hf:<name> for hf_fsdp2 / hf_ddp"))
    if hf and args.attention != "auto":
        return "--attention applies to our Llama only: HF models run odc_documents' automatic choice (cuDNN on Hopper)"
    if hf and "module_hooks" in args.ablate:
        return "--ablate module_hooks applies to our Llama only (HF decoder layers are always odc units here)"
    if args.vocab is None:
        path = Path(args.model_path or "") / "config.json"
        args.vocab = (json.loads(path.read_text())["vocab_size"] if args.model_path
                      else HF_SHAPES[args.model[3:]][1]["vocab_size"] if hf else 32000)
    return None


@dataclass(frozen=True)
class BenchModel:
    """The model a run trains, and what MFU, the balancers, NVSHMEM's heap and the attention warm-up need.

    ``build()`` makes it on the current default device (the caller seeds torch); ``finish(wrapped)``
    runs after wrapping (HF models: per-layer compile); ``units`` are the decoder-layer classes.
    """

    label: str
    params: int
    layers: int
    dim: int
    matmul_params: int
    heads: int
    kv_heads: int
    head_dim: int
    units: tuple[type[nn.Module], ...]
    build: Callable[[], nn.Module]
    finish: Callable[[nn.Module], None]


def bench_model(args) -> BenchModel:
    """``--model``'s model (``llama``: ``--size``), built the same for every method of the invocation."""
    if args.model == "llama" and not args.model_path:
        return _llama(args.size, args.vocab, args.activation_checkpointing, args.compile, args.attention)
    return _hf(args.model, args.model_path, args.vocab, args.activation_checkpointing, args.compile)


@functools.lru_cache(maxsize=4)
def _llama(size: str, vocab: int, recompute: bool, compile_backend: str, attention: str) -> BenchModel:
    cfg = llama_config(size, vocab, activation_checkpointing=recompute, compile=bool(compile_backend),
                       compile_backend=compile_backend or "inductor", attention_backend=attention)
    return BenchModel(f"Llama {size}", cfg.num_params(), cfg.n_layers, cfg.dim, cfg.matmul_params(),
                      cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, (DecoderLayer,), functools.partial(Llama, cfg),
                      lambda wrapped: None)


@functools.lru_cache(maxsize=4)
def _hf(model: str, model_path: str | None, vocab: int, recompute: bool, compile_backend: str) -> BenchModel:
    from odcfsdp.models.hf import HFCausalLM

    def build() -> nn.Module:
        if model_path:
            m = HFCausalLM(model_path, vocab)
        else:  # HFCausalLM reads a config directory: write the named shape's config.json to a temporary one
            with tempfile.TemporaryDirectory(prefix="e2e_hf_") as d:
                hf_config(model[3:]).save_pretrained(d)
                m = HFCausalLM(d, vocab)
        if recompute:
            m.enable_activation_checkpointing()
        return m.train()  # HF's gradient checkpointing runs in training mode only

    def finish(wrapped: nn.Module) -> None:  # after wrapping, as the CLI's spec compiles (odcfsdp/app/specs/hf.py)
        if compile_backend:
            for layer in decoder_layers(wrapped, units):
                layer.compile(backend=compile_backend)

    with torch.device("meta"):  # shapes only: counted without memory
        meta = build()
    c = meta.config
    units = meta.decoder_layer_classes()
    matmul = meta.matmul_params()
    label = f"HF {model_path or model[3:]} ({type(meta.model).__name__})"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return BenchModel(label, sum(p.numel() for p in meta.parameters()), c.num_hidden_layers, c.hidden_size,
                      matmul, c.num_attention_heads, c.num_key_value_heads, head_dim, units, build, finish)


def decoder_layers(model: nn.Module, units: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The model's decoder layers (instances of ``units``), in forward order."""
    return [m for m in model.modules() if isinstance(m, units)]

