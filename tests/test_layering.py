"""The package's structure: no import cycle, lower layers never import higher ones, no source file over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "odcfsdp"
# Lower layers first; a module may import only from its own layer or lower ones (README: Layout).
LAYERS = [
    ["kernels", "schedule", "mfu", "metrics", "checks", "data", "bundle", "interrupts", "launcher_link"],
    ["sharding", "models", "optim", "launch", "plot"],
    ["checkpoint", "memory", "loop"],
    ["specs"],
    ["shard_config", "config"],
    ["preflight", "builders", "cli"],
    ["trainer", "export"],
    ["train"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    target = next((c for c in (f"{base}.{alias.name}", base) if c in mods), None)
                    if target and target != m:
                        graph[m].add(target)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
    # A package's __init__ re-exporting its own children is not a dependency of the children on it.
    return {m: {d for d in ds if not (mods[d].name == "__init__.py" and m.startswith(d + "."))}
            for m, ds in graph.items()}


def _layer(module: str) -> int | None:
    top = module.split(".")[1] if module.count(".") else None
    return next((k for k, names in enumerate(LAYERS) if top in names), None)


def test_no_import_cycle():
    graph = _imports(_modules())
    seen: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in graph[m]:
            assert seen.get(d) != 1, f"import cycle: {' -> '.join(path + [m, d])}"
            if d not in seen:
                visit(d, path + [m])
        seen[m] = 2

    for m in graph:
        if m not in seen:
            visit(m, [])


def test_lower_layers_never_import_higher_ones():
    graph = _imports(_modules())
    up = [(m, d) for m, ds in graph.items() for d in ds
          if _layer(m) is not None and _layer(d) is not None and _layer(d) > _layer(m)]
    assert not up, f"imports that run back up: {up}"
    unplaced = sorted({m.split(".")[1] for m in graph if m.count(".") and _layer(m) is None})
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for d in ("odcfsdp", "benchmarks", "tests", "examples")
            for p in (ROOT / d).rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
