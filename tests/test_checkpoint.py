"""Sharded checkpoints: exact resume, resharding N -> M, HF export/import, and faults that must not load silently."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from odcfsdp import ODCShard
from odcfsdp.checkpoint import (
    CheckpointError, export_hf, latest_checkpoint, list_checkpoints, load_checkpoint, load_hf, save_checkpoint,
)
from odcfsdp.launch import spawn
from odcfsdp.models import Llama, LlamaConfig
from test_train import run_ranks

from checkpoint_state import CFG, assert_same_state, build, full_state, save_outcome, train_steps


# -- exact resume --------------------------------------------------------------------------------
def test_resume_continues_exactly_like_the_uninterrupted_run(tmp_path):
    """Collective transport (deterministic sums): losses and final state bit for bit."""
    base = {"run": {"steps": 6, "seed": 2}, "balance": {"kind": "lb_micro"}, "shard": {"comm": "collective"},
            "data": {"batch_size": 8, "micro_batch_tokens": 256, "lengths": {"max_len": 200}},
            "checkpoint": {"interval": 3}}
    whole = run_ranks(base, tmp_path / "whole")
    run_ranks({**base, "run": {**base["run"], "stop_after": 3}}, tmp_path / "cut")  # "preempted" after step 3
    assert [p.name for p in list_checkpoints(tmp_path / "cut" / "checkpoints")] == ["step_00000003"]
    rest = run_ranks({**base, "checkpoint": {"interval": 3, "resume": "auto"}}, tmp_path / "cut")
    assert [r["step"] for r in rest] == [4, 5, 6]
    assert [r["loss"] for r in rest] == [r["loss"] for r in whole[3:]]
    assert [r["grad_norm"] for r in rest] == [r["grad_norm"] for r in whole[3:]]
    merged = [json.loads(x)["step"] for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert merged == [1, 2, 3, 4, 5, 6]
    for rank in range(2):
        a = load_file(tmp_path / "whole" / "checkpoints" / "step_00000006" / f"rank{rank:05d}.safetensors")
        b = load_file(tmp_path / "cut" / "checkpoints" / "step_00000006" / f"rank{rank:05d}.safetensors")
        assert a.keys() == b.keys()
        for k in a:
            if not k.startswith("__rng__"):
                assert torch.equal(a[k], b[k]), k


# -- resharding ----------------------------------------------------------------------------------
def _train_and_save(path: str, group_bytes: int) -> dict:
    model, opt = build(group_bytes=group_bytes)
    train_steps(model, opt, 2)
    save_checkpoint(path, model, opt, step=2)
    return full_state(model, opt)


def _load(path: str, group_bytes: int) -> dict:
    model, opt = build(group_bytes=group_bytes, seed=123)  # different initial values, all overwritten
    manifest = load_checkpoint(latest_checkpoint(path), model, opt)
    out = full_state(model, opt)
    out["step"] = manifest["step"]
    return out


@pytest.mark.parametrize("n, m, gb_write, gb_read", [(2, 3, 4096, 1 << 20), (3, 1, 4096, 4096), (1, 4, 1 << 20, 2048),
                                                     (2, 2, 4096, 16384)])
def test_reshard_n_to_m_exactly(tmp_path, n, m, gb_write, gb_read):
    written = spawn(_train_and_save, n, str(tmp_path), gb_write)[0]
    for loaded in spawn(_load, m, str(tmp_path), gb_read):
        assert loaded["step"] == 2
        assert_same_state(written, loaded)


def _read_slices_only(path: str) -> list[str]:
    """Which writer files each reader opens: only those holding its slices."""
    import odcfsdp.checkpoint.sharded as sharded

    opened = []
    real = sharded._Files.get

    def spy(self, rank, *replica):
        opened.append(rank)
        return real(self, rank, *replica)

    sharded._Files.get = spy
    model, opt = build()
    load_checkpoint(latest_checkpoint(path), model, opt)
    return sorted(set(opened))


def test_each_reader_opens_only_the_files_it_needs(tmp_path):
    spawn(_train_and_save, 4, str(tmp_path), 4096)
    opened = spawn(_read_slices_only, 2, str(tmp_path))
    # Reader 0 holds each parameter's first half (writers 0-1, a third writer only across a padded
    # boundary); reader 1 the second half. Neither touches the other end.
    assert 0 in opened[0] and 3 not in opened[0]
    assert 3 in opened[1] and 0 not in opened[1]


# -- HF export / import --------------------------------------------------------------------------
def _export(path: str, tied: bool, max_shard_bytes: int) -> dict:
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    model, opt = build(cfg)
    train_steps(model, opt, 1)
    export_hf(model, path, max_shard_bytes=max_shard_bytes)
    x = torch.arange(12).view(2, 6) % cfg.vocab_size
    with torch.no_grad():
        return {"params": model.full_state_dict(), "logits": model(x)}


def test_export_loads_into_the_plain_model(tmp_path):
    want = spawn(_export, 2, str(tmp_path), False, 5 << 30)[0]
    weights = load_file(tmp_path / "model.safetensors")
    plain = Llama(CFG)
    plain.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    with torch.no_grad():
        torch.testing.assert_close(plain(torch.arange(12).view(2, 6) % CFG.vocab_size), want["logits"],
                                   rtol=1e-6, atol=1e-6)


def _import_on_meta(path: str, tied: bool) -> dict:
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_embeddings": tied})
    with torch.device("meta"):
        inner = Llama(cfg)
    model = ODCShard(inner, 4096, comm="shm", device="cpu")
    load_hf(model, path)
    return model.full_state_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_export_with_index_then_meta_import(tmp_path, tied):
    want = spawn(_export, 2, str(tmp_path), tied, 20_000)[0]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3  # really sharded
    assert ("lm_head.weight" in index["weight_map"]) is not tied  # tied weights written once
    for got in spawn(_import_on_meta, 3, str(tmp_path), tied):
        assert got.keys() == want["params"].keys()
        for k in got:
            assert torch.equal(got[k], want["params"][k]), k


def test_export_loads_into_the_hugging_face_class(tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
    want = spawn(_export, 2, str(tmp_path), True, 5 << 30)[0]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.arange(12).view(2, 6) % CFG.vocab_size).logits
    torch.testing.assert_close(got, want["logits"], rtol=1e-5, atol=1e-5)


# -- faults --------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    model, opt = build()
    train_steps(model, opt, 1)
    return save_checkpoint(tmp_path, model, opt, step=1), model, opt


def test_truncated_file_is_named(saved):
    path, model, opt = saved
    file = path / "rank00000.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"rank00000.safetensors: \d+ bytes, the manifest says \d+"):
        load_checkpoint(path, model, opt)


def test_altered_file_is_named(saved):
    path, model, opt = saved
    file = path / "rank00000.safetensors"
    data = bytearray(file.read_bytes())
    data[-100] ^= 0x40  # one bit of one value, size unchanged
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank00000.safetensors: checksum mismatch"):
        load_checkpoint(path, model, opt)


def test_incompatible_manifest_version(saved):
    path, model, opt = saved
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(CheckpointError, match="format version 99 is not supported"):
        load_checkpoint(path, model, opt)


def test_model_that_differs_from_the_manifest(saved):
    path, _, _ = saved
    other, opt = build(LlamaConfig(**{**CFG.__dict__, "ffn_dim": 96}))
    with pytest.raises(CheckpointError, match=r"parameter 'layers.0.mlp.gate_proj.weight' has shape \(108, 40\)"):
        load_checkpoint(path, other, opt)
    deeper, opt = build(LlamaConfig(**{**CFG.__dict__, "n_layers": 3}))
    with pytest.raises(CheckpointError, match="parameter 'layers.2.*' of the model is not in the checkpoint"):
        load_checkpoint(path, deeper, opt)


def test_saving_with_pending_gradients_is_refused(tmp_path):
    model, opt = build()
    model(torch.randint(0, CFG.vocab_size, (1, 4))).sum().backward()
    with pytest.raises(CheckpointError, match="between optimizer steps"):
        save_checkpoint(tmp_path, model, opt, step=1)



def test_optimizer_state_without_the_parameter_shape_is_refused_before_saving(tmp_path):
    """Adafactor keeps row and column factors, which have no shard layout: a clear error, and nothing written."""
    model, _ = build()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    train_steps(model, opt, 1)
    with pytest.raises(CheckpointError, match="Adafactor state 'row_var' of .* element-wise optimizer state only"):
        save_checkpoint(tmp_path / "ckpt", model, opt, step=1)
    assert not (tmp_path / "ckpt").exists()
    save_checkpoint(tmp_path / "ckpt", model, None, step=1)  # the model alone still saves

def test_keep_last_prunes_old_checkpoints(tmp_path):
    model, opt = build()
    for step in range(1, 5):
        train_steps(model, opt, 1)
        save_checkpoint(tmp_path, model, opt, step=step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


KILLED_SAVE = """
import sys, time, torch
import odcfsdp.checkpoint.sharded as sharded
sys.path.insert(0, {tests!r})
from checkpoint_state import build, train_steps
model, opt = build()
train_steps(model, opt, 1)
sharded.save_checkpoint({dir!r}, model, opt, step=1)
real = sharded.save_file
def slow(*args, **kwargs):
    real(*args, **kwargs)
    print("written", flush=True)
    time.sleep(600)  # killed here: the file is on disk, the manifest is not
sharded.save_file = slow
train_steps(model, opt, 1)
sharded.save_checkpoint({dir!r}, model, opt, step=2)
"""


def test_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = KILLED_SAVE.format(tests=str(Path(__file__).parent), dir=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list(tmp_path.glob("step_00000002.tmp-*/rank00000.safetensors"))  # the partial save is there
    assert latest_checkpoint(tmp_path).name == "step_00000001"  # and ignored
    model, opt = build(seed=5)
    assert load_checkpoint(latest_checkpoint(tmp_path), model, opt)["step"] == 1
    save_checkpoint(tmp_path, model, opt, step=2)  # the next save clears the leftovers
    assert not list(tmp_path.glob("*.tmp-*"))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_checkpoint(tmp_path / "step_00000003", model, opt)


def test_rng_state_round_trips(saved):
    path, model, opt = saved
    expected = torch.rand(3)  # what the RNG draws next after the save
    torch.manual_seed(999)
    load_checkpoint(path, model, opt)
    assert torch.equal(torch.rand(3), expected)
    with safe_open(str(path / "rank00000.safetensors"), framework="pt") as f:
        assert "python_random" in f.metadata()


# -- review fixes ----------------------------------------------------------------------------------
def test_rollback_save_is_kept_and_later_steps_move_aside(tmp_path):
    model, opt = build()
    train_steps(model, opt, 1)
    save_checkpoint(tmp_path, model, opt, step=200)
    with pytest.warns(UserWarning, match="moved .*step_00000200.* aside"):
        path = save_checkpoint(tmp_path, model, opt, step=110, keep_last=1)
    assert path.is_dir() and latest_checkpoint(tmp_path) == path
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000110"]
    assert list(tmp_path.glob("step_00000200.abandoned-*"))  # not deleted


def test_a_step_cut_between_its_renames_is_still_listed(tmp_path):
    model, opt = build()
    path = save_checkpoint(tmp_path, model, opt, step=5)
    path.rename(tmp_path / "step_00000005.old-abcd")  # the window between the two renames of a re-save
    (found,) = list_checkpoints(tmp_path)
    assert found.name == "step_00000005.old-abcd"
    assert load_checkpoint(found, model, opt)["step"] == 5


def test_second_export_replaces_the_first(tmp_path):
    model, _ = build()
    export_hf(model, tmp_path, max_shard_bytes=10_000)  # sharded, with an index
    with torch.no_grad():
        for p in model.parameters():  # the parameters are the master shards: changing them changes the model
            p.add_(1.0)
    export_hf(model, tmp_path)  # single file: the index and shards of the first must go
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    fresh, _ = build(seed=9)
    load_hf(fresh, tmp_path)
    want = model.full_state_dict()
    assert all(torch.equal(v, want[k]) for k, v in fresh.full_state_dict().items())
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="both model.safetensors and model.safetensors.index.json"):
        load_hf(fresh, tmp_path)


class WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor([2.0]))  # persistent: part of the model's state

    def forward(self, x):
        return self.lin(x) * self.scale


def test_persistent_buffers_are_saved_and_restored(tmp_path):
    model = ODCShard(WithBuffer())
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path, model, opt, step=1)
    model.module.scale.fill_(-1.0)
    load_checkpoint(path, model, opt)
    assert model.module.scale.item() == 2.0


def test_closed_model_is_freed():
    import gc
    import weakref

    model, opt = build()
    train_steps(model, opt, 1)
    ref = weakref.ref(model)
    model.close()
    del model, opt
    gc.collect()
    assert ref() is None


def _save_with_pending_on_one_rank(path: str) -> str:
    model, opt = build()
    if dist.get_rank() == 1:
        model(torch.randint(0, CFG.vocab_size, (1, 4))).sum().backward()
    return save_outcome(path, model, opt)


def test_pending_gradients_on_one_rank_stop_every_rank(tmp_path):
    for message in spawn(_save_with_pending_on_one_rank, 2, str(tmp_path), timeout=120):
        assert "between optimizer steps" in message
