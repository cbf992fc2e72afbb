"""An optimizer's state parked in host memory between its steps, so forward and backward run without it.

Design note [parking]
---------------------
AdamW's two moments are 8 bytes per parameter and rank (8P/N), the largest thing a sharded rank holds, and
nothing reads them between one ``step()`` and the next. An odcfsdp rank must hold what FSDP2 need not: its
fp32 accumulators for the whole minibatch (4P/N: peers push into them at any time) and the bf16 rows peers
read (2P/N). Parking the state during forward and backward frees more than that:

1. **Park** (the optimizer's step post-hook). A side stream waits for the step, copies each element-wise state
   tensor into a pinned host buffer of its own (allocated once, reused), and the device storage is freed at
   tensor by tensor with ``record_stream``: torch's allocator reuses each block once its own copy is done, early
   in the next forward (PCIe, which one-sided gathers and pushes over NVLink do not use). The tensors stay the
   optimizer's own objects: only their storage is emptied (``untyped_storage().resize_(0)``, as FSDP2 frees
   its unsharded parameters). On CUDA a helper thread queues these copies a chunk at a time ([park-trickle] in
   ``copy_trickle.py``): queued at once they would hold every later small read to the host behind them.
2. **Prefetch** (``prefetch_parked(optimizer)``, which ``odcfsdp.loop.train_step`` calls once the micro-batches
   are done on the device). The storage is allocated again on the current stream and the copies back run on
   the side stream after it, under the meeting and ``clip_grad_norm_``: a rank that waits there for a slower
   one hides them, the slowest rank does not. Allocated all at once earlier, during the last backward, the
   state would sit beside that backward's activations, which may make the peak (a rank with one micro-batch).
   What fits in the memory the last backward frees comes back under it, unit by unit ([park-backward] in
   ``park_backward.py``; ``odcfsdp.loop.train_step`` does it for ODCShard models). The copies back cost about
   8P/N bytes over PCIe a step.
3. **Unpark** (the step pre-hook). The current stream waits for the copies back (issuing them first if no
   prefetch came), then the step runs on the state as if it had never moved: the same tensors, the same
   values, bit for bit.

Whatever reads the state between steps reads the host copies, and the state stays parked: ``state_dict()``
returns copies of them (host tensors, DTensors where the state is: a dict held across later steps keeps its
values, as a parked tensor's emptied storage would not), and odcfsdp's checkpoints read them with
``parked_copy``. ``load_state_dict`` parks what it loaded; ``unparked(optimizer)`` brings the state to its
device for code that must touch ``optimizer.state`` itself. A step skipped for a non-finite gradient norm leaves
a prefetch unused: ``settle_parked`` frees it again (no copy: the host holds the same values). Only tensors that
are their whole storage and share it with no parameter or gradient are parked. It costs 8P/N of pinned host
memory per rank. On CPU the same steps run with plain host copies (no saving, the same semantics: what the CPU
tests check). How much to park can be left to the run: ``fraction=None`` parks the least share that keeps the
device's peak under a budget, measured as the run goes ([park-fit] in ``park_fit.py``).
"""

from __future__ import annotations

import contextlib
import enum
from typing import Iterator, NamedTuple

import torch

from ..torch_private import local_of, stored_grad
from .park_copies import ParkCopies
from .park_fit import CudaMemory, DeviceMemory, ParkFit
from .parked_host import host_buffers, share_of
from .parked_state_dict import StateDictHooks

_ATTRIBUTE = "_odc_parking"  # the optimizer's ParkedOptimizerState, held by the optimizer: freed with it


class Where(enum.Enum):
    """Where a parked optimizer's state is."""

    RESIDENT = "resident"  # on its device, the step may run
    PARKED = "parked"  # on the host only, the device storage empty
    ARRIVING = "arriving"  # device storage allocated, copies back issued on the side stream


class _Parked(NamedTuple):
    value: torch.Tensor  # the optimizer's state tensor (a DTensor for sharded parameters)
    local: torch.Tensor  # its local tensor, whose storage is emptied
    host: torch.Tensor  # the host copy


class ParkedOptimizerState:
    """Keep ``optimizer``'s element-wise state tensors in host memory between steps ([parking]).

    Build it once, after the optimizer; it registers the optimizer's step and state-dict hooks and parks the
    state after every step (nothing before the first step, which creates the state). ``prefetch()`` once the
    micro-batches are done starts the copies back under the meeting; without it the step's pre-hook copies the
    state back before the step runs. The optimizer holds it (``parking_of``): both are freed together.

    Args:
        optimizer: any ``torch.optim.Optimizer`` whose per-parameter state tensors are element-wise (shaped
            like their parameter: AdamW, Adam, SGD's momentum, ...); scalars (``step``) stay where they are.
        fraction: the share of the state's bytes to park, in (0, 1]: the first state tensors in parameter order
            until their bytes reach it (the rest stays resident). Parking only what does not fit costs only
            its copies. None: the least share that keeps the device's peak under ``budget`` of its memory,
            chosen from the measured peaks ([park-fit]); nothing while it fits, and nothing on CPU.
        budget: ``fraction=None``: the share of the device's memory the peak may reach.
        memory: how the device's memory is read (``park_fit.CudaMemory()`` by default): the fitted share's peaks,
            and the room the last backward frees.
        under_backward: bring back what fits in the memory the last micro-batch's backward frees, under it
            ([park-backward]; ``odcfsdp.loop.train_step`` does it for ODCShard models); False: all of it once the
            micro-batches are done.
        trickle: on CUDA, queue the copies out a chunk at a time from a helper thread, so that the copy engine
            never holds a later small device-to-host read behind all of them ([park-trickle] in
            ``copy_trickle.py``; measured 6-7% a step faster at the same peak); False: all at once after the step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, fraction: float | None = 1.0, budget: float = 0.9,
                 memory: DeviceMemory | None = None, under_backward: bool = True, trickle: bool = True):
        if parking_of(optimizer) is not None:
            raise ValueError("this optimizer's state is already parked between steps (one ParkedOptimizerState "
                             "per optimizer)")
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction={fraction}: the share of the optimizer's state to park is in (0, 1] "
                             "(None: the share that fits, measured)")
        self.optimizer = optimizer
        self.memory = memory if memory is not None else CudaMemory()
        self.under_backward = under_backward
        self.copies = ParkCopies(trickle)
        self.fit = ParkFit(budget, memory=self.memory) if fraction is None else None
        self.fraction = 0.0 if fraction is None else fraction  # fit: the share chosen at the last step
        self._device = local_of(optimizer.param_groups[0]["params"][0]).device
        self._observed = False  # fit: this minibatch's peak is read
        if self.fit is not None:
            self.fit.begin(self._device)
        self.where = Where.RESIDENT
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (id of param, state key) -> host copy
        self._parked: list[_Parked] = []
        self._arrived = 0  # parked: the first entries of _parked already coming back ([park-backward])
        self._keys: set[tuple[int, str]] = set()  # the state tensors the last park parked (a share: not all)
        self._host_of: dict[int, torch.Tensor] = {}  # id of a parked local tensor -> its host copy
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(lambda *_: self.park()),
                         *StateDictHooks(self).register(optimizer)]
        self.owns_loads = False  # set by owned_loads(): the loaded state dict is nobody else's
        setattr(optimizer, _ATTRIBUTE, self)

    @property
    def device(self) -> torch.device:
        """The device the state lives on (its first parameter's)."""
        return self._device

    @property
    def away(self) -> bool:
        """Whether the state is parked or on its way back (not resident): its values are the host copies'."""
        return self.where is not Where.RESIDENT

    @property
    def parked_bytes(self) -> int:
        """Bytes of state the device does not hold now (0 unless parked; less what came back under a backward)."""
        return sum(e.host.nbytes for e in self._parked[self._arrived:]) if self.where is Where.PARKED else 0

    def host_copy(self, value: torch.Tensor) -> torch.Tensor | None:
        """The host tensor holding ``value``'s values while it is parked or arriving (read it, never write it);
        None for a tensor that is not parked (resident state, scalars). The copies out are done when it returns."""
        if self.where is Where.RESIDENT:
            return None
        self.copies.host_ready()
        return self._host_of.get(id(local_of(value)))

    def _state_tensors(self) -> Iterator[tuple[tuple[int, str], torch.Tensor, torch.Tensor]]:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        # a state tensor sharing a parameter's or a gradient's storage must not be emptied with the state
        # (the C-level .grad slot: a sharded parameter's .grad property is an event, [grad-protocol])
        seen = {local_of(t).untyped_storage().data_ptr() for p in params
                for t in (p, stored_grad(p)) if t is not None}
        for p in params:
            for key, value in self.optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != p.shape:
                    continue
                local = local_of(value)
                storage = local.untyped_storage()
                # only a tensor that is its whole storage can be emptied and filled again
                if storage.nbytes() != local.nbytes or storage.data_ptr() in seen or local.nbytes == 0:
                    continue
                seen.add(storage.data_ptr())
                yield (id(p), key), value, local

    @property
    def trickle(self) -> bool:
        """Whether the copies out are queued a chunk at a time by a helper thread ([park-trickle])."""
        return self.copies.trickle

    @trickle.setter
    def trickle(self, on: bool) -> None:
        self.copies.trickle = on

    def wait_copies_out(self) -> None:
        """Wait until the last park's copies out are queued and done, where a helper thread queues them
        ([park-trickle]; ``ParkCopies.wait_out``)."""
        self.copies.wait_out()

    def _set_parked(self, entries: list[_Parked]) -> None:
        self._parked, self._arrived = entries, 0
        self._host_of = {id(e.local): e.host for e in entries}
        self.where = Where.PARKED

    def _observe(self) -> None:
        # [park-fit] 2: the micro-batches are done and nothing has come back yet
        if self.fit is not None and not self._observed and self.where is not Where.ARRIVING:
            self.wait_copies_out()  # [park-trickle]: every parked storage is empty when it is counted
            self.fit.observe(self._device, self._resident_footprint())
            self._observed = True

    def _resident_footprint(self) -> int:
        # the state on the device through the forward and backward, as the allocator counts it: parked tensors'
        # storage is empty, and what came back under the last backward came into memory that backward had freed
        # (the trickle's thread is joined: every parked storage is empty)
        early = sum(self.memory.footprint(e.host.nbytes) for e in self._parked[:self._arrived])
        return sum(self.memory.footprint(local_of(v).untyped_storage().nbytes())
                   for state in self.optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.device == self._device) - early

    def _passed(self) -> None:
        # [park-fit] 3: the peak since the last reading was not a backward's; the next minibatch is read afresh
        self._observed = False
        if self.fit is not None:
            self.fit.after_step(self._device)

    def _before_step(self, *_) -> None:  # the step pre-hook: what it returns would replace the step's arguments
        self._observe()
        self.unpark()

    def park(self) -> None:
        """Step 1: copy the state to the host and free its device storage (after a step: the post-hook)."""
        if self.where is not Where.RESIDENT:
            return
        everything = list(self._state_tensors())
        self._passed()
        share = self.fraction
        if self.fit is not None:  # [park-fit] 4; before any reading (a resumed process) all of it, once
            share = self.fraction = self.fit.share(sum(local.nbytes for *_, local in everything))
            if not self.fit.measured and self.fit.reports(self._device):
                share = 1.0
        found = share_of(everything, share)
        if not found:
            return
        if any(key not in self._host or self._host[key].shape != local.shape or self._host[key].dtype != local.dtype
               for key, _, local in found):
            # a fitted share may grow: buffers for all of the state at once, pinned once
            self._host = host_buffers([(key, local) for key, _, local in (found if self.fit is None else everything)])
        entries = [_Parked(value, local, self._host[key]) for key, value, local in found]
        self.copies.out(entries)
        self._keys = {key for key, *_ in found}
        self._set_parked(entries)

    def prefetch(self) -> None:
        """Step 2: allocate the state's device storage and start the copies back (on CUDA, on a side stream)."""
        self._observe()
        self._bring_back()

    def _bring_back(self) -> None:
        if self.where is not Where.PARKED:
            return
        self._arrive(len(self._parked))
        self.where = Where.ARRIVING

    def _arrive(self, end: int) -> None:
        # entries [arrived, end): device storage allocated on the current stream, copies back on the side stream
        self.wait_copies_out()
        coming = self._parked[self._arrived:end]
        for e in coming:
            e.local.untyped_storage().resize_(e.host.nbytes)
        self.copies.back(coming)
        self._arrived = end

    def bring_back_within(self, room: int) -> int:
        """Start bringing back the next parked tensors, in order, while their blocks fit in ``room`` bytes (part
        of step 2, [park-backward]); return the bytes of the blocks allocated. The rest comes back with
        ``prefetch``, or before the step."""
        if self.where is not Where.PARKED:
            return 0
        end, used = self._arrived, 0
        while end < len(self._parked):
            block = self.memory.footprint(self._parked[end].host.nbytes)
            if used + block > room:
                break
            used, end = used + block, end + 1
        if end > self._arrived:
            self._arrive(end)
        return used

    def unpark(self) -> None:
        """Step 3: the state is on its device for the current stream (before a step: the pre-hook)."""
        if self.where is Where.RESIDENT:
            return
        self._bring_back()
        # the blocks were allocated on the current stream: only the wait is needed
        self.copies.current_waits({e.local.device for e in self._parked})
        self._parked, self._host_of, self._arrived = [], {}, 0
        self.where = Where.RESIDENT

    def settle(self) -> None:
        """Free a prefetch no step used (a skipped step): the host still holds the same values, nothing is copied."""
        if self.where is Where.RESIDENT or not self._arrived:
            return
        self.copies.synchronize({e.local.device for e in self._parked})  # they write into the storage freed here
        for e in self._parked[:self._arrived]:
            e.local.untyped_storage().resize_(0)
        self._arrived = 0
        self.where = Where.PARKED
        self._passed()  # the state brought back for nothing is no backward's peak

    @contextlib.contextmanager
    def resident(self, changes: bool = False) -> Iterator[None]:
        """The state on its device inside the block, parked again after it (copied again if ``changes``)."""
        was = self.where
        self.unpark()
        try:
            yield
        finally:
            if was is not Where.RESIDENT:
                if changes:
                    self.park()
                else:
                    self._park_unchanged()
                    self._passed()  # the state brought back to be read is no backward's peak

    def _park_unchanged(self) -> None:
        # the host copies still hold the device values: free the storage without copying
        entries = [_Parked(value, local, self._host[key]) for key, value, local in self._state_tensors()
                   if key in self._keys]  # the last park's share: a fitted share's other buffers were never filled
        if not entries:
            return
        for device in {e.local.device for e in entries if e.local.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # readers on the stream are done
        for e in entries:
            e.local.untyped_storage().resize_(0)
        self._set_parked(entries)

    def close(self) -> None:
        """Bring the state back and remove the hooks: the optimizer is as it was without parking."""
        self.unpark()
        self.copies.close()
        for handle in self._handles:
            handle.remove()
        if getattr(self.optimizer, _ATTRIBUTE, None) is self:
            delattr(self.optimizer, _ATTRIBUTE)
        self._host.clear()


def parking_of(optimizer: torch.optim.Optimizer) -> ParkedOptimizerState | None:
    """The optimizer's ``ParkedOptimizerState``, if its state is parked between steps."""
    return getattr(optimizer, _ATTRIBUTE, None)
