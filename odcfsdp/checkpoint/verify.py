"""A checkpoint's files checked without loading them, and what to resume from when a checkpoint is damaged.

A flipped byte or a truncated file is found when the ranks read the checkpoint (sizes, bindings and CRC-32s, in
``load_checkpoint``), and refused naming the file. The error then names the way on as well
(``resume_instead``): the newest complete checkpoint before the damaged one whose files all verify here, as the
``checkpoint.resume=<path>`` to give. Older checkpoints are read in full only on this failure path, newest first,
until one verifies.
"""

from __future__ import annotations

from pathlib import Path

from .files import crc32_of
from .manifest import CheckpointError, check_files_bound, check_size, read_manifest
from .sharded import list_checkpoints


def verify_checkpoint(path: str | Path) -> dict:
    """Check checkpoint ``path`` whole, reading every file: its manifest, every listed file's size, binding
    ([bound-files] in ``manifest.py``) and CRC-32. ``CheckpointError`` names the first file that fails; returns the
    manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    check_files_bound(path, manifest)
    for info in manifest["files"]:
        file = path / info["file"]
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        check_size(file, info)
        if crc32_of(file) != info["crc32"]:
            raise CheckpointError(f"{file}: checksum mismatch (the file was altered or corrupted)")
    return manifest


def _step(path: Path) -> int | None:
    try:
        return int(path.name[5:13])
    except ValueError:
        return None


def newest_intact(directory: str | Path, before: int | None = None) -> Path | None:
    """The newest complete checkpoint under ``directory`` (of a step below ``before``) whose files verify."""
    for path in reversed(list_checkpoints(directory)):
        step = _step(path)
        if before is not None and (step is None or step >= before):
            continue
        try:
            verify_checkpoint(path)
        except (CheckpointError, OSError):
            continue
        return path
    return None


def resume_instead(path: str | Path) -> str:
    """What the error about checkpoint ``path`` adds: nothing when its files verify (the checkpoint is whole; what
    failed is not the files), else the newest intact checkpoint before it to resume from, as
    ``; ... checkpoint.resume=<path>``, or that there is none."""
    path = Path(path)
    try:
        verify_checkpoint(path)
        return ""
    except (CheckpointError, OSError):
        pass
    step = _step(path)
    found = newest_intact(path.parent, before=step)
    if found is not None:
        return (f"; the newest intact checkpoint before it is {found}: resume from it with "
                f"checkpoint.resume={found}")
    return (f"; no complete checkpoint before it in {path.parent} is intact: start again with run.overwrite=true "
            "(or another run.out_dir)")


__all__ = ["newest_intact", "resume_instead", "verify_checkpoint"]
