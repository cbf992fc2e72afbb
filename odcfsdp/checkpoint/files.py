"""File helpers for checkpoints: checksums and durable writes."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

CHUNK = 16 << 20


def crc32_of(path: Path) -> int:
    """CRC-32 of a file's bytes (detects truncation and corruption; fast enough for multi-GB files)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsynced, then renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
