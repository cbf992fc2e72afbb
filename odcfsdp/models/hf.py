"""Hugging Face causal LMs behind the same forward signature as our Llama.

Built from a *local* directory (never downloaded; ``transformers`` optional): its
config, and, to fine-tune, its weights, which ``odcfsdp.checkpoint.load_hf`` reads
into the sharded model (each rank only its slices) after wrapping. Packed
micro-batches pass per-document positions and their document lengths, which the
per-document attention of ``hf_attention`` uses (no S x S mask; see
[hf-document-attention]); other models (other families, sliding windows,
soft-capping) run SDPA on the masks HF builds from the positions.

Families whose head is a plain ``lm_head(hidden)`` (``FUSED_LOSS_FAMILIES``) compute the
loss with the head fused into the cross-entropy when given targets
([linear-cross-entropy] in ``loss.py``); others compute logits and the plain loss.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn as nn

from .hf_attention import (DOC_LENGTHS_KWARG, DOCUMENT_ATTENTION, lengths_given, register_document_attention,
                           supports_document_attention)
from .loss import LinearCrossEntropyHead, causal_lm_loss

# Model types whose ForCausalLM forward is ``lm_head(model(...).last_hidden_state)`` with nothing
# between (no logit soft-capping or scaling), so the fused head gives the same loss.
FUSED_LOSS_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class HFCausalLM(nn.Module):
    """``AutoModelForCausalLM.from_config`` of a local config, called as ``model(tokens, positions, document_ids)``.

    Build it under ``torch.device("meta")`` to fine-tune a checkpoint that is larger than
    a rank should hold: ``ODCShard(model, device=...)`` then ``load_hf(wrapped, path)``.

    Args:
        config_path: a directory holding ``config.json`` (or the file itself).
        vocab_size: if given and larger than the config's, the vocabulary is grown to it
            (random weights only: a checkpoint's vocabulary is what its weights have).
    """

    def __init__(self, config_path: str, vocab_size: int | None = None):
        super().__init__()
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as e:
            raise ImportError("model.name=hf needs the `transformers` package") from e
        path = Path(config_path)
        if not path.exists():
            raise FileNotFoundError(f"{config_path!r} does not exist (a local Hugging Face model directory is needed)")
        # absolute: the config's name_or_path is what a LoRA adapter export records as its base model, read later
        # from wherever the adapter is loaded (PEFT's base_model_name_or_path)
        path = path.resolve()
        config = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path), local_files_only=True)
        if vocab_size is not None and vocab_size > config.vocab_size:
            config.vocab_size = vocab_size
        config._attn_implementation = register_document_attention() if supports_document_attention(config) else "sdpa"
        self.config = config
        # fp32 parameters whatever dtype the checkpoint's files have: they become the fp32 masters, and the
        # compute dtype is ODCShard's param_dtype (bf16 on CUDA). from_config would otherwise take config.dtype.
        try:
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except TypeError:  # transformers before 4.56 calls it torch_dtype
            self.model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        if (config.model_type in FUSED_LOSS_FAMILIES and type(self.model.lm_head) is nn.Linear
                and hasattr(self.model, "model")):
            LinearCrossEntropyHead.adopt(self.model.lm_head)

    @property
    def _causal(self) -> nn.Module:
        """The transformers model itself (under a PEFT wrapper, its base model)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def fused_loss(self) -> bool:
        """Whether ``forward(..., targets=)`` computes the loss with the LM head fused ([linear-cross-entropy]): a
        family it suits and the head still ours (LoRA on ``lm_head`` wraps it, and then logits + loss)."""
        return isinstance(self._causal.lm_head, LinearCrossEntropyHead)

    def decoder_layer_classes(self) -> tuple[type[nn.Module], ...]:
        """The classes Hugging Face never splits across devices (``_no_split_modules``): the decoder layers."""
        names = set(getattr(self._causal, "_no_split_modules", None) or ())
        return tuple({type(m) for m in self.model.modules() if type(m).__name__ in names})

    def matmul_params(self) -> int:
        """Parameters in matrix products per token (for FLOPs and MFU): every 2-D weight but the input embedding (a
        lookup); an LM head tied to it is a matmul, counted once."""
        emb = self.model.get_input_embeddings().weight
        head = getattr(self.model.get_output_embeddings(), "weight", None)
        return sum(p.numel() for p in self.parameters() if p.dim() == 2 and p is not emb) + (
            emb.numel() if head is emb else 0)

    def enable_activation_checkpointing(self) -> None:
        """Hugging Face's gradient checkpointing of every decoder layer (non-reentrant)."""
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers 5.x's name
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def add_lora(self, r: int, alpha: float, dropout: float, target_modules: list[str]) -> None:
        """Wrap the model in PEFT LoRA adapters on ``target_modules``; base weights become frozen."""
        try:
            import peft
        except ImportError as e:
            raise ImportError("model.lora needs the `peft` package (pip install -e \".[hf]\")") from e
        config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                                 bias="none")
        self.model = peft.get_peft_model(self.model, config)

    def initial_adapters(self, seed: int) -> dict[str, torch.Tensor]:
        """Full initial values of the LoRA adapters, by parameter name, the same on every rank.

        PEFT's initialisation (A as ``nn.Linear``'s Kaiming-uniform, B zero, so training
        starts from the base model) from a generator seeded with ``seed``: a model built
        on the meta device has no values to start from.
        """
        g = torch.Generator().manual_seed(seed)
        out = {}
        for name, p in self.named_parameters():
            if ".lora_A." in name:
                bound = 1.0 / p.shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)) of a (out, in) weight
                out[name] = (torch.rand(p.shape, generator=g) * 2 - 1) * bound
            elif ".lora_B." in name:
                out[name] = torch.zeros(p.shape)
        return out

    def generate(self, *args, **kwargs):
        """``generate`` of the Hugging Face model (under ``ODCShard``: every rank must call it, see README)."""
        return self.model.generate(*args, **kwargs)

    def forward(self, tokens, positions=None, document_ids=None, doc_lengths=None, targets=None):
        """Logits (B, S, vocab) of ``tokens`` (B, S), attending causally within each packed document.

        With ``targets`` (B, S) the summed next-token loss instead (targets == -100 ignored),
        with the head fused into the loss where the family allows (see the module's note).

        Documents are given by ``doc_lengths`` (one row, host-side: what the training loop
        passes) or ``document_ids`` (B, S); ``positions`` restart at 0 in each document
        (derived from the documents if None). With per-document attention the lengths
        reach the attention directly; otherwise HF detects the packing from the positions
        and builds its own masks per layer type (sliding windows included).
        """
        if positions is None and doc_lengths is not None:
            positions = torch.cat([torch.arange(n, device=tokens.device) for n in doc_lengths])[None]
        elif positions is None and document_ids is not None:
            positions = _positions_within_documents(document_ids)
        kwargs = {}
        if self.model.config._attn_implementation == DOCUMENT_ATTENTION and (doc_lengths is not None or
                                                                            document_ids is not None):
            if doc_lengths is not None:
                # a tensor: compiled layers do not guard on its values; the trailing 0 keeps its size above 1
                # (see [hf-document-attention], 5.)
                lengths = torch.tensor([*doc_lengths, 0])
            else:  # each row's runs of equal ids, zero-padded to the longest list
                rows = [torch.unique_consecutive(r, return_counts=True)[1] for r in document_ids.cpu()]
                lengths = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
            kwargs[DOC_LENGTHS_KWARG] = lengths
        with lengths_given() if kwargs else contextlib.nullcontext():
            if targets is not None and self.fused_loss:
                causal = self._causal
                hidden = causal.model(input_ids=tokens, position_ids=positions, use_cache=False,
                                      **kwargs).last_hidden_state
                return causal.lm_head(hidden, targets)
            logits = self.model(input_ids=tokens, position_ids=positions, use_cache=False, **kwargs).logits
        return logits if targets is None else causal_lm_loss(logits, targets)


def _positions_within_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (documents are runs of equal ids along a row)."""
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(-1).values
