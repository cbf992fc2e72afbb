"""One error path for every way ranks start (issue 44, item 5): under torchrun as with spawned ranks or one process, a
pre-start refusal is one line (not one per rank) and a failed rank is one line with its traceback in error.log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    from odcfsdp.launch import free_port

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "odcfsdp.train", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)


def test_under_torchrun_a_pre_start_refusal_is_one_line_and_the_memory_check_runs(tmp_path):
    """The memory check used to be skipped under torchrun (the README's 8B torchrun line on a small machine was
    killed for memory after 69 s); now each rank refuses before touching the model, and one line says why."""
    proc = _torchrun(tmp_path, "data.vocab_size=1000000000", "run.out_dir=run")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [
        "error: the model has 128.00B parameters (model.size=tiny, data.vocab_size=1000000000): its fp32 weights and "
        "gradients alone need 954 GiB on this machine" + errors[0].split("on this machine", 1)[1]], proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and not (tmp_path / "run").exists()


def test_under_torchrun_a_failed_rank_is_one_line_with_its_traceback_in_error_log(tmp_path):
    """Rank 0's metrics file refuses every write (/dev/full): its one line names the file and error.log, which holds
    the traceback, as with ranks the CLI spawns (it used to be a traceback per rank inside torchrun's)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to("/dev/full")
    proc = _torchrun(tmp_path, "run.out_dir=run", "run.steps=3", "optim.warmup_steps=1")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [
        "error: rank 0 failed: OSError: [Errno 28] No space left on device: 'run/metrics.jsonl' "
        "(traceback in run/error.log)"], proc.stderr[-3000:]
    assert "Traceback" in (tmp_path / "run" / "error.log").read_text()
