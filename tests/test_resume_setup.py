"""[resume-setup] in odcfsdp/app/resume_setup.py: a resumed run that changes the model, the data, the optimizer's class
or the seed is refused in one line before any rank starts; a changed hyper-parameter is applied (the optimizer's
state dict used to bring the old one back silently) and said in one note line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from odcfsdp.app.resume_setup import setup_changes
from warm_cli import cli

BASE = ["run.world_size=1", "optim.schedule=cosine", "optim.warmup_steps=1", "checkpoint.interval=2",
        "optim.lr=0.01"]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_changes_are_refused_applied_or_accepted_by_kind():
    saved = {"model": {"size": "tiny", "overrides": {}, "lora": {"r": 0, "alpha": 16.0}},
             "data": {"path": "a.jsonl", "batch_size": 16}, "optim": {"name": "AdamW", "lr": 0.01, "kwargs": {}},
             "run": {"seed": 0, "steps": 60, "epochs": None, "world_size": 2}, "shard": {"prefetch": 1}}
    now = {"model": {"size": "tiny", "overrides": {"n_layers": 3}, "lora": {"r": 0, "alpha": 8.0}},
           "data": {"path": "b.jsonl", "batch_size": 16}, "optim": {"name": "AdamW", "lr": 0.02, "kwargs": {"eps": 1}},
           "run": {"seed": 0, "steps": 90, "epochs": None, "world_size": 4}, "shard": {"prefetch": 2}}
    refused, applied = setup_changes(saved, now)
    assert refused == [("model.overrides", {}, {"n_layers": 3}), ("data.path", "a.jsonl", "b.jsonl")]
    assert applied == [("optim.lr", 0.01, 0.02), ("optim.kwargs", {}, {"eps": 1}), ("run.steps", 60, 90)]
    assert setup_changes(saved, saved) == ([], [])  # lora.alpha without adapters, world size, prefetch: not a word
    amsgrad = {**now, "model": saved["model"], "data": saved["data"], "optim": {**saved["optim"], "kwargs": {
        "amsgrad": True}}}
    assert setup_changes(saved, amsgrad)[0] == [("optim.kwargs", {}, {"amsgrad": True})]  # the state's shape changes


def test_a_resume_with_a_new_learning_rate_applies_it_and_says_so(tmp_path):
    """Steps 3-4 after a checkpoint at step 2: resumed with optim.lr=0.05, the run's learning rate is the new
    schedule's (warmup and cosine: what a run started with 0.05 has at those steps), its losses leave the unchanged
    resume's (which are the uninterrupted run's), and one note line says so."""
    first = cli(*BASE, "run.steps=2", f"run.out_dir={tmp_path / 'a'}", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    for name in ("same", "new"):
        (tmp_path / name).mkdir()
        for f in ("metrics.jsonl", "config.yaml"):
            (tmp_path / name / f).write_bytes((tmp_path / "a" / f).read_bytes())
        import shutil

        shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / name / "checkpoints")
    same = cli(*BASE, "run.steps=4", "checkpoint.resume=auto", f"run.out_dir={tmp_path / 'same'}", cwd=tmp_path,
               timeout=300)
    new = cli(*BASE, "run.steps=4", "checkpoint.resume=auto", "optim.lr=0.05", f"run.out_dir={tmp_path / 'new'}",
              cwd=tmp_path, timeout=300)
    whole = cli(*BASE, "run.steps=4", f"run.out_dir={tmp_path / 'whole'}", cwd=tmp_path, timeout=300)
    fresh = cli(*BASE, "run.steps=4", "optim.lr=0.05", f"run.out_dir={tmp_path / 'fresh'}", cwd=tmp_path, timeout=300)
    for proc in (same, new, whole, fresh):
        assert proc.returncode == 0, proc.stderr[-2000:]
    notes = [line for line in new.stderr.splitlines() if line.startswith("note: resuming")]
    assert notes == ["note: resuming with optim.lr=0.05 (was 0.01), run.steps=4 (was 2): applied from the "
                     "checkpoint's step on"], new.stderr
    assert [r["loss"] for r in _rows(tmp_path / "same")] == [r["loss"] for r in _rows(tmp_path / "whole")]
    rows = _rows(tmp_path / "new")
    # the new schedule at the resumed steps: what a run started with optim.lr=0.05 has there (warmup and cosine)
    assert [r["lr"] for r in rows[2:]] == [r["lr"] for r in _rows(tmp_path / "fresh")[2:]]
    assert rows[2]["lr"] != _rows(tmp_path / "same")[2]["lr"]
    assert rows[2]["loss"] == _rows(tmp_path / "same")[2]["loss"]  # step 3's forward ran on step 2's weights
    assert rows[3]["loss"] != _rows(tmp_path / "same")[3]["loss"]  # step 3's update used the new rate


@pytest.mark.parametrize("arg, key", [("optim.name=SGD", "optim.name='AdamW'"), ("run.seed=1", "run.seed=0"),
                                      ("data.batch_size=8", "data.batch_size=16")])
def test_a_resume_that_would_be_another_run_is_refused_in_one_line(tmp_path, arg, key):
    """optim.name=SGD used to fail with a bare KeyError 'momentum' in the ranks, Adam to continue silently as
    AdamW, another seed or data to be accepted without a word: exit code 2, one line naming the key."""
    first = cli(*BASE, "run.steps=2", f"run.out_dir={tmp_path / 'a'}", cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    before = (tmp_path / "a" / "metrics.jsonl").read_bytes()
    proc = cli(*BASE, "run.steps=4", "checkpoint.resume=auto", arg, f"run.out_dir={tmp_path / 'a'}", cwd=tmp_path,
               timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: checkpoint.resume: ") and f"was written by a run with {key}" in lines[0]
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == before  # nothing of the first run touched
