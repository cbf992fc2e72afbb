"""Documentation derived from code stays in step with it."""

import re
from pathlib import Path

import pytest

from odcfsdp.sharding.transport import COMM_CHOICES, TRANSPORTS, transport_class, transport_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_transport_table_is_the_generated_one():
    """The README's table of transports is ``transport_table()`` verbatim (regenerate it when a transport changes)."""
    assert transport_table() in README.read_text()


def test_comm_choices_come_from_the_registry():
    assert COMM_CHOICES == ("auto", *TRANSPORTS)
    assert all(t.caps.devices and t.caps.where and t.caps.how for t in TRANSPORTS.values())


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

    from odcfsdp.app.cli import field_docs
    from odcfsdp.app.shard_config import ShardConfig

    assert all(field_docs(ShardConfig).get(f.name) for f in dataclasses.fields(ShardConfig))


# -- every figure traceable (issue 31) ---------------------------------------------------------------------------------
HISTORY = README.parent / "docs" / "history.md"
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


@pytest.mark.parametrize("page", [README, HISTORY], ids=lambda p: p.name)
def test_every_figure_links_to_its_results_file(page):
    """Each paragraph, list item or table row of the README (and docs/history.md) that states a measured figure
    links to the committed file under results/ it comes from (or to docs/history.md, which does)."""
    assert unlinked_figures(page) == []


@pytest.mark.parametrize("page", [README, HISTORY], ids=lambda p: p.name)
def test_every_results_and_docs_link_resolves(page):
    """Every relative link of the README and docs/history.md (results/, docs/, anything in the checkout) exists."""
    assert broken_links(page) == []


def test_readme_odcshard_heading_lists_every_argument_and_describes_it():
    """The README's ODCShard heading lists the real signature, and every keyword argument is named in backticks
    (``name`` or ``name=...``) elsewhere in the README."""
    import inspect

    from odcfsdp import ODCShard

    names = [n for n in inspect.signature(ODCShard.__init__).parameters if n != "self"]
    text = README.read_text()
    heading = re.search(r"^### `odcfsdp\.ODCShard\((.*)\)`$", text, re.M)
    assert heading, "no ODCShard heading"
    listed = [a.split("=")[0].strip() for a in heading.group(1).split(",") if a.strip() != "*"]
    assert listed == names
    body = text.replace(heading.group(0), "")
    assert [n for n in names if not re.search(rf"`{n}[`=]", body)] == []
