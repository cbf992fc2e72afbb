"""benchmarks/provenance.py: the commit a benchmark's results name."""

from __future__ import annotations

import subprocess

from benchmarks import provenance


def test_provenance_marks_a_tree_that_is_not_its_commit(tmp_path):
    """provenance.commit: the short sha of a clean checkout, +dirty once a tracked file differs (as in a copy whose
    .git is older than its files), unknown outside git."""
    assert provenance.commit(tmp_path) == "unknown"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    (tmp_path / "a.py").write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "a.py"], ["commit", "-qm", "a"]):
        subprocess.run(git + args, cwd=tmp_path, check=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                         text=True).stdout.strip()
    assert provenance.commit(tmp_path) == sha
    (tmp_path / "b.py").write_text("untracked\n")
    assert provenance.commit(tmp_path) == sha
    (tmp_path / "a.py").write_text("x = 2\n")
    assert provenance.commit(tmp_path) == sha + "+dirty"
