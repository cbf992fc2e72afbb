"""Checkpoints that must never be written or read (issue 32): non-finite state is not saved ([sharded] step 1), and
a manifest or rank file that do not belong together is refused ([bound-files] in odcfsdp/checkpoint/manifest.py)."""

from __future__ import annotations

import json
import shutil
import zlib

import pytest
import torch.distributed as dist

from odcfsdp.checkpoint import CheckpointError, NonFiniteStateError, list_checkpoints, load_checkpoint, save_checkpoint
from odcfsdp.launch import spawn

from checkpoint_state import build, save_outcome, train_steps


def test_an_update_that_made_weights_non_finite_is_not_saved(tmp_path):
    """lr=inf passes the gradient-norm guard (the norm is finite) and makes the weights non-finite: the save is
    refused naming a parameter, and nothing is written; a finite model saves."""
    model, opt = build()
    train_steps(model, opt, 1)
    save_checkpoint(tmp_path, model, opt, step=1)
    for group in opt.param_groups:
        group["lr"] = float("inf")
    train_steps(model, opt, 1)
    with pytest.raises(NonFiniteStateError, match=r"not saving step 2: \d+ non-finite values .* \(first: \S+"):
        save_checkpoint(tmp_path, model, opt, step=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # no .tmp- left either


def _nan_in_rank_1s_optimizer_state(path: str) -> str:
    model, opt = build()
    train_steps(model, opt, 1)
    if dist.get_rank() == 1:
        state = next(s for s in opt.state.values() if s["exp_avg"].to_local().numel())
        state["exp_avg"].to_local().view(-1)[0] = float("nan")
    return save_outcome(path, model, opt, NonFiniteStateError)


def test_non_finite_optimizer_state_on_one_rank_stops_every_rank(tmp_path):
    messages = spawn(_nan_in_rank_1s_optimizer_state, 2, str(tmp_path), timeout=120)
    assert messages[0] == messages[1] and "1 non-finite values" in messages[0] and "(exp_avg) on rank 1" in messages[0]
    assert not list_checkpoints(tmp_path)


def _save_steps_1_and_2(path: str) -> None:
    model, opt = build()
    for step in (1, 2):
        train_steps(model, opt, 1, seed=step)
        save_checkpoint(path, model, opt, step=step)


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bound")
    spawn(_save_steps_1_and_2, 2, str(root), timeout=120)
    return root


def _edited(root, tmp_path, edit) -> object:
    """A copy of the 2-rank step 1 checkpoint, edited by ``edit(dir, manifest)``; the manifest written back."""
    path = tmp_path / "step_00000001"
    shutil.copytree(root / "step_00000001", path)
    manifest = json.loads((path / "manifest.json").read_text())
    edit(path, manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def _other_steps_file_with_its_crc(path, manifest):
    other = path.parent.parent / "bound_src_step2"
    shutil.copy(other / "rank00001.safetensors", path / "rank00001.safetensors")
    entry = next(f for f in manifest["files"] if f["file"] == "rank00001.safetensors")
    data = (path / "rank00001.safetensors").read_bytes()
    entry.update(bytes=len(data), crc32=zlib.crc32(data))


EDITS = {  # issue 32's three edits that resumed silently with a jump in the loss
    "world_size": (lambda p, m: m.update(world_size=1), "lists 2 rank files for world_size 1"),
    "world_size_and_files": (lambda p, m: m.update(world_size=1, files=m["files"][:1]),
                             "rank00000.safetensors: written with world_size '2', but the manifest says '1'"),
    "segs": (lambda p, m: [q.update(seg=q["seg"] + 1) for q in m["params"]],
             "rank00000.safetensors: written with parameter plan"),
    "file_of_another_step": (_other_steps_file_with_its_crc,
                             "rank00001.safetensors: written with step '2', but the manifest says '1'"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_manifest_and_files_that_do_not_belong_together_are_refused(two_rank_checkpoints, tmp_path, edit):
    shutil.copytree(two_rank_checkpoints / "step_00000002", tmp_path / "bound_src_step2")
    fn, message = EDITS[edit]
    (tmp_path / "edited").mkdir()
    path = _edited(two_rank_checkpoints, tmp_path / "edited", fn)
    model, opt = build()  # one process reads the 2-rank checkpoint (resharding 2 -> 1)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, model, opt)


def test_the_untouched_two_rank_checkpoint_loads(two_rank_checkpoints):
    model, opt = build()
    manifest = load_checkpoint(two_rank_checkpoints / "step_00000001", model, opt)
    assert manifest["version"] == 3 and manifest["world_size"] == 2


# -- a damaged checkpoint names the one to resume from (issue 44, item 6) --------------------------------------------
def _flip_a_byte(file) -> None:
    data = bytearray(file.read_bytes())
    data[-100] ^= 0x40  # one bit of one value, size and header unchanged: only the checksum tells
    file.write_bytes(bytes(data))


def test_the_newest_intact_checkpoint_before_a_damaged_one_is_named(two_rank_checkpoints, tmp_path):
    from odcfsdp.checkpoint.verify import newest_intact, resume_instead, verify_checkpoint

    for step in ("step_00000001", "step_00000002"):
        shutil.copytree(two_rank_checkpoints / step, tmp_path / step)
    assert resume_instead(tmp_path / "step_00000002") == ""  # whole: what failed was not the files
    _flip_a_byte(tmp_path / "step_00000002" / "rank00001.safetensors")
    with pytest.raises(CheckpointError, match="rank00001.safetensors: checksum mismatch"):
        verify_checkpoint(tmp_path / "step_00000002")
    assert newest_intact(tmp_path) == tmp_path / "step_00000001"
    assert resume_instead(tmp_path / "step_00000002") == (
        f"; the newest intact checkpoint before it is {tmp_path / 'step_00000001'}: resume from it with "
        f"checkpoint.resume={tmp_path / 'step_00000001'}")
    (tmp_path / "step_00000001" / "rank00000.safetensors").unlink()
    assert newest_intact(tmp_path) is None
    assert resume_instead(tmp_path / "step_00000002") == (
        f"; no complete checkpoint before it in {tmp_path} is intact: start again with run.overwrite=true (or "
        "another run.out_dir)")


def test_resuming_a_damaged_checkpoint_names_the_newest_intact_one(tmp_path):
    """A flipped byte in the newest checkpoint: checkpoint.resume=auto exits with code 1 and one error line naming the
    file and checkpoint.resume=<the newest intact checkpoint before it>, writing nothing; resuming from there trains
    to the end."""
    from warm_cli import cli

    common = ["run.out_dir=run", "checkpoint.interval=2"]
    first = cli("run.steps=4", *common, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    _flip_a_byte(tmp_path / "run" / "checkpoints" / "step_00000004" / "rank00001.safetensors")
    damaged = cli("run.steps=6", "checkpoint.resume=auto", *common, cwd=tmp_path, timeout=300)
    errors = [line for line in damaged.stderr.splitlines() if line.startswith("error:")]
    assert damaged.returncode == 1 and len(errors) == 1, damaged.stderr[-3000:]
    assert "run/checkpoints/step_00000004/rank00001.safetensors: checksum mismatch (the file was altered or " \
           "corrupted); the newest intact checkpoint before it is run/checkpoints/step_00000002: resume from it " \
           "with checkpoint.resume=run/checkpoints/step_00000002 (traceback in run/error.log)" in errors[0], errors
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # nothing of the run lost
    again = cli("run.steps=6", "checkpoint.resume=run/checkpoints/step_00000002", *common, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
