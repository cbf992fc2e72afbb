"""The watchdog's liveness half ([watchdog] in odcfsdp/sharding/placement/watchdog.py) under torchrun, through the Python API:
a rank blocked inside a gloo collective (where no Python exception reaches) still ends, naming the stopped rank.
The meeting half and the spawned CLI run are tested in test_train.py (test_a_stuck_rank_...); the arrival guard's
barrier contract here, through benchmarks/meeting_bench.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

CASE = r"""
import os, signal, torch, torch.distributed as dist
from odcfsdp import ODCShard
from odcfsdp.launch import init_torchrun
from odcfsdp.models import Llama, LlamaConfig

init_torchrun(use_cuda=False)
torch.manual_seed(0)
model = ODCShard(Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)), 4096, timeout=3)
os.write(1, f"rank {dist.get_rank()} pid {os.getpid()}\n".encode())  # one write: lines of the ranks do not mix
dist.barrier()  # both pids are out before rank 0 stops (a slow rank 1 would otherwise be ended before its line)
if dist.get_rank() == 0:
    os.kill(os.getpid(), signal.SIGSTOP)
dist.all_reduce(torch.ones(1))  # rank 1 waits here, inside gloo
print("unreachable", flush=True)
"""


def test_a_rank_blocked_in_a_collective_names_the_stopped_one_under_torchrun(tmp_path: Path):
    """Rank 0 stops itself; rank 1, blocked in all_reduce, reports it after timeout=3 s on one stderr line and
    exits 1; the stopped rank is killed (not left to torchrun's 30 s grace), so torchrun ends well within 3 + 15 s
    of the stop."""
    import re

    (tmp_path / "case.py").write_text(CASE)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "case.py"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        while not any("rank 0 pid" in line for line in lines):  # rank 0 stops right after this line
            line = proc.stdout.readline()
            assert line, "".join(lines)[-3000:]
            lines.append(line)
        stopped = time.monotonic()
        # wait, then read: communicate() would read the pipe's fd and drop what readline() has buffered
        proc.wait(timeout=3 + 15)  # the output is a few kB, well inside the pipe's buffer
        elapsed = time.monotonic() - stopped
        rest = proc.stdout.read()
    finally:
        proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"rank\(s\) \[0\] stopped responding \(no sign of life for 3 s.*rank 1 "
                                          r"stops here", errors[0]), out[-3000:]
    assert "unreachable" not in out
    pids = [int(p) for p in re.findall(r"rank \d pid (\d+)", out)]
    assert len(pids) == 2 and not [p for p in pids if Path(f"/proc/{p}").exists()], out[-3000:]
    assert elapsed < 3 + 15, f"{elapsed:.0f} s from the stop to the end"


def test_the_arrival_guard_holds_every_rank_until_the_last_comes(tmp_path: Path):
    """benchmarks.meeting_bench on 3 CPU ranks, rank 2 late by 0 and 20 ms: in no meeting does a rank leave
    ``Watchdog.arrive`` before the last one entered it (the barrier's contract, from the ranks' clocks on one host),
    and every meeting's release lag is recorded, finite and >= 0."""
    import json
    import math

    from benchmarks import meeting_bench

    meeting_bench.main(["--cpu-ranks", "3", "--late-ms", "0", "20", "--meetings", "5", "--warmup", "1",
                        "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "meeting_bench.json").read_text())["rows"]
    assert [r["late_ms"] for r in rows] == [0, 20] and all(r["meetings"] == 5 for r in rows)
    assert all(r["early_leaves"] == 0 for r in rows), rows
    lags = [r[k] for r in rows for k in ("release_lag_ms_median", "release_lag_ms_p90", "release_lag_ms_max")]
    assert all(math.isfinite(x) and x >= 0 for x in lags), rows


INTERRUPTED = r"""
import os, time
import torch.distributed as dist
from odcfsdp.launch import init_torchrun
from odcfsdp.sharding.placement.collectives import RankGroup
from odcfsdp.sharding.placement.watchdog import Watchdog

init_torchrun(use_cuda=False)
watchdog = Watchdog(RankGroup(), timeout_s=float("inf"))  # no bound: only a signal ends the wait
os.write(1, f"rank {dist.get_rank()} pid {os.getpid()}\n".encode())
if dist.get_rank() == 1:
    time.sleep(60)  # never comes
try:
    watchdog.arrive("the test's meeting")
except KeyboardInterrupt:
    os.write(1, b"rank 0 interrupted\n")
    os._exit(3)
"""


def test_ctrl_c_reaches_a_rank_waiting_at_a_meeting_at_once(tmp_path: Path):
    """Rank 0 waits at a meeting rank 1 never reaches, with no time bound; a SIGINT to rank 0 alone raises
    KeyboardInterrupt there within 5 s (the store's wait runs on a thread of its own, [watchdog] 1: waiting inside
    it, the main thread would run no signal handler until the store answered); the run then fails, exit code 1."""
    import os
    import re
    import signal

    import threading

    (tmp_path / "case.py").write_text(INTERRUPTED)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "case.py"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # the output, as it comes

    def seen(text: str, within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if any(text in line for line in list(lines)):
                return True
            time.sleep(0.05)
        return False

    try:
        assert seen("rank 0 pid", 60) and seen("rank 1 pid", 10), "".join(lines)[-3000:]
        pid = int(re.search(r"rank 0 pid (\d+)", "".join(lines)).group(1))
        time.sleep(1.0)  # rank 0 is in arrive by now
        os.kill(pid, signal.SIGINT)
        assert seen("rank 0 interrupted", 5), "".join(lines)[-3000:]
        proc.wait(timeout=60)  # rank 0 exited 3 from its handler: torchrun stops rank 1 and fails
        assert proc.returncode == 1, "".join(lines)[-3000:]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the run
        except ProcessLookupError:
            pass
        proc.wait()
