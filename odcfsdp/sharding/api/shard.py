"""``ODCShard``: the module wrapper that shards a model's parameters in flat groups.

The machinery is ``ShardEngine``'s (``engine.py``, which lists the tiers it composes); the wrapper
adds the wrapped model's surface. It stands for the model it wraps ([transparent-wrapper] in
``transparent.py``); ``fully_shard`` (``fully_shard.py``) is the same engine without a wrapper.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from ...torch_private import IncompatibleKeys as _IncompatibleKeys

from ..runtime.arguments import check_params, check_reshard_after_forward, check_units, compute_dtype, shard_device
from ..runtime.engine_settings import EngineSettings, settings_args_doc
from ..runtime.engine import ShardEngine
from ..runtime.hooks import unit_of
from ..groups.float8 import FLOAT8_GATHER_DEFAULT, prepare_float8
from ..groups.float8_rows import Float8Gather
from ..runtime.lifecycle import TrainingPhase
from ..placement.mesh import ShardMesh
from ..groups.precision import policy_param_dtype, resolve_precision
from ..runtime.shard_state import persistent_buffers
from ..runtime.transparent import MOVE_ERROR
from .minibatch_control import MinibatchControl

__all__ = ["ODCShard", "TrainingPhase"]

class ODCShard(MinibatchControl, nn.Module):
    """Shard ``module``'s parameters over the ranks of a process group, in flat groups.

    Parameters are packed in order into groups, one per ``units`` module and of up to
    ``group_bytes`` outside units, and sharded on dim 0 (see [layout]); rank r keeps
    row r of every group plus an fp32 master copy of it. Outside forward and backward
    every parameter of the model is this rank's shard, a DTensor (``Shard(0)``) over
    the master row, and its ``.grad`` the rank's fully reduced fp32 gradient shard, so the standard PyTorch loop (any
    element-wise ``torch.optim`` optimizer, ``clip_grad_norm_``, LR schedulers,
    ``torch.distributed.checkpoint``) works unchanged (see [params],
    [step-protocol]). Groups are gathered right before a module needs them and
    freed after; gradients are added in fp32 into their owners' accumulator rows,
    where they sum up over micro-batches, which may differ in number per rank with
    the one-sided transports.

    Gradient reduction is FSDP2's: ``.grad`` is the sum over every rank's micro-batches
    divided by the gradient divide factor, by default the number of data-parallel ranks
    (shard ranks x HSDP replicas), so with a per-rank mean loss (what Hugging Face models
    return) gradients, ``clip_grad_norm_`` and SGD steps equal FSDP2's and DDP's.
    ``set_gradient_divide_factor(1.0)`` keeps the plain sum (a loss already normalised
    by the global token count, as ``begin_minibatch(tokens=...)`` gives it, wants
    that). The division is done once per minibatch at the sync ([lifecycle] 8); on one
    rank there is nothing to divide by.

    The engine's own options, ``group_bytes`` to ``overlap_push``, come last among the arguments below, as
    ``EngineSettings`` documents them (each once, there; ``fully_shard`` takes them as one ``EngineSettings``).

    Args:
        module: the model; every rank must hold the same initial values.
        comm: transport: ``"auto"`` (``nvshmem`` on CUDA, ``shm`` on CPU), ``"shm"``,
            ``"nvshmem"`` (one-sided: ranks meet only between the minibatch's last
            backward and the next forward, where the loop reads and consumes the
            gradients, and may run different numbers of micro-batches) or ``"collective"``
            (all-gather / reduce-scatter; equal micro-batch counts required).
        process_group: ranks to shard over; the default group if None, or a single
            process if torch.distributed is not initialised.
        reshard_after_forward: free a group after its last use in forward and gather
            it again in backward (less memory); keep it until backward if False. FSDP2's
            int (keep a copy within a smaller group) is refused: see ``check_reshard_after_forward``.
        param_dtype: dtype parameters are computed (and communicated) in; bf16 on
            CUDA and the parameters' own dtype elsewhere when None.
        device: where rows and buffers live. Needed for a model built on the meta
            device (``with torch.device("meta"): model = ...``): its rows start at
            zero, meta buffers are materialised and any submodule's
            ``init_buffers()`` is called; then load values with
            ``odcfsdp.checkpoint.load_hf`` or ``load_checkpoint``. Defaults to the
            parameters' device.
        units: module classes whose instances are hooked as a whole (all parameters
            of their subtree gathered before their forward, e.g. the decoder layer
            class); other modules that own parameters are hooked one by one.
        mesh: a ``DeviceMesh`` instead of ``process_group``: 1-D to shard over its ranks, or
            2-D ``("replicate", "shard")`` for hybrid sharding (HSDP): sharded within each
            shard group, replicated across them, gradients combined once per minibatch at
            the first ``.grad`` read (see [hsdp] in ``hsdp.py``).
        offload_policy: FSDP2's ``CPUOffloadPolicy(pin_memory=True)``: fp32 masters, and so the
            optimizer's state and step, in host memory ([offload] in ``group.py``).
        mp_policy: FSDP2's ``MixedPrecisionPolicy``: ``param_dtype`` (as above), ``reduce_dtype``
            (the gradient accumulators' dtype, e.g. bf16; fp32 by default), ``output_dtype`` and
            ``cast_forward_inputs`` at the model's forward (see [precision] in ``precision.py``).
        float8: ``"tensorwise"`` or ``"rowwise"``: convert the model's linears to torchao's float8 training first
            (not the output head, nor a linear whose dims are not multiples of 16); needs torchao
            (``pip install odcfsdp[fp8]``) and a GPU of compute capability 8.9+ ([float8] in ``float8.py``).
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
        timeout: float = 300.0,
        gather_masters: bool = False,
        split_masters: bool = False,
        offload_policy=None,
        mp_policy=None,
        float8: str | None = None,
        float8_gather: bool = FLOAT8_GATHER_DEFAULT,
    ):
        super().__init__()
        if not isinstance(module, nn.Module) or isinstance(module, ODCShard):
            raise TypeError(f"ODCShard wraps a plain nn.Module once, got {type(module).__name__}")
        check_reshard_after_forward(reshard_after_forward)
        named = list(module.named_parameters())
        if not named:
            raise ValueError("the module has no parameters to shard")
        check_params(named)
        device = shard_device(named, device)
        param_dtype = compute_dtype(named, device, policy_param_dtype(mp_policy, param_dtype))
        self.precision = resolve_precision(mp_policy, param_dtype)
        units = check_units(units, module)
        settings = EngineSettings(group_bytes=group_bytes, prefetch=prefetch, gather_masters=gather_masters,
                                  split_masters=split_masters, float8_gather=float8_gather, timeout=timeout,
                                  overlap_push=overlap_push)
        self.float8_linears = prepare_float8(module, float8, device)  # [float8]: before the plan (same parameters)
        late_rows = Float8Gather.of(module, named) if float8_gather else None

        self.module = module
        self.units = units
        self.reshard_after_forward = reshard_after_forward
        self.engine = ShardEngine(
            module, named, device=device, mesh=ShardMesh(device, process_group, mesh, timeout_s=timeout),
            param_dtype=param_dtype, precision=self.precision, settings=settings, comm=comm,
            reshard_after_forward=reshard_after_forward, offload_policy=offload_policy,
            is_unit=lambda m: isinstance(m, units),
            owner_of=unit_of(module, lambda m: isinstance(m, units)) if units else None, late_rows=late_rows)
        self.engine.expose_on(self)

    # -- the wrapped model's surface -------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self._modules.get("module")
            if module is None:
                raise
            return getattr(module, name)

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        # DistributedDataParallel (and Accelerate's prepare, which wraps in it) asks for this first.
        raise TypeError("an ODCShard model cannot be wrapped in DistributedDataParallel (or Accelerate's prepare): "
                        "ODCShard already shards and reduces gradients; train it directly with the standard loop "
                        "(model(x), loss.backward(), clip_grad_norm_, opt.step())")

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped model's parameters under its own names: this rank's shards outside forward."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The wrapped model's buffers under its own names."""
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        # torch.distributed.checkpoint's name walk leaves out the children named here, as our names do.
        return {"module": "module"}

    def forward(self, *args, **kwargs):
        """Run the wrapped model, gathering each group right before it is needed."""
        self._check_open()
        return self.module(*args, **kwargs)

    # -- minibatch protocol: begin / end / finish_minibatch ([implicit-events], MinibatchControl) ---------------
    def _control_minibatch(self):
        return self.minibatch

    def _control_lifecycle(self):
        return self.lifecycle

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the gradients summed over ranks and micro-batches by ``factor``, as FSDP2's method of that name.

        The default is the number of data-parallel ranks (shard ranks x HSDP replicas): ``.grad`` is the mean
        over ranks, as with FSDP2 and DDP. ``1.0`` keeps the sum (for a loss normalised by the global token
        count). Takes effect at the next sync (the first ``.grad`` read after the micro-batches).
        """
        self.minibatch.set_divide_factor(factor)

    @property
    def gradient_divide_factor(self) -> float:
        """What the summed gradients are divided by at the sync (``set_gradient_divide_factor``)."""
        return self.minibatch.divide_factor

    # -- whole-model access -----------------------------------------------------------
    @property
    def phase(self) -> TrainingPhase:
        """Where the wrapper is in a forward/backward pass."""
        return self.lifecycle.phase

    def reshard_all(self) -> None:
        """Free every group's unsharded buffer (modules hold their shards again)."""
        self.lifecycle.reshard_all()

    @property
    def sync_wait_s(self) -> float:
        """Seconds the last minibatch's sync (the first ``.grad`` read) waited for the other ranks."""
        return self.minibatch.last_wait_s

    @property
    def pending_pushes(self) -> int:
        """Gradient pushes of this rank whose minibatch has not finished (0 between minibatches)."""
        return self.minibatch.pending_pushes

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The wrapped model's persistent buffers by name (replicated on every rank; checkpoints keep them)."""
        return persistent_buffers(self.module)

    @contextlib.contextmanager
    def unsharded(self) -> Iterator[None]:
        """Context in which every parameter holds its full value (collective: all ranks enter). A weight gathered in
        float8 (``float8_gather``) holds its float8 form, a ``Float8TrainingTensor``: read masters with
        ``full_state_dict`` instead."""
        with self.engine.unsharded():
            yield

    @contextlib.contextmanager
    def changing_parameters(self) -> Iterator[None]:
        """Context in which parameters may be changed in place, e.g. re-initialised after wrapping (collective).

        Inside, every parameter is this rank's shard; the changes are published to the
        rows peers gather on exit. Pending gradients are dropped. Between
        ``opt.step()`` and the next forward no context is needed (the step's end
        publishes changed rows, see [step-protocol])::

            with model.changing_parameters(), torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.02)
        """
        self._check_open()
        with self.shard_state.changing():
            yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameter values (from the master rows), keyed by parameter name.

        Collective: every rank must call it. Values have the parameters' original
        dtypes; tied parameters appear under each of their names.
        """
        self._check_open()
        return self.shard_state.full_state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set every parameter from full values (collective: all ranks call it with the same values)."""
        self._check_open()
        self.shard_state.load_full_state_dict(state)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):  # type: ignore[override]
        """The wrapped model's state dict under its own names: parameters are this rank's shards (DTensors
        placed ``Shard(0)``, or ``(Replicate(), Shard(0))`` with HSDP, as FSDP2's), buffers are whole. No
        communication."""
        if args:
            raise TypeError("ODCShard.state_dict takes keyword arguments only (destination=, prefix=, keep_vars=)")
        self._check_open()
        self.reshard_all()  # a group kept for backward would otherwise show its unsharded form
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Set parameters and buffers from a state dict (collective: every rank calls it).

        Parameter values may be this rank's shards (DTensors, as ``state_dict()``
        gives them) or full tensors (each rank takes its rows). Returns the missing and
        unexpected keys like ``nn.Module.load_state_dict``; with ``strict`` they raise.
        ``assign=True`` (what loaders of meta-device models pass, accelerate's among them) copies too: peers read
        the shards one-sidedly, so they keep their identity, and the values are the state dict's either way.
        """
        self._check_open()
        return _IncompatibleKeys(*self.shard_state.load_state_dict(self.module, state_dict, strict))

    def to_empty(self, *, device, recurse: bool = True):  # type: ignore[override]
        """After building the model on the meta device and wrapping it with ``device=``: the shards already live
        there (another device is refused), meta buffers become real, and the model's in-place initialisation that
        follows is published at the next forward ([meta-init] in ``materialize.py``). Returns the wrapper."""
        self.engine.to_empty(device)
        return self

    def _apply(self, fn, recurse=True):
        raise RuntimeError(MOVE_ERROR)

    def close(self) -> None:
        """Release the transport, hooks and rows; the model cannot be used afterwards (collective)."""
        self.engine.close()

    def _check_open(self) -> None:
        self.engine.check_open()

    def extra_repr(self) -> str:
        return (
            f"groups={len(self.groups)}, world_size={self.world_size}, comm={self.transport.name}, "
            f"param_dtype={self.param_dtype}, reshard_after_forward={self.reshard_after_forward}"
            + (f", units={[u.__name__ for u in self.units]}" if self.units else "")
        )


if ODCShard.__doc__:  # the engine's options, documented once in EngineSettings (no docstrings under -OO)
    ODCShard.__doc__ = inspect.cleandoc(ODCShard.__doc__) + "\n" + settings_args_doc()
