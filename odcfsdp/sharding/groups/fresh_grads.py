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
most (the buffer replaced the zeroed one autograd added into). ``memory_breakdown`` counts the tensors as
``grad_buffers`` (``FlatGroup.pending_grads``); the peak replay, which sees them allocated by autograd without a
Python frame of ours, with the activations, and the push's buffer as ``grad_buffers``. A sparse gradient (a
sparse embedding's) is added into a zeroed buffer instead, as before.
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
    One ``torch.cat`` into the buffer; sparse gradients are added into a zeroed one."""
    grads = [sp.unsharded.grad if sp.trained else None for sp in params]
    if all(g is None for g in grads):
        return None
    if any(g is not None and g.is_sparse for g in grads):  # a sparse embedding's: add it into dense zeros
        out = torch.zeros(layout.unsharded_numel, dtype=grad_dtype, device=device)
        for i, g in enumerate(grads):
            if g is not None:
                start, end = layout.unsharded_range(i)
                out[start:end].view(g.shape).add_(g)
        return out
    out = torch.empty(layout.unsharded_numel, dtype=grad_dtype, device=device)
    pieces, position = [], 0  # (start, end, gradient or None: zeros), padding included, in order
    for i, g in enumerate(grads):
        start, end = layout.unsharded_range(i)
        pieces += [(position, start, None), (start, end, g)]
        position = end
    pieces = [p for p in pieces + [(position, out.numel(), None)] if p[1] > p[0]]
    most = max((e - s for s, e, g in pieces if g is None), default=0)
    zeros = torch.zeros(most, dtype=grad_dtype, device=device) if most else None  # one fill, sliced
    if pieces:
        torch.cat([g.reshape(-1) if g is not None else zeros[:e - s] for s, e, g in pieces], out=out)
    return out


__all__ = ["buffer_from_grads", "fresh_grads_apply"]
