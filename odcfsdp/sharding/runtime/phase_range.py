"""``phase_range``: each step of [lifecycle] as a profiler range ``odc::<step>``, free unless a profiler records."""

from __future__ import annotations

import contextlib

import torch

from ...torch_private import profiler_enabled


def phase_range(name: str):
    """A ``record_function`` range ``odc::<name>`` while a profiler records, else nothing (no cost per hook)."""
    if profiler_enabled():
        return torch.profiler.record_function(f"odc::{name}")
    return contextlib.nullcontext()


__all__ = ["phase_range"]
