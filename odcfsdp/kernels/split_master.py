"""fp32 master values stored as a bf16 row (upper half, rounded) plus 16 low bits.

An fp32 value's bit pattern is ``hi16 << 16 | lo16``; its upper half alone is the bf16
value truncated toward zero. The row keeps that upper half *rounded* to nearest
(ties away from zero: one is added to the pattern when ``lo16 >= 0x8000``, which
for sign-magnitude patterns moves away from zero and carries into the exponent
correctly), so computing with the row is computing with the master rounded to
bf16. Because rounding up happened exactly when the top bit of ``lo16`` is set,
the truncated half, and so the exact fp32 value, is recovered from the pair.
(Round-half-to-even could not be undone: at a tie both neighbours end even.)

The fused AdamW kernel does the same arithmetic per element; these torch versions
serve every other reader and writer (checkpoints, state dicts, the unfused step).
"""

from __future__ import annotations

import torch

_LOW = 0xFFFF


def split_master_(master: torch.Tensor, row: torch.Tensor, lo: torch.Tensor) -> None:
    """Store fp32 ``master`` as bf16 ``row`` (rounded upper half) and int16 ``lo`` (low bits), in place."""
    bits = master.detach().contiguous().view(torch.int32)
    low = bits & _LOW
    high = ((bits >> 16) & _LOW) + (low >> 15)  # int32 arithmetic; the 16-bit pattern wraps below
    row.view(torch.int16).copy_(high.to(torch.int16))
    lo.copy_(low.to(torch.int16))


def join_master(row: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The exact fp32 values that ``split_master_`` stored as ``row`` and ``lo`` (a new tensor)."""
    low = lo.to(torch.int32) & _LOW
    high = (row.view(torch.int16).to(torch.int32) & _LOW) - (low >> 15)
    return ((high << 16) | low).view(torch.float32)
