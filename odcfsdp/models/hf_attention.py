"""Packed documents in Hugging Face models through odcfsdp's per-document attention.

Design note [hf-document-attention]
-----------------------------------
A packed micro-batch is one row of S tokens holding documents of lengths n_1..n_k.
Hugging Face's own path for it (``attention_mask=None``, positions restarting per
document) detects the packing and builds a (B, 1, S, S) boolean mask for SDPA: S^2
bytes per row (4 GiB at 64K tokens), and SDPA with an arbitrary mask cannot use the
flash or cuDNN kernels, so it falls back to the memory-efficient or the math kernel,
which also compute the masked-out S^2/2 - sum(n_i^2)/2 scores. Our Llama instead runs
causal attention per document (``causal_attention``: flash / cuDNN with bucketed
lengths), i.e. sum(n_i^2)/2 scores and no mask at all.

``DOCUMENT_ATTENTION`` is that kernel registered with transformers' attention
interface, so HF models get it without a change to their code:

1. Which models: the families in ``DOCUMENT_ATTENTION_MODEL_TYPES``, each checked
   against plain transformers in ``tests/test_hf.py`` (their attention is causal softmax
   over HF's standard masks, and they pass keyword arguments on to it), and only configs
   without sliding-window layers or logit soft-capping (``supports_document_attention``).
   Every other model keeps SDPA on the masks HF builds.
2. Boundaries: ``HFCausalLM`` passes each row's document lengths as the ``odc_doc_lengths``
   keyword (a CPU tensor: no device sync, and compiled layers do not guard on its values)
   inside ``lengths_given()``; HF hands the keyword on to the attention.
3. Masks: the mask function builds none where the attention splits documents itself
   (lengths given, no padding mask, as many queries as keys; the listed families add no
   mask functions of their own) or where the mask would be
   plain causal and HF allows skipping it; otherwise it builds HF's SDPA mask (padding,
   a cache, a packing HF detected from positions without our lengths, custom mask
   functions) and the attention runs HF's SDPA path on it: never a mask dropped.
4. Refusals, never silence: keywords the kernel cannot honour (attention sinks, a
   sliding window, soft-capping, position biases, ``is_causal=False``) raise, and so do
   lengths that were given but did not reach the attention.
5. Compiled decoder layers (``model.compile``) break their graph around the attention
   (``torch.compiler.disable``), as our Llama's compiled dense parts do: a per-document
   loop traced by dynamo would recompile for every new number of documents, and a Python
   list of lengths would be guarded value by value (a recompile at every
   micro-batch); a tensor of lengths costs one recompile (to dynamic shapes). ``HFCausalLM``
   ends the tensor with a 0 (dropped here), so it never has size 1, which dynamo would
   specialise: a micro-batch of one document would otherwise compile a third graph the
   first time one comes, in the middle of training (a compilation inside a step).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .attention import causal_attention

DOCUMENT_ATTENTION = "odc_documents"
DOC_LENGTHS_KWARG = "odc_doc_lengths"
# Checked one by one against plain transformers (tests/test_hf.py); add a family only with its test.
DOCUMENT_ATTENTION_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "granite", "granitemoe",
    "olmo", "olmo2", "olmoe", "phi3", "phimoe", "glm", "glm4", "smollm3", "starcoder2", "cohere",
    "helium", "internlm3",
})
_LENGTHS_GIVEN: contextvars.ContextVar[bool] = contextvars.ContextVar("odc_lengths_given", default=False)


def supports_document_attention(config) -> bool:
    """Whether ``DOCUMENT_ATTENTION`` computes ``config``'s attention exactly (see the design note, 1.)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types:  # HF applies a window on sliding layers only
        windowed = any(t != "full_attention" for t in layer_types)
    else:
        windowed = getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
    return (getattr(text, "model_type", None) in DOCUMENT_ATTENTION_MODEL_TYPES and not windowed
            and getattr(text, "is_causal", True) and getattr(text, "attn_logit_softcapping", None) is None)


def register_document_attention() -> str:
    """Register ``DOCUMENT_ATTENTION`` (attention and mask functions) with transformers; return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DOCUMENT_ATTENTION, document_attention_forward)
    AttentionMaskInterface.register(DOCUMENT_ATTENTION, document_mask_function)
    return DOCUMENT_ATTENTION


@contextlib.contextmanager
def lengths_given():
    """Within it, the model call carries ``odc_doc_lengths``: its masks are not built (see the design note, 3.)."""
    token = _LENGTHS_GIVEN.set(True)
    try:
        yield
    finally:
        _LENGTHS_GIVEN.reset(token)


def document_mask_function(**kwargs) -> torch.Tensor | None:
    """HF mask-interface function of ``DOCUMENT_ATTENTION``: None where no mask is needed, else HF's SDPA mask.

    Takes ``sdpa_mask``'s keywords (``q_length``, ``kv_length``, ``q_offset``, ``kv_offset``,
    ``attention_mask``, ``mask_function``, ``allow_is_causal_skip``, ...) and hands them on.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    whole = (kwargs.get("attention_mask") is None and kwargs["q_length"] == kwargs["kv_length"]
             and not kwargs.get("q_offset") and not kwargs.get("kv_offset"))
    skippable = (kwargs.get("mask_function", causal_mask_function) is causal_mask_function
                 and kwargs.get("allow_is_causal_skip", True))
    return None if whole and (_LENGTHS_GIVEN.get() or skippable) else sdpa_mask(**kwargs)


def _rows(lengths, batch: int, tokens: int) -> list[list[int]]:
    """Each row's document lengths from ``odc_doc_lengths``: one row's (a list or 1-D tensor) or (B, k) zero-padded."""
    if isinstance(lengths, torch.Tensor):
        rows = [[n for n in r if n] for r in (lengths[None] if lengths.dim() == 1 else lengths).tolist()]
    else:
        rows = [list(lengths)]
    if len(rows) != batch or any(sum(r) != tokens for r in rows):
        raise ValueError(f"{DOC_LENGTHS_KWARG} {rows} must cover {batch} row(s) of {tokens} tokens")
    return rows


@torch.compiler.disable
def document_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: causal attention within each packed document (see the design note).

    Takes (B, H, S, D) queries and (B, H_kv, S_kv, D) keys/values as HF passes them;
    returns ((B, S, H, D) output, None).
    """
    for name in ("s_aux", "sliding_window", "softcap", "position_bias", "indices"):
        if kwargs.get(name) is not None:
            raise ValueError(f"attention {DOCUMENT_ATTENTION!r} does not support {name}; build the model with "
                             "attn_implementation='sdpa'")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"attention {DOCUMENT_ATTENTION!r} is causal only; build the model with "
                         "attn_implementation='sdpa'")
    lengths = kwargs.pop(DOC_LENGTHS_KWARG, None)
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if lengths is None and _LENGTHS_GIVEN.get():
        raise RuntimeError(f"{DOC_LENGTHS_KWARG} did not reach the attention of {type(module).__name__}: the model "
                           "does not hand keyword arguments on to it; use attn_implementation='sdpa'")
    rows = _rows(lengths, query.shape[0], query.shape[2]) if lengths is not None else [None]
    if len(rows) == 1 or all(r == rows[0] for r in rows):
        out = causal_attention(query, key, value, rows[0], scale=scaling, dropout_p=dropout)
    else:
        out = torch.cat([causal_attention(query[b:b + 1], key[b:b + 1], value[b:b + 1], rows[b], scale=scaling,
                                          dropout_p=dropout) for b in range(query.shape[0])])
    return out.transpose(1, 2).contiguous(), None
