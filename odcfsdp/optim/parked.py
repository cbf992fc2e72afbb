"""What to call on an optimizer that may have its state parked ([parking] in ``parking.py``): each is a no-op for an
optimizer without a ``ParkedOptimizerState``, so a loop calls them whether or not the run parks."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .parking import parking_of


def parked_copy(optimizer: torch.optim.Optimizer, value: torch.Tensor) -> torch.Tensor | None:
    """The host tensor holding a state tensor's values while the optimizer's state is parked (read only); None for
    a resident tensor or an optimizer without parking."""
    parking = parking_of(optimizer)
    return parking.host_copy(value) if parking is not None else None


def prefetch_parked(optimizer: torch.optim.Optimizer) -> None:
    """Start bringing a parked optimizer's state back ([parking] 2); nothing for any other optimizer."""
    parking = parking_of(optimizer)
    if parking is not None:
        parking.prefetch()


def settle_parked(optimizer: torch.optim.Optimizer) -> None:
    """After a skipped step: free an unused prefetch again; nothing for an optimizer without parking."""
    parking = parking_of(optimizer)
    if parking is not None:
        parking.settle()


@contextlib.contextmanager
def unparked(optimizer: torch.optim.Optimizer, changes: bool = False) -> Iterator[None]:
    """The optimizer's state resident inside the block (for readers and writers of ``optimizer.state``), parked
    again after it if it was; a no-op for an optimizer without parking."""
    parking = parking_of(optimizer)
    with parking.resident(changes) if parking is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def owned_loads(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block, ``optimizer.load_state_dict`` takes state dicts that nobody else holds: a parked optimizer
    parks their tensors as they are instead of copying them first (odcfsdp's checkpoint loader)."""
    parking = parking_of(optimizer)
    if parking is None:
        yield
        return
    parking.owns_loads = True
    try:
        yield
    finally:
        parking.owns_loads = False
