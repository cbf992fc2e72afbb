"""[sharded-model]: what reads a sharded model as a whole takes a ``fully_shard`` model as it takes an ``ODCShard``: a
sharded checkpoint round trip, the Hugging Face export and ``load_hf`` into a meta-device build (what the docs tell
meta-device users to call), and the memory breakdown; on 2 CPU ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from odcfsdp.launch import spawn
from test_fully_shard import CFG, _close, _micro_batches, _model, _optimizer, _step


def _blocks_then_root(model):
    from odcfsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _script(ckpt: str, hf_dir: str) -> dict:
    from odcfsdp.checkpoint import export_hf, load_checkpoint, load_hf, save_checkpoint
    from odcfsdp.memory import memory_breakdown
    from odcfsdp.models import Llama
    from odcfsdp.sharding.api.sharded_model import sharded

    rank = dist.get_rank()
    model = _blocks_then_root(_model())
    opt, sched = _optimizer(model)
    steps = []
    for step in range(4):
        if step == 2:
            save_checkpoint(ckpt, model, opt, step=step, scheduler=sched)
        steps.append(_step(model, opt, sched, _micro_batches(step, rank, 2), True))
    breakdown = memory_breakdown(model, opt).as_dict()
    export_hf(model, hf_dir)
    fresh = _blocks_then_root(_model())
    fresh_opt, fresh_sched = _optimizer(fresh)
    load_checkpoint(_latest(ckpt), fresh, fresh_opt, scheduler=fresh_sched)
    resumed = [_step(fresh, fresh_opt, fresh_sched, _micro_batches(step, rank, 2), True) for step in range(2, 4)]
    with torch.device("meta"):
        meta = Llama(CFG)
    meta = _blocks_then_root(meta)
    load_hf(meta, hf_dir)
    want = sharded(model).full_state_dict()
    got = sharded(meta).full_state_dict()
    return {"steps": steps, "resumed": resumed, "breakdown": breakdown,
            "hf_equal": all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()}


def _latest(ckpt: str) -> str:
    from odcfsdp.checkpoint import latest_checkpoint

    return str(latest_checkpoint(ckpt))


def test_checkpoints_hf_files_and_the_memory_breakdown_take_a_fully_shard_model(tmp_path):
    out = spawn(_script, 2, str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    for rank in range(2):
        _close(out[rank]["resumed"], out[rank]["steps"][2:])  # the checkpoint resumes exactly
        assert out[rank]["hf_equal"]  # export_hf then load_hf into a meta-device build: the same values
        b = out[rank]["breakdown"]
        assert b["masters"] == 0 and b["rows"] > 0 and b["accumulators"] == b["rows"]  # fp32 model: row = master
        assert 0 <= b["optimizer_state"] - 2 * b["rows"] < 1024  # AdamW's two moments a master element, and steps


def test_sharded_refuses_a_model_odcfsdp_did_not_shard():
    from odcfsdp.sharding.api.sharded_model import sharded

    with pytest.raises(TypeError, match="^expected a model sharded by odcfsdp .* got Linear$"):
        sharded(torch.nn.Linear(2, 2))
