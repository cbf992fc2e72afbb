"""Issue 35 part 2: the float8 parameter gather with tensorwise scaling ([float8-gather] in odcfsdp/sharding/groups/float8.py).

On 2 CPU ranks (torch's CPU ``_scaled_mm`` takes tensorwise scales), test_float8's Llama whose linears are torchao's
tensorwise ``Float8Linear``s, under ``ODCShard(float8="tensorwise", float8_gather=True)`` over ``shm`` and
``collective``, against independent references: one plain process running the same float8 model, torchao + FSDP2 with
torchao's float8 all-gather on 2 gloo ranks, and torchao's own cast of each whole weight (a scale's closed form).
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from odcfsdp.launch import spawn
from odcfsdp.sharding.groups import float8
from odcfsdp.sharding.groups.float8_rows import FLOAT8_DTYPE
from odcfsdp.sharding.placement.layout import plan_groups
from test_float8 import CONFIG, _batches, _float8_llama, _train

pytest.importorskip("torchao")

FLOAT8_WEIGHTS = 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers; not the head
TOKENS = 2 * 16 * 2  # the target tokens of a step's two micro-batches (one per rank)
GATHERS = ("all_gather_single", "all_gather_into_tensor")  # torch >= 2.13's name, and the older one


def _sharded(comm: str, float8_gather: bool = True, seed: int = 0, meta: bool = False, **kwargs):
    from odcfsdp import ODCShard
    from odcfsdp.models import Llama, LlamaConfig

    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        llama = Llama(LlamaConfig(**CONFIG))
    with mock.patch.object(float8, "float8_problem", return_value=None):  # the GPU check lifted: CPU float8 runs
        model = ODCShard(llama, float8="tensorwise", comm=comm, float8_gather=float8_gather,
                         device="cpu" if meta else None, **kwargs)
    model.set_gradient_divide_factor(1.0)  # the losses are per global token: the sum over ranks is the gradient
    return model


def _train_sharded(comm: str, batches) -> list[float]:
    model = _sharded(comm)
    assert sum(len(lay.slots) for lay in model.layouts if lay.row_dtype == FLOAT8_DTYPE) == FLOAT8_WEIGHTS
    rank = dist.get_rank()
    losses = _train(model, [[step[rank]] for step in batches], TOKENS)
    model.close()
    return losses


@contextlib.contextmanager
def _float8_as_bytes_on_gloo():
    """gloo has no float8 dtype: FSDP2's float8 all-gather crosses as bytes (the same bytes NCCL moves)."""
    originals = {n: getattr(dist, n) for n in GATHERS if hasattr(dist, n)}

    def wrap(fn):
        def gather(out, inp, *args, **kwargs):
            if out.dtype == FLOAT8_DTYPE:
                out, inp = out.view(torch.uint8), inp.view(torch.uint8)
            return fn(out, inp, *args, **kwargs)
        return gather

    for n, fn in originals.items():
        setattr(dist, n, wrap(fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def _train_fsdp2(batches) -> list[float]:
    """torchtitan's float8 under FSDP2: torchao's tensorwise conversion (the same layers) with
    ``enable_fsdp_float8_all_gather``, ``fully_shard`` per layer and the root (fp32), the scales precomputed after
    every step (``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce of the amaxes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    from odcfsdp.models import causal_lm_loss
    from odcfsdp.models.llama import DecoderLayer
    from odcfsdp.sharding.groups.float8 import float8_eligible

    model = _float8_llama(None)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=float8_eligible)
    mesh = init_device_mesh("cpu", (2,))
    for layer in [m for m in model.modules() if isinstance(m, DecoderLayer)]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    rank, losses = dist.get_rank(), []
    with _float8_as_bytes_on_gloo():
        for step in batches:
            seq = step[rank]
            loss = causal_lm_loss(model(seq[:, :-1]), seq[:, 1:], TOKENS)
            # FSDP2 divides the summed gradients by the 2 ranks (a divide factor of 1 is a PREMUL_SUM, which gloo
            # lacks): twice the loss gives the sum, exactly (powers of two; float8's tensorwise casts scale alike)
            (2 * loss).backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            precompute_float8_dynamic_scale_for_fsdp(model)
    return losses


def test_float8_gather_trains_like_one_process_and_like_fsdp2_float8_all_gather():
    """Every float8 weight is cast by its owner with the scale of the whole weight's amax (over both ranks), as one
    process casts it and as FSDP2's float8 all-gather does: the same float8 bytes in every matmul, so the losses of 3
    steps agree to the bit, over shm and collective alike; the model without float8 is far off (float8 runs)."""
    batches = _batches(2)
    one_process = _train(_float8_llama("tensorwise"), batches, TOKENS)
    plain = _train(_float8_llama(None), batches, TOKENS)
    fsdp2 = [a + b for a, b in zip(*spawn(_train_fsdp2, 2, batches, timeout=300))]
    for comm in ("shm", "collective"):
        sharded = [a + b for a, b in zip(*spawn(_train_sharded, 2, comm, batches, timeout=300))]
        assert sharded == one_process, (comm, sharded, one_process)
        assert sharded == fsdp2, (comm, sharded, fsdp2)
    assert max(abs(a - b) / b for a, b in zip(plain, one_process)) > 1e-4, (plain, one_process)


def _check_casts(model) -> int:
    """Each float8 weight's gathered bytes and scale against torchao's own cast of the whole fp32 weight
    (``hp_tensor_to_float8_dynamic``: amax over the weight, ``finfo.max / amax``); returns how many were checked."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    linears = model.engine.late.linears
    full = {name: linears[name].weight.full_tensor() for name in linears}  # every rank's fp32 master slices
    checked = 0
    with model.engine.unsharded():
        for name, linear in linears.items():
            weight = linear.weight
            assert isinstance(weight, Float8TrainingTensor) and weight._data.dtype == FLOAT8_DTYPE, name
            expected = hp_tensor_to_float8_dynamic(full[name], FLOAT8_DTYPE, linear.linear_mm_config,
                                                   gemm_input_role=GemmInputRole.WEIGHT)
            assert torch.equal(weight._scale, expected._scale), name
            assert torch.equal(weight._data.view(torch.uint8), expected._data.view(torch.uint8)), name
            checked += 1
    return checked


def _casts_at_construction_and_after_steps(comm: str) -> list[int]:
    model = _sharded(comm)
    counts = [_check_casts(model)]
    _train(model, [[step[dist.get_rank()]] for step in _batches(2, steps=2)], TOKENS)
    counts.append(_check_casts(model))
    model.close()
    return counts


@pytest.mark.parametrize("comm", ["shm", "collective"])
def test_the_gathered_weights_are_torchaos_casts_of_the_whole_weights(comm):
    """After construction and after 2 steps (the masters moved): every float8 weight is a ``Float8TrainingTensor``
    whose bytes and scale are torchao's cast of the whole fp32 weight, although each owner cast only its rows."""
    assert spawn(_casts_at_construction_and_after_steps, 2, comm, timeout=300) == [[FLOAT8_WEIGHTS] * 2] * 2


def _step_collectives(comm: str, float8_gather: bool) -> list[tuple[str, torch.dtype, int]]:
    """The collectives of ``opt.step()`` (the finish, [lifecycle] 10): name, dtype and elements of the input."""
    model = _sharded(comm, float8_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _batches(2, steps=1)[0]
    calls = []
    names = [n for n in (*GATHERS, "all_reduce", "barrier", "broadcast", "all_gather", "reduce_scatter_tensor")
             if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def wrap(n, fn):
        def call(*args, **kwargs):
            t = args[1] if n in GATHERS else args[0] if args else None
            calls.append((n, t.dtype, t.numel()) if isinstance(t, torch.Tensor) else (n, None, 0))
            return fn(*args, **kwargs)
        return call

    from odcfsdp.models import causal_lm_loss

    seq = step[dist.get_rank()]
    causal_lm_loss(model(seq[:, :-1]), seq[:, 1:], TOKENS).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the sync meeting, and the norm's all-reduce
    for n, fn in originals.items():
        setattr(dist, n, wrap(n, fn))
    try:
        opt.step()
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    model.close()
    return calls


@pytest.mark.parametrize("comm", ["shm", "collective"])
def test_the_amaxes_ride_the_finish_meeting(comm):
    """The step's finish is one meeting, with float8 gathers as without: its one all-gather carries the 4 counts and
    the 14 amaxes, in float64, and no collective reduces the amaxes. Where peers read rows one-sidedly (shm) one
    1-element all-reduce orders the owners' casts before any gather ([streams] 6); collective needs none."""
    with_float8, without = spawn(_step_collectives, 2, comm, True, timeout=300)[0], \
        spawn(_step_collectives, 2, comm, False, timeout=300)[0]
    meeting = [c for c in with_float8 if c[0] in GATHERS]
    assert meeting == [(meeting[0][0], torch.float64, 4 + FLOAT8_WEIGHTS)], with_float8
    assert [c for c in without if c[0] in GATHERS] == [(meeting[0][0], torch.float64, 4)], without
    ordering = [c for c in with_float8 if c[0] not in GATHERS]
    assert ordering == ([("all_reduce", torch.float32, 1)] if comm == "shm" else []), with_float8
    assert [c for c in without if c[0] not in GATHERS] == []


def _forward_gather_bytes(float8_gather: bool) -> tuple[int, int, list[int], int]:
    """The bytes a forward all-gathers (collective transport, bf16 parameters): (float8 bytes, other bytes), the
    float8 groups' row element sizes, and the elements of the converted linears' weights."""
    model = _sharded("collective", float8_gather, param_dtype=torch.bfloat16)
    sizes = [model.transport.rows[lay.index].element_size() for lay in model.layouts if lay.row_dtype == FLOAT8_DTYPE]
    weights = sum(model.module.get_submodule(name).weight.numel() for name in model.float8_linears)
    moved = {torch.uint8: 0, torch.bfloat16: 0}
    name = next(n for n in GATHERS if hasattr(dist, n))
    original = getattr(dist, name)

    def gather(out, inp, *args, **kwargs):
        moved[inp.dtype] += out.numel() * out.element_size()
        return original(out, inp, *args, **kwargs)

    with mock.patch.object(dist, name, gather), torch.no_grad():
        model(_batches(2, steps=1)[0][dist.get_rank()][:, :-1])
    model.close()
    return moved[torch.uint8], moved[torch.bfloat16], sizes, weights


def test_a_float8_weight_gathers_half_of_bf16s_bytes():
    """A forward's all-gathers of the float8 weights move 1 byte a parameter (uint8 views of float8 rows), exactly
    half of what the same weights cost gathered in bf16; the other parameters move the same bf16 bytes."""
    f8_bytes, other, sizes, weights = spawn(_forward_gather_bytes, 2, True, timeout=300)[0]
    zero, bf16_bytes, none, _ = spawn(_forward_gather_bytes, 2, False, timeout=300)[0]
    assert sizes == [1] * 4 and none == [] and zero == 0  # 2 float8 groups a layer: attention, feed-forward
    assert f8_bytes == weights and bf16_bytes - other == 2 * f8_bytes, (f8_bytes, other, bf16_bytes)


def test_float8_weights_plan_into_groups_of_their_own_counted_at_one_byte():
    """``plan_groups``: a float8 weight never shares a group with another kind of parameter, and its bytes count
    at 1 a parameter against ``group_bytes`` (two 64x64 weights fill 8 KiB in float8; in bf16 one would)."""
    ps = [("a.weight", torch.zeros(64, 64)), ("b.weight", torch.zeros(64, 64)), ("norm", torch.zeros(64)),
          ("c.weight", torch.zeros(64, 64))]
    names = frozenset({"a.weight", "b.weight", "c.weight"})
    layouts = plan_groups(ps, 2, 8192, torch.bfloat16, own_rows=dict.fromkeys(names, FLOAT8_DTYPE))
    assert [([s.name for s in lay.slots], lay.row_dtype == FLOAT8_DTYPE) for lay in layouts] == [
        (["a.weight", "b.weight"], True), (["norm"], False), (["c.weight"], True)]
    in_bf16 = plan_groups(ps, 2, 8192, torch.bfloat16)  # 8 KiB a weight: each fills a group
    assert [[s.name for s in lay.slots] for lay in in_bf16] == [["a.weight"], ["b.weight"], ["norm"], ["c.weight"]]
    assert layouts[0].row_len == 2 * 64 * 32  # each rank holds 32 rows of each; 1 byte an element is 16-aligned
