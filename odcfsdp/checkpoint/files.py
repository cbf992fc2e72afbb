"""File helpers for checkpoints: checksums, durable writes, and write errors that name their file."""

from __future__ import annotations

import contextlib
import json
import os
import re
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


@contextlib.contextmanager
def naming(path: Path):
    """Errors of writing ``path`` inside the block name it. A failed write or fsync (a full disk, a file-size limit)
    raises an ``OSError`` without a file name ("[Errno 28] No space left on device" names nothing), and
    safetensors' I/O errors name none either: both become ``OSError(errno, strerror, path)``."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except Exception as e:  # safetensors' SafetensorError: "... I/O error: File too large (os error 27)"
        code = re.search(r"\(os error (\d+)\)", str(e))
        if type(e).__name__ != "SafetensorError" or code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from e


def fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage (an error names ``path``)."""
    with naming(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json_durably(path: Path, obj: Any) -> None:
    """Write JSON to ``path`` through a temporary file, fsynced, then renamed into place (an error names the
    file)."""
    tmp = path.with_name(path.name + ".tmp")
    with naming(tmp), open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
