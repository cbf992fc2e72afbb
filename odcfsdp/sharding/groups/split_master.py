"""The fp32 master held as its bf16 row plus 16 low bits while micro-batches run ([split-masters]).

Design note [split-masters]
---------------------------
By default a rank holds, per parameter of a bf16 group, an fp32 master (4 bytes / N) and the bf16 row peers gather
(2 / N): 6 / N where FSDP2 holds its fp32 shard alone (4 / N) and casts it per all-gather ([gather-masters] in
``group.py``). The row is the master rounded to nearest even, so it is already the master's upper half up to the
rounding: the master is the row plus 16 low bits. ``split_masters=True`` keeps only those between a minibatch's
first forward and its sync, where the peak is: 4 / N, FSDP2's, with the gathers still bf16.

Per group, with ``m`` the master's bits and ``h`` the row's (unsigned), ``d = m - (h << 16)``:

1. **Split** (the minibatch's first forward with gradients on, ``Minibatch.before_forward``; the rows are current:
   a master changed since it was published raises there). Rounding to nearest even puts ``d`` in
   [-32768, 32768], 65537 values for 16 bits: an exact tie that rounded down (``d = 32768``) is stored as 32767, the
   master moved 1 fp32 ulp (2^-24 of its value) towards its row, which it still rounds to, so what peers gather and
   what layers compute with are unchanged. ``d`` becomes an int16 tensor; the master's storage is freed
   (``resize_(0)``: the shards, views of it, keep their identity for the optimizer and the state dict).
2. **Join** (the sync, where ``.grad`` is first read: once this rank's pushes are done, so their buffers are free,
   and *before* the meeting, so that the device joins while the host meets and waits for its peers; the finish;
   a change of rows; a reader, step 3): the storage comes back, ``m = (h << 16) + d``, the low bits are freed.
   The master is then what it was, or 1 ulp nearer its row at a tie (about one element in 65536 per split).
3. **Readers.** odcfsdp's own readers make the masters whole first: any module's ``state_dict()`` (a pre-hook on
   every module), ``read_master`` (``full_state_dict``, checkpoints, exports), ``to_empty``. Any other read of a
   parameter between the two (a norm of the shards, a print, a copy into it) finds its DTensor pointing at a tensor
   without storage (``ShardedParam.hold``, ``ValuesOnRead`` in the adapter) whose first operation joins every
   master (step 2) and then runs on the master's view, so it reads or writes what it would without
   ``split_masters``; the next training forward splits them again (a write there is a change outside a step,
   refused as by default). Before, such a read touched freed storage and ended the process (a segmentation
   fault). Not covered: a plain parameter (one process without torch.distributed), which cannot be re-pointed; the local
   tensor itself (``to_local()`` under ``no_grad``, ``_local_tensor``), which is the ``ValuesOnRead`` (an operation
   on it still reads the master; ``data_ptr()`` and pickling do not); a read on a CUDA stream other than the
   current one at the split; and a tensor taken from a shard before the split (a ``state_dict`` between steps
   holds views of the masters: write it out before the next forward; DCP's ``async_save`` stages a copy first). A
   write the version counters do not see (through ``.data``) leaves a row that is not its master's rounding: the
   split notes it on the device and the join raises, naming the fix (without ``split_masters`` the row would stay
   stale).

The step itself holds the master, not the low bits (each group joins before the next: one group's 2 / N extra at
a time), so its peak is the default's; the forward and backward hold 2 / N less. NaN stays NaN (its row's),
infinities and signed zeros come back exactly. Groups of other formats (the masters gathered, float8 rows, masters
offloaded, rows that are not bf16 under fp32 masters) are left as they are.

Measured (f0ddbfb, 8B on 4 H200s, results/e2e/n4_8b_*_levers_f0ddbfb): balanced, 30.7 GiB against FSDP2's 31.1 (the
default 33.9), but the split and the join, a few torch operators per chunk of ``CHUNK`` elements, cost about 45 ms a
1.1 s step (0.93x FSDP2, the default 0.97x); long-tailed (11-16 s steps) 0.2-0.7%. Then (7c802f1) each way was one
kernel per group compiled by ``torch.compile``: on one H200 at 8B's shards of 2 ranks (3.62B elements) the split took
14.5 ms (inductor reduced the stale flag in a kernel of its own, reading the master and the row again) and the join
7.9; 24.5 ms more than the default's optimizer step (``benchmarks/optim_bench.py``, variant ``odc_split_masters``),
and 1.5-2% of odc's step in training (8B balanced, 2 H200s; host-issue time 25 ms a step above odc's, but the
passes' own host time 6-10 ms of it). Tried, no better within the calls' spread: the splits on the push stream under
the forward (d4fde0f: 0.7-2.4%, and 2 GiB more reserved, the low bits in that stream's pool) and each group split
where the forward first gathers it (b35958f: 2.6-3.0%); both reverted. The join runs before the sync's meeting
(d4fde0f), hidden where the host waits for a peer. Since 2026-11-30 CUDA runs both ways as the Triton kernels of
``kernels/split_bits.py`` (``on_kernels``), the flag in the split's own pass: 7.0 and 7.2 ms there, a copy's
bandwidth (``results/optim/n1_split_kernels_54c0737``), and the optimizer bench's step 14.6 ms above the default's
(``results/optim/n1_split_masters_step_3e499ce``); in training its steps took 1.012x odc's (8B balanced, 2 H200s,
median of 8 steps in two calls: ``results/e2e/n2_8b_balanced_split_kernels_54c0737``), its host-issue time odc's.
Off CUDA the same arithmetic runs as torch operators in chunks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...kernels.split_bits import join_bits, split_bits
from .row_format import ParamDtypeRows

CHUNK = 1 << 24  # elements per pass of the operators (off CUDA): a few int32 temporaries of 64 MiB


def on_kernels(t: torch.Tensor) -> bool:
    """Whether the split and join of ``t`` run as the Triton kernels of ``kernels/split_bits.py`` (CUDA: a launch
    each way per group, and one program more for a partial last block; 8 bytes an element read and written) rather
    than as torch operators in chunks."""
    return t.is_cuda


def _split_pass(m_bits: torch.Tensor, h_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 on flat bits: the int16 low bits, and whether any difference was out of range (the row was stale)."""
    h32 = h_bits.to(torch.int32)  # sign-extended: its << 16 wraps to the unsigned row's bits, as int32 sums do
    d = torch.where((h32 & 0x7FFF) > 0x7F80, 0, m_bits - (h32 << 16))  # a NaN row: its own NaN comes back
    return d.clamp(-32768, 32767).to(torch.int16), ((d > 32768) | (d < -32768)).any()


def _join_pass(h_bits: torch.Tensor, d_bits: torch.Tensor, out: torch.Tensor) -> None:
    """Step 2 on flat bits: ``out`` (int32) = the row's bits << 16 + the low bits."""
    out.copy_((h_bits.to(torch.int32) << 16) + d_bits.to(torch.int32))


def split_low_bits(master: torch.Tensor, row: torch.Tensor, stale: torch.Tensor) -> torch.Tensor:
    """Step 1's low bits: an int16 tensor ``d`` with ``master``'s bits ``(row's << 16) + d``, ``row`` being
    ``master`` rounded to bf16 (a tie that rounded down: 1 ulp towards the row). int32 arithmetic wraps modulo
    2^32, and the true difference is small, so it comes out exact. A difference outside [-32768, 32768] says the
    row is not the master's rounding (a write the version counters did not see): ``stale`` (an int32 scalar on the
    master's device) is set to 1, read at the join, never here (no wait for the device). A NaN master comes back as
    its row's NaN."""
    low = torch.empty(master.shape, dtype=torch.int16, device=master.device)
    if on_kernels(master):
        split_bits(master, row, low, stale)
        return low
    m_bits, h_bits, out = master.view(torch.int32).view(-1), row.view(torch.int16).view(-1), low.view(-1)
    for start in range(0, m_bits.numel(), CHUNK):
        out[start:start + CHUNK], bad = _split_pass(m_bits[start:start + CHUNK], h_bits[start:start + CHUNK])
        stale.logical_or_(bad)
    return low


def join_low_bits(row: torch.Tensor, low: torch.Tensor, master: torch.Tensor) -> None:
    """Step 2: write ``(row's bits << 16) + low`` into ``master`` (fp32, the row's shape)."""
    if on_kernels(master):
        join_bits(row, low, master)
        return
    h_bits, d_bits, out = row.view(torch.int16).view(-1), low.view(-1), master.view(torch.int32).view(-1)
    for start in range(0, h_bits.numel(), CHUNK):
        _join_pass(h_bits[start:start + CHUNK], d_bits[start:start + CHUNK], out[start:start + CHUNK])


def splittable(group) -> bool:
    """Whether a group's master is a bf16 row plus low bits: a separate fp32 master on the row's device."""
    fmt = group.format
    return (type(fmt) is ParamDtypeRows and not fmt.offloaded and group.master.dtype == torch.float32
            and group.row.dtype == torch.bfloat16)


class SplitMasters:
    """The model's masters held split between a minibatch's first forward and its sync ([split-masters])."""

    def __init__(self, groups: Sequence):
        self.groups = [g for g in groups if splittable(g)]
        self._low: dict = {}
        self._stale: torch.Tensor | None = None  # set where a split found a row that was not its master's rounding
        for g in self.groups:
            g.join_masters = self.join  # a reader of a group's master makes them whole first (read_master)

    @property
    def split_now(self) -> bool:
        """Whether the masters are held as low bits now."""
        return bool(self._low)

    def low_bits(self) -> list[torch.Tensor]:
        """The low bits held now (none outside a minibatch)."""
        return list(self._low.values())

    def split(self) -> None:
        """Step 1 for every group not split yet; frees each master as its low bits are made."""
        with torch.no_grad():
            for g in self.groups:
                if g not in self._low:
                    if self._stale is None:  # one device: the model's
                        self._stale = torch.zeros((), dtype=torch.int32, device=g.master.device)
                    self._low[g] = split_low_bits(g.master, g.row, self._stale)
                    g.master.untyped_storage().resize_(0)
                    for sp in g.params:  # step 3: a read of a shard joins every master first
                        sp.hold(self.join)

    def join(self, check: bool = True) -> None:
        """Step 2 for every split group; frees each group's low bits once its master is whole. Raises (once every
        master is back) where a split found a row that was not its master's rounding: the host reads that flag, so
        it waits for the device, unless ``check`` is False (the sync joins before its meeting, so that the device
        joins while the host meets, and checks after it: the flag is kept until a join checks it)."""
        with torch.no_grad():
            for g in list(self._low):
                g.master.untyped_storage().resize_(g.master.nbytes)  # its shape and dtype stay: its size
                join_low_bits(g.row, self._low[g], g.master)
                for sp in g.params:
                    sp.unhold()
                del self._low[g]  # only now: a join that fails keeps the low bits
                g.note_published()  # the master its row was published from (to 1 ulp at a tie)
        if not check:
            return
        stale, self._stale = self._stale, None
        if stale is not None and bool(stale):  # the host's only read of the flag
            raise RuntimeError("split_masters=True found parameters changed outside an optimizer step in a way the "
                               "version counters did not see (through .data, or a tensor sharing the storage), "
                               "before the minibatch's first forward: their changes are lost. "
                               "Change parameters inside `with model.changing_parameters():` (collective), or with "
                               "load_state_dict()")


__all__ = ["SplitMasters", "join_low_bits", "split_low_bits", "splittable"]
