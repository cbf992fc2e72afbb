"""A group's gradient buffer made at its push from autograd's own gradient tensors ([fresh-grads]).

Design note [fresh-grads]
-------------------------
Before, a site's pre-backward gave each trained parameter a ``.grad`` that viewed a zeroed, parameter-major
buffer, and autograd accumulated into it ([grad-buffers] in ``group.py``): with a ``.grad`` already there,
autograd's gradient accumulation adds in place, so each parameter's gradient was written by its kernel (2 bytes
an element, bf16), zero-filled (2) and added (read 2 + 2, write 2). Now a group whose gradients come in its
buffer's dtype leaves ``.grad`` unset: autograd keeps the tensor its kernel wrote, as it does under FSDP2, and
the push copies those tensors into the buffer, padding zeroed, in one ``torch.cat`` (read 2, write 2): 4 bytes
an element of the unsharded model less, every micro-batch (at 8B, 29 GB a micro-batch on every rank).

The rest of [grad-buffers] holds as it was: the push runs after the site's gradients are accumulated, a gradient
that arrives after the push lands in a fresh ``.grad`` and is collected at the end of backward, one that arrives
before the site's backward (TRL's fused head reading ``lm_head.weight``) is simply accumulated into by the site's.
What it costs: the site's gradient tensors and its buffer live together for the copy, one site's gradients more at
most (the buffer replaced the zeroed one autograd added into); the tensors are autograd's, so a memory breakdown
counts them with the activations until the push.
"""

from __future__ import annotations

import torch


def fresh_grads_apply(params, grad_dtype: torch.dtype, unsharded: torch.Tensor) -> bool:
    """Whether a group's gradients can be left to autograd and copied at the push: they come in the buffer's
    dtype (autograd's gradients have their parameter's, the unsharded buffer's) and there is something to train."""
    return grad_dtype == unsharded.dtype and any(sp.trainable for sp in params)


def buffer_from_grads(layout, params, grad_dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The group's parameter-major gradient buffer, from its trained parameters' unsharded ``.grad`` (zeros for
    those without one, and in the padding between parameters); None if no trained parameter has a gradient.
    One ``torch.cat`` into the buffer."""
    grads = [sp.unsharded.grad if sp.trained else None for sp in params]
    if all(g is None for g in grads):
        return None
    out = torch.empty(layout.unsharded_numel, dtype=grad_dtype, device=device)
    pieces, position, zeros = [], 0, None
    for i, g in enumerate(grads):
        start, end = layout.unsharded_range(i)
        gap = start - position + (0 if g is not None else end - start)
        if gap:
            if zeros is None or zeros.numel() < gap:
                zeros = torch.zeros(max(gap, 1024), dtype=grad_dtype, device=device)
            pieces.append(zeros[:start - position])
        if g is not None:
            pieces.append(g.reshape(-1))
        else:
            pieces.append(zeros[:end - start])
        position = end
    if position < out.numel():
        pieces.append(torch.zeros(out.numel() - position, dtype=grad_dtype, device=device))
    torch.cat([p for p in pieces if p.numel()], out=out)
    return out


__all__ = ["buffer_from_grads", "fresh_grads_apply"]
