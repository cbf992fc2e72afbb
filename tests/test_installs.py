"""Installs that fit the machine (issue 25): the bundle runs where torch is not installed, plotting without
matplotlib says what to install in one line, and the loss chart shows the held-out loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def without(modules: list[str], module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -m module args` in a fresh interpreter where importing any of ``modules`` fails."""
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)  # None in sys.modules: ImportError
    code = (f"import runpy, sys; {blocked}; sys.argv = [{module!r}, *{list(args)!r}]; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_bundle_runs_without_torch(tmp_path):
    """`python -m odcfsdp.bundle` is for the machine that downloads, which need not have torch: --help and an
    argument error work with torch unimportable (the package no longer imports it at `import odcfsdp`)."""
    proc = without(["torch"], "odcfsdp.bundle", "--help", cwd=ROOT)
    assert proc.returncode == 0 and "--python-version" in proc.stdout, proc.stderr[-2000:]
    proc = without(["torch"], "odcfsdp.bundle", "--out", str(tmp_path / "w"), "--python-version", "3", cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip() == "error: --python-version='3' must look like 3.12"
    check = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; import odcfsdp\n"
                            "try:\n    odcfsdp.ODCShard\nexcept ImportError:\n    print('needs torch')"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert check.returncode == 0 and check.stdout.strip() == "needs torch", check.stderr[-2000:]


def test_plot_without_matplotlib_is_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    proc = without(["matplotlib"], "odcfsdp.plot", str(tmp_path), cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: plotting needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')"]
    missing = subprocess.run([sys.executable, "-m", "odcfsdp.plot", str(tmp_path / "nowhere")], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr[-2000:]


def test_loss_chart_draws_the_held_out_loss(tmp_path, monkeypatch):
    """Rows with eval_loss at steps 2 and 4 (hand-written): the loss chart has a line of exactly those points."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from odcfsdp.app.plot import plot_run

    rows = [{"step": s, "loss": 3.0 - 0.1 * s, "grad_norm": 1.0, "rank_compute_s": [0.1, 0.2],
             "rank_wait_s": [0.0, 0.1], **({"eval_loss": 3.5 - 0.2 * s} if s % 2 == 0 else {})} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k))[1])
    plot_run(tmp_path)
    lines = {line.get_label(): line for line in drawn[0].axes[0].get_lines()}
    assert list(lines["eval loss (held out)"].get_xdata()) == [2, 4]
    assert list(lines["eval loss (held out)"].get_ydata()) == pytest.approx([3.1, 2.7])
