"""``ODCShard``: the module wrapper that shards a model's parameters in flat groups.

It composes the tiers of ``odcfsdp.sharding`` (after FSDP2's ``_fully_shard``):

* ``ShardMesh`` ([mesh]): the ranks and the collectives they meet with;
* ``Transport`` ([transport]): where rows live and how they move;
* ``FlatGroup`` ([layout], [grad-buffers]): one group's rows, buffers, state and use counts;
* ``HookDriver`` ([hooks]) with its ``PrefetchSchedule`` ([prefetch]): what runs when;
* ``StepProtocol`` ([step-protocol]): the minibatch's meeting and every change of rows.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from .group import FlatGroup
from .hooks import HookDriver, TrainingPhase
from .layout import GroupLayout, plan_groups
from .materialize import materialize_buffers, swap_params
from .mesh import ShardMesh
from .prefetch import PrefetchSchedule
from .protocol import StepProtocol
from .state_dict import gather_full, load_full, persistent_buffers
from .transport import Transport, make_transport

__all__ = ["ODCShard", "TrainingPhase"]


def _check_params(named: list[tuple[str, nn.Parameter]]) -> None:
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, found {sorted(map(str, devices))}")
    for name, p in named:
        if not p.dtype.is_floating_point:
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be sharded")


def _shard_device(named: list[tuple[str, nn.Parameter]], device) -> torch.device:
    on_meta = named[0][1].is_meta
    if on_meta and device is None:
        raise ValueError("the model is on the meta device: pass device= (where its shards should live)")
    if device is not None and not on_meta and torch.device(device) != named[0][1].device:
        raise ValueError(f"device={device} differs from the parameters' device {named[0][1].device}; "
                         "move the model first (or build it on the meta device)")
    device = torch.device(device) if device is not None else named[0][1].device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _compute_dtype(named: list[tuple[str, nn.Parameter]], device: torch.device, param_dtype) -> torch.dtype:
    if param_dtype is None:
        dtypes = {p.dtype for _, p in named}
        if device.type != "cuda" and len(dtypes) > 1:
            raise ValueError(
                f"parameters have mixed dtypes {sorted(map(str, dtypes))}; pass param_dtype= to "
                "compute them all in one dtype"
            )
        param_dtype = torch.bfloat16 if device.type == "cuda" else named[0][1].dtype
    if not param_dtype.is_floating_point:
        raise ValueError(f"param_dtype must be a floating dtype, got {param_dtype}")
    return param_dtype


class ODCShard(nn.Module):
    """Shard ``module``'s parameters over the ranks of a process group, in flat groups.

    Parameters are packed in order into groups of up to ``group_bytes`` (see
    [layout]); rank r keeps row r of every group plus a master copy of it in fp32.
    Groups are gathered right before a module needs them and freed after, and
    gradients are reduced in fp32 into their owners' accumulator rows, where they
    add up over micro-batches until ``odcfsdp.optim.AdamW.step``.

    Args:
        module: the model; every rank must hold the same initial values.
        group_bytes: byte budget of one group, counted in unsharded ``param_dtype``
            bytes. A larger parameter forms its own group.
        comm: transport: ``"auto"`` (``nvshmem`` on CUDA, ``shm`` on CPU), ``"shm"``,
            ``"nvshmem"`` (one-sided: ranks meet only at the optimizer step and may
            run different numbers of micro-batches) or ``"collective"``
            (all-gather / reduce-scatter; equal micro-batch counts required).
        process_group: ranks to shard over; the default group if None, or a single
            process if torch.distributed is not initialised.
        reshard_after_forward: free a group after its last use in forward and gather
            it again in backward (less memory); keep it until backward if False.
        param_dtype: dtype parameters are computed (and communicated) in; bf16 on
            CUDA and the parameters' own dtype elsewhere when None.
        device: where rows and buffers live. Needed for a model built on the meta
            device (``with torch.device("meta"): model = ...``): its rows start at
            zero, meta buffers are materialised and any submodule's
            ``init_buffers()`` is called; then load values with
            ``odcfsdp.checkpoint.load_hf`` or ``load_checkpoint``. Defaults to the
            parameters' device.
        prefetch: how many hook sites ahead to gather (forward order, reversed in
            backward; sites whose groups are already in hand do not count); 0
            disables. On CUDA on a side stream while the current site computes;
            elsewhere simply ahead of use. Each prefetched group holds its unsharded
            buffer early.
        overlap_push: on CUDA, push gradients on a side stream while backward goes on.
        units: module classes whose instances are hooked as a whole (all parameters
            of their subtree gathered before their forward, e.g. the decoder layer
            class); other modules that own parameters are hooked one by one.
        mesh: a 1-D ``DeviceMesh`` to shard over, instead of ``process_group``.
    """

    def __init__(
        self,
        module: nn.Module,
        group_bytes: int = 32 << 20,
        *,
        comm: str = "auto",
        process_group: dist.ProcessGroup | None = None,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
        prefetch: int = 1,
        device: torch.device | str | None = None,
        overlap_push: bool = True,
        units: tuple[type[nn.Module], ...] | list[type[nn.Module]] = (),
        mesh=None,
    ):
        super().__init__()
        if not isinstance(module, nn.Module) or isinstance(module, ODCShard):
            raise TypeError(f"ODCShard wraps a plain nn.Module once, got {type(module).__name__}")
        named = list(module.named_parameters())
        if not named:
            raise ValueError("the module has no parameters to shard")
        _check_params(named)
        on_meta = named[0][1].is_meta
        device = _shard_device(named, device)
        param_dtype = _compute_dtype(named, device, param_dtype)
        units = tuple(units)
        if not all(isinstance(u, type) and issubclass(u, nn.Module) for u in units):
            raise TypeError(f"units must be nn.Module subclasses, got {units!r}")
        if units and not any(isinstance(m, units) for m in module.modules()):
            raise ValueError(f"no module of the model is one of units={[u.__name__ for u in units]}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (groups gathered ahead), got {prefetch!r}")

        self.module = module
        self.units = units
        self.mesh = ShardMesh(device, process_group, mesh)
        self.rank, self.world_size = self.mesh.rank, self.mesh.world_size
        self.param_dtype = param_dtype
        self.reshard_after_forward = reshard_after_forward
        accum_dtype = torch.promote_types(param_dtype, torch.float32)
        self.layouts: list[GroupLayout] = plan_groups(named, self.world_size, group_bytes, param_dtype)
        self.transport: Transport = make_transport(comm, self.mesh)
        self.transport.setup(self.layouts, param_dtype, accum_dtype)
        by_name = dict(named)
        self.groups: list[FlatGroup] = [
            FlatGroup(lay, [by_name[s.name] for s in lay.slots], self.transport,
                      torch.promote_types(lay.dtype, accum_dtype))
            for lay in self.layouts
        ]
        if on_meta:
            swap_params(module, {id(by_name[s.name]): p for g in self.groups for s, p in zip(g.layout.slots, g.params)})
            materialize_buffers(module, device)
        self.mesh.barrier()  # every row written before anyone may read it

        # Every name a parameter is reachable by (tied parameters have several).
        self._registered = [
            (name, p, tuple(p.shape), p.requires_grad) for name, p in module.named_parameters(remove_duplicate=False)
        ]
        canonical = {id(p): name for name, p in module.named_parameters()}  # after any meta swap
        self.aliases = {name: canonical[id(p)] for name, p, _, _ in self._registered if canonical[id(p)] != name}
        cuda = device.type == "cuda"
        gather_stream = torch.cuda.Stream(device) if cuda and prefetch else None
        push_stream = torch.cuda.Stream(device) if cuda and overlap_push else None
        self.protocol = StepProtocol(self.groups, self.transport, self.mesh, gather_stream, push_stream)
        group_of = {p: g for g in self.groups for p in g.params}
        self._driver = HookDriver(module, self.groups, group_of, self.protocol, PrefetchSchedule(prefetch),
                                  reshard_after_forward, gather_stream, units)
        self._closed = False

    # -- minibatch protocol --------------------------------------------------------
    def begin_minibatch(self, micro_batches: int, tokens: int | None = None) -> int | None:
        """Declare this rank's share of the coming minibatch; return the global token count.

        Optional with one-sided transports, which accept any number of micro-batches
        per rank (zero included) and communicate here only to sum ``tokens`` (one small
        all-reduce, right after the step's barrier, where ranks are in step anyway).
        With ``comm="collective"`` it checks that every rank runs the same number of
        micro-batches and raises otherwise, instead of letting mismatched collectives
        hang later.

        Args:
            micro_batches: micro-batches this rank will run before the next step.
            tokens: this rank's loss-bearing tokens; if given, the sum over ranks is
                returned (normalise the loss by it: ranks' shares differ).
        """
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 0:
            raise ValueError(f"micro_batches must be an int >= 0, got {micro_batches!r}")
        if self.world_size == 1 or (self.transport.one_sided and tokens is None):
            return tokens
        local = torch.tensor([micro_batches, tokens or 0], dtype=torch.int64, device=self.mesh.device)
        table = self.mesh.all_gather_rows(local).cpu()
        counts = table[:, 0].tolist()
        if not self.transport.one_sided and len(set(counts)) > 1:
            raise RuntimeError(
                f"comm='{self.transport.name}' needs the same number of micro-batches on every rank, got {counts} "
                "by rank; balance with lb_micro, or use a one-sided transport (comm='shm' on CPU, 'nvshmem' on CUDA)"
            )
        return int(table[:, 1].sum()) if tokens is not None else None

    # -- forward -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the wrapped module, gathering each group right before it is needed."""
        self._check_open()
        self._check_unchanged()
        self._driver.begin_forward()
        try:
            return self.module(*args, **kwargs)
        finally:
            self._driver.end_forward()

    def _check_unchanged(self) -> None:
        current = list(self.module.named_parameters(remove_duplicate=False))
        if len(current) != len(self._registered):
            raise RuntimeError(
                f"the wrapped model now has {len(current)} parameter entries, ODCShard planned "
                f"{len(self._registered)}: parameters must not be added or removed after wrapping"
            )
        for (name, p), (rname, rp, shape, req) in zip(current, self._registered):
            if name != rname or p is not rp:
                raise RuntimeError(
                    f"parameter {rname!r} was replaced after ODCShard wrapped the model; "
                    "change parameters before wrapping (or load values with load_full_state_dict)"
                )
            if tuple(p.shape) != shape or p.dtype != self.param_dtype:
                raise RuntimeError(f"parameter {name!r} had its data reassigned after wrapping")
            if p.requires_grad != req:
                raise RuntimeError(
                    f"parameter {name!r} changed requires_grad after wrapping; freeze or unfreeze before ODCShard"
                )

    # -- whole-model access -----------------------------------------------------------
    @property
    def phase(self) -> TrainingPhase:
        """Where the wrapper is in a forward/backward pass."""
        return self._driver.phase

    def reshard_all(self) -> None:
        """Free every group's unsharded buffer."""
        self.protocol.reshard_all()

    @property
    def pending_pushes(self) -> int:
        """Gradient pushes since the last optimizer step (0 between minibatches)."""
        return self.protocol.pushes

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The wrapped model's persistent buffers by name (replicated on every rank; checkpoints keep them)."""
        return persistent_buffers(self.module)

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        """Context in which every parameter holds its full value (collective: all ranks enter)."""
        self._check_open()
        for g in self.groups:
            g.to_unsharded()
            g.wait_ready()
        try:
            yield
        finally:
            self.reshard_all()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameter values (from the master rows), keyed by parameter name.

        Collective: every rank must call it. Values have the parameters' original
        dtypes; tied parameters appear under each of their names.
        """
        self._check_open()
        return gather_full(self.groups, self.mesh, self.aliases)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set every parameter from full values (collective: all ranks call it with the same values)."""
        self._check_open()
        load_full(self.groups, self.protocol, self.aliases, state)

    def state_dict(self, *args, **kwargs):  # type: ignore[override]
        """Same as ``full_state_dict`` (a gathered, plain-PyTorch view of the model)."""
        if args or kwargs:
            raise TypeError("ODCShard.state_dict takes no arguments; it returns full_state_dict()")
        return self.full_state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Same as ``load_full_state_dict`` (``strict`` must stay True, ``assign`` False)."""
        if not strict or assign:
            raise ValueError("ODCShard.load_state_dict supports only strict=True, assign=False")
        self.load_full_state_dict(state_dict)

    def _apply(self, fn, recurse=True):
        # .to()/.cuda()/.half() would replace parameter data with tensors outside the group
        # buffers, silently disconnecting the model from its shards.
        raise RuntimeError(
            "ODCShard does not support .to()/.cuda()/.float() and the like after wrapping; move or cast "
            "the model before wrapping it (param_dtype= sets the compute dtype)"
        )

    def close(self) -> None:
        """Release the transport, hooks and rows; the model cannot be used afterwards (collective)."""
        if not self._closed:
            self.reshard_all()
            self._closed = True
            self._driver.remove()
            for g in self.groups:
                g.release()
            self.transport.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ODCShard was closed; its rows (and masters) are released")

    def extra_repr(self) -> str:
        return (
            f"groups={len(self.groups)}, world_size={self.world_size}, comm={self.transport.name}, "
            f"param_dtype={self.param_dtype}, reshard_after_forward={self.reshard_after_forward}"
            + (f", units={[u.__name__ for u in self.units]}" if self.units else "")
        )
