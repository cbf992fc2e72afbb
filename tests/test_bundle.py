"""The offline wheel bundle (odcfsdp.bundle), end to end and without network: a local mirror holds a wheel that
depends on a package published only as a source distribution; the bundle must hold wheels of both, and its
install.sh must install them with no index into a directory from which they import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


# A minimal in-tree PEP 517 backend: builds the package's wheel and sdist with the standard library alone, so that
# pip builds it offline, in build isolation, whatever setuptools / wheel the test environment has.
BACKEND = r"""
import base64, hashlib, io, os, tarfile, zipfile
from odcx_meta import NAME, VERSION, DEPS

MOD = NAME.replace("-", "_")
DIST = f"{MOD}-{VERSION}"
META = "Metadata-Version: 2.1\nName: %s\nVersion: %s\n%s" % (NAME, VERSION, "".join(f"Requires-Dist: {d}\n" for d in DEPS))
SOURCES = ["pyproject.toml", "odcx_backend.py", "odcx_meta.py", f"{MOD}/__init__.py"]

def build_sdist(directory, config_settings=None):
    with tarfile.open(os.path.join(directory, DIST + ".tar.gz"), "w:gz") as t:
        for f in SOURCES:
            t.add(f, arcname=f"{DIST}/{f}")
        info = tarfile.TarInfo(f"{DIST}/PKG-INFO")
        info.size = len(META.encode())
        t.addfile(info, io.BytesIO(META.encode()))
    return DIST + ".tar.gz"

def build_wheel(directory, config_settings=None, metadata_directory=None):
    name = f"{DIST}-py3-none-any.whl"
    files = {f"{MOD}/__init__.py": open(f"{MOD}/__init__.py", "rb").read(), f"{DIST}.dist-info/METADATA": META.encode(),
             f"{DIST}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: odcx\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    with zipfile.ZipFile(os.path.join(directory, name), "w") as z:
        for arc, data in files.items():
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
        z.writestr(f"{DIST}.dist-info/RECORD", "\n".join(record + [f"{DIST}.dist-info/RECORD,,"]) + "\n")
    return name
"""


def _package(root: Path, name: str, deps: list[str]) -> Path:
    pkg = root / name
    (pkg / name.replace("-", "_")).mkdir(parents=True)
    (pkg / name.replace("-", "_") / "__init__.py").write_text(f"NAME = {name!r}\n")
    (pkg / "odcx_meta.py").write_text(f"NAME, VERSION, DEPS = {name!r}, '1.0', {deps!r}\n")
    (pkg / "odcx_backend.py").write_text(BACKEND)
    (pkg / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = []
        build-backend = "odcx_backend"
        backend-path = ["."]
        """))
    return pkg


def test_bundle_from_a_mirror_installs_offline(tmp_path):
    links = tmp_path / "mirror"
    links.mkdir()
    top = _package(tmp_path / "src", "odcx-top", ["odcx-leaf"])
    leaf = _package(tmp_path / "src", "odcx-leaf", [])
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-index", "-w", str(links), str(top)], check=True)
    subprocess.run([sys.executable, "-c", f"import odcx_backend; odcx_backend.build_sdist({str(links)!r})"],
                   cwd=leaf, check=True)  # the leaf exists only as a source distribution
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
