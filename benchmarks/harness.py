"""What every benchmark shares: the common flags, ``meta()``, one result writer (and the reader of every shape
committed under results/), and the launch of its ranks.

The result schema (docs/benchmarks.md)::

    {"meta": {"date": "YYYY-MM-DD", "commit": "abc1234", "command": "python -m benchmarks.x ...",
              "device": "NVIDIA H200 x 2", ...what else the run needs to be read...},
     "rows": [{...one measured thing...}, ...]}

A script may add further top-level tables next to ``rows`` (``step_sim``'s ``measured``); ``rows`` is its main one.
Files committed before the schema (``results`` / ``runs`` / ``points`` / ``tests``, or meta fields at the top)
are read through ``load_result``, never rewritten.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks import provenance

ROOT = Path(__file__).resolve().parents[1]
META_KEYS = ("date", "commit", "command", "device")
#: the row lists of results written before the one schema, by key (first match wins)
LEGACY_ROWS = ("results", "runs", "points", "tests")


# -- flags ------------------------------------------------------------------------------------------------------------
def add_common(p: argparse.ArgumentParser, out: str | None = None, cpu_ranks: bool = False) -> argparse.ArgumentParser:
    """``--out`` (required when ``out`` is None, else its default) and ``--commit`` (``provenance.default_commit``);
    with ``cpu_ranks``, ``--cpu-ranks N`` (a CPU run on N spawned gloo ranks instead of torchrun's GPUs)."""
    if out is None:
        p.add_argument("--out", required=True, help="folder the results are written to")
    else:
        p.add_argument("--out", default=out, help="folder the results are written to")
    p.add_argument("--commit", default=provenance.default_commit(), help="the commit the results name")
    if cpu_ranks:
        p.add_argument("--cpu-ranks", type=int, default=0, help="CPU run: spawn this many gloo ranks (no torchrun)")
    return p


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that reproduces this run: ``python -m benchmarks.<module> ARGS``."""
    args = sys.argv[1:] if argv is None else argv
    if module == "__main__":  # run as `python -m benchmarks.x` (or torchrun -m): __name__ is __main__, the spec knows
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else Path(sys.argv[0]).stem
    return " ".join(["python -m benchmarks." + module.rsplit(".", 1)[-1], *map(str, args)])


# -- meta -------------------------------------------------------------------------------------------------------------
def device_name(device: Any = None, world: int | None = None) -> str:
    """The device a run measured: the CUDA device's name (``cpu`` otherwise), `` x world`` when given."""
    import torch

    cuda = device is None and torch.cuda.is_available() or getattr(device, "type", device) == "cuda"
    name = torch.cuda.get_device_name(device if device is not None and not isinstance(device, str) else None) \
        if cuda else "cpu"
    return name if world is None else f"{name} x {world}"


def meta(commit: str, command: str, device: str, date: str | None = None, **extra) -> dict:
    """A result's ``meta``: date (today), commit, command and device first, then ``extra``."""
    return {"date": date or datetime.date.today().isoformat(), "commit": commit, "command": command,
            "device": device, **extra}


# -- results ----------------------------------------------------------------------------------------------------------
def write_result(out: Path | str, name: str, meta: dict, rows: list, markdown: str | None = None,
                 **tables) -> dict:
    """Write ``out/<name>.json`` in the one schema (``tables``: further top-level tables) and, when given,
    ``out/<name>.md``; returns the data written."""
    missing = [k for k in META_KEYS if k not in meta]
    assert not missing, f"meta lacks {missing}"
    assert isinstance(rows, list), type(rows)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "rows": rows, **tables}
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    if markdown is not None:
        (out / f"{name}.md").write_text(markdown)
    return data


def normalize(data: dict) -> dict:
    """Any committed result as the one schema: ``meta`` (the top-level date/commit/command/device of old files
    moved in) and ``rows`` (``results`` / ``runs`` / ``points`` / ``tests`` of old files, or the file's other
    top-level fields as one row); the other top-level tables are kept."""
    data = dict(data)
    if "meta" not in data:
        data["meta"] = {k: data.pop(k) for k in list(data) if k in META_KEYS}
    if "rows" not in data:
        key = next((k for k in LEGACY_ROWS if isinstance(data.get(k), list)), None)
        if key is not None:
            data["rows"] = data.pop(key)
        else:
            row = {k: data.pop(k) for k in list(data) if k != "meta"}
            data["rows"] = [row] if row else []
    return data


def load_result(path: Path | str) -> dict:
    """Read a result file of any shape (``normalize``)."""
    return normalize(json.loads(Path(path).read_text()))


def rows(data_or_path: dict | Path | str) -> list:
    """The rows of a result (a loaded dict or a file), whatever its shape."""
    data = data_or_path if isinstance(data_or_path, dict) else json.loads(Path(data_or_path).read_text())
    return normalize(data)["rows"]


# -- processes --------------------------------------------------------------------------------------------------------
def run_benchmark_ranks(worker: Callable[[Any, Any], Any], args: Any, cpu_ranks: int, timeout: float = 600.0) -> None:
    """A benchmark's ranks: ``worker(args, None)`` on ``cpu_ranks`` spawned gloo ranks when it is > 0 (a CPU run),
    else ``worker(args, device)`` on this ``torchrun`` rank's GPU, the process group closed afterwards."""
    import torch.distributed as dist

    from odcfsdp.launch import init_torchrun, spawn

    if cpu_ranks:
        spawn(worker, cpu_ranks, args, None, timeout=timeout)
        return
    worker(args, init_torchrun(use_cuda=True))
    dist.destroy_process_group()


def module_env() -> dict:
    """The environment for a subprocess that runs ``-m benchmarks.<name>``: this checkout first on PYTHONPATH."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
