"""Test-wide set-up: Triton runs in its CPU interpreter where there is no GPU.

This must happen before any module defines a ``@triton.jit`` kernel, hence here.
With ``ODC_TEST_OUTCOMES`` set, every test's outcome is appended to that file (JSON lines) as the test ends,
so that a run cut off by its time limit still says which tests passed, failed or hung ([bounded-spawn] in
``odcfsdp/launch/processes.py``; the GPU suite's tests sections set it).
"""

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_leftovers():
    """The shm transport must leave no files behind, whatever the tests did (crashes included)."""
    from odcfsdp.sharding.transport.shm import shm_dir

    before = set(shm_dir().glob("odcfsdp-*"))
    yield
    left = set(shm_dir().glob("odcfsdp-*")) - before
    assert not left, f"shared-memory files left behind: {sorted(map(str, left))}"


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` where CUDA is not available (CI, laptops)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Append the outcome of each test phase that decides it (the call; a failed or skipped set-up or tear-down) to
    ``$ODC_TEST_OUTCOMES`` as soon as it is known."""
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
