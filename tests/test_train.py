"""The main job end to end: ``python -m odcfsdp.train`` with 2 CPU ranks it starts itself."""

from __future__ import annotations

import json
import subprocess
import sys


def test_default_job_short_run_loss_falls(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "odcfsdp.train", "steps=12", "optim.lr=1e-2", f"out_dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.3, (first, last)
    assert "12/12" in proc.stderr  # the progress bar reached the end


def test_bad_override_fails_at_start(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "odcfsdp.train", "stepz=3"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert "stepz" in proc.stderr
