"""Checks of configuration values whose errors name the key and what is allowed.

Shared by ``odcfsdp.config.validate`` and the model specs' own checks
(``odcfsdp.specs``), so that every configuration error reads the same way.
"""

from __future__ import annotations


def choice(key: str, value, allowed) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed``, naming the key and the choices."""
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {tuple(allowed)}")


def positive(key: str, value, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is > 0 (>= 0 with ``allow_zero``), naming the key."""
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")
