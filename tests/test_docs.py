"""Documentation derived from code stays in step with it."""

import re
from pathlib import Path

import pytest

from odcfsdp.sharding.transport import COMM_CHOICES, TRANSPORTS, transport_class, transport_table

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"
#: every page: the README and each docs/*.md
PAGES = [README, *sorted(DOCS.glob("*.md"))]
#: links to files that other branches of issue 33 add (docs/benchmarks.md; the [lifecycle] note's module): allowed
#: to be missing until they land; drop each entry once its file is in the checkout
PENDING: set[str] = set()


def test_design_transport_table_is_the_generated_one():
    """docs/design.md's table of transports is ``transport_table()`` verbatim (regenerate it when a transport
    changes)."""
    assert transport_table() in (DOCS / "design.md").read_text()


def test_comm_choices_are_the_documented_transports_and_each_one_is_accepted():
    """The documented choices (the README's and design.md's), each accepted where its capabilities say it runs, an
    unknown one refused naming them, and every transport's facts filled in."""
    assert COMM_CHOICES == ("auto", "nvshmem", "shm", "collective")
    assert all(t.caps.devices and t.caps.where and t.caps.how for t in TRANSPORTS.values())
    for name in COMM_CHOICES[1:]:
        for device in TRANSPORTS[name].caps.devices:
            assert transport_class(name, device) is TRANSPORTS[name]
    with pytest.raises(ValueError, match="auto.*nvshmem.*shm.*collective"):
        transport_class("nccl", "cpu")


def test_device_checks_come_from_the_registry():
    assert transport_class("auto", "cuda").name == "nvshmem" and transport_class("auto", "cpu").name == "shm"
    with pytest.raises(ValueError, match=r"comm='shm' moves cpu tensors, the model is on cuda; use comm='auto' or "
                                         r"one of \['nvshmem', 'collective'\]"):
        transport_class("shm", "cuda")
    with pytest.raises(ValueError, match="comm='nvshmem' moves cuda tensors, the model is on cpu"):
        transport_class("nvshmem", "cpu")


def test_every_shard_key_has_its_help():
    """Each ``shard.*`` key has its docstring, the help ``--help`` prints ([shard-config]; tests/test_config.py holds
    the keys equal to ODCShard's arguments)."""
    import dataclasses

    from odcfsdp.checks import field_docs
    from odcfsdp.app.shard_config import ShardConfig

    assert all(field_docs(ShardConfig).get(f.name) for f in dataclasses.fields(ShardConfig))


# -- every figure traceable (issue 31) ---------------------------------------------------------------------------------
#: a measured figure: a number followed by x (a ratio), GiB, GB/s, tokens/s, % or ms ("2x2" is a mesh, not a ratio)
FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:\s?K)?(?:x(?!\w)|\s?(?:GiB|GB/s|tokens/s|ms)(?!\w)|%)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_blocks(text: str) -> list[str]:
    """The paragraphs, list items, table rows and headings of ``text``, outside fenced code blocks."""
    blocks: list[list[str]] = []
    fenced = False
    current: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced, current = not fenced, None
            continue
        body = stripped.lstrip("> ").strip() if stripped.startswith(">") else stripped
        if fenced or not body:
            current = None
            continue
        starts = body.startswith(("|", "#", "* ", "- ", "![")) or re.match(r"\d+\. ", body)
        if current is None or starts or current[0].startswith(("|", "#")):
            current = []
            blocks.append(current)
        current.append(body)
    return [" ".join(b) for b in blocks]


def link_targets(block: str) -> list[str]:
    """The block's relative link targets (anchors dropped; web addresses and in-page anchors left out)."""
    return [t.split("#")[0] for t in LINK.findall(block) if "://" not in t and not t.startswith("#")]


def broken_links(path: Path, repo: Path = README.parent) -> list[str]:
    """Relative links of ``path`` into ``repo`` whose target does not exist."""
    repo = repo.resolve()
    return [t for block in markdown_blocks(path.read_text()) for t in link_targets(block)
            if (path.parent / t).resolve().is_relative_to(repo) and not (path.parent / t).resolve().exists()]


def unlinked_figures(path: Path, repo: Path = README.parent) -> list[str]:
    """Blocks of ``path`` that state a figure without a link into ``repo``'s results/ or docs/history.md."""
    bad = []
    roots = (repo.resolve() / "results", repo.resolve() / "docs" / "history.md")
    for block in markdown_blocks(path.read_text()):
        if not FIGURE.search(block):
            continue
        resolved = [(path.parent / t).resolve() for t in link_targets(block)]
        if not any(r == root or root in r.parents for r in resolved for root in roots):
            bad.append(f"{path.name}: {block[:160]}")
    return bad


def test_the_checks_catch_an_unlinked_figure_and_a_broken_link(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "x.md").write_text("64.0\n")
    page = tmp_path / "README.md"
    page.write_text("# t\n\n```bash\npip install -e .   # 5 GiB\n```\n\nFast: 1.13x FSDP2.\n\n"
                    "| a | 64.0 GiB |\n| b | [64.0 GiB](results/x.md) |\n\n* a 2x2 mesh, 18P/N bytes\n"
                    "> Status:\n>\n> * 24.3K tokens/s ([run](results/y.md))\n")
    assert [b.split(": ", 1)[1] for b in unlinked_figures(page, tmp_path)] == ["Fast: 1.13x FSDP2.",
                                                                              "| a | 64.0 GiB |"]
    assert broken_links(page, tmp_path) == ["results/y.md"]


def pending(target: Path, repo: Path = README.parent) -> bool:
    """Whether ``target`` is a file another branch adds (``PENDING``) and is not here yet."""
    return target.resolve().relative_to(repo.resolve()).as_posix() in PENDING


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_figure_links_to_its_results_file(page):
    """Each paragraph, list item or table row of the README and of every docs/*.md page that states a measured
    figure links to the committed file under results/ it comes from (or to docs/history.md, which does)."""
    assert unlinked_figures(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_results_and_docs_link_resolves(page):
    """Every relative link of the README and of every docs/*.md page (results/, docs/, code, anything in the
    checkout) exists, but for the files other branches add (``PENDING``)."""
    assert [t for t in broken_links(page) if not pending(page.parent / t)] == []


def test_readme_is_at_most_16_kb():
    """The README says what and why and links on; the rest lives in docs/ (issue 33)."""
    assert len(README.read_bytes()) <= 16 * 1024


def test_readme_starts_with_the_two_commands():
    """The two commands at the README's top: install and run the main job, install and run the tests; CI runs the
    second verbatim (.ci/run)."""
    text = README.read_text()
    assert text.startswith("# odcfsdp\n\n```bash\n")
    lines = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    commands = [line.split("  #", 1)[0].strip() for line in lines]
    assert commands == ["pip install -e . && python -m odcfsdp.train",
                        'pip install -e ".[test]" && python -m pytest -n 2 --dist loadfile']
    assert commands[1] + "\n" in (README.parent / ".ci" / "run").read_text().splitlines(keepends=True)
    assert "No GPU? Run `pip install torch --index-url https://download.pytorch.org/whl/cpu` first" in text


def _readme_example(steps: int) -> str:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert "for step in range(20):" in code and len(code.splitlines()) <= 25
    return code.replace("range(20)", f"range({steps})") + "\nassert torch.isfinite(loss)\n"


def test_readme_example_runs_in_one_process_and_says_what_it_trained():
    """The README's Python example is a working loop (one process, CPU; 2 of its steps) that prints what it did."""
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(README.parent)
    done = subprocess.run([sys.executable, "-c", _readme_example(2)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(r"rank 0: 2 steps, 1 micro-batches each, last loss \d+\.\d{3}\n", done.stdout), done.stdout


def test_readme_example_under_torchrun_trains_as_ranks_and_refuses_separate_copies(tmp_path):
    """Under ``torchrun --nproc-per-node=2`` the example trains as 2 ranks (rank r runs r + 1 micro-batches); without
    its ``init_process_group`` line each rank would train a copy of its own, and is refused in one line, rc 1."""
    import os
    import subprocess
    import sys

    from odcfsdp.launch import free_port

    (tmp_path / "example.py").write_text(_readme_example(2))
    (tmp_path / "alone.py").write_text(_readme_example(2).replace("if \"RANK\" in os.environ:", "if False:"))
    env = {**os.environ, "PYTHONPATH": str(README.parent), "OMP_NUM_THREADS": "1"}
    runs = {}
    for name in ("example", "alone"):
        runs[name] = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                     f"--master-port={free_port()}", str(tmp_path / f"{name}.py")], env=env,
                                    capture_output=True, text=True, timeout=300)
    assert runs["example"].returncode == 0, runs["example"].stderr[-3000:]
    said = sorted(re.findall(r"rank (\d): 2 steps, (\d) micro-batches each", runs["example"].stdout))
    assert said == [("0", "1"), ("1", "2")], runs["example"].stdout
    assert runs["alone"].returncode == 1
    assert ("RuntimeError: WORLD_SIZE=2: a launcher (torchrun) started 2 ranks, but torch.distributed is not "
            "initialised") in runs["alone"].stderr


def test_cli_page_is_the_generated_one():
    """docs/cli.md's key reference is docs/gen_cli.py's output (run ``python docs/gen_cli.py`` after changing a
    config field, its help or a preset)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    page = (DOCS / "cli.md").read_text()
    assert gen_cli.MARKER in page
    assert page == gen_cli.render(page)
    from odcfsdp.app.cli import key_table

    assert [k for k, _, _ in key_table() if f"| `{k}` |" not in page] == []


@pytest.mark.parametrize("name", ["ODCShard", "fully_shard"])
def test_documented_arguments_are_the_signature(name):
    """Wherever the README or a docs page lists ODCShard's or fully_shard's arguments (a heading
    ``odcfsdp.ODCShard(...)``), the list is ``inspect.signature``'s, in order, and that page names every argument in
    backticks (``name`` or ``name=...``) elsewhere."""
    import inspect

    import odcfsdp

    obj = getattr(odcfsdp, name)
    names = [n for n in inspect.signature(obj.__init__ if isinstance(obj, type) else obj).parameters if n != "self"]
    found = 0
    for page in PAGES:
        text = page.read_text()
        for heading in re.finditer(rf"^#+ `odcfsdp\.{name}\((.*)\)`$", text, re.M):
            found += 1
            listed = [a.split("=")[0].strip() for a in heading.group(1).split(",") if a.strip() != "*"]
            assert listed == names, page.name
            body = text.replace(heading.group(0), "")
            assert [n for n in names if not re.search(rf"`{n}[`=]", body)] == [], page.name
    assert found, f"no page lists {name}'s arguments"


#: a design note named by tag and file: "[memory-model] in `odcfsdp/memory/__init__.py`" (the file may be a link)
NOTE_REFERENCE = re.compile(r"\[([a-z0-9-]+)\](?: \d+)?\s+in\s+\[?`((?:odcfsdp|benchmarks)/[\w./-]+\.py)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_design_note_named_by_file_is_in_that_file(page):
    """A design note the docs name by tag and file is in that file (notes move; the docs must follow)."""
    text = " ".join(markdown_blocks(page.read_text()))
    wrong = []
    for tag, file in NOTE_REFERENCE.findall(text):
        path = README.parent / file
        if not path.exists():
            wrong += [] if file in PENDING else [f"[{tag}] in {file}: no such file"]
        elif f"[{tag}]" not in path.read_text():
            wrong.append(f"[{tag}] in {file}: not there")
    assert wrong == []


#: a design note's heading, and its block: up to the docstring's end or the next note
NOTE = re.compile(r"Design note \[([a-z0-9-]+)\](.*?)(?=Design note \[|\"\"\"|\Z)", re.S)
#: a reference to a note, ``[name]`` or ``[name] N`` (``[name] N-M``): not a markdown link, not an index (``x[i-1]``)
NOTE_REF = re.compile(r"(?<![\w\]\[])\[([a-z][a-z0-9]+(?:-[a-z0-9]+)*)\](?!\()(?:\s+(\d+)(?:-(\d+))?)?")
#: bracketed words that are no note: TOML tables
NOT_NOTES = {"build-system", "project", "tool"}


def _notes_and_references() -> tuple[dict[str, int], list[tuple[str, int, str, str | None]]]:
    """Every design note (name -> its numbered items' count) and every reference to one (file, line, name, item)
    in the package, the benchmarks, the tests and the docs."""
    repo = README.parent
    files = [*sorted((repo / "odcfsdp").rglob("*.py")), *sorted((repo / "benchmarks").rglob("*.py")),
             *sorted((repo / "tests").glob("*.py")), *PAGES]
    notes: dict[str, int] = {}
    for f in files:
        for m in NOTE.finditer(f.read_text()):
            items = [int(n) for n in re.findall(r"^\s*(\d+)\. ", m.group(2), re.M)]
            notes[m.group(1)] = max(items, default=0)
    refs = []
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for m in NOTE_REF.finditer(line):
                cited = line[m.end():].startswith(" in ``")  # "[engine] in ``engine.py``": a note, wherever it is
                if "-" in m.group(1) or m.group(1) in notes or cited:
                    refs += [(f"{f.relative_to(repo)}:{n}", n, m.group(1), m.group(2)),
                             *([(f"{f.relative_to(repo)}:{n}", n, m.group(1), m.group(3))] if m.group(3) else [])]
    return notes, refs


def test_every_design_note_reference_names_a_note_and_one_of_its_items():
    """``[name]`` and ``[name] N`` point at a ``Design note [name]`` that exists and has an item N (issue 43: 74
    references were checked by nothing, and ``[engine]`` pointed nowhere)."""
    notes, refs = _notes_and_references()
    assert len(notes) > 40 and len(refs) > 200
    dangling = [f"{where}: [{name}]" for where, _, name, _ in refs if name not in notes and name not in NOT_NOTES]
    beyond = [f"{where}: [{name}] {item} (the note has {notes[name]} items)" for where, _, name, item in refs
              if name in notes and item and int(item) > notes[name]]
    assert dangling == [] and beyond == []


def test_design_layout_names_every_file_of_the_packages_it_lists():
    """docs/design.md's layout: a package whose row names files names all of them (a subpackage by its folder, or by
    a row of its own indented under the package's, which then names its files), and every file a row names exists
    there; every package of odcfsdp has a row (issue 43 item 4)."""
    text = (DOCS / "design.md").read_text()
    block = text.split("## Layout of the checkout", 1)[1].split("```", 2)[1]
    rows: dict[str, str] = {}  # "sharding", "sharding/runtime", ...
    current = parent = None
    for line in block.splitlines():
        top, sub = re.match(r"^  (\w+)/\s", line), re.match(r"^    (\w+)/\s", line)
        if top:
            current = parent = top.group(1)
            rows[current] = line
        elif sub and parent is not None:
            current = f"{parent}/{sub.group(1)}"
            rows[parent] += f" {sub.group(1)}/"
            rows[current] = line
        elif line.startswith("    ") and current is not None:
            rows[current] += " " + line
        else:
            current = parent = None
    package = README.parent / "odcfsdp"
    subpackages = sorted(p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(r for r in rows if "/" not in r) == subpackages
    problems = []
    for name, row in rows.items():
        named = set(re.findall(r"(\w+)\.py\b", row.split("/", 1)[1] if "/" in name else row))
        folder = package / name
        folders = {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        problems += [f"{name}/{d}/ is not in the layout" for d in sorted(folders) if f"{d}/" not in row]
        if not named:
            continue  # a row that says what the package does, not file by file
        files = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | ({"__init__"} & named)
        problems += [f"{name}/{f}.py is not in the layout" for f in sorted(files - named)]
        problems += [f"{name}/{f}.py is in the layout but not in the package" for f in sorted(named - files)]
    assert problems == [], "\n".join(problems)
