"""An optimizer's state parked in host memory between its steps, so forward and backward run without it.

Design note [parking]
---------------------
AdamW's two moments are 8 bytes per parameter and rank (8P/N), the largest thing a sharded rank holds, and
nothing reads them between one ``step()`` and the next. An odcfsdp rank must hold what FSDP2 need not: its
fp32 accumulators for the whole minibatch (4P/N: peers push into them at any time) and the bf16 rows peers
read (2P/N). Parking the state during forward and backward frees more than that:

1. **Park** (the optimizer's step post-hook). A side stream waits for the step, copies each element-wise state
   tensor into a pinned host buffer of its own (allocated once, reused), and the device storage is freed at
   once with ``record_stream``: torch's allocator reuses the block only after the copy is done, early in the
   next forward (PCIe, which one-sided gathers and pushes over NVLink do not use). The tensors stay the
   optimizer's own objects: only their storage is emptied (``untyped_storage().resize_(0)``, as FSDP2 frees
   its unsharded parameters).
2. **Prefetch** (``prefetch_parked(optimizer)``, which ``odcfsdp.loop.train_step`` calls once the host has queued
   the minibatch's last backward). The storage is allocated again on the current stream and the copies back run on
   the side stream after it. By then the host has freed every activation of the backward (its frees are stream
   ordered), so the state is allocated below the step's peak. Called before the last backward instead, it would
   hold the state through that backward, which may be the peak's (a rank with one micro-batch): measured, the
   peak stayed where it was without parking.
3. **Unpark** (the step pre-hook). The current stream waits for the copies back (issuing them first if no
   prefetch came), then the step runs on the state as if it had never moved: the same tensors, the same
   values, bit for bit.

Whatever reads the state between steps sees it resident: ``optimizer.state_dict()`` unparks first (the state
then stays on the device until the next step parks it again), ``load_state_dict`` parks the loaded state,
and odcfsdp's checkpoints read and write it inside ``unparked(optimizer)``. A step skipped for a non-finite
gradient norm leaves a prefetch unused: ``settle_parked`` frees it again (no copy: the host holds the same
values). What it costs: the copies each way, about 8P/N bytes over PCIe per step (the park overlaps the next
forward; the copies back overlap the sync meeting and ``clip_grad_norm_``), and 8P/N of pinned host memory per
rank. On CPU the same steps run with plain host copies (no saving, the same semantics: what the CPU tests check).
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from typing import Iterator

import torch

from ..torch_private import local_of


class Where(enum.Enum):
    """Where a parked optimizer's state is."""

    RESIDENT = "resident"  # on its device, the step may run
    PARKED = "parked"  # on the host only, the device storage empty
    ARRIVING = "arriving"  # device storage allocated, copies back issued on the side stream


_PARKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its ParkedOptimizerState


class ParkedOptimizerState:
    """Keep ``optimizer``'s element-wise state tensors in host memory between steps ([parking]).

    Build it once, after the optimizer; it registers the optimizer's step and state-dict hooks and parks the
    state after every step (nothing before the first step, which creates the state). ``prefetch()`` before
    the minibatch's last backward hides the copies back under it; without it the step's pre-hook copies the
    state back before the step runs.

    Args:
        optimizer: any ``torch.optim.Optimizer`` whose per-parameter state tensors are element-wise (shaped
            like their parameter: AdamW, Adam, SGD's momentum, ...); scalars (``step``) stay where they are.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        if optimizer in _PARKED:
            raise ValueError("this optimizer's state is already parked between steps (one ParkedOptimizerState "
                             "per optimizer)")
        self.optimizer = optimizer
        self.where = Where.RESIDENT
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (id of param, state key) -> host copy
        self._parked: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device local tensor, its host copy)
        self._stream: torch.cuda.Stream | None = None
        self._handles = [optimizer.register_step_pre_hook(lambda *_: self.unpark()),
                         optimizer.register_step_post_hook(lambda *_: self.park()),
                         optimizer.register_state_dict_pre_hook(lambda *_: self.unpark()),
                         optimizer.register_load_state_dict_pre_hook(self._before_load),
                         optimizer.register_load_state_dict_post_hook(lambda *_: self._after_load())]
        self._loaded: set[int] = set()  # storages of the tensors handed to load_state_dict
        self.owns_loads = False  # set by owned_loads(): the loaded state dict is nobody else's
        _PARKED[optimizer] = self

    @property
    def parked_bytes(self) -> int:
        """Bytes of state the device does not hold now (0 unless parked)."""
        return sum(host.nbytes for _, host in self._parked) if self.where is Where.PARKED else 0

    def _state_tensors(self) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
        seen: set[int] = set()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != p.shape:
                        continue
                    local = local_of(value)
                    storage = local.untyped_storage()
                    # only a tensor that is its whole storage can be emptied and filled again
                    if storage.nbytes() != local.nbytes or storage.data_ptr() in seen or local.nbytes == 0:
                        continue
                    seen.add(storage.data_ptr())
                    yield (id(p), key), local

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def park(self) -> None:
        """Step 1: copy the state to the host and free its device storage (after a step: the post-hook)."""
        if self.where is not Where.RESIDENT:
            return
        found = list(self._state_tensors())
        if not found:
            return
        if any(key not in self._host or self._host[key].shape != local.shape or self._host[key].dtype != local.dtype
               for key, local in found):
            self._host = _host_buffers(found)
        entries = [(local, self._host[key]) for key, local in found]
        cuda = entries[0][0].is_cuda
        if cuda:
            side = self._side_stream(entries[0][0].device)
            side.wait_stream(torch.cuda.current_stream(entries[0][0].device))  # the step's results
            with torch.cuda.stream(side):
                for local, host in entries:
                    host.copy_(local, non_blocking=True)
        else:
            for local, host in entries:
                host.copy_(local)
        for local, _ in entries:
            if cuda:
                local.record_stream(side)  # the block is reused only once the copy is done
            local.untyped_storage().resize_(0)
        self._parked = entries
        self.where = Where.PARKED

    def prefetch(self) -> None:
        """Step 2: allocate the state's device storage and start the copies back (on CUDA, on a side stream)."""
        if self.where is not Where.PARKED:
            return
        for local, host in self._parked:
            local.untyped_storage().resize_(host.nbytes)
        if self._parked[0][0].is_cuda:
            device = self._parked[0][0].device
            side = self._side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))  # the new blocks may be ones the stream just freed
            with torch.cuda.stream(side):
                for local, host in self._parked:
                    local.copy_(host, non_blocking=True)
        else:
            for local, host in self._parked:
                local.copy_(host)
        self.where = Where.ARRIVING

    def unpark(self) -> None:
        """Step 3: the state is on its device for the current stream (before a step: the pre-hook)."""
        if self.where is Where.RESIDENT:
            return
        self.prefetch()
        local = self._parked[0][0]
        if local.is_cuda:  # the blocks were allocated on the current stream: only the wait is needed
            torch.cuda.current_stream(local.device).wait_stream(self._side_stream(local.device))
        self._parked = []
        self.where = Where.RESIDENT

    def settle(self) -> None:
        """Free a prefetch no step used (a skipped step): the host still holds the same values, nothing is copied."""
        if self.where is not Where.ARRIVING:
            return
        local = self._parked[0][0]
        if local.is_cuda:
            self._side_stream(local.device).synchronize()  # the copies back write into the storage freed here
        for local, _ in self._parked:
            local.untyped_storage().resize_(0)
        self.where = Where.PARKED

    def _before_load(self, _optimizer, state_dict: dict) -> None:
        # load_state_dict replaces the tensors: the old ones come back first, nothing is left half-parked
        self.unpark()
        self._loaded = set() if self.owns_loads else {
            local_of(v).untyped_storage().data_ptr() for state in state_dict.get("state", {}).values()
            for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0}

    def _after_load(self) -> None:
        # torch keeps a loaded tensor that is already on the parameter's device and dtype as it is: parking
        # would empty the caller's tensor (another optimizer's state, a dict read again). Such tensors are
        # copied first; odcfsdp's checkpoints hand over dicts of their own (owned_loads) and skip the copy.
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if (isinstance(value, torch.Tensor) and value.dim() > 0
                        and local_of(value).untyped_storage().data_ptr() in self._loaded):
                    state[key] = value.clone()
        self._loaded = set()
        self.park()

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

    def _park_unchanged(self) -> None:
        # the host copies still hold the device values: free the storage without copying
        entries = [(local, self._host[key]) for key, local in self._state_tensors() if key in self._host]
        if not entries:
            return
        if entries[0][0].is_cuda:
            torch.cuda.current_stream(entries[0][0].device).synchronize()  # readers on the stream are done
        for local, _ in entries:
            local.untyped_storage().resize_(0)
        self._parked = entries
        self.where = Where.PARKED

    def close(self) -> None:
        """Bring the state back and remove the hooks: the optimizer is as it was without parking."""
        self.unpark()
        for handle in self._handles:
            handle.remove()
        _PARKED.pop(self.optimizer, None)
        self._host.clear()


def _host_buffers(found: list[tuple[tuple[int, str], torch.Tensor]]) -> dict[tuple[int, str], torch.Tensor]:
    """One host buffer per dtype (pinned for CUDA state), cut into one view per state tensor: pinned memory
    allocated tensor by tensor would be rounded up to powers of two by torch's host allocator."""
    by_dtype: dict[torch.dtype, int] = {}
    for _, local in found:
        by_dtype[local.dtype] = by_dtype.get(local.dtype, 0) + local.numel()
    pinned = found[0][1].is_cuda
    flat = {dtype: torch.empty(n, dtype=dtype, pin_memory=pinned) for dtype, n in by_dtype.items()}
    out, offset = {}, dict.fromkeys(by_dtype, 0)
    for key, local in found:
        start = offset[local.dtype]
        out[key] = flat[local.dtype][start:start + local.numel()].view(local.shape)
        offset[local.dtype] = start + local.numel()
    return out


def parking_of(optimizer: torch.optim.Optimizer) -> ParkedOptimizerState | None:
    """The optimizer's ``ParkedOptimizerState``, if its state is parked between steps."""
    return _PARKED.get(optimizer)


def prefetch_parked(optimizer: torch.optim.Optimizer) -> None:
    """Start bringing a parked optimizer's state back ([parking] 2); nothing for any other optimizer."""
    parking = _PARKED.get(optimizer)
    if parking is not None:
        parking.prefetch()


def settle_parked(optimizer: torch.optim.Optimizer) -> None:
    """After a skipped step: free an unused prefetch again; nothing for an optimizer without parking."""
    parking = _PARKED.get(optimizer)
    if parking is not None:
        parking.settle()


@contextlib.contextmanager
def unparked(optimizer: torch.optim.Optimizer, changes: bool = False) -> Iterator[None]:
    """The optimizer's state resident inside the block (for readers and writers of ``optimizer.state``), parked
    again after it if it was; a no-op for an optimizer without parking."""
    parking = _PARKED.get(optimizer)
    with parking.resident(changes) if parking is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def owned_loads(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block, ``optimizer.load_state_dict`` takes state dicts that nobody else holds: a parked optimizer
    parks their tensors as they are instead of copying them first (odcfsdp's checkpoint loader)."""
    parking = _PARKED.get(optimizer)
    if parking is None:
        yield
        return
    parking.owns_loads = True
    try:
        yield
    finally:
        parking.owns_loads = False
