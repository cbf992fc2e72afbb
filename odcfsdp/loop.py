"""One training step of the standard PyTorch loop, shared by ``python -m odcfsdp.train`` and the e2e benchmark.

A step, as numbered steps:

1. ``plan_step``: the global minibatch is samples ``[step * B, (step + 1) * B)`` of the
   source; every rank computes the same balancing plan from the samples' lengths (no
   communication) and takes its share of micro-batches;
2. ``train_step``: each micro-batch is packed, moved to the device and run forward and backward (with ``ODCShard``,
   [lifecycle] 1-7 in ``sharding/runtime/lifecycle.py``); the model returns its loss summed over target tokens (the
   head fused with the cross-entropy, [linear-cross-entropy]), divided here by the number of target tokens of the whole
   minibatch (ranks' shares differ), then scaled by ``loss_scale`` (methods that average gradients over ranks pass
   the world size);
3. ``clip_grad_norm_`` over the model's parameters (the global pre-clip norm), the
   optimizer's step, the scheduler's step, ``zero_grad``: the standard loop, which
   with ``ODCShard`` is also where ranks meet ([lifecycle] 8-10, [step-protocol]); optimizer state parked on the
   host ([parking]) comes back under the last backward as far as the memory it frees allows ([park-backward]),
   the rest once the micro-batches are done;
4. ``gather_stats``: every rank's numbers in one small all-gather, after the step.

``evaluate`` is the held-out loss between steps: the same packing and loss, without
gradients, each rank a share of the samples (equal counts, for the collective transport).

The model may be an ``ODCShard``, an FSDP2 module or a DDP module: only the wrapping
differs (``autocast``, ``loss_scale``, ``no_sync`` for DDP's non-final micro-batches).

``StepGarbageCollection`` runs Python's cycle collector between steps:

Design note [step-gc]
---------------------
CPython's collector starts a full (generation 2) collection on its own once enough objects have
survived younger collections; its cost grows with every object the process tracks, and a compiled
model's process tracks millions (inductor's graphs and code), so one such collection can take as long
as a step (docs/design.md, Figures behind the design notes). With several ranks one rank's pause
is everyone's: the others wait for it at the next meeting. torchtitan's answer, followed here with its
default frequency (``training.gc_freq = 50``): switch automatic collection off for the run and
collect the young generations (``gc.collect(1)``) every N steps, between steps, where it is cheap
and every rank pauses at the same point. What torch's activation checkpointing leaves in cycles
waits for that collection; odc's own hooks leave none (``tests/test_lifecycle.py``). The price,
torchtitan's too: cycles among objects that survived into the oldest generation and die later wait
for the end of the loop (or ``gc.collect()`` called by hand).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .data.balance import CostModel, plan_minibatch
from .data.packing import Sample, empty_micro_batch, pack
from .optim.park_backward import returning_under_backward
from .optim.parked import prefetch_parked, settle_parked
from .sharding.placement.collectives import all_gather_tensor


@dataclass
class Minibatch:
    """One global minibatch and this rank's share of it.

    Attributes:
        samples: the minibatch's samples (every rank holds all of them, truncated to the cap).
        mine: this rank's micro-batches, as lists of indices into ``samples``.
        global_targets: target tokens of the whole minibatch (the loss normaliser).
    """

    samples: list[Sample]
    mine: list[list[int]]
    global_targets: int

    @property
    def sizes(self) -> list[int]:
        return [s.n_inputs for s in self.samples]

    def my_sizes(self) -> list[int]:
        """Input lengths of this rank's samples."""
        return [self.samples[i].n_inputs for mb in self.mine for i in mb]


def plan_step(source, step: int, batch: int, cap: int, balance: str, cost: CostModel, rank: int,
              world: int, *, largest_last: bool = False) -> Minibatch:
    """Step 1: the minibatch of ``step`` and this rank's micro-batches under ``balance``. ``largest_last``: the
    largest of them (by positions; the first of equals) runs last, the others in the plan's order, so that its
    backward frees the most for a parked optimizer state to come back into ([park-backward] 0;
    ``wants_largest_last(optimizer)`` says when)."""
    samples = [source[step * batch + i].truncated(cap + 1) for i in range(batch)]
    mine = plan_minibatch([s.n_inputs for s in samples], world, balance, cap, cost)[rank]
    if largest_last and len(mine) > 1:
        sizes = [sum(samples[i].n_inputs for i in mb) for mb in mine]
        big = max(range(len(mine)), key=lambda k: (sizes[k], -k))
        mine = mine[:big] + mine[big + 1:] + [mine[big]]
    return Minibatch(samples, mine, max(1, sum(s.n_targets for s in samples)))


def grad_norm_value(norm: torch.Tensor) -> float:
    """``clip_grad_norm_``'s result as a float (a DTensor's full value for sharded models)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, minibatch: Minibatch,
               device: torch.device, *, max_norm: float | None, loss_scale: float = 1.0,
               autocast: Callable = contextlib.nullcontext,
               no_sync: Callable[[], contextlib.AbstractContextManager] | None = None) -> dict:
    """Steps 2-3 for this rank: forward/backward of its micro-batches, clip, step; returns its numbers.

    A non-finite global gradient norm (a NaN or inf loss or gradient on any rank) skips the
    optimizer's and the scheduler's step: the gradients are dropped, the weights stay as they were.

    Returned: ``loss`` (this rank's share of the minibatch loss), ``grad_norm`` (the
    global pre-clip norm), ``finite`` (whether the update was applied), ``compute_s`` (micro-batches,
    waited for on CUDA), ``host_s`` (until the host had queued them), ``step_s``
    (clip + optimizer step, waits for other ranks included; on CUDA until the current stream is done: work left
    on side streams, ODCShard's accumulator zeroing, overlaps the next step's micro-batches).
    """
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    last = len(minibatch.mine) - 1
    for k, mb in enumerate(minibatch.mine):
        micro = (pack([minibatch.samples[i] for i in mb]) if mb else empty_micro_batch()).to(device)
        sync = no_sync() if no_sync is not None and k < last else contextlib.nullcontext()
        # parked optimizer state comes back under the last backward, in the memory it frees ([park-backward])
        early = (returning_under_backward(optimizer, getattr(model, "register_post_backward_hook", None),
                                          getattr(model, "gradient_bytes_in_flight", None),
                                          getattr(model, "backward_pushes", None))
                 if k == last else contextlib.nullcontext())
        with sync, early:  # around backward too: FSDP2 reads its sync flag in backward, DDP at forward
            with autocast():
                # The model returns the summed loss of its targets, its head fused with the loss
                # ([linear-cross-entropy]): no micro-batch holds its full logits.
                loss = model(micro.tokens, micro.positions, doc_lengths=micro.doc_lengths,
                             targets=micro.targets) / minibatch.global_targets
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        loss_sum += loss.detach()
    t_issued = time.perf_counter()
    if cuda:
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    # Optimizer state parked on the host ([parking] 2) that did not come back under the last backward starts back
    # now, with every activation freed: its copies run under the meeting and clipping below.
    prefetch_parked(optimizer)
    # The global gradient norm, which clipping needs anyway, is the non-finite guard: a NaN or inf
    # in any rank's loss or gradient makes it non-finite on every rank alike, with no extra meeting.
    if max_norm is not None:
        norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    else:
        norm = grad_norm_value(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                                              if p.grad is not None]))
    finite = math.isfinite(norm)
    if finite:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    else:
        settle_parked(optimizer)  # the skipped step's prefetched state goes back to the host
    optimizer.zero_grad()  # also what drops a non-finite minibatch's gradients (the update is not applied)
    if cuda:  # the current stream only: ODCShard's accumulator zeroing goes on under the next forward ([streams] 5)
        torch.cuda.current_stream(device).synchronize()
    t2 = time.perf_counter()
    return {"loss": loss_sum.item(), "grad_norm": norm, "finite": finite, "compute_s": t1 - t0,
            "host_s": t_issued - t0, "step_s": t2 - t1}


def evaluate(model: nn.Module, source, cap: int, device: torch.device, rank: int, world: int,
             group=None) -> float:
    """Mean next-token loss over every target token of ``source`` (all its samples once; collective).

    Samples are packed in order into micro-batches of up to ``cap`` positions; micro-batch
    k runs on rank ``k % world``, and ranks with fewer run an empty one, so every rank runs
    the same number of forwards. Returns the loss summed over targets / their number.
    """
    batches, current, used = [], [], 0
    for i in range(source.num_samples):
        s = source[i].truncated(cap + 1)
        if current and used + s.n_inputs > cap:
            batches.append(current)
            current, used = [], 0
        current.append(s)
        used += s.n_inputs
    if current:
        batches.append(current)
    mine = batches[rank::world]
    rounds = -(-len(batches) // world)
    was_training = model.training
    model.eval()
    total, targets = 0.0, 0
    with torch.no_grad():
        for k in range(rounds):
            micro = (pack(mine[k]) if k < len(mine) else empty_micro_batch()).to(device)
            total += model(micro.tokens, micro.positions, doc_lengths=micro.doc_lengths,
                           targets=micro.targets).item()
            targets += int((micro.targets != -100).sum())
    model.train(was_training)
    table = gather_stats([total, targets], device, group)
    return table[:, 0].sum().item() / max(1.0, table[:, 1].sum().item())


def gather_stats(values: list[float], device: torch.device, group=None) -> torch.Tensor:
    """Step 4: every rank's ``values`` as a ``(world, len)`` float64 CPU table (one all-gather)."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    if not dist.is_initialized():
        return local.view(1, -1).cpu()
    world = dist.get_world_size(group)
    out = torch.empty(world * local.numel(), dtype=local.dtype, device=device)
    all_gather_tensor(out, local, group=group)
    return out.view(world, -1).cpu()


#: torchtitan's default (``training.gc_freq``)
GC_EVERY_DEFAULT = 50


class StepGarbageCollection:
    """Automatic collection off while in use, ``gc.collect(1)`` every ``every`` steps ([step-gc]).

    ``every = 0`` leaves Python's automatic collection as it is (and ``step`` does nothing). Use as a context
    manager around the training loop: on entry one full collection, then automatic collection is off; on exit it
    is back as it was. Call ``step(n)`` between steps with the number of steps done.
    """

    def __init__(self, every: int = GC_EVERY_DEFAULT):
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"gc every must be an int >= 0 (steps between collections; 0: Python's own), "
                             f"got {every!r}")
        self.every = every
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> "StepGarbageCollection":
        self._was_enabled = gc.isenabled()
        if self.every:
            gc.collect()
            gc.disable()
        return self

    def step(self, done: int) -> None:
        """Between steps, ``done`` steps done: collect the young generations every ``every`` steps."""
        if self.every and done > 0 and done % self.every == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.every and self._was_enabled:
            gc.enable()

