"""Which tree a benchmark ran on: the checkout's commit, marked when the tree is not that commit's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit(root: Path = ROOT) -> str:
    """The checkout's short commit; ``<sha>+dirty`` when tracked files differ from it (uncommitted edits, or a
    copy of a working tree whose ``.git`` is older than its files, as the GPU host's copies can be); ``unknown``
    outside git. Results are committed from a clean tree, or with the commit passed explicitly."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=root).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return "unknown"
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def default_commit() -> str:
    """What a benchmark's ``--commit`` defaults to: ``ODC_COMMIT`` (``gpu_suite.sh`` exports the commit it was
    given), else ``commit()``."""
    return os.environ.get("ODC_COMMIT") or commit()
