"""Hugging Face causal LMs behind the same forward signature as our Llama.

Built from a *local* config (no weights are downloaded; ``transformers`` optional).
Packed micro-batches pass per-document positions and a 4-D additive attention mask
that keeps attention causal and inside each document.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from .llama import document_mask


class HFCausalLM(nn.Module):
    """``AutoModelForCausalLM.from_config`` of a local config, called as ``model(tokens, positions, document_ids)``.

    Args:
        config_path: a directory holding ``config.json`` (or the file itself).
        vocab_size: if given and larger than the config's, the vocabulary is grown to it.
    """

    def __init__(self, config_path: str, vocab_size: int | None = None):
        super().__init__()
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as e:
            raise ImportError("model.name=hf needs the `transformers` package") from e
        path = Path(config_path)
        if not path.exists():
            raise FileNotFoundError(f"model.hf_config={config_path!r} does not exist")
        config = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path), local_files_only=True)
        if vocab_size is not None and vocab_size > config.vocab_size:
            config.vocab_size = vocab_size
        config._attn_implementation = "sdpa"
        self.config = config
        self.model = AutoModelForCausalLM.from_config(config)

    def init_buffers(self) -> None:
        """Rebuild rotary-embedding buffers (computed in __init__, so empty after meta construction)."""
        for mod in self.model.modules():
            if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "config"):
                fresh = type(mod)(mod.config)
                for name, buf in fresh.named_buffers(recurse=False):
                    setattr(mod, name, buf.to(getattr(mod, name).device))

    def forward(self, tokens, positions=None, document_ids=None, doc_lengths=None):
        if doc_lengths is not None and document_ids is None:  # HF attention takes masks: build one
            document_ids = torch.repeat_interleave(
                torch.arange(len(doc_lengths), device=tokens.device),
                torch.tensor(doc_lengths, device=tokens.device))[None]
        mask = None
        if document_ids is not None:
            allowed = document_mask(document_ids)
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device)
            mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return self.model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False).logits
