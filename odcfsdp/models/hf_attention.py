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

1. Boundaries: the ``odc_doc_lengths`` keyword that ``HFCausalLM`` passes through the
   model (a CPU tensor: no device sync); without it, per row from ``position_ids``
   (a new document wherever a position is not the previous one + 1, HF's own rule; one
   device sync per layer); without those, the row is one document.
2. Its mask function builds no mask for that case (``attention_mask=None`` and as many
   queries as keys) and HF's SDPA mask otherwise (a 2-D padding mask, decoding with a
   cache); the attention then runs HF's SDPA path with that mask, as before.
3. Only for plain causal softmax attention: ``supports_document_attention`` refuses
   configs with a sliding window, logit soft-capping or attention dropout, and the
   function raises on keywords it cannot honour (attention sinks, a sliding window).
4. Compiled decoder layers (``model.compile``) break their graph around the attention
   (``torch.compiler.disable``), as our Llama's compiled dense parts do: a per-document
   loop traced by dynamo would recompile for every new number of documents, and a Python
   list of lengths would be guarded value by value (measured: a recompile at every
   micro-batch); a tensor of lengths costs one recompile, to dynamic shapes.
"""

from __future__ import annotations

import torch

from .attention import causal_attention

DOCUMENT_ATTENTION = "odc_documents"
DOC_LENGTHS_KWARG = "odc_doc_lengths"


def supports_document_attention(config) -> bool:
    """Whether ``config``'s attention is plain causal softmax attention (what ``DOCUMENT_ATTENTION`` computes)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    sliding = getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
    return (getattr(text, "is_causal", True) and not sliding
            and all(t == "full_attention" for t in layer_types)
            and getattr(text, "attn_logit_softcapping", None) is None
            and not getattr(text, "attention_dropout", 0.0))


def register_document_attention() -> str:
    """Register ``DOCUMENT_ATTENTION`` (attention and mask functions) with transformers; return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DOCUMENT_ATTENTION, document_attention_forward)
    AttentionMaskInterface.register(DOCUMENT_ATTENTION, _document_mask)
    return DOCUMENT_ATTENTION


def _document_mask(*args, **kwargs):
    """No mask where the attention splits documents itself; HF's SDPA mask elsewhere (see the design note, 2.)."""
    from transformers.masking_utils import sdpa_mask

    plain = (kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length")
             and not kwargs.get("q_offset") and not kwargs.get("kv_offset"))
    return None if plain else sdpa_mask(*args, **kwargs)


def document_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """Each row's document lengths: a document starts wherever a position is not the previous one + 1."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    out = []
    for row in starts.cpu():
        first = row.nonzero().flatten().tolist() + [row.numel()]
        out.append([b - a for a, b in zip(first, first[1:])])
    return out


@torch.compiler.disable
def document_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: causal attention within each packed document (see the design note).

    Takes (B, H, S, D) queries and (B, H_kv, S_kv, D) keys/values as HF passes them;
    returns ((B, S, H, D) output, None).
    """
    for name in ("s_aux", "sliding_window", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(f"attention {DOCUMENT_ATTENTION!r} does not support {name}={kwargs[name]!r}; "
                             "build the model with attn_implementation='sdpa'")
    if attention_mask is not None or query.shape[2] != key.shape[2]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        kwargs.pop(DOC_LENGTHS_KWARG, None)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError(f"attention {DOCUMENT_ATTENTION!r} has no attention dropout (got {dropout}); "
                         "set the config's attention_dropout to 0 or use attn_implementation='sdpa'")
    lengths = kwargs.get(DOC_LENGTHS_KWARG)
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    if lengths is not None and (query.shape[0] != 1 or sum(lengths) != query.shape[2]):
        raise ValueError(f"{DOC_LENGTHS_KWARG} {list(lengths)} must cover one row of {query.shape[2]} tokens "
                         f"(got {query.shape[0]} rows)")
    if lengths is not None:
        rows = [list(lengths)]
    elif kwargs.get("position_ids") is not None:
        rows = document_lengths(kwargs["position_ids"].expand(query.shape[0], -1))
    else:
        rows = [None] * query.shape[0]
    if len(rows) == 1 or all(r == rows[0] for r in rows):
        out = causal_attention(query, key, value, rows[0], scale=scaling)
    else:
        out = torch.cat([causal_attention(query[b:b + 1], key[b:b + 1], value[b:b + 1], rows[b], scale=scaling)
                         for b in range(query.shape[0])])
    return out.transpose(1, 2).contiguous(), None
