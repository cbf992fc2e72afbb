"""A small Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Used by tests, examples and benchmarks. Parameter names and the rotate-half RoPE
convention follow Hugging Face's Llama so weights map one to one. Supports packed
micro-batches: ``positions`` restart at every document, and attention stays inside
each document, either by running causal attention per document (``doc_lengths``, a
host-side list: cost grows with the sum of squared document lengths, no mask) or
through a dense mask built from ``document_ids`` (cost grows with the square of the
whole row).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .attention import ATTENTION_BACKENDS, causal_attention, repeat_kv
from .loss import LinearCrossEntropyHead


@dataclass
class LlamaConfig:
    """Decoder hyper-parameters (``ffn_dim`` defaults to ~8/3 * dim, rounded to ``multiple_of``)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int | None = None
    multiple_of: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    compile: bool = False  # torch.compile each decoder layer's dense parts (attention itself stays eager)
    compile_backend: str = "inductor"
    # "auto" (cuDNN on Hopper+, else flash), "cudnn" or "flash": see [attention-kernels]
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")
        if self.ffn_dim is None:
            hidden = int(8 * self.dim / 3)
            self.ffn_dim = (hidden + self.multiple_of - 1) // self.multiple_of * self.multiple_of

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Number of distinct parameters (tied embeddings counted once)."""
        d, f, h, kv = self.dim, self.ffn_dim, self.head_dim, self.n_kv_heads
        per_layer = 2 * d + d * d * 2 + 2 * d * kv * h + 3 * d * f
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + d

    def matmul_params(self) -> int:
        """Parameters that take part in matrix products per token (the input embedding does not)."""
        norms = (2 * self.n_layers + 1) * self.dim
        embedding = 0 if self.tie_embeddings else self.vocab_size * self.dim  # a lookup, not a matmul
        return self.num_params() - norms - embedding


# Named sizes (Llama 3.x shapes; the vocabulary comes from the data). "tiny" and "150m" are for
# CPUs and quick tests; "14b" is the ODC paper's size class (Qwen2.5-14B's block shapes: 13.5B parameters with a
# 32000-token vocabulary).
LLAMA_SIZES: dict[str, dict] = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2),
    "150m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4),
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, rope_theta=500000.0,
               tie_embeddings=True),
    "3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, rope_theta=500000.0,
               tie_embeddings=True),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0),
    "14b": dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_dim=13824, rope_theta=1000000.0),
}


def llama_config(size: str, vocab_size: int, **overrides) -> LlamaConfig:
    """``LlamaConfig`` of a named size (see ``LLAMA_SIZES``), with overrides."""
    if size not in LLAMA_SIZES:
        raise ValueError(f"model.size={size!r} is not one of {tuple(LLAMA_SIZES)}")
    fields = {**LLAMA_SIZES[size], "vocab_size": vocab_size, **overrides}
    unknown = set(fields) - set(LlamaConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"model.overrides has unknown LlamaConfig fields {sorted(unknown)}")
    for name, value in overrides.items():  # a number's field takes a number (a string fails later, obscurely)
        default = LlamaConfig.__dataclass_fields__[name].default
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            continue
        wanted = (int, float) if isinstance(default, float) else int
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise ValueError(f"model.overrides.{name}={value!r} must be {type(default).__name__}")
    return LlamaConfig(**fields)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary (per-document) positions."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)

    def _inv_freq(self, device) -> torch.Tensor:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        return 1.0 / self.theta ** (steps / self.head_dim)

    def init_buffers(self) -> None:
        """Recompute the frequencies where they live (after meta-device construction)."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, S, head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """Grouped-query attention through ``scaled_dot_product_attention``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.backend = cfg.attention_backend
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated queries (B, H, S, D) and keys, and values (B, H_kv, S, D)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attend(self, q, k, v, mask, doc_lengths=None) -> torch.Tensor:
        """Causal attention of (B, H, S, D) inputs, within documents; returns (B, S, H * D)."""
        b, _, s, _ = q.shape
        if mask is None:
            out = causal_attention(q, k, v, doc_lengths, self.backend)
        else:  # a dense mask: no kernel takes grouped heads with one, so repeat keys and values
            out = F.scaled_dot_product_attention(q, *repeat_kv(q, k, v), attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, -1)

    def forward(self, x, cos, sin, mask, doc_lengths=None):
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(self.attend(q, k, v, mask, doc_lengths))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.compiled = cfg.compile_backend if cfg.compile else None

    def forward(self, x, cos, sin, mask, doc_lengths=None):
        if self.compiled and hasattr(self.mlp.down_proj.weight, "_odc"):
            # ODCShard's sharded form of a parameter (see odcfsdp.sharding.groups.param) where the gathered one should
            # be: its per-module hooks would run inside the compiled code, as graph breaks.
            raise RuntimeError("compiled decoder layers need all their parameters in hand when the layer starts: "
                               "with ODCShard, hook whole layers (units=(DecoderLayer,))")
        pre, post = _layer_parts(self.compiled)
        q, k, v = pre(self, x, cos, sin)
        return post(self, x, self.self_attn.attend(q, k, v, mask, doc_lengths))


def _before_attention(layer: DecoderLayer, x, cos, sin):
    return layer.self_attn.project(layer.input_layernorm(x), cos, sin)


def _after_attention(layer: DecoderLayer, x, attended):
    x = x + layer.self_attn.o_proj(attended)
    return x + layer.mlp(layer.post_attention_layernorm(x))


@functools.lru_cache(maxsize=None)
def _layer_parts(backend: str | None):
    """The two dense parts of a decoder layer around attention, compiled with ``backend`` (None: eager).

    Attention stays outside: packed rows run one kernel per document, whose count and
    lengths change with every micro-batch. The parts take the layer as an argument, so
    every layer (and every model) shares one compiled graph per shape class; sequence
    lengths are dynamic from the start, as long-tailed data changes them every step.
    """
    if backend is None:
        return _before_attention, _after_attention
    return (torch.compile(_before_attention, backend=backend, dynamic=True),
            torch.compile(_after_attention, backend=backend, dynamic=True))


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, S, S) mask: causal, and only within the same document."""
    s = document_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


class Llama(nn.Module):
    """Llama-style causal decoder returning logits of shape (B, S, vocab)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = LinearCrossEntropyHead(cfg.dim, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for matrices, scaled by depth for output projections; ones for norms."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        doc_lengths: list[int] | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for ``tokens`` (B, S); packed rows pass ``positions`` and ``doc_lengths`` (B = 1) or ``document_ids``.

        With ``targets`` (B, S) the summed next-token loss instead, the output projection
        fused with the cross-entropy so no full logits exist ([linear-cross-entropy]).
        """
        b, s = tokens.shape
        if doc_lengths is not None and (b != 1 or sum(doc_lengths) != s):
            raise ValueError(f"doc_lengths must describe one packed row of {s} tokens, got {b} rows and "
                             f"lengths summing to {sum(doc_lengths)}")
        if positions is None:
            positions = torch.arange(s, device=tokens.device).expand(b, s)
        h = self.embed_tokens(tokens)
        cos, sin = self.rotary(positions, h.dtype)
        mask = None if document_ids is None or doc_lengths is not None else document_mask(document_ids)
        recompute = self.config.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                h = checkpoint(layer, h, cos, sin, mask, doc_lengths, use_reentrant=False)
            else:
                h = layer(h, cos, sin, mask, doc_lengths)
        return self.lm_head(self.norm(h), targets)

