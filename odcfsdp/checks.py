"""Checks of configuration values whose errors name the key and what is allowed, and the one help of a settings
field (``field_docs``).

Shared by ``odcfsdp.app.config.validate`` and the model specs' own checks
(``odcfsdp.app.specs``), so that every configuration error reads the same way.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
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


def field_docs(cls: type) -> dict[str, str]:
    """One line of help per field of the dataclass ``cls``: the string literal right below the field (its docstring,
    [config-docs] in ``odcfsdp/app/config.py``), whitespace joined; read from the class's source with ``ast``, so
    ``python -OO`` keeps it. A field without one takes the docstring of the same field of ``cls._field_docs_from``
    where the class names such a dataclass (documented once, there); else it has none, as has a class without
    source. A new dict each call (the reading is cached)."""
    docs = dict(_own_field_docs(cls))
    source = getattr(cls, "_field_docs_from", None)
    if source is not None:
        names = {f.name for f in dataclasses.fields(cls)}
        docs = {**{k: v for k, v in field_docs(source).items() if k in names}, **docs}
    return docs


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls)))
    except (OSError, TypeError):  # a class made at run time: no source to read
        return {}
    body = tree.body[0].body
    docs = {}
    for node, below in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(below, ast.Expr)
                and isinstance(below.value, ast.Constant) and isinstance(below.value.value, str)):
            docs[node.target.id] = " ".join(below.value.value.split())
    return docs
