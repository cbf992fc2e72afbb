"""A deep ``$TMPDIR`` (pytest-xdist's, a cluster's scratch path) no longer fails the start: multiprocessing's fork
server puts its Unix socket under the temporary directory, and a socket's path holds at most 107 bytes."""

from __future__ import annotations

import os
import subprocess
import sys

from odcfsdp.launch.tempdir import ROOM


def test_a_deep_tmpdir_starts_the_ranks(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    assert len(str(deep)) > ROOM
    proc = subprocess.run([sys.executable, "-m", "odcfsdp.train", "run.steps=2", f"run.out_dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env={**os.environ, "TMPDIR": str(deep)}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 2/2" in proc.stdout + proc.stderr
