"""Test-wide set-up: Triton runs in its CPU interpreter where there is no GPU.

This must happen before any module defines a ``@triton.jit`` kernel, hence here.
"""

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
