"""The causal-LM loss, and the output projection fused with it so no full fp32 logits ever exist.

Design note [linear-cross-entropy]
----------------------------------
The unfused loss ``F.cross_entropy(lm_head(h).float(), t)`` holds, per micro-batch of S
tokens and vocabulary V, the bf16 logits (2 S V bytes), their fp32 copy (4 S V) and its
gradient (4 S V): at S = 64K, V = 128K that is 10 S V = 84 GB, more than the 8B model's
whole sharded state. ``linear_cross_entropy`` walks the tokens in chunks of C rows and, for
each chunk, computes everything the backward needs at once (as Liger-Kernel's fused linear
cross-entropy does, written here with torch ops):

1. ``z = h_c W^T + b`` in the compute dtype, upcast to fp32 (the unfused path's numerics);
2. ``lse = logsumexp(z)``; loss += sum over valid rows of ``lse - z[target]``;
3. in grad mode: ``p = exp(z - lse)``, ``p[target] -= 1``, ignored rows zeroed: the gradient
   of the summed loss by ``z``; cast to the compute dtype like the unfused path's gradient;
4. ``dh_c = p W`` (kept for backward) and ``dW += p^T h_c``, ``db += sum p`` (fp32 accumulators,
   one rounding to the weight's dtype at the end).

On CUDA steps 2-3 run as one compiled function (a reduction and a pointwise kernel over the compute-dtype logits, no
fp32 copy). Backward only scales the kept ``dh`` and ``dW`` by the incoming gradient (the normaliser, a loss scale).
Peak extra memory is one chunk's logits (~10 C V bytes; C is sized so the fp32 chunk is ``chunk_bytes``, 512 MiB by
default, i.e. 1K tokens at V = 128K) plus ``dh`` (the size of ``h``) and the fp32 ``dW`` (4 V H: 2.1 GB at 8B), the
latter two only from the loss to the start of backward. FLOPs are the unfused path's (three matmuls of 2 S V H each);
nothing is recomputed.

The head runs as a module call (``LinearCrossEntropyHead``, an ``nn.Linear`` whose forward
also takes ``targets``): sharding wrappers (ours, FSDP2) gather a module's parameters in its
hooks, so reading ``lm_head.weight`` from the parent's forward would see a shard.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100
DEFAULT_CHUNK_BYTES = 512 << 20


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy (targets == -100 ignored), divided by ``normalizer``.

    Pass the global number of target tokens of the minibatch as ``normalizer``: ranks
    may run different numbers of micro-batches, so a per-micro-batch mean would
    weight tokens unequally.
    """
    upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (float64 stays)
    loss = F.cross_entropy(upcast.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss if normalizer is None else loss / normalizer


_addmm_out_dtype: bool | None = None  # whether torch.addmm takes out_dtype on CUDA (torch >= 2.8), once known


def _accumulate_weight_grad(grad_w: torch.Tensor, p: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_w += p^T h`` into an fp32 accumulator, the product's own accumulation in fp32 too."""
    global _addmm_out_dtype
    if p.dtype == grad_w.dtype:
        grad_w.addmm_(p.t(), h)
        return
    if p.is_cuda and _addmm_out_dtype is not False:  # bf16 inputs, fp32 output without an fp32 (V, H) temporary
        try:
            torch.addmm(grad_w, p.t(), h, out_dtype=grad_w.dtype, out=grad_w)
            _addmm_out_dtype = True
            return
        except (TypeError, RuntimeError):  # older torch: no out_dtype (fails before writing anything)
            if _addmm_out_dtype:
                raise
            _addmm_out_dtype = False
    grad_w += (p.t() @ h).to(grad_w.dtype)


def _chunk_loss_and_grad(z: torch.Tensor, t: torch.Tensor, with_grad: bool):
    """Steps 2-3 for one chunk of logits ``z`` (C, V): the summed loss (``acc`` dtype) and ``p`` in ``z``'s dtype."""
    acc = torch.promote_types(z.dtype, torch.float32)
    zf = z.to(acc)
    lse = torch.logsumexp(zf, dim=-1)
    valid = t != IGNORE_INDEX
    index = torch.where(valid, t, 0)
    loss = torch.where(valid, lse - zf.gather(1, index[:, None])[:, 0], 0.0).sum()
    if not with_grad:
        return loss, None
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == index[:, None]
    p = torch.exp(zf - lse[:, None]) - onehot.to(acc)
    return loss, torch.where(valid[:, None], p, 0.0).to(z.dtype)


# On CUDA the chunk's elementwise work runs compiled: one reduction and one pointwise kernel reading the
# compute-dtype logits, instead of eager passes over an fp32 copy, each a round trip through memory of the
# chunk's (tokens x vocab) size, which made the fused loss slower than the unfused one (docs/design.md, The loss).
_compiled_chunk = None


def _chunk_fn(like: torch.Tensor):
    """Steps 2-3 for chunks on ``like``'s device: compiled on CUDA (once per process), eager elsewhere."""
    global _compiled_chunk
    if not like.is_cuda:
        return _chunk_loss_and_grad
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk_loss_and_grad, dynamic=True)
    return _compiled_chunk


class _LinearCrossEntropy(torch.autograd.Function):
    """Steps 1-4 of [linear-cross-entropy] in forward; backward scales the kept gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows: int, grad_enabled: bool):
        # The compute dtype is autocast's where it is on (the unfused head's F.linear would run in it),
        # else the weight's; autocast is then off inside, so every op below runs in the dtype it names.
        device_type = hidden.device.type
        on = torch.is_autocast_enabled(device_type)
        cdt = torch.get_autocast_dtype(device_type) if on else weight.dtype
        with torch.autocast(device_type, enabled=False):
            return _LinearCrossEntropy._forward(ctx, hidden, weight, bias, targets, chunk_rows, cdt, grad_enabled)

    @staticmethod
    def _forward(ctx, hidden, weight, bias, targets, chunk_rows: int, cdt: torch.dtype, grad_enabled: bool):
        h = hidden.reshape(-1, hidden.shape[-1])
        t = targets.reshape(-1).to(h.device)
        # needs_input_grad follows requires_grad, not grad mode: under no_grad (evaluation) nothing is computed
        needs = [grad_enabled and n for n in ctx.needs_input_grad]
        w, b = weight.to(cdt), None if bias is None else bias.to(cdt)
        acc = torch.promote_types(cdt, torch.float32)  # fp32, or float64 for a float64 model
        grad_h = torch.empty_like(h) if needs[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if needs[1] else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if bias is not None and needs[2] else None
        loss = torch.zeros((), dtype=acc, device=h.device)
        with_grad = grad_h is not None or grad_w is not None or grad_b is not None
        chunk_fn = _chunk_fn(h)
        for start in range(0, h.shape[0], chunk_rows):
            hc, tc = h[start:start + chunk_rows].to(cdt), t[start:start + chunk_rows]
            z = F.linear(hc, w, b)                                      # 1
            chunk_loss, p = chunk_fn(z, tc, with_grad)                  # 2, 3
            loss += chunk_loss
            if not with_grad:
                continue
            if grad_h is not None:                                      # 4
                grad_h[start:start + chunk_rows] = p @ w
            if grad_w is not None:
                _accumulate_weight_grad(grad_w, p, hc)
            if grad_b is not None:
                grad_b += p.sum(0, dtype=acc)
        ctx.hidden_shape = hidden.shape
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        dh = None if grad_h is None else (grad_h * grad_out.to(grad_h.dtype)).reshape(ctx.hidden_shape)
        dw = None if grad_w is None else (grad_w * grad_out).to(ctx.dtypes[0])
        db = None if grad_b is None else (grad_b * grad_out).to(ctx.dtypes[1])
        return dh, dw, db, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T + bias`` against ``targets`` (-100 ignored), chunked.

    Equal to ``causal_lm_loss(F.linear(hidden, weight, bias), targets)`` in value and
    gradients, without materialising the (tokens, vocab) fp32 logits: see
    [linear-cross-entropy]. ``hidden`` is (..., H), ``targets`` the matching (...) ids;
    ``chunk_bytes`` bounds one chunk's fp32 logits.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} must match hidden {tuple(hidden.shape)} without its "
                         f"last dimension")
    chunk_rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_rows, torch.is_grad_enabled())


class LinearCrossEntropyHead(nn.Linear):
    """An output projection (``nn.Linear``) that returns the summed loss when given ``targets``.

    ``head(h)`` is the logits as before; ``head(h, targets)`` is
    ``linear_cross_entropy(h, head.weight, targets, head.bias)``. Parameter names and
    state are ``nn.Linear``'s, so checkpoints and Hugging Face files are unchanged;
    ``adopt`` turns an existing ``nn.Linear`` (a Hugging Face ``lm_head``) into one in place.
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def forward(self, input: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
        """Logits of ``input``, or with ``targets`` the summed cross-entropy (see [linear-cross-entropy])."""
        if targets is None:
            return super().forward(input)
        return linear_cross_entropy(input, self.weight, targets, self.bias, chunk_bytes=self.chunk_bytes)

    @classmethod
    def adopt(cls, linear: nn.Linear) -> "LinearCrossEntropyHead":
        """Make ``linear`` (exactly an ``nn.Linear``) this class in place, keeping its parameters and hooks."""
        if type(linear) is not nn.Linear and not isinstance(linear, cls):
            raise TypeError(f"can only adopt a plain nn.Linear output layer, got {type(linear).__name__}")
        linear.__class__ = cls
        return linear
