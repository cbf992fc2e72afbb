"""The leftovers of saves that did not finish, removed at the next start of the run that left them.

A save killed midway leaves ``step_<k>.tmp-<token>/`` (partial: loading ignores it), a rollback moves later
checkpoints aside as ``step_<k>.abandoned-<token>/``, and a re-save cut between its two renames leaves
``step_<k>.old-<token>/`` (``save_checkpoint`` in ``sharded.py``). None of them is ever resumed from, so they
would stay for good: ``sweep_leftovers`` removes them when the run starts again, holding the directory's lock
([run-lock] in ``lock.py``: no other run can be writing one of them). An ``.old-`` copy is kept while it is the
only copy of its step (``list_checkpoints`` lists it then), and the directory a run resumes from is never touched.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from .manifest import MANIFEST
from .sharded import _ASIDE  # the previous copy of a step saved twice: the save's own pattern

_PARTIAL = re.compile(r"^step_\d{8}\.(tmp|abandoned)-[0-9a-f]+$")


def leftovers(directory: str | Path, keep: str | Path | None = None) -> list[Path]:
    """The partial, abandoned and superseded checkpoint directories under ``directory``, by name; never ``keep``."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    kept = Path(keep).resolve() if keep else None
    found = []
    for p in sorted(directory.iterdir()):
        aside = _ASIDE.match(p.name)
        if not p.is_dir() or p.resolve() == kept:
            continue
        if _PARTIAL.match(p.name) or (aside and (directory / f"step_{aside.group(1)}" / MANIFEST).is_file()):
            found.append(p)
    return found


def sweep_leftovers(directory: str | Path, keep: str | Path | None = None) -> list[str]:
    """Remove ``leftovers(directory, keep)``; return the names removed (for the run's one-line note)."""
    removed = []
    for p in leftovers(directory, keep):
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            removed.append(p.name)
    return removed


def sweep_note(directory: str | Path, removed: list[str], shown: int = 4) -> str | None:
    """The one line that says what ``sweep_leftovers`` removed (None: nothing)."""
    if not removed:
        return None
    names = ", ".join(removed[:shown]) + (f" and {len(removed) - shown} more" if len(removed) > shown else "")
    return (f"note: removed {len(removed)} leftover{'s' * (len(removed) != 1)} of unfinished or rolled-back saves "
            f"from {directory}: {names}")


__all__ = ["leftovers", "sweep_leftovers", "sweep_note"]
