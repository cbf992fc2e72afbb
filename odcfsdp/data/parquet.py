"""Parquet data files, the format of Hugging Face datasets on the Hub, read through pyarrow (an optional extra).

Each row is one record and its columns are the record's fields, read in the formats JSONL
records are ([data-formats] in ``formats.py``): a ``messages`` column of lists of
``{role, content}`` structs, ``prompt`` and ``completion`` columns, a ``text`` column, and
so on. pyarrow is not a dependency of odcfsdp (``pip install "odcfsdp[parquet]"`` adds it);
without it a Parquet ``data.path`` is refused in one line naming that command, before any
rank starts.

Arrow gives every row every field of its table's (and its structs') types, null where the
record had none: a file mixing ``text`` rows and ``prompt`` / ``completion`` rows has
``prompt = null`` in its text rows, and a turn without tool calls has ``tool_calls = null``.
A null field is read as an absent one, so that a row is the JSON record it was made from
(``datasets``' ``to_parquet`` of a JSONL file reads back as that file's records).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

#: what installs pyarrow, the one package Parquet files need
INSTALL_HINT = 'pip install "odcfsdp[parquet]"'
#: the bytes a Parquet file starts (and ends) with
MAGIC = b"PAR1"
#: rows converted to Python records at a time: a file's records are never all held as Arrow and Python objects
BATCH_ROWS = 1024


def is_parquet(path: str | Path) -> bool:
    """Whether the file at ``path`` is to be read as Parquet: named ``*.parquet``, or starting with Parquet's
    magic bytes (a Parquet file under another name is never JSON text)."""
    p = Path(path)
    if p.suffix.lower() == ".parquet":
        return True
    with p.open("rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _pyarrow():
    """``pyarrow`` and ``pyarrow.parquet``; ``ImportError`` naming the install command where pyarrow is missing."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as e:
        raise ImportError(f"reading a Parquet file needs pyarrow, which is not installed ({e}): {INSTALL_HINT}") \
            from None
    return pyarrow, pyarrow.parquet


def read_parquet(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(row number from 1, record) of every row of the Parquet file at ``path``, its null fields dropped.

    Raises ``ImportError`` naming the install command where pyarrow is missing, and ``ValueError`` (one line
    naming the file) for a file pyarrow cannot read.
    """
    pa, pq = _pyarrow()
    failures = (pa.ArrowException, OSError, UnicodeDecodeError)
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS)
    except failures as e:
        raise ValueError(f"{path}: not a Parquet file ({_one_line(e)})") from None
    row = 0
    try:
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield row, _present(record)
    except failures as e:  # a damaged row group, or a string that is not UTF-8
        raise ValueError(f"{path}: cannot be read past row {row} ({_one_line(e)})") from None


def _one_line(error: Exception) -> str:
    """pyarrow's message, which may run over several lines, as one."""
    return " ".join(str(error).split())


def _present(value):
    """``value`` with every null field of its objects (at any depth) dropped: absent, as in the source record."""
    if isinstance(value, dict):
        return {k: _present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_present(v) for v in value]
    return value
