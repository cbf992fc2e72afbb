"""Checks of configuration values whose errors name the key and what is allowed.

Shared by ``odcfsdp.config.validate`` and the model specs' own checks
(``odcfsdp.specs``), so that every configuration error reads the same way.
"""

from __future__ import annotations

import difflib


def choice(key: str, value, allowed) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``allowed``, naming the key and the choices."""
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of {tuple(allowed)}")


def positive(key: str, value, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is > 0 (>= 0 with ``allow_zero``), naming the key."""
    if value is None or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{key}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def did_you_mean(word: str, options, cutoff: float = 0.6, prefix: str = "", ignore_case: bool = False) -> str:
    """``"did you mean <prefix><option>? "`` for the option closest to ``word`` (difflib's, at least ``cutoff``
    alike; with ``ignore_case`` one equal but for case first), or ``""`` when none is close: an error's hint."""
    options = list(options)
    same = [o for o in options if o.lower() == word.lower()] if ignore_case else []
    close = same or difflib.get_close_matches(word, options, n=1, cutoff=cutoff)
    return f"did you mean {prefix}{close[0]}? " if close else ""
