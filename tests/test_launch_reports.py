"""A rank's one report to ``spawn`` ([one-report] in odcfsdp/launch/one_report.py): when a peer stops, the rank's main
thread (its arrival wait) and its watchdog's heartbeat fail at the same moment; whichever reports first, exactly one
report reaches the launcher, however late the queue's feeder thread runs, and a rank that died with its report unsent
is still named by it.

The launcher holds the queue's write lock for ``HELD_S``: the rank's feeder thread cannot write before then, as a
feeder not yet scheduled on busy cores (the CI failure: "rank 1 exited with code 0 without a result").
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time

import pytest
import torch.distributed as dist

from odcfsdp.launch import processes
from odcfsdp.launch.processes import _worker, loopback_store, spawn
from odcfsdp.launch.start_method import worker_context
from odcfsdp.sharding.placement import watchdog

HELD_S = 1.5
HEARTBEAT = "rank(s) [0] stopped responding (the heartbeat's report)"
MEETING = "rank(s) [0] did not reach the meeting (the main thread's report)"


def _heartbeat_fails() -> None:
    watchdog._die(HEARTBEAT)  # as _Heartbeat._give_up: the launcher's handler, then os._exit(1)


def _heartbeat_reports() -> None:
    """Start the heartbeat's report; return once its thread waits for the queue's feeder (which waits for the held
    lock), or once it ended the process, or after 5 s."""
    heartbeat = threading.Thread(target=_heartbeat_fails, daemon=True)
    heartbeat.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(heartbeat.ident)
        if frame is None or frame.f_code.co_name == "_wait_for_tstate_lock":  # in Thread.join: the feeder's
            return
        time.sleep(0.01)


def _heartbeat_first() -> None:
    _heartbeat_reports()
    raise RuntimeError(MEETING)


def _main_thread_first() -> None:
    def destroy_then_heartbeat() -> None:  # the heartbeat fires while the main thread, reported, is on its way out
        _heartbeat_reports()

    dist.destroy_process_group = destroy_then_heartbeat  # in this rank only
    raise RuntimeError(MEETING)


def _reports_of(fn, tmp_path) -> tuple[int | None, list]:
    """Run ``fn`` as rank 0 of 1 under ``_worker`` with the queue's write lock held for ``HELD_S``: its exit code and
    every report that reached this process."""
    ctx = worker_context("gloo", fn)
    results, store = ctx.Queue(), loopback_store(1)
    results._wlock.acquire()  # the feeder's lock (multiprocessing's own): no write until it is let go
    proc = ctx.Process(target=_worker, args=(fn, (), 0, 1, store.port, "gloo", 1, results), daemon=True,
                       kwargs=dict(guard_s=6.0, stack_path=str(tmp_path / "rank0.txt")))
    proc.start()
    try:
        proc.join(HELD_S)  # the old code's rank exits here, its report still in the feeder's buffer
    finally:
        results._wlock.release()
    proc.join(15)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail("the rank did not exit within 15 s of its feeder's lock being let go")
    reports = []
    while True:
        try:
            reports.append(results.get(timeout=1.0))
        except queue.Empty:
            return proc.exitcode, reports


def test_the_heartbeat_reports_first_and_the_process_exits_1(tmp_path):
    code, reports = _reports_of(_heartbeat_first, tmp_path)
    assert reports == [(0, False, f"RuntimeError: {HEARTBEAT}")], (code, reports)
    assert code == 1  # the main thread, failed too, waits for the heartbeat's os._exit(1): never an exit 0


def test_the_main_thread_reports_first_and_the_heartbeat_loses_nothing(tmp_path):
    code, reports = _reports_of(_main_thread_first, tmp_path)
    assert len(reports) == 1 and reports[0][:2] == (0, False) and MEETING in reports[0][2], (code, reports)
    assert code is not None


def _dies_with_its_report_unsent() -> None:
    """A rank whose report is written (``report_path``) but never reached the queue, exiting 0."""
    from odcfsdp.launch.rank_outcomes import report_path

    with open(report_path(processes._stack_file.name), "w") as f:
        f.write(f"RuntimeError: {HEARTBEAT}\n")
    os._exit(0)


def test_a_rank_that_died_with_its_report_unsent_is_named_by_it():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 0 failed:\nRuntimeError: rank\(s\) \[0\] stopped responding"):
        spawn(_dies_with_its_report_unsent, 1, timeout=60)
    assert time.monotonic() - start < 30
