"""[bounded-spawn] in odcfsdp/launch/processes.py: a hung rank costs one bounded call and names where every rank stood.

Each case runs spawn on 2 CPU ranks (gloo) with a short bound and checks the time it took, the error and the stacks
attached to it; the GPU suite runs the same spawn with its 90 s bound around NCCL ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from odcfsdp.launch.processes import GUARD_FRACTION, spawn
from odcfsdp.launch.rank_outcomes import DUMP_WAIT_S, KILL_WAIT_S


def _sleep_forever_on(rank_to_hang: int) -> int:
    """Rank ``rank_to_hang`` never returns (a hang where no exception reaches: a blocked sleep); the other returns."""
    if dist.get_rank() == rank_to_hang:
        hang_here_forever()
    return dist.get_rank()


def hang_here_forever() -> None:
    while True:
        time.sleep(3600)


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


def test_a_hung_rank_times_out_in_bound_and_names_its_line():
    """Rank 1 hangs, rank 0 returns: the call ends within its bound plus the stack dump and the kill, and the
    error carries rank 1's Python stack down to the function it hung in (rank 0 delivered: no stack for it)."""
    bound = 8.0
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish in 8.0s") as info:
        spawn(_sleep_forever_on, 2, 1, timeout=bound)
    elapsed = time.monotonic() - start
    assert elapsed < bound + DUMP_WAIT_S + KILL_WAIT_S + 10, f"{elapsed:.0f} s"  # + start-up on 2 busy cores
    notes = _notes(info.value)
    assert "--- rank 1 (still running)" in notes and "hang_here_forever" in notes, notes
    assert "--- rank 0" not in notes, notes


def _fail_on_0_hang_on_1() -> None:
    dist.barrier()  # both ranks started (on busy cores rank 1 was still importing when rank 0 failed at once)
    if dist.get_rank() == 0:
        time.sleep(2.0)  # rank 1 is inside hang_here_forever by then, where its stack is to show it
        raise ValueError("rank 0 gives up")
    hang_here_forever()


def test_a_failed_rank_ends_the_call_at_once_with_the_others_stacks():
    """Rank 0 raises while rank 1 hangs: the call fails at rank 0's error, long before its bound, and the error
    names where rank 1 stood before it was killed."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed(.|\n)*ValueError: rank 0 gives up") as info:
        spawn(_fail_on_0_hang_on_1, 2, timeout=120)
    assert time.monotonic() - start < 60
    assert "hang_here_forever" in _notes(info.value)


def _meet_without_rank_1() -> None:
    """Rank 1 hangs before its first meeting; rank 0 reaches it (the sync in clip_grad_norm_) and waits there."""
    from odcfsdp import ODCShard

    torch.manual_seed(0)
    model = ODCShard(torch.nn.Sequential(torch.nn.Linear(4, 4)), 4096, comm="shm")  # ODCShard's default timeout
    model(torch.ones(2, 4)).sum().backward()
    if dist.get_rank() == 1:
        hang_here_forever()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_the_ranks_own_meeting_guard_fires_before_the_bound():
    """ODCShard's watchdog (300 s by default) is capped below spawn's bound: rank 0, waiting at the sync for a
    rank that never comes, raises naming it and the meeting at about GUARD_FRACTION of the bound, so the call
    fails with that line rather than a bare time-out."""
    bound = 20.0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 failed(.|\n)*rank\(s\) \[1\] did not reach the sync meeting "
                                           r"of minibatch 0 within 14 s") as info:
        spawn(_meet_without_rank_1, 2, timeout=bound)
    assert time.monotonic() - start < bound + DUMP_WAIT_S + KILL_WAIT_S
    assert GUARD_FRACTION * bound == 14
    assert "hang_here_forever" in _notes(info.value)


CASES = """
import time, pytest

def test_passes():
    pass

def test_hangs():
    time.sleep(300)

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_runs_after_the_hang():
    assert 1 == 2
"""


def test_each_outcome_is_recorded_as_it_ends_and_a_hung_test_costs_only_itself(tmp_path):
    """pytest with the suite's conftest as a plugin and a 20 s per-test bound (pytest-timeout, as the GPU suite
    runs it; the first test's set-up imports torch, slow on two busy cores): the hung test fails alone, the test after it runs, and ODC_TEST_OUTCOMES holds one line per test in
    the order they ended (what a run cut off by its time limit keeps)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "test_cases.py").write_text(CASES)
    outcomes = tmp_path / "outcomes.jsonl"
    tests_dir = Path(__file__).resolve().parent
    env = {**os.environ, "ODC_TEST_OUTCOMES": str(outcomes), "PYTHONPATH": str(tests_dir)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p", "no:cacheprovider",
                           "--timeout", "20", "test_cases.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 1, proc.stdout[-2000:]
    rows = [json.loads(line) for line in outcomes.read_text().splitlines()]
    got = [(r["test"].split("::")[1], r["outcome"]) for r in rows]
    assert got == [("test_passes", "passed"), ("test_hangs", "failed"), ("test_skipped", "skipped"),
                   ("test_runs_after_the_hang", "failed")], got
    assert "Timeout" in rows[1]["message"] and 19 < rows[1]["duration_s"] < 60

    # the GPU suite's report reads such a run (no JUnit XML: cut off) from this file
    from benchmarks import gpu_test_report

    (tmp_path / "gpu_measured.jsonl").write_text(json.dumps({"test": "timing", "zero_grad_s": [[0.001]]}) + "\n")
    gpu_test_report.main([str(tmp_path), str(tmp_path / "report"), "--commit", "abc1234", "--device", "cpu",
                          "--date", "2026-11-25"])
    md = (tmp_path / "report" / "gpu_tests.md").read_text()
    assert "- outcome: 1 passed, 2 failed, 0 errors, 1 skipped" in md, md
    assert '| timing | `{"zero_grad_s": [[0.001]]}` |' in md and "test_cases::test_hangs | failed" in md, md


def _die_mid_collectives() -> None:
    """Rank 1 SIGKILLs itself between all-reduces; rank 0 keeps reducing and fails at the closed connection."""
    import os
    import signal

    for i in range(10_000):
        if dist.get_rank() == 1 and i == 50:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("attempt", range(3))
def test_the_rank_that_died_first_is_named_not_the_survivor(attempt):
    """A SIGKILLed rank's peer reports "connection closed" at once, often before the death can be seen: the error
    names the rank that died, then the survivor's failure (it used to blame the survivor alone)."""
    with pytest.raises(RuntimeError) as info:
        spawn(_die_mid_collectives, 2, timeout=120)
    assert str(info.value).startswith("rank 1 was killed by SIGKILL without a result"), str(info.value)[:300]
