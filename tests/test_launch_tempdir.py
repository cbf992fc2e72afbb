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


def test_ranks_that_cannot_start_fail_in_one_line(tmp_path, monkeypatch):
    """An OSError while starting the ranks (a socket, no processes left) is one line naming it and where its traceback
    went, as a failed rank is; it was a 20-line Hydra traceback."""
    import pytest

    from odcfsdp.app import train as app_train
    from odcfsdp.app.config import TrainConfig

    def no_socket(*_args, **_kwargs):
        raise OSError("AF_UNIX path too long")

    monkeypatch.setattr(app_train, "spawn", no_socket)
    cfg = TrainConfig()
    cfg.run.out_dir = str(tmp_path / "run")
    with pytest.raises(app_train.RankError) as caught:
        app_train._spawn_ranks(cfg)
    line = str(caught.value)
    assert line == f"could not start the ranks: AF_UNIX path too long (traceback in {tmp_path / 'run' / 'error.log'})"
    assert "no_socket" in (tmp_path / "run" / "error.log").read_text()
