"""Issue 35 part 2, the float8 gather's edges ([float8-gather] in odcfsdp/sharding/groups/float8.py): checkpoints, gather_masters,
the switch and rowwise layers in one process, ranks at different meetings, frozen weights, HSDP, and the default's
cost for models without float8. On CPU, against the same references as tests/test_float8_gather.py (whose helpers
these use): one plain process, and what a checkpoint holds.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from odcfsdp.launch import spawn
from odcfsdp.sharding.groups import float8
from odcfsdp.sharding.groups.float8_rows import FLOAT8_DTYPE
from test_float8 import _batches, _float8_llama, _train
from test_float8_gather import FLOAT8_WEIGHTS, TOKENS, _check_casts, _sharded

pytest.importorskip("torchao")


def _checkpoint_round_trip(path: str, meta: bool) -> bool:
    from safetensors.torch import load_file

    from odcfsdp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    model = _sharded("shm")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, [[step[rank]] for step in _batches(2, steps=2)], TOKENS)
    save_checkpoint(path, model, opt, step=2)
    saved = load_file(latest_checkpoint(path) / f"rank{rank:05d}.safetensors")
    assert all(t.dtype != FLOAT8_DTYPE for t in saved.values())  # masters, not rows
    x = _batches(2, steps=1)[0][rank][:, :-1]
    with torch.no_grad():
        before = model(x)
    fresh = _sharded("shm", seed=7, meta=meta)  # other values, or none (zero rows): all replaced by the load
    load_checkpoint(latest_checkpoint(path), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    with torch.no_grad():
        after = fresh(x)
    same = torch.equal(before, after) and torch.equal(model.engine.late.scales, fresh.engine.late.scales)
    assert _check_casts(fresh) == FLOAT8_WEIGHTS
    model.close()
    fresh.close()
    return same


@pytest.mark.parametrize("meta", [False, True])
def test_a_float8_gather_model_saves_masters_and_loads_its_casts_back(tmp_path, meta):
    """Checkpoints hold the fp32 masters; loading them into a model of other values (or none: built on the meta
    device) recasts its float8 rows (the load's change meeting carries the amaxes): the same scales, the same
    outputs to the bit."""
    assert spawn(_checkpoint_round_trip, 2, str(tmp_path / "ckpt"), meta, timeout=300) == [True, True]


def _casts_with_gather_masters() -> int:
    model = _sharded("shm", gather_masters=True)  # the other groups' rows are their fp32 masters; float8 rows not
    assert all(model.transport.rows[lay.index].dtype == (lay.row_dtype or torch.float32)
               for lay in model.layouts)
    _train(model, [[step[dist.get_rank()]] for step in _batches(2, steps=2)], TOKENS)
    checked = _check_casts(model)
    model.close()
    return checked


def test_gather_masters_keeps_float8_rows_apart_from_the_masters():
    """With ``gather_masters`` the float8 groups still keep a float8 row next to their fp32 master, cast as ever."""
    assert spawn(_casts_with_gather_masters, 2, timeout=300) == [FLOAT8_WEIGHTS] * 2


def test_rowwise_layers_and_the_switch_off_gather_param_dtype_in_one_process():
    """One process, no process group: rowwise float8 layers, or tensorwise ones with ``float8_gather=False``, plan
    no float8 group; tensorwise with the switch on trains as the plain float8 model does, to the bit. A switch that is
    not a bool is refused in one line, before the model is converted."""
    from odcfsdp import ODCShard

    with mock.patch.object(float8, "float8_problem", return_value=None):
        rowwise = ODCShard(_float8_llama(None), float8="rowwise", comm="shm", float8_gather=True)
        off = ODCShard(_float8_llama(None), float8="tensorwise", comm="shm", float8_gather=False)
        llama = _float8_llama(None)
        weights = {n: p for n, p in llama.named_parameters() if n.endswith("proj.weight")}  # a user's references
        on = ODCShard(llama, float8="tensorwise", comm="shm")  # the default: float8_gather=True
        model = _float8_llama(None)
        with pytest.raises(TypeError, match=r"^float8_gather must be True or False, got 'yes'$"):
            ODCShard(model, float8="tensorwise", float8_gather="yes")
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    assert not any(lay.row_dtype for lay in rowwise.layouts) and not any(lay.row_dtype for lay in off.layouts)
    assert sum(len(lay.slots) for lay in on.layouts if lay.row_dtype == FLOAT8_DTYPE) == FLOAT8_WEIGHTS
    # the float8 weights' original parameters no longer hold their full values (the masters do): at 8B on 2 GPUs
    # they were 26 GiB a rank, kept alive by the sharded parameter's reference
    assert len(weights) == FLOAT8_WEIGHTS and all(p.untyped_storage().nbytes() == 0 for p in weights.values())
    batches = [[torch.cat(step)] for step in _batches(2)]  # both ranks' micro-batches as one
    assert _train(on, batches, TOKENS) == _train(_float8_llama("tensorwise"), batches, TOKENS)
    for m in (rowwise, off, on):
        m.close()


def _meet_apart() -> str:
    from odcfsdp.sharding.placement.meetings import Meeting

    model = _sharded("shm")
    try:
        if dist.get_rank() == 0:
            model.minibatch.meet(Meeting.SYNC)  # reads .grad while rank 1 finishes its step
        else:
            model.minibatch.meet_carrying(Meeting.FINISH, model.engine.late.amaxes(torch.device("cpu")))
    except RuntimeError as e:
        return str(e)
    finally:
        model.close()
    return "no error"


def test_ranks_at_different_meetings_get_the_disagreement_error_not_a_hang():
    """A sync carries no amaxes but has the finish's row length (zeros), so ranks at different meetings read one
    table and raise the same one-line error, as without float8."""
    errors = spawn(_meet_apart, 2, timeout=120)
    assert errors[0] == errors[1] and errors[0].startswith("ranks disagree about the minibatch (rank 0: sync of "
                                                           "minibatch 0"), errors


def test_frozen_float8_weights_are_gathered_in_float8_too():
    """One process: the attention weights frozen (requires_grad off before wrapping) are planned into float8 groups of
    their own, without accumulators, and cast as the trained ones: training equals the plain float8 model's to the
    bit, and the frozen weights do not move."""
    from odcfsdp import ODCShard

    def frozen(model):
        for name, p in model.named_parameters():
            p.requires_grad_(".self_attn." not in name)
        return model

    with mock.patch.object(float8, "float8_problem", return_value=None):
        model = ODCShard(frozen(_float8_llama(None)), float8="tensorwise", comm="shm", float8_gather=True)
    cold = [lay for lay in model.layouts if lay.row_dtype == FLOAT8_DTYPE and not lay.requires_grad]
    assert sum(len(lay.slots) for lay in cold) == 2 * 4 and all(model.transport.accumulators[lay.index] is None
                                                                for lay in cold)
    before = {n: v.clone() for n, v in model.full_state_dict().items() if ".self_attn." in n}
    batches = [[torch.cat(step)] for step in _batches(2)]
    reference = frozen(_float8_llama("tensorwise"))
    assert _train(model, batches, TOKENS) == _train(reference, batches, TOKENS)
    after = model.full_state_dict()
    assert before and all(torch.equal(v, after[n]) for n, v in before.items())
    model.close()


def _train_hsdp(batches, tokens: int) -> tuple[list[float], int]:
    from odcfsdp.sharding.placement.hsdp import hybrid_mesh

    model = _sharded("shm", mesh=hybrid_mesh(2, "cpu"))  # 2 replicas of 2 shards: amaxes meet within a shard group
    losses = _train(model, [[step[dist.get_rank()]] for step in batches], tokens)
    checked = _check_casts(model)
    model.close()
    return losses, checked


def test_hsdp_replicas_cast_alike_and_train_like_one_process():
    """HSDP on 4 ranks (2 replicas x 2 shards): each shard group's meeting carries its amaxes, the replicas' masters
    are equal, so every replica casts the same bytes; the losses match one process on the 4 micro-batches (the
    gradient sums run in another order: 1e-6), and every weight is torchao's cast of the whole weight."""
    batches, tokens = _batches(4), 4 * 16 * 2
    reference = _train(_float8_llama("tensorwise"), batches, tokens)
    results = spawn(_train_hsdp, 4, batches, tokens, timeout=300)
    assert [checked for _, checked in results] == [FLOAT8_WEIGHTS] * 4
    sharded = [sum(step) for step in zip(*(losses for losses, _ in results))]
    assert max(abs(a - b) / b for a, b in zip(sharded, reference)) < 1e-6, (sharded, reference)


def test_a_model_without_float8_never_imports_torchao():
    """The float8 gather is on by default, yet a model with no ``Float8Linear`` must not pay torchao's import (slow,
    and its warnings land on every run's stderr): checked in a fresh interpreter, where nothing imported it yet."""
    import subprocess
    import sys

    code = ("import sys, torch; from odcfsdp import ODCShard; "
            "m = ODCShard(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)), comm='shm'); "
            "m.close(); print(sorted(k for k in sys.modules if k.startswith('torchao')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]" and "torchao" not in out.stderr, (out.stdout, out.stderr[-2000:])
