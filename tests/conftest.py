"""Test-wide set-up: Triton runs in its CPU interpreter where there is no GPU.

This must happen before any module defines a ``@triton.jit`` kernel, hence here.
With ``ODC_TEST_OUTCOMES`` set, every test's outcome is appended to that file (JSON lines) as the test ends,
so that a run cut off by its time limit still says which tests passed, failed or hung ([bounded-spawn] in
``odcfsdp/launch/processes.py``; the GPU suite's tests sections set it). With ``ODC_FILE_TIMES`` set (``.ci/run``
sets it), the run ends with each test file's seconds (set-up, calls and tear-down, module fixtures included), slowest
first: where CI's time goes.
"""

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_leftovers():
    """The shm transport leaves no files behind, whatever the tests did: a rank killed inside its heap's set-up (a
    signal test's SIGKILL can land there) leaves its file to the next set-up, which removes it once its creator is
    gone ([shm-cleanup] in ``shm.py``); that sweep runs here too, and what is left after it belongs to a process
    still alive. (A normal run leaves nothing at all: ``tests/test_shm.py``.)"""
    from odcfsdp.sharding.transport.shm import shm_dir, sweep_stale_heaps

    before = set(shm_dir().glob("odcfsdp-*"))
    yield
    sweep_stale_heaps()
    left = set(shm_dir().glob("odcfsdp-*")) - before
    assert not left, f"shared-memory files left behind by live processes: {sorted(map(str, left))}"


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` where CUDA is not available (CI, laptops)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Count each phase's seconds to its file (``ODC_FILE_TIMES``); append the outcome of each test phase that
    decides it (the call; a failed or skipped set-up or tear-down) to ``$ODC_TEST_OUTCOMES`` as soon as it is known."""
    file = report.nodeid.split("::")[0]
    _FILE_SECONDS[file] = _FILE_SECONDS.get(file, 0.0) + report.duration
    path = os.environ.get("ODC_TEST_OUTCOMES")
    if not path or (report.when != "call" and report.passed):
        return
    message = ""
    if report.failed:
        message = str(getattr(report.longrepr, "reprcrash", None) or report.longrepr or "")[-2000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    with open(path, "a") as f:
        f.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "duration_s": round(report.duration, 3), "message": message}) + "\n")


def pytest_terminal_summary(terminalreporter):
    """With ``ODC_FILE_TIMES`` set: every test file's seconds, slowest first (with xdist, summed over its worker)."""
    if not os.environ.get("ODC_FILE_TIMES") or not _FILE_SECONDS:
        return
    terminalreporter.section("seconds per test file (set-up + calls + tear-down)")
    for file, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {file}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  all files")
