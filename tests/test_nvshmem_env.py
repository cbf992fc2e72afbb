"""The NVSHMEM heap size the framework computes is set for NVSHMEM's start only (runs on CPU: no NVSHMEM call)."""

from __future__ import annotations

import os

from odcfsdp.sharding.transport.nvshmem import HEAP_HEADROOM, heap_size_env


def test_computed_heap_size_is_not_left_for_child_processes(monkeypatch):
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    with heap_size_env(1000) as size:
        assert size == 1000 + HEAP_HEADROOM
        assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(size)  # what NVSHMEM's init reads
    assert "NVSHMEM_SYMMETRIC_SIZE" not in os.environ  # a rank spawned later sizes its own heap


def test_users_heap_size_is_kept(monkeypatch):
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "2G")
    with heap_size_env(1000) as size:
        assert size == 2 << 30
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == "2G"
