"""The package's structure: no import cycle, lower layers never import higher ones, no source file over 400 lines,
no package line over 120 characters, at most TOP_MODULES modules at the top of the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "odcfsdp"
# Lower layers first; a module may import only from its own layer or lower ones (README: Layout). The library is
# everything but ``app`` (the training application) and the four command-line shims above it, which keep the
# documented ``python -m odcfsdp.<name>``.
LAYERS = [
    ["torch_private"],  # [torch-private]: the adapter, the one module that touches torch's private APIs
    ["kernels", "mfu", "checks", "data", "interrupts"],
    ["sharding", "models", "optim", "launch"],
    ["checkpoint", "memory", "loop"],
    ["app"],
    ["train", "export", "plot", "bundle"],
]
# Inside ``app``, the same rule over its own modules (shifted above the library's layers).
APP_LAYERS = [
    ["metrics", "bundle", "plot", "resume_setup"],
    ["specs"],
    ["shard_config", "sources"],
    ["validation"],
    ["config"],
    ["preflight", "builders", "cli"],
    ["trainer", "export"],
    ["train"],
]
# Inside ``sharding``, its subpackages by responsibility, lowest first (docs/design.md, Layout): a module may import
# only from its own subpackage or lower ones; ``sharding/__init__`` (the re-exports) sits above them all.
SHARDING_LAYERS = ["placement", "transport", "groups", "runtime", "api"]
#: at most this many modules directly under odcfsdp/ (the library's front; the application lives in app/)
TOP_MODULES = 10


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


def _layer(module: str) -> float | None:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else None
    layer = next((k for k, names in enumerate(LAYERS) if top in names), None)
    if top == "app" and len(parts) > 2:  # app.<name>: its place inside app, between app's layer and the next
        inner = next((k for k, names in enumerate(APP_LAYERS) if parts[2] in names), None)
        return None if inner is None else layer + inner / len(APP_LAYERS)
    return layer


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
    unplaced = sorted({".".join(m.split(".")[1:3]) for m in graph if m.count(".") and _layer(m) is None})
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_sharding_subpackages_import_only_their_own_layer_or_lower_ones():
    """sharding/ is its subpackages and the front door's re-exports; none imports one above it."""
    mods = _modules()
    graph = _imports(mods)
    flat = sorted(p.name for p in (PACKAGE / "sharding").glob("*.py"))
    assert flat == ["__init__.py"], f"modules directly under sharding/ (put each in a subpackage): {flat}"
    assert sorted(p.parent.name for p in (PACKAGE / "sharding").glob("*/__init__.py")) == sorted(SHARDING_LAYERS)

    def rank(m: str) -> int | None:
        parts = m.split(".")
        return SHARDING_LAYERS.index(parts[2]) if parts[:2] == ["odcfsdp", "sharding"] and len(parts) > 2 else None

    up = [(m, d) for m, ds in graph.items() for d in ds
          if rank(m) is not None and rank(d) is not None and rank(d) > rank(m)]
    assert not up, f"sharding imports that run back up: {up}"


def test_no_package_line_over_120_characters():
    """ruff's line length: a file near its limit is split, never squeezed into long lines."""
    long = [f"{p.relative_to(ROOT)}:{k}" for p in PACKAGE.rglob("*.py")
            for k, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert not long, long


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for d in ("odcfsdp", "benchmarks", "tests", "examples")
            for p in (ROOT / d).rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_the_top_of_the_package_is_the_library_front():
    """At most TOP_MODULES modules directly under odcfsdp/ (the training application is app/'s)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_MODULES, top
