"""The offline wheel bundle (odcfsdp.bundle), end to end and without network: a local mirror holds a wheel that
depends on a package published only as a source distribution; the bundle must hold wheels of both, and its
install.sh must install them with no index into a directory from which they import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _package(root: Path, name: str, deps: list[str]) -> Path:
    pkg = root / name
    (pkg / name.replace("-", "_")).mkdir(parents=True)
    (pkg / name.replace("-", "_") / "__init__.py").write_text(f"NAME = {name!r}\n")
    (pkg / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "1.0"
        dependencies = {deps!r}
        """))
    return pkg


def test_bundle_from_a_mirror_installs_offline(tmp_path):
    links = tmp_path / "mirror"
    links.mkdir()
    top = _package(tmp_path / "src", "odcx-top", ["odcx-leaf"])
    leaf = _package(tmp_path / "src", "odcx-leaf", [])
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(links), str(top)], check=True)
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(links)!r})"],
                   cwd=leaf, check=True, capture_output=True)  # the leaf exists only as a source distribution
    assert sorted(p.suffix for p in links.iterdir()) == [".gz", ".whl"]

    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, "-m", "odcfsdp.bundle", "--out", str(out), "--requirement", "odcx-top",
                           "--no-index", "--find-links", str(links),
                           "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[1/2] odcx-leaf==1.0: built" in proc.stderr and "[2/2] odcx-top==1.0: downloaded" in proc.stderr
    assert sorted(w.name for w in out.glob("*.whl")) == ["odcx_leaf-1.0-py3-none-any.whl",
                                                         "odcx_top-1.0-py3-none-any.whl"]
    assert (out / "requirements.txt").read_text() == "odcx-leaf==1.0\nodcx-top==1.0\n"

    site = tmp_path / "site"
    install = subprocess.run(["sh", str(out / "install.sh"), str(site)], capture_output=True, text=True, timeout=300,
                             env={"PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"})
    assert install.returncode == 0, install.stderr[-2000:]
    imported = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import odcx_top, "
                               "odcx_leaf; print(odcx_top.__file__, odcx_leaf.NAME)", str(site)],
                              capture_output=True, text=True, check=True)
    assert imported.stdout.startswith(str(site)) and imported.stdout.strip().endswith("odcx-leaf")


def test_a_bad_python_version_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "odcfsdp.bundle", "--out", str(tmp_path), "--python-version", "312"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip() == "error: --python-version='312' must look like 3.12"
