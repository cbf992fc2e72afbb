"""Leftovers of saves and write failures (issue 44, item 6): a checkpoint write that fails names its file, and the
partial (``.tmp-``) and abandoned (``.abandoned-``) directories that saves leave are removed at the next start of the
run, with one note (odcfsdp/checkpoint/sweep.py). Subprocesses with bounded time, exit codes asserted."""

from __future__ import annotations

import errno
import json
import re
import resource
import shutil

import pytest

from odcfsdp.checkpoint.files import naming, write_json_durably
from odcfsdp.checkpoint.sweep import leftovers, sweep_leftovers, sweep_note
from odcfsdp.checkpoint.verify import verify_checkpoint

from warm_cli import cli


def _step(directory, name: str, complete: bool = True):
    path = directory / name
    path.mkdir()
    (path / "rank00000.safetensors").write_bytes(b"x")
    if complete:
        (path / "manifest.json").write_text("{}")
    return path


def test_partial_abandoned_and_superseded_saves_are_swept_and_nothing_else(tmp_path):
    """Swept: a killed save's .tmp-, a rollback's .abandoned-, a re-save's .old- copy of a complete step. Kept: the
    checkpoints, an .old- copy that is its step's only one, the directory the run resumes from, other files."""
    for name in ("step_00000001", "step_00000004.old-0a0b", "step_00000007.abandoned-77aa"):
        _step(tmp_path, name)
    (tmp_path / "notes.txt").write_text("mine")
    swept = [_step(tmp_path, "step_00000002.tmp-1234abcd", complete=False).name,
             _step(tmp_path, "step_00000003.abandoned-deadbeef").name,
             _step(tmp_path, "step_00000001.old-5e5e").name]
    resumed = tmp_path / "step_00000007.abandoned-77aa"
    assert [p.name for p in leftovers(tmp_path)] == sorted(swept + [resumed.name])
    removed = sweep_leftovers(tmp_path, keep=resumed)
    assert removed == sorted(swept)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt", "step_00000001", "step_00000004.old-0a0b", "step_00000007.abandoned-77aa"]
    assert sweep_note(tmp_path, removed) == (f"note: removed 3 leftovers of unfinished or rolled-back saves from "
                                             f"{tmp_path}: {', '.join(removed)}")
    assert sweep_note(tmp_path, []) is None and sweep_leftovers(tmp_path / "none") == []


def test_a_write_that_fails_names_its_file(tmp_path):
    """safetensors' I/O error names no file, nor does a failed write of the manifest on a full disk (/dev/full
    refuses every write with ENOSPC): both are OSErrors naming it."""
    from safetensors import SafetensorError

    with pytest.raises(OSError) as e, naming(tmp_path / "rank00000.safetensors"):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "rank00000.safetensors")
    (tmp_path / "manifest.json.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '.*/manifest\.json\.tmp'"):
        write_json_durably(tmp_path / "manifest.json", {"step": 1})
    with pytest.raises(ValueError, match="not an I/O error"), naming(tmp_path / "x"):
        raise ValueError("not an I/O error")  # anything else passes unchanged


def _file_size_limit(limit: int):
    """A preexec_fn: files this process and its children write stop at ``limit`` bytes (EFBIG past it, as a full
    disk would stop them; Python ignores the SIGXFSZ that comes with it)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_failed_save_names_its_file_and_the_next_start_sweeps_its_leftovers(tmp_path):
    """The run's 800 KB rank files meet a 256 KB file-size limit at step 3's save: exit code 1, one error line naming
    the rank file (it named none); the earlier checkpoints stay whole. Each start removes what the saves before it
    left, with one note: a rollback's abandoned copy, then the failed save's partial one; the last resumes from step
    2 and trains to the end. (The collective transport:
    the shm transport's heap file would meet the limit first.)"""
    import subprocess
    import sys

    common = ["run.out_dir=run", "checkpoint.interval=1", "shard.comm=collective", "balance.kind=lb_micro",
              "data.batch_size=4"]
    first = cli("run.steps=2", *common, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    ck = tmp_path / "run" / "checkpoints"
    shutil.copytree(ck / "step_00000001", ck / "step_00000009.abandoned-0badcafe")  # as a rollback leaves it
    limited = subprocess.run([sys.executable, "-m", "odcfsdp.train", "run.steps=4", "checkpoint.resume=auto", *common],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             preexec_fn=_file_size_limit(256 << 10))
    errors = [line for line in limited.stderr.splitlines() if line.startswith("error:")]
    assert limited.returncode == 1 and len(errors) == 1, limited.stderr[-3000:]
    assert ("note: removed 1 leftover of unfinished or rolled-back saves from run/checkpoints: "
            "step_00000009.abandoned-0badcafe") in limited.stderr.splitlines()
    assert re.search(r"OSError: \[Errno 27\] File too large: 'run/checkpoints/step_00000003\.tmp-[0-9a-f]{8}/"
                     r"rank0000[01]\.safetensors'", errors[0]), errors
    for step in (1, 2):
        assert verify_checkpoint(ck / f"step_{step:08d}")["step"] == step  # nothing of the run lost
    (partial,) = ck.glob("step_00000003.tmp-*")
    again = cli("run.steps=4", "checkpoint.resume=auto", *common, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    notes = [line for line in again.stderr.splitlines() if line.startswith("note: removed")]
    assert notes == [f"note: removed 1 leftover of unfinished or rolled-back saves from run/checkpoints: "
                     f"{partial.name}"], again.stderr[-2000:]
    assert "resumed from run/checkpoints/step_00000002 at step 2" in again.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000002", "step_00000003", "step_00000004"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
