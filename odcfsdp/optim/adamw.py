"""Sharded AdamW over each rank's master rows, with global-norm gradient clipping."""

from __future__ import annotations

import fnmatch
import math
from typing import Callable, Iterable

import torch

from ..kernels.adamw import decay_runs, fused_adamw_
from ..sharding.layout import align_elems
from ..sharding.group import FlatGroup
from ..sharding.layout import GroupLayout
from ..sharding.shard import ODCShard

NoDecay = Callable[[str, tuple[int, ...]], bool] | Iterable[str] | None


def _no_decay_predicate(no_decay: NoDecay) -> Callable[[str, tuple[int, ...]], bool]:
    if no_decay is None:
        return lambda name, shape: False
    if callable(no_decay):
        return no_decay
    if isinstance(no_decay, str):
        raise TypeError("no_decay takes a list of names or glob patterns, not a single string")
    patterns = list(no_decay)
    return lambda name, shape: any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def _decay_ranges(layout: GroupLayout, skip: Callable[[str, tuple[int, ...]], bool]) -> list[tuple[int, int]]:
    """Row ranges [start, end) that get weight decay, adjacent slots merged."""
    ranges: list[tuple[int, int]] = []
    for s in layout.slots:
        if skip(s.name, s.shape):
            continue
        if ranges and ranges[-1][1] == s.offset:
            ranges[-1] = (ranges[-1][0], s.offset + s.seg)
        else:
            ranges.append((s.offset, s.offset + s.seg))
    return ranges


class AdamW:
    """AdamW (decoupled weight decay) on the rows this rank owns.

    ``step`` is the one place ranks meet in a minibatch:

    1. finish this rank's gradient pushes and wait for every rank's (barrier);
    2. one all-reduce of [sum of squared accumulator entries, pushes]: the global
       gradient norm, and a check that some rank ran backward;
    3. scale gradients by ``min(1, max_norm / (norm + 1e-6))`` if ``max_norm``;
    4. the AdamW update of each master row, as ``torch.optim.AdamW`` does it;
    5. publish master rows to the communicated rows, zero the accumulators
       (steps 3-5 in one Triton kernel per row when ``fused``);
    6. barrier, so that nobody gathers before every row is updated.

    Unlike ``torch.optim.AdamW``, which skips a parameter whose ``.grad`` is None, a
    trained parameter that got no gradient in a minibatch is treated as having a
    zero gradient (weight decay and momentum still move it), as in other flat-buffer
    optimizers (ZeRO, Megatron's distributed optimizer): ranks cannot tell "no
    gradient" from "zero gradient" without another exchange. Freeze parameters that
    must not move (``requires_grad=False`` before wrapping).

    Args:
        model: the ``ODCShard``-wrapped model.
        lr: base learning rate.
        betas, eps, weight_decay: as in ``torch.optim.AdamW``.
        no_decay: parameters without weight decay: a predicate ``(name, shape) ->
            bool``, or names / glob patterns such as ``["*.bias", "*norm*"]``.
        lr_lambda: the learning rate of step k (0-based) is ``lr * lr_lambda(k)``,
            like ``torch.optim.lr_scheduler.LambdaLR``.
        fused: one Triton kernel per row for steps 3-5 (clip, update, zero, publish)
            instead of separate kernels; default on CUDA. It matches the unfused
            update up to rounding (fused multiply-adds), not bit for bit.
    """

    FUSED_BLOCK = 2048

    def __init__(
        self,
        model: ODCShard,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        no_decay: NoDecay = None,
        lr_lambda: Callable[[int], float] | None = None,
        fused: bool | None = None,
    ):
        if not isinstance(model, ODCShard):
            raise TypeError(f"AdamW expects an ODCShard-wrapped model, got {type(model).__name__}")
        for key, val, ok in (
            ("lr", lr, lr >= 0),
            ("eps", eps, eps >= 0),
            ("weight_decay", weight_decay, weight_decay >= 0),
            ("betas[0]", betas[0], 0 <= betas[0] < 1),
            ("betas[1]", betas[1], 0 <= betas[1] < 1),
        ):
            if not ok:
                raise ValueError(f"invalid AdamW {key}={val}")
        self.model = model
        self.base_lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.lr_lambda = lr_lambda
        self.step_count = 0
        self.last_wait_s = 0.0  # time the last step spent waiting for the other ranks (phase 1)
        skip = _no_decay_predicate(no_decay)
        self.groups: list[FlatGroup] = [g for g in model.groups if g.layout.requires_grad]
        self.exp_avg = [torch.zeros_like(g.row, dtype=g.master_dtype) for g in self.groups]
        self.exp_avg_sq = [torch.zeros_like(g.row, dtype=g.master_dtype) for g in self.groups]
        self.decay_ranges = [_decay_ranges(g.layout, skip) for g in self.groups]
        device = model.mesh.device
        self.fused = device.type == "cuda" if fused is None else fused
        if self.fused and any(g.master_dtype != torch.float32 for g in self.groups):
            raise ValueError("fused AdamW needs fp32 master rows; pass fused=False for float64 models")
        self._runs = [decay_runs(g.layout.row_len, r, self.FUSED_BLOCK, device) for g, r in
                      zip(self.groups, self.decay_ranges)] if self.fused else []
        # Runs start and end on segment bounds, which are 16-byte aligned in the row and master dtypes.
        self._align = [max(align_elems(g.layout.dtype), align_elems(g.row.dtype)) for g in self.groups]

    @property
    def lr(self) -> float:
        """Learning rate the next step will use."""
        return self.base_lr * (self.lr_lambda(self.step_count) if self.lr_lambda else 1.0)

    @torch.no_grad()
    def step(self, max_norm: float | None = None) -> torch.Tensor:
        """Apply one update from the accumulated gradients; return the pre-clip global norm."""
        protocol = self.model.protocol
        with protocol.rows_changing():
            self.last_wait_s = protocol.last_wait_s
            return self._update(max_norm)

    def _update(self, max_norm: float | None) -> torch.Tensor:
        protocol = self.model.protocol
        accs = [g.accumulator for g in self.groups]
        dtype = accs[0].dtype if accs else torch.float32
        stats = torch.zeros(2, dtype=dtype, device=protocol.mesh.device)
        if accs:
            stats[0] = torch.stack(torch._foreach_norm(accs)).square().sum()
        stats[1] = protocol.consume_push_count()
        protocol.mesh.all_reduce_sum(stats)
        if stats[1].item() == 0:
            raise RuntimeError("optimizer step() called, but no rank ran backward since the last step")
        norm = stats[0].sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0) if max_norm is not None else None
        lr = self.lr
        beta1, beta2 = self.betas
        self.step_count += 1
        if self.fused:
            ones = torch.ones((), device=norm.device)
            for g, grad, m, v, runs, align in zip(self.groups, accs, self.exp_avg, self.exp_avg_sq, self._runs,
                                                  self._align):
                master = None if g.split else g.read_master()
                fused_adamw_(master, m, v, grad, None if g.row is master else g.row, runs,
                             coef if coef is not None else ones, lr=lr, beta1=beta1, beta2=beta2, eps=self.eps,
                             weight_decay=self.weight_decay, step=self.step_count, block=self.FUSED_BLOCK,
                             master_lo=g.master_lo, align=align)
            return norm
        if coef is not None:
            torch._foreach_mul_(accs, coef)
        bc1 = 1 - beta1**self.step_count
        bc2_sqrt = math.sqrt(1 - beta2**self.step_count)
        for g, grad, m, v, ranges in zip(self.groups, accs, self.exp_avg, self.exp_avg_sq, self.decay_ranges):
            with g.updating_master() as p:
                if self.weight_decay:
                    for lo, hi in ranges:
                        p[lo:hi].mul_(1 - lr * self.weight_decay)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
                p.addcdiv_(m, denom, value=-lr / bc1)
            grad.zero_()
        return norm

    def full_state_dict(self) -> dict:
        """Step count and full per-parameter moments (collective: every rank calls it; for inspection)."""
        state = {"step_count": self.step_count, "exp_avg": {}, "exp_avg_sq": {}}
        for g, m, v in zip(self.groups, self.exp_avg, self.exp_avg_sq):
            for key, row in (("exp_avg", m), ("exp_avg_sq", v)):
                full = g.layout.unpack(self.model.mesh.all_gather_rows(row))
                for i, s in enumerate(g.layout.slots):
                    state[key][s.name] = g.layout.param_view(full, i).clone()
        return state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op kept so training loops read like PyTorch: ``step`` consumes the gradients.

        (Gradients live in the owners' accumulator rows and are zeroed by ``step``
        before its closing barrier; zeroing them later would race with peers that
        already push the next minibatch. Use ``discard_gradients`` to drop a
        partly accumulated minibatch.)
        """

    def discard_gradients(self) -> None:
        """Drop every gradient accumulated since the last step (collective: all ranks call it)."""
        protocol = self.model.protocol
        with protocol.rows_changing():
            protocol.consume_push_count()
            for g in self.groups:
                g.accumulator.zero_()
