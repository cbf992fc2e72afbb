"""Causal attention within documents, on the fastest kernel PyTorch has for the GPU.

Design note [attention-kernels]
-------------------------------
On Hopper, cuDNN's attention runs forward + backward faster than PyTorch's
FlashAttention-2 at every length we train on (docs/design.md, Figures behind the design
notes). cuDNN builds an execution plan for every new shape, once per shape and process, a
cost long-tailed data would pay at almost every document. So with cuDNN each document is padded at its end to a
*bucket* length (``bucket_length``: less than 1/8 or 128 tokens longer, 8 buckets per
doubling), and ``warm_attention`` can build the plans of the buckets a run will meet
before it starts. Padding at the end is exact under a causal mask: real queries never see the
padded keys, and the padded queries' outputs are cut off (their gradients are zero).
Elsewhere (``backend="flash"``, CPUs, other GPUs) documents run at their own length.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_BACKENDS = ("auto", "cudnn", "flash")

# In order of preference; later ones catch inputs an earlier one rejects. No per-shape set-up
# in flash attention; cuDNN's plans are what the buckets are for.
_CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_WARMED: dict[tuple, set[int]] = {}  # buckets whose plans this process built, by shape and dtype


def bucket_length(length: int) -> int:
    """``length`` rounded up to a multiple of 1/8 of the largest power of two <= it (of 128 at least)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    step = 1 << max(7, length.bit_length() - 4)
    return -(-length // step) * step


@functools.lru_cache(maxsize=None)
def _uses_cudnn(backend: str, device_index: int) -> bool:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "flash":
        return False
    usable = torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device_index) >= (9, 0)
    if backend == "cudnn" and not usable:
        raise ValueError("attention backend 'cudnn' needs cuDNN and a Hopper (sm_90) or newer GPU; use 'auto'")
    return usable


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lengths: list[int] | None = None,
                     backend: str = "auto", scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of (B, H, S, D) queries over (B, H_kv, S, D) keys/values, within each document.

    ``doc_lengths`` splits the sequence into documents (one packed row, B = 1);
    None means one document. Grouped heads (H a multiple of H_kv) are handled here.
    ``scale`` multiplies the scores (None: 1/sqrt(D)); ``dropout_p`` drops attention weights
    (training). Returns (B, H, S, D).
    """
    if not q.is_cuda:  # the math kernel: repeating keys costs nothing extra there
        return _per_document(q, *repeat_kv(q, k, v), doc_lengths, contextlib.nullcontext, pad=False, gqa=False,
                             scale=scale, dropout_p=dropout_p)
    cudnn = _uses_cudnn(backend, q.device.index)
    kernels = functools.partial(sdpa_kernel, _CUDNN_FIRST if cudnn else _FLASH_FIRST, set_priority=True)
    return _per_document(q, k, v, doc_lengths, kernels, pad=cudnn, gqa=q.shape[1] != k.shape[1], scale=scale,
                         dropout_p=dropout_p)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with each head repeated to match the query heads (for kernels without grouped heads)."""
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _per_document(q, k, v, doc_lengths, kernels, pad: bool, gqa: bool, scale: float | None = None,
                  dropout_p: float = 0.0) -> torch.Tensor:
    lengths = doc_lengths if doc_lengths is not None and len(doc_lengths) > 1 else None
    parts = zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2)) if lengths else [(q, k, v)]
    outs = []
    with kernels():
        for qd, kd, vd in parts:
            n = qd.shape[2]
            extra = bucket_length(n) - n if pad else 0
            if extra:
                qd, kd, vd = (F.pad(t, (0, 0, 0, extra)) for t in (qd, kd, vd))
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=gqa, scale=scale,
                                                 dropout_p=dropout_p)
            outs.append(out[:, :, :n] if extra else out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def warm_attention(lengths, heads: int, kv_heads: int, head_dim: int, device: torch.device,
                   backend: str = "auto", dtype: torch.dtype = torch.bfloat16) -> int:
    """Run forward + backward once per bucket of ``lengths`` not warmed yet in this process; return how many.

    With cuDNN this builds each bucket's plans before a run (or a timed region)
    starts, instead of at its first document of that bucket. Does nothing elsewhere.
    """
    device = torch.device(device)
    if device.type != "cuda" or not _uses_cudnn(backend, device.index or 0):
        return 0
    key = (heads, kv_heads, head_dim, device, dtype)
    buckets = sorted({bucket_length(n) for n in lengths} - _WARMED.get(key, set()))
    _WARMED.setdefault(key, set()).update(buckets)
    gen = torch.Generator(device).manual_seed(0)  # the global generators stay untouched (model init follows)
    for n in buckets:
        q, k, v = (torch.randn(1, h, n, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        causal_attention(q, k, v, backend=backend).sum().backward()
    torch.cuda.synchronize(device)
    return len(buckets)
