"""Where ranks meet: one small all-gather per meeting, and the one error every rank raises when they disagree.

The step protocol ([step-protocol] in ``protocol.py``) decides *when* ranks meet; this module is *how*: each
rank contributes one row (kind, minibatch number, skipped ``zero_grad`` passes [zero-grad-pass], pushes), every
rank reads the same table, and a disagreement raises the same error on every rank instead of mixing two
minibatches. With HSDP a sync also meets the other replicas ([hsdp] in ``hsdp.py``).
"""

from __future__ import annotations

import enum

import torch

from .mesh import ShardMesh


class Meeting(enum.IntEnum):
    """The kinds of meeting of [step-protocol]."""

    SYNC = 1
    CHANGE = 2
    FINISH = 3


def disagreement(who: str, table: torch.Tensor) -> str | None:
    """The error when the rows of ``table`` (``who`` 0, 1, ...: kind, minibatch, skipped zero_grad passes, ...)
    name different meetings ([zero-grad-pass] in ``protocol.py``)."""
    if not (table[:, :3] != table[0, :3]).any():
        return None
    names = {int(m): m.name.lower() for m in Meeting}
    where = ", ".join(f"{who} {r}: {names.get(k, f'meeting {k}')} of minibatch {m}, {z} zero_grad() pass(es) "
                      "without gradients since the last meeting" for r, (k, m, z, *_) in enumerate(table.tolist()))
    return (f"{who}s disagree about the minibatch ({where}). Every rank must run the same loop: read .grad "
            "(clip_grad_norm_, opt.step) only after its micro-batches, call zero_grad() only outside them, and step "
            "or zero_grad every trained parameter each minibatch")


class Meetings:
    """The meetings of one model's ranks.

    Args:
        mesh: the ranks that meet.
        transport_name: named in errors.
        uneven_micro_batches: whether ranks may push different numbers of times per minibatch (the
            transport's capability); if not, a sync with unequal pushes raises.
    """

    def __init__(self, mesh: ShardMesh, transport_name: str, uneven_micro_batches: bool):
        self.mesh = mesh
        self.transport_name = transport_name
        self.uneven_micro_batches = uneven_micro_batches
        self.carry_len = 0  # what every meeting carries (the float8 amaxes, [float8-gather]): set by the ``Minibatch``

    def meet(self, kind: Meeting, minibatch: int, skipped_passes: int, pushes: int) -> int:
        """One meeting of all ranks; returns the pushes of every rank. Raises alike on every rank if they disagree.

        A sync of a shard group also meets the other replicas ([hsdp]): one small all-gather of each group's
        (kind, minibatch, skipped passes, pushes, problem), so that a problem found in one group stops every
        replica together.
        """
        return self.meet_carrying(kind, minibatch, skipped_passes, pushes)[0]

    def meet_carrying(self, kind: Meeting, minibatch: int, skipped_passes: int, pushes: int,
                      carry: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """``meet``, whose one all-gather also carries this rank's ``carry`` (a float64 vector of the same length on
        every rank: the float8 weights' amaxes, [float8-gather] in ``float8.py``); returns every rank's pushes and
        the ``(ranks, len)`` table of every rank's ``carry``. The row is float64 (counts stay exact below 2**53), so
        carrying costs no collective of its own."""
        self.mesh.arrive(f"the {kind.name.lower()} meeting of minibatch {minibatch}")  # [watchdog]
        if carry is None and self.carry_len:  # every meeting's row has one length: ranks at different meetings
            carry = torch.zeros(self.carry_len, dtype=torch.float64)  # get the disagreement error, not a hang
        mine = torch.tensor([int(kind), minibatch, skipped_passes, pushes], dtype=torch.float64,
                            device=self.mesh.device)
        if carry is not None:
            mine = torch.cat([mine, carry.to(mine.device, torch.float64)])
        full = self.mesh.all_gather_rows(mine).cpu()
        table, carried = full[:, :4].to(torch.int64), full[:, 4:]
        problem = disagreement("rank", table)
        if problem is None and kind is Meeting.SYNC and not self.uneven_micro_batches and \
                (table[:, 3] != table[0, 3]).any():
            problem = (f"comm='{self.transport_name}' needs the same number of micro-batches on every rank, but ranks "
                       f"pushed {table[:, 3].tolist()} gradients: balance with lb_micro, or use a one-sided transport")
        total = int(table[:, 3].sum())
        if kind is Meeting.SYNC and self.mesh.replicas > 1:
            row = torch.tensor([int(kind), minibatch, int(table[0, 2]), total, problem is not None],
                               dtype=torch.int64, device=self.mesh.device)
            groups = self.mesh.replicate.all_gather_rows(row).cpu()
            total = int(groups[:, 3].sum())
            if problem is None:
                problem = disagreement("replica", groups)
            if problem is None and groups[:, 4].any():
                stopped = groups[:, 4].nonzero().flatten().tolist()
                problem = f"replica(s) {stopped} stopped at this sync (see their error)"
        if problem is not None:
            raise RuntimeError(problem)
        return total, carried

    def declare_minibatch(self, micro_batches: int, tokens: int | None) -> int | None:
        """``ODCShard.begin_minibatch``: one small all-gather (none if one-sided without tokens); see there."""
        everyone = self.mesh.everyone  # with HSDP the tokens of every replica count
        if everyone.world_size == 1 or (self.uneven_micro_batches and tokens is None):
            return tokens
        local = torch.tensor([micro_batches, tokens or 0], dtype=torch.int64, device=self.mesh.device)
        table = everyone.all_gather_rows(local).cpu()
        mine = [self.mesh.global_rank(r) for r in range(self.mesh.world_size)]
        group = table if everyone is self.mesh else table[mine]
        counts = group[:, 0].tolist()  # this shard group's
        if not self.uneven_micro_batches and len(set(counts)) > 1:
            raise RuntimeError(
                f"comm='{self.transport_name}' needs the same number of micro-batches on every rank, got {counts} "
                "by rank; balance with lb_micro, or use a one-sided transport (comm='shm' on CPU, 'nvshmem' on CUDA)")
        return int(table[:, 1].sum()) if tokens is not None else None
