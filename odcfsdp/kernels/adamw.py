"""Fused AdamW over one rank's rows: one pass instead of a dozen elementwise kernels.

A candidate for the optimizer step, measured by ``benchmarks/optim_bench.py`` against
torch's fused AdamW on the shards plus ODCShard's publish and zeroing (the path
training takes): it does the update, the publish of the bf16 row and the zeroing of
the accumulator in one pass (38 bytes per parameter with the norm, against 50). At
44e14f3, before its alignment hint, it was 2.6x slower than torch's fused AdamW at 8B;
it is not wired into training until it is measured faster.

Per element, reading the fp32 master ``p``, moments ``m``, ``v`` and accumulated
gradient ``g``, and writing ``p``, ``m``, ``v``, ``g = 0`` and (optionally) the
communicated row in its own dtype:

    g  <- g * coef                      (global-norm clipping; coef read on the device)
    p  <- p * (1 - lr * wd)             (only where decay applies)
    m  <- m + (1 - beta1) * (g - m)
    v  <- beta2 * v + (1 - beta2) * g * g
    p  <- p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)

the update of ``torch.optim.AdamW``, up to rounding (fused multiply-adds may round
differently from the separate kernels).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _adamw_kernel(
    p,  # *fp32 [C]: master row (updated in place)
    m,  # *fp32 [C]: first moment
    v,  # *fp32 [C]: second moment
    g,  # *fp32 [C]: accumulated gradient (read, then zeroed)
    row,  # *T [C]: communicated row (written when HAS_ROW)
    runs,  # *int64 [n, 3]: (start, length, decay 0/1) chunks of the row
    coef,  # *fp32 []: gradient scale (clipping)
    lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt,  # fp32 scalars
    HAS_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,  # every run's start and length are multiples of ALIGN elements (1: no promise)
):
    c = tl.program_id(0)
    # Starts and lengths come from a table, so Triton cannot see their alignment; without the hint
    # it issues one narrow access per element instead of 16-byte vectors.
    start = tl.multiple_of(tl.load(runs + c * 3), ALIGN)
    n = tl.multiple_of(tl.load(runs + c * 3 + 1), ALIGN)
    decay = tl.load(runs + c * 3 + 2).to(tl.float32)
    offs = start + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < n
    grad = tl.load(g + offs, mask=mask) * tl.load(coef)
    tl.store(g + offs, tl.zeros_like(grad), mask=mask)
    pv = tl.load(p + offs, mask=mask)
    pv = pv * (1.0 - lr * weight_decay * decay)
    mv = tl.load(m + offs, mask=mask)
    mv = mv + (1.0 - beta1) * (grad - mv)
    vv = tl.load(v + offs, mask=mask) * beta2 + (1.0 - beta2) * grad * grad
    pv = pv - step_size * mv / (tl.sqrt(vv) / bc2_sqrt + eps)
    tl.store(m + offs, mv, mask=mask)
    tl.store(v + offs, vv, mask=mask)
    tl.store(p + offs, pv, mask=mask)
    if HAS_ROW:
        tl.store(row + offs, pv.to(row.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def decay_runs(row_len: int, decay_ranges: Sequence[tuple[int, int]], block: int, device) -> torch.Tensor:
    """(start, length, decay) chunks of at most ``block`` covering ``[0, row_len)``."""
    runs, pos = [], 0
    for lo, hi in list(decay_ranges) + [(row_len, row_len)]:
        for a, b, flag in ((pos, lo, 0), (lo, hi, 1)):
            for s in range(a, b, block):
                runs.append((s, min(block, b - s), flag))
        pos = hi
    return torch.tensor(runs, dtype=torch.int64, device=device).view(-1, 3)


def fused_adamw_(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, row: torch.Tensor | None,
    runs: torch.Tensor, coef: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, step: int, block: int, align: int = 1,
) -> None:
    """One AdamW step on a row (see the module docstring); ``runs`` from ``decay_runs`` with the same block.

    ``align``: a promise that every run starts and ends on a multiple of that many
    elements (lets the kernel use vector loads).
    """
    for name, t in (("master", p), ("exp_avg", m), ("exp_avg_sq", v), ("gradient", g)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.shape != m.shape:
            raise ValueError(f"{name} must be a contiguous fp32 tensor shaped like the master row")
    if row is not None and (row.shape != m.shape or not row.is_contiguous()):
        raise ValueError("the communicated row must be contiguous and shaped like the master row")
    bc1 = 1 - beta1**step
    bc2_sqrt = (1 - beta2**step) ** 0.5
    if runs.shape[0]:
        _adamw_kernel[(runs.shape[0],)](
            p, m, v, g, row if row is not None else p, runs, coef.to(torch.float32), lr, beta1, beta2, eps,
            weight_decay, lr / bc1, bc2_sqrt, HAS_ROW=row is not None, BLOCK=block, ALIGN=align,
        )
