"""How much of an optimizer's state to park: the share that keeps the device's peak under a budget.

Design note [park-fit]
----------------------
Parking ([parking] in ``parking.py``) costs copies over PCIe at every step, in proportion to what it parks. A
fixed share is a guess made before the run; this chooses it from what the run measures, so a run that fits
parks nothing and one that would not fit parks what it must.

The model. Let S be the bytes of the optimizer's element-wise state, f the share parked during a minibatch's
forward and backward, and A that minibatch's peak of torch-allocated bytes *without* the state. The peak with a
share f parked is

    peak(f) = A + (1 - f) S                                                     (1)

(the state parked is off the device during forward and backward; what is left is resident through them). The
step's own peak (all of the state resident, the activations gone) does not depend on f and is not counted: no
share can lower it. With L the bytes torch may allocate on the device (``budget`` of its memory, less what lives
outside torch's allocator: the CUDA context, NVSHMEM's heap, NCCL's buffers), the least share that fits is

    f = clamp((A + S - L) / S, 0, 1), rounded up to a multiple of ``grain``.    (2)

The steps:

1. **Watch** (``begin``, when the parking is built). The peak so far is noted; torch's peak statistics are only
   read, never reset (they are the user's too).
2. **Read** (``observe``, once the minibatch's micro-batches are done, before any state comes back). The peak
   since the last reading, if it grew, is a forward and backward peak with R resident: A = peak - R, R counted
   as the allocator counts it (each state tensor on the device rounded to its block, the scalars too). The blocks
   the copies out still hold ([park-trickle]) are part of a peak they coincide with: device memory then. A peak
   that did not grow was a survived one and says nothing new, except at the first reading: a higher peak before
   training (a model built whole on the device) is then taken as the first minibatch's, which parks more, never
   less. One lower than the last reading was reset since, by the user, and is read as grown. The largest A
   seen is kept: long-tailed minibatches differ, and the share only grows, so a share once needed is not given
   up for a shorter minibatch, nor for a roomier device later.
3. **Pass the step** (``after_step``). What the step allocated (the state's creation at the first step, the
   state brought back) raised the peak without saying anything about A: the reading is taken and set aside.
   So is a skipped step's (its state came back unused) and a reader's of the state between steps.
4. **Choose** (``share``, when the state is parked after the step): (2) with the largest A.

The first minibatch runs without any state (the optimizer creates it at its first step), so its peak is A
itself: the share for the second minibatch is chosen before the state has ever sat beside activations. A
process resuming from a checkpoint has state before any reading: until its first reading all of it is parked
(``ParkedOptimizerState`` does that, not counted as a chosen share), so its first minibatch measures A too. A later
minibatch longer than every earlier one can still exceed the budget before it is measured: ``budget`` (0.9 by
default) leaves that margin. Each rank chooses its own share (its own minibatches, its own peak); nothing is
exchanged. Where the device reports no memory (the CPU) nothing is parked: ``share`` stays 0.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class DeviceMemory(Protocol):
    """What ``ParkFit`` reads of a device's memory (CUDA's by default; tests give their own)."""

    def peak(self, device: torch.device) -> int | None:
        """The most torch-allocated bytes so far (torch's peak statistics); None where the device reports none."""

    def limit(self, device: torch.device, budget: float) -> int | None:
        """The bytes torch may allocate: ``budget`` of the device's memory less what lives outside torch's
        allocator; None where the device reports none."""

    def footprint(self, nbytes: int) -> int:
        """The bytes the allocator takes for a tensor of ``nbytes`` (what its peak counts)."""

    def allocated(self, device: torch.device) -> int | None:
        """The torch-allocated bytes now (what its peak is the most of); None where the device reports none."""


class CudaMemory:
    """``DeviceMemory`` of CUDA devices, from torch's allocator statistics and ``cudaMemGetInfo``; none on CPU."""

    def peak(self, device: torch.device) -> int | None:
        return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    def limit(self, device: torch.device, budget: float) -> int | None:
        if device.type != "cuda":
            return None
        free, total = torch.cuda.mem_get_info(device)
        outside = total - free - torch.cuda.memory_reserved(device)  # context, NVSHMEM heap, NCCL buffers
        return int(budget * total) - outside

    def footprint(self, nbytes: int) -> int:
        return -(-nbytes // 512) * 512  # CUDA's caching allocator rounds every block up to 512 bytes

    def allocated(self, device: torch.device) -> int | None:
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


class ParkFit:
    """Choose the share of an optimizer's state to park from the measured peak ([park-fit]).

    Args:
        budget: the share of the device's memory the peak may reach, in (0, 1].
        grain: shares are multiples of it (fewer distinct choices, a margin above the least that fits).
        memory: how the device's memory is read (``CudaMemory()`` by default).
    """

    def __init__(self, budget: float = 0.9, grain: float = 0.05, memory: DeviceMemory | None = None):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget={budget}: the share of the device's memory the peak may reach is in (0, 1]")
        self.budget, self.grain = budget, grain
        self.memory = memory if memory is not None else CudaMemory()
        self.need = 0  # the largest forward/backward peak seen without the state (A), in bytes
        self.fraction = 0.0  # the share chosen last (only grows)
        self._seen = 0  # the peak at the last reading
        self._limit: int | None = None  # None: not measured yet

    def reports(self, device: torch.device) -> bool:
        """Whether ``device`` reports its memory (a CUDA device; the CPU does not)."""
        return self.memory.peak(device) is not None

    @property
    def measured(self) -> bool:
        """Whether a minibatch's peak has been read (a fresh process resuming has none yet)."""
        return self._limit is not None

    def begin(self, device: torch.device) -> None:
        """Step 1: the first window starts at the peak so far."""
        self._seen = self.memory.peak(device) or 0

    def observe(self, device: torch.device, resident_bytes: int) -> None:
        """Step 2: the micro-batches are done, with ``resident_bytes`` of the state on the device through them."""
        peak = self.memory.peak(device)
        if peak is None:
            return
        # grown in this window, or reset since (read as grown), or the first window: a higher peak before it
        # (a model built whole on the device) is read as this window's, which parks more, never less
        if peak != self._seen or not self.measured:
            self.need = max(self.need, peak - resident_bytes)
        self._seen = peak
        self._limit = self.memory.limit(device, self.budget)

    def after_step(self, device: torch.device) -> None:
        """Step 3: what the step allocated is not a forward or backward peak: set its reading aside."""
        self._seen = self.memory.peak(device) or self._seen

    def share(self, state_bytes: int) -> float:
        """Step 4: the least share of ``state_bytes`` that keeps the next peak under the limit, (2), and never
        less than the share chosen before."""
        if self._limit is None or state_bytes <= 0:
            return self.fraction
        over = (self.need + state_bytes - self._limit) / state_bytes
        if over > 0:
            over = min(1.0, math.ceil(round(over / self.grain, 9)) * self.grain)
        self.fraction = max(self.fraction, over if over > 0 else 0.0)
        return self.fraction
