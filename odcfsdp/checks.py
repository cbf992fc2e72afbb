"""Checks of configuration values whose errors name the key and what is allowed.

Shared by ``odcfsdp.app.config.validate`` and the model specs' own checks
(``odcfsdp.app.specs``), so that every configuration error reads the same way.
"""

from __future__ import annotations

import difflib
import math


def choice(key: str, value, allowed) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed``, naming the key and the choices."""
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {tuple(allowed)}")


def positive(key: str, value, allow_zero: bool = False, allow_inf: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a number > 0 (>= 0 with ``allow_zero``), naming the key; NaN is
    refused, and infinity unless ``allow_inf`` (a learning rate of inf would train to NaN and be checkpointed)."""
    bound = ">= 0" if allow_zero else "> 0"
    if value is not None and (math.isnan(value) or (math.isinf(value) and not allow_inf)):
        raise ValueError(f"{key}={value!r} must be a {'' if allow_inf else 'finite '}number {bound}")
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key}={value!r} must be {bound}")


def in_range(key: str, value, lo: float, hi: float, hi_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``lo <= value <= hi`` (``< hi`` with ``hi_open``), naming the key."""
    if value is None or not (lo <= value and (value < hi if hi_open else value <= hi)):
        raise ValueError(f"{key}={value!r} must be in [{lo:g}, {hi:g}{')' if hi_open else ']'}")


def did_you_mean(word: str, options, cutoff: float = 0.6, prefix: str = "", ignore_case: bool = False) -> str:
    """``"did you mean <prefix><option>? "`` for the option closest to ``word`` (difflib's, at least ``cutoff``
    alike; with ``ignore_case`` one equal but for case first), or ``""`` when none is close: an error's hint."""
    options = list(options)
    same = [o for o in options if o.lower() == word.lower()] if ignore_case else []
    close = same or difflib.get_close_matches(word, options, n=1, cutoff=cutoff)
    return f"did you mean {prefix}{close[0]}? " if close else ""
