"""Float8 training: torchao's float8 linears under ODCShard (``ODCShard(float8="tensorwise" | "rowwise")``).

Design note [float8]
--------------------
``ODCShard(module, float8=recipe)`` converts ``module``'s ``nn.Linear`` layers to torchao's
``Float8Linear`` (``torchao.float8.convert_to_float8_training`` with
``Float8LinearConfig.from_recipe_name(recipe)``) *before* it plans its groups, so the converted
model is what is sharded. ``convert_float8_linears`` is the same conversion for a model you wrap
yourself. What is converted, as torchtitan's float8 converter chooses:

* every ``nn.Linear`` whose ``in_features`` and ``out_features`` are both multiples of 16 (the
  float8 matmul, ``torch._scaled_mm``, wants them so; smaller odd shapes would not pay anyway);
* but not the output head: a linear whose name (last component) is ``output`` or ``lm_head``
  (``FLOAT8_SKIP``), whose logits feed the loss and are kept in the compute dtype.

A ``Float8Linear``'s weight is an ordinary parameter, so it is sharded, pushed and stepped like
any other: the fp32 master is what the optimizer updates. With ``float8_gather`` (the default;
tensorwise layers, [float8-gather] below) the owners cast their rows to float8 once per step and
peers gather float8 bytes, which each layer takes as already cast. Otherwise (rowwise layers, or
``float8_gather=False``) the ``param_dtype`` (bf16) row is what peers gather, and the layer casts
the gathered weight to float8 in its forward (tensorwise: one scale per tensor from the whole
weight's amax; rowwise: one per row). Either way the layer casts its input and output gradient in
the matmuls of backward, so float8 speeds up the linears' matmuls. A model converted with torchao
by hand before wrapping is gathered in float8 too wherever its layers cast tensorwise (the scales
then come from the fp32 masters' amaxes, as torchao's FSDP2 float8 all-gather takes them from its
fp32 shards); ``float8_gather=False`` keeps the bf16 gather.

Float8 needs a GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell) and torchao
(``pip install odcfsdp[fp8]``); ``float8_problem`` says, in one line, what is missing, and
``ODCShard`` raises it, as the training CLI does before any rank starts. The conversion itself
runs anywhere (torchao's float8 matmul also runs, slowly, on CPU), which is how the CPU tests
check that a converted model trains alike sharded and in one process.

Design note [float8-gather]
---------------------------
With tensorwise scaling and ``ODCShard(float8_gather=True)`` peers gather float8 bytes, one byte a
parameter (half of bf16's), plus one fp32 scale per weight that no one gathers: FSDP2 does the same
with torchao's ``enable_fsdp_float8_all_gather`` (each local shard a ``WeightWithDynamicFloat8CastTensor``
whose ``fsdp_pre_all_gather`` casts it with a scale ``precompute_float8_dynamic_scale_for_fsdp``
computed after the optimizer step from one all-reduce (max) of the shards' inf-norms;
``fsdp_post_all_gather`` wraps the gathered bytes and the scale as a ``Float8TrainingTensor``).
The maths, for weight w whose fp32 master slices ``M_r,w`` ranks r hold:

    amax_w = max_r max|M_r,w|          (a rank holding no rows of w contributes 0)
    s_w    = fp32(448 / fp64(max(amax_w, 1e-12)))        (448: e4m3's largest; torchao's EPS)
    row    = e4m3(clamp(fp32(M_r,w) * s_w, -448, 448))   (rank r's float8 slice, saturating)

and the matmul divides by ``s_w`` (torchao's ``_scaled_mm`` with the reciprocal). The cast is
elementwise, so casting each slice with the whole weight's scale gives the slices of torchao's cast of
the whole weight, bit for bit: a float8-gather model trains exactly as one process running the same
``Float8Linear``s and as FSDP2's float8 all-gather (``tests/test_float8_gather.py``, fp32 on CPU;
config key ``shard.float8_gather``). Built, by step
of [lifecycle] (``float8_rows.py`` holds the machinery):

1. plan: the weights of ``Float8Linear`` layers that cast tensorwise (``float8_gathered``:
   ``float8="tensorwise"``'s, or layers converted before wrapping; not a weight tied to another
   module, whose other users want plain values) are ``Float8Gather``'s, the engine's ``LateRows``
   ([row-format]): ``plan_groups`` gives them groups of their own (``GroupLayout.row_dtype`` e4m3),
   counted at 1 byte a parameter against ``group_bytes``, and ``row_format`` their format; their rows are
   ``float8_e4m3fn``, their unsharded buffer too, while their gradient buffer keeps ``param_dtype``
   (``FlatGroup.grad_dtype``), their accumulator ``reduce_dtype`` and their master fp32.
2. finish (step 10), before the meeting: each rank takes the inf-norm of each float8 weight's slice of
   its master (``Float8Rows.amaxes``: one ``_foreach_norm``, no copy) and appends them to its meeting
   row: the meeting's all-gather (``Meetings.meet_carrying``) moves a float64 row (the counts stay
   exact below 2**53), so the max over ranks costs no collective of its own. Every meeting of such a
   model has that row length (zeros where nothing is carried), so ranks at different meetings still
   read one table and raise the same disagreement error. ``publish`` leaves
   float8 rows alone: without the scales there is nothing to cast with.
3. finish, after the meeting: every rank computes every scale from the same table (so scales need no
   gather) and casts its master slices into its row (``Float8Rows.cast``). Peers may gather right
   after the meeting, so the cast is ordered before any peer's next gather ([streams] 6 in
   ``streams.py``): where peers read rows one-sidedly, a 1-element all-reduce follows the cast on the
   current stream (device-side on CUDA, a host barrier on CPU); the collective transport needs none.
   A row change outside a step (``rows_changing``: checkpoint and Hugging Face loads) ends in the same
   finish, so its meeting carries the amaxes too; at construction one all-gather of the amaxes
   precedes the existing barrier.
4. gather (step 2): the transports move float8 rows as bytes (``transport.base.as_bytes``: ``uint8``
   views; gloo has no float8, and the row kernels load and store by dtype, ``_TL_DTYPES`` in
   ``kernels/rows.py`` takes ``uint8``). Each weight's unsharded form is a parameter whose data is a
   ``Float8TrainingTensor`` over its slice of the gathered float8 buffer with its scale (a 0-dim view
   of one scales tensor, updated in place: the parameter is made once, as FSDP2 makes its unsharded
   float8 parameter once). ``Float8Linear.forward`` takes it as already cast (torchao's
   ``tensor_already_casted_to_fp8``), so the layer's own amax pass and cast over the whole weight are
   gone, in forward and in backward's ``grad_input`` matmul. Its gradient, which torchao's matmul
   returns in ``param_dtype``, accumulates into the group's gradient buffer as any other's.
5. the collective transport's all-gather moves the same float8 rows as bytes.

Costs and limits: the owner's cast is one pass over its float8 master rows a step (FSDP2 casts its
shard at every all-gather instead), on CUDA one kernel per group that gives each element its segment's
scale and reads 4 bytes and writes 1 (``kernels/float8_cast.py``, which says why torch's operators would
not do); on the nvshmem transport the cast
adds one device-side all-reduce and one ``quiesce`` per step. With ``gather_masters`` the other groups'
rows are their masters, the float8 groups keep their float8 row. ``ODCShard.unsharded()`` shows a
float8 weight in its float8 form (``full_state_dict`` and checkpoints read the fp32 masters).
``float8_gather`` is on by default (its GPU checks: ``results/fp8/``, ``results/e2e/``, listed in
``results/README.md``). ``float8_gather=False`` gathers the float8 layers' weights in ``param_dtype``. A
float8-gathered weight's original parameter object keeps its identity (an optimizer over it is still refused) but
not its values, which live in the master: it reads as an empty tensor.

Rowwise scaling gathers bf16 and lets torchao cast locally, on purpose: a rowwise weight needs one
scale per row of the weight for the forward matmul *and* one per column for the backward's
``grad_input = grad_output @ W`` (the transposed operand is scaled along the other axis), so a
float8 row cast once by the owner would serve only one of the two, and the column scales need the
amax of every column over every rank's rows, a reduction over the whole gathered weight. Casting
bf16 locally, after the gather, has no such problem, and rowwise's gain is in its accuracy, not in
bytes (its speed against bf16: ``results/fp8/``).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn

#: the torchao float8 recipes ODCShard takes (``Float8LinearConfig.from_recipe_name``)
FLOAT8_RECIPES = ("tensorwise", "rowwise")
#: names (last component) of the output heads that stay in the compute dtype, as torchtitan's filter keeps ``output``
FLOAT8_SKIP = ("output", "lm_head")
#: the least CUDA compute capability with float8 matmuls (Ada Lovelace); Hopper is (9, 0)
FLOAT8_MIN_CAPABILITY = (8, 9)
INSTALL_HINT = "pip install odcfsdp[fp8]"
#: ``ODCShard(float8_gather=)``'s default: tensorwise weights gathered in float8 ([float8-gather])
FLOAT8_GATHER_DEFAULT = True


def torchao_installed() -> bool:
    """Whether torchao can be imported (without importing it: its import is slow and prints warnings)."""
    return importlib.util.find_spec("torchao") is not None


def float8_problem(device: torch.device | str, capability: tuple[int, int] | None = None) -> str | None:
    """Why float8 training cannot run on ``device`` (one line naming the fix), or None when it can.

    ``capability`` is the GPU's compute capability where the caller knows it without a CUDA context (the launcher
    reads it from ``nvidia-smi``); otherwise CUDA is asked.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return (f"float8 training needs a GPU of compute capability {FLOAT8_MIN_CAPABILITY[0]}."
                f"{FLOAT8_MIN_CAPABILITY[1]} or more (H100, H200, L40S, RTX 4090), and this run is on {device.type}: "
                "drop float8 (shard.float8=none) or run on such a GPU")
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FLOAT8_MIN_CAPABILITY:
        return (f"float8 training needs a GPU of compute capability {FLOAT8_MIN_CAPABILITY[0]}."
                f"{FLOAT8_MIN_CAPABILITY[1]} or more (H100, H200, L40S, RTX 4090); this GPU's is "
                f"{capability[0]}.{capability[1]}: drop float8 (shard.float8=none) or use such a GPU")
    if not torchao_installed():
        return f"float8 training needs torchao, which is not installed: {INSTALL_HINT}"
    return None


def check_recipe(recipe) -> None:
    """``recipe`` is one of ``FLOAT8_RECIPES`` (or None: no float8)."""
    if recipe is not None and recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8={recipe!r} is not a recipe; choose one of {FLOAT8_RECIPES} (None: no float8)")


def float8_eligible(module: nn.Module, fqn: str) -> bool:
    """Whether ``module`` (named ``fqn`` in the model) is converted: an ``nn.Linear`` whose dims are both multiples
    of 16 and that is not the output head (``FLOAT8_SKIP``), as torchtitan's float8 converter filters."""
    if not isinstance(module, nn.Linear):
        return False
    if fqn.rsplit(".", 1)[-1] in FLOAT8_SKIP:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_float8_linears(module: nn.Module, recipe: str) -> list[str]:
    """Convert ``module``'s eligible ``nn.Linear`` layers (``float8_eligible``) in place to torchao's
    ``Float8Linear`` with the ``recipe`` ("tensorwise" or "rowwise"); return the converted layers' names.

    Call it before wrapping (``ODCShard(float8=recipe)`` does); it needs torchao (``pip install odcfsdp[fp8]``).
    """
    check_recipe(recipe)
    if recipe is None:
        return []
    if not torchao_installed():
        raise ImportError(f"float8 training needs torchao, which is not installed: {INSTALL_HINT}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = [name for name, m in module.named_modules() if float8_eligible(m, name)]
    if not chosen:
        raise ValueError("float8: the model has no nn.Linear whose dims are multiples of 16 outside the output head; "
                         "there is nothing to convert")
    wanted = set(chosen)
    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda _m, fqn: fqn in wanted)
    return chosen


def prepare_float8(module: nn.Module, recipe: str | None, device: torch.device) -> list[str]:
    """``ODCShard(float8=recipe)``: refuse in one line where float8 cannot run (``float8_problem``), else convert
    ``module``'s linears (``convert_float8_linears``); returns the converted names (none without a recipe)."""
    check_recipe(recipe)
    if recipe is None:
        return []
    problem = float8_problem(device)
    if problem:
        raise RuntimeError(problem)
    return convert_float8_linears(module, recipe)


__all__ = ["FLOAT8_RECIPES", "FLOAT8_SKIP", "check_recipe", "convert_float8_linears", "float8_eligible",
           "float8_problem", "prepare_float8", "torchao_installed"]
