"""An offline wheel bundle: odcfsdp's dependencies as wheels for a machine that cannot download.

Air-gapped clusters (and our GPU host) have torch and CUDA but not always hydra-core or
nvshmem4py. ``python -m odcfsdp.bundle --out wheels/`` (also ``odcfsdp-bundle``), on a
machine with network access, as numbered steps:

1. resolves the dependency closure of odcfsdp with the chosen extras (``pip install
   --dry-run --report``), leaving out what the target already has (``--have``; by default
   torch, triton, numpy, safetensors and the CUDA runtime packages). The closure is
   resolved for this interpreter (environment markers included): run the bundle under the
   target's Python version where a dependency's markers tell versions apart;
2. downloads each package, pinned, as a wheel for the target interpreter and platform
   (``--python-version``, ``--platform``); a package published only as a source
   distribution (antlr4-python3-runtime) is built into a wheel here (in pip's build
   isolation: its build requirements come from the index or ``--find-links`` too), which
   works for pure-Python ones;
3. writes ``requirements.txt`` (the pins) and ``install.sh``: on the target,
   ``sh wheels/install.sh /tmp/site`` installs them with no index and no dependency
   resolution into that directory (``PYTHONPATH=/tmp/site:<odcfsdp checkout>``), or into
   the current environment without an argument.

Progress goes to stderr, one line per package; a package that can be neither downloaded
nor built stops the bundle with one line naming it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_HAVE = ("torch", "triton", "numpy", "safetensors", "nvidia-*", "cuda-*", "setuptools", "pip", "wheel",
                "filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx", "sympy", "typing-extensions")


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _has(name: str, have: tuple[str, ...]) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(normalize(name), normalize(h)) for h in have)


def closure(requirements: list[str], pip: list[str]) -> list[tuple[str, str]]:
    """(name, version) of every package ``pip install <requirements>`` would install, odcfsdp itself left out."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run([*pip, "install", "--dry-run", "--ignore-installed", "--quiet",
                               "--report", str(report), *requirements], capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"error: resolving {' '.join(requirements)} failed: {_pip_error(proc.stderr)}")
        items = json.loads(report.read_text())["install"]
    return sorted((m["metadata"]["name"], m["metadata"]["version"]) for m in items
                  if normalize(m["metadata"]["name"]) != "odcfsdp")


def _pip_error(stderr: str) -> str:
    """pip's own error line out of its output (not the notes after it)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith("error:")]
    return (errors or lines or ["?"])[0].removeprefix("ERROR: ").removeprefix("error: ")


def fetch(name: str, version: str, out: Path, python_version: str, platforms: list[str], pip: list[str],
          index: list[str] = ()) -> str:
    """Put a wheel of ``name==version`` for the target into ``out``; returns how (downloaded / built)."""
    spec = f"{name}=={version}"
    plat = [a for p in platforms for a in ("--platform", p)]
    got = subprocess.run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
                          "--python-version", python_version, *plat, *index, "--dest", str(out), spec],
                         capture_output=True, text=True)
    if got.returncode == 0:
        return "downloaded"
    built = subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-binary", name, *index,
                            "--wheel-dir", str(out), spec],
                           capture_output=True, text=True)
    if built.returncode:
        raise SystemExit(f"error: no wheel of {spec} for cp{python_version.replace('.', '')} {platforms[0]}, and "
                         f"building one failed: {_pip_error(built.stderr)}")
    wheel = next((w for w in out.glob(f"{normalize(name).replace('-', '_')}-{version}-*.whl")), None)
    if wheel is not None and not wheel.name.endswith("-none-any.whl"):
        wheel.unlink()
        raise SystemExit(f"error: {spec} has no wheel for the target and builds only a platform wheel here "
                         f"({wheel.name}); build it on the target")
    return "built"


INSTALL_SH = """#!/bin/sh
# Install this bundle without network: sh install.sh [target directory] (default: the current environment).
set -e
here=$(cd "$(dirname "$0")" && pwd)
if [ -n "$1" ]; then
    python3 -m pip install --no-index --no-deps --target "$1" "$here"/*.whl
    echo "installed into $1: add it to PYTHONPATH"
else
    python3 -m pip install --no-index --no-deps "$here"/*.whl
fi
"""


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``odcfsdp-bundle``)."""
    p = argparse.ArgumentParser(prog="odcfsdp-bundle", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the wheels, requirements.txt, install.sh")
    p.add_argument("--extras", default="cuda", help="comma-separated extras of odcfsdp (cuda, hf, plot, test)")
    p.add_argument("--python-version", default="3.12", help="the target's Python (major.minor)")
    p.add_argument("--platform", action="append", default=None,
                   help="target platform tags (repeatable; default manylinux_2_28_x86_64 and manylinux2014_x86_64)")
    p.add_argument("--have", action="append", default=None,
                   help=f"packages the target already has (globs, repeatable; default {', '.join(DEFAULT_HAVE)})")
    p.add_argument("--only", action="append", default=None, help="bundle only these packages of the closure")
    p.add_argument("--requirement", action="append", default=None,
                   help="bundle the closure of these requirements instead of odcfsdp's own (repeatable)")
    p.add_argument("--find-links", default=None, help="a local directory of wheels / sources to take packages from")
    p.add_argument("--no-index", action="store_true", help="use no package index (with --find-links: a mirror)")
    a = p.parse_args(argv)
    if not re.fullmatch(r"\d+\.\d+", a.python_version):
        raise SystemExit(f"error: --python-version={a.python_version!r} must look like 3.12")
    pip = [sys.executable, "-m", "pip"]
    extras = [e for e in a.extras.split(",") if e]
    platforms = a.platform or ["manylinux_2_28_x86_64", "manylinux2014_x86_64"]
    have = tuple(a.have) if a.have is not None else DEFAULT_HAVE
    index = (["--no-index"] if a.no_index else []) + (["--find-links", a.find_links] if a.find_links else [])
    root = Path(__file__).resolve().parents[2]
    requirements = a.requirement or [f"{root}[{','.join(extras)}]" if extras else str(root)]
    print(f"resolving {' '.join(a.requirement or [f'odcfsdp[{a.extras}]'])} ...", file=sys.stderr)
    wanted = [(n, v) for n, v in closure([*index, *requirements], pip) if not _has(n, have)]
    if a.only:
        only = {normalize(o) for o in a.only}
        missing = only - {normalize(n) for n, _ in wanted}
        if missing:
            raise SystemExit(f"error: --only {sorted(missing)} is not in the closure (or is in --have)")
        wanted = [(n, v) for n, v in wanted if normalize(n) in only]
    a.out.mkdir(parents=True, exist_ok=True)
    for k, (name, version) in enumerate(wanted, 1):
        how = fetch(name, version, a.out, a.python_version, platforms, pip, index)
        print(f"[{k}/{len(wanted)}] {name}=={version}: {how}", file=sys.stderr)
    (a.out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in wanted))
    (a.out / "install.sh").write_text(INSTALL_SH)
    print(f"wrote {len(wanted)} wheels to {a.out}; on the target: sh {a.out}/install.sh /tmp/site", file=sys.stderr)


if __name__ == "__main__":
    main()
