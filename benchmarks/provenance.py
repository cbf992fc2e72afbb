"""Which tree a benchmark ran on: the checkout's commit, marked when the tree is not that commit's."""

from __future__ import annotations

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
