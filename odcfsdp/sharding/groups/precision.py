"""Mixed precision in FSDP2's vocabulary: ``MixedPrecisionPolicy`` resolved into the dtypes ODCShard uses.

Design note [precision]
-----------------------
``ODCShard(mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(...))`` means what it means
for ``fully_shard``:

* ``param_dtype``: the dtype of the unsharded parameters forward and backward compute with,
  and of the rows peers gather (the same as ODCShard's own ``param_dtype=``; giving both
  with different values is an error);
* ``reduce_dtype``: the dtype gradients are summed in: every push is rounded to it and added
  into the owner's accumulator row, which is kept in it (fp32 by default, or the masters'
  dtype if wider). A narrower one (bf16) halves the accumulators (on the heap) and the bytes
  each push moves; at the sync the optimizer sees ``.grad`` as an upcast copy in the masters'
  dtype, held until the minibatch finishes, as FSDP2 hands its optimizer gradients in the
  sharded parameters' dtype. So it saves 2 bytes per parameter / N from backward to the sync
  (where activations peak) but costs 2 more from the sync to the finish (the optimizer step:
  accumulator 2 + copy 4, against 4): a lever for activation-bound peaks, not step-bound ones;
* ``output_dtype``: floating-point outputs of the wrapped model's forward are cast to it;
* ``cast_forward_inputs``: floating-point inputs of the wrapped model's forward are cast to
  ``param_dtype`` (when the policy sets one).

Without ``mp_policy`` nothing is cast at the model's boundary, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ...torch_private import apply_to_tensors as _apply_to_tensors  # what fully_shard casts with (dataclasses too)


@dataclass(frozen=True)
class Precision:
    """The dtypes an ODCShard model uses (see [precision]).

    Attributes:
        param_dtype: compute and communication dtype of the parameters.
        reduce_dtype: dtype of the gradient accumulators (None: the masters' dtype, at least fp32).
        output_dtype: floating outputs of the model's forward are cast to it (None: left as they are).
        cast_inputs: floating inputs of the model's forward are cast to ``param_dtype``.
    """

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_inputs: bool = False

    def accumulator_dtype(self, master_dtype: torch.dtype) -> torch.dtype:
        """The accumulators' dtype for a group whose masters are ``master_dtype``."""
        return self.reduce_dtype or master_dtype


def policy_param_dtype(mp_policy, param_dtype: torch.dtype | None) -> torch.dtype | None:
    """``param_dtype`` as ``ODCShard(param_dtype=, mp_policy=)`` give it together (they must agree)."""
    if mp_policy is None:
        return param_dtype
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    if param_dtype is not None and mp_policy.param_dtype is not None and param_dtype != mp_policy.param_dtype:
        raise ValueError(f"param_dtype={param_dtype} and mp_policy.param_dtype={mp_policy.param_dtype} differ; "
                         "give the compute dtype once (mp_policy is FSDP2's way)")
    return mp_policy.param_dtype or param_dtype


def resolve_precision(mp_policy, param_dtype: torch.dtype) -> Precision:
    """The ``Precision`` of a model computing in ``param_dtype`` under ``mp_policy`` (None: no policy)."""
    if mp_policy is None:
        return Precision(param_dtype)
    for name in ("reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, name)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"mp_policy.{name} must be a floating dtype, got {dtype}")
    return Precision(param_dtype, mp_policy.reduce_dtype, mp_policy.output_dtype,
                     bool(mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None))


def _cast(dtype: torch.dtype):
    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() else x
    return cast


def register_casts(module: nn.Module, precision: Precision) -> list:
    """Hooks on ``module`` that cast its forward's floating inputs / outputs as ``precision`` says; their handles."""
    handles = []
    if precision.cast_inputs:
        cast_in = _cast(precision.param_dtype)
        handles.append(module.register_forward_pre_hook(
            lambda _m, args, kwargs: (_apply_to_tensors(cast_in, args), _apply_to_tensors(cast_in, kwargs)),
            with_kwargs=True))
    if precision.output_dtype is not None:
        cast_out = _cast(precision.output_dtype)
        handles.append(module.register_forward_hook(lambda _m, _a, out: _apply_to_tensors(cast_out, out)))
    return handles
