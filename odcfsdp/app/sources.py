"""Data sources: where a run's samples come from (``data.source``), one registration each.

Design note [data-sources]
--------------------------
``SOURCES`` is the one list of data sources, as ``TRANSPORTS`` is of transports
(``odcfsdp/sharding/transport``): each ``DataSource`` says how to build the source from the
config, its vocabulary, its checks (``validate``: values; ``preflight``: files, before any rank
starts), which ``data.*`` keys only it reads, and its facts (whether it has an end, reads a
tokenizer, takes a held-out file). ``data.source``'s choices, ``validate``, ``unused_key``
(``validation.py``), ``builders.build_source`` and ``vocab_size`` and ``preflight``'s data checks
read them from here; no other module branches on a source's name. Adding a source is one
``register(DataSource(...))`` below (and its field docs in ``DataConfig`` for keys of its own).

``data.source=auto`` is the first source whose ``implied_by`` key is set (``data.path``: jsonl),
else the one that no key implies (synthetic). The config is read by attribute: this module sits
below ``config`` ([layering]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..data.formats import Chat, parse
from ..data.jsonl import JsonlSource, read_records
from ..data.lengths import LengthDistribution
from ..data.synthetic import SyntheticSFT
from ..data.tokenizer import load_tokenizer
from .specs import model_spec


def _nothing(cfg) -> list[str]:
    return []


@dataclass(frozen=True)
class DataSource:
    """One ``data.source``.

    ``build(cfg)``: the sample source and its vocabulary size; ``vocab_size(cfg)``: that vocabulary without reading
    the data; ``config_vocab(cfg)``: the vocabulary the config alone sets (None: it comes from a file);
    ``validate(cfg)``: ``ValueError`` for values of the config this source cannot run with; ``preflight(cfg)``:
    ``ValueError`` for what would fail only after the ranks started (files), else notes; ``reads``: the ``data.*``
    keys (and groups) that only this source reads; ``unread``: why a run of this source does not read another
    source's keys; ``implied_by``: the ``data.*`` key whose value means this source under ``data.source=auto``
    (None: the source ``auto`` falls back to); ``finite``: it ends (``run.epochs`` counts passes over it);
    ``tokenized``: it reads text through a tokenizer (``data.tokenizer_path`` or the model's); ``held_out``: it
    takes a held-out file (``data.eval_path``).
    """

    name: str
    build: Callable[[Any], tuple[Any, int]]
    vocab_size: Callable[[Any], int]
    reads: tuple[str, ...]
    unread: str
    config_vocab: Callable[[Any], int | None] = lambda cfg: None
    validate: Callable[[Any], None] = lambda cfg: None
    preflight: Callable[[Any], list[str]] = _nothing
    implied_by: str | None = None
    finite: bool = False
    tokenized: bool = False
    held_out: bool = False


#: every data source by name, in the order ``data.source``'s choices list them.
SOURCES: dict[str, DataSource] = {}


def register(source: DataSource) -> DataSource:
    """Add ``source`` to ``SOURCES`` (its name must be new); returns it."""
    if source.name in SOURCES or source.name == "auto":
        raise ValueError(f"data source {source.name!r} is already registered")
    SOURCES[source.name] = source
    return source


def source_choices() -> tuple[str, ...]:
    """``data.source``'s values: ``auto`` and every registered source."""
    return ("auto", *SOURCES)


def data_source(cfg) -> str:
    """The data source the run reads: ``data.source``, where ``auto`` is the source ``implied_by`` a key that is set
    (jsonl when ``data.path`` is set), else the one no key implies."""
    if cfg.data.source != "auto":
        return cfg.data.source
    implied = [s for s in SOURCES.values() if s.implied_by and getattr(cfg.data, s.implied_by)]
    return (implied or [s for s in SOURCES.values() if s.implied_by is None])[0].name


def source_of(cfg) -> DataSource:
    """The registered ``DataSource`` the run reads (``data.source=auto`` resolved)."""
    return SOURCES[data_source(cfg)]


# -- synthetic ---------------------------------------------------------------------------------------------------------
def _build_synthetic(cfg):
    d = cfg.data
    lengths = LengthDistribution(d.lengths, cfg.run.seed)
    return SyntheticSFT(d.vocab_size, lengths, cfg.run.seed, d.pool_tokens, d.prompt_fraction), d.vocab_size


def _validate_synthetic(cfg) -> None:
    if cfg.data.path:
        raise ValueError(f"data.path={cfg.data.path!r} is not read with data.source=synthetic: drop data.source "
                         "(a data.path means jsonl) or drop data.path")


register(DataSource(
    "synthetic", build=_build_synthetic, vocab_size=lambda cfg: cfg.data.vocab_size,
    config_vocab=lambda cfg: cfg.data.vocab_size, validate=_validate_synthetic,
    reads=("vocab_size", "lengths", "prompt_fraction", "pool_tokens"),
    unread="synthetic data is not read from a file (set data.path to train on a JSONL file)"))


# -- jsonl -------------------------------------------------------------------------------------------------------------
def tokenizer_path(cfg) -> str | None:
    """``data.tokenizer_path``, or the model's own tokenizer (a pretrained HF model's ``model.path``), or None
    (bytes)."""
    return cfg.data.tokenizer_path or model_spec(cfg.model.name).tokenizer_path(cfg)


def jsonl_source(cfg, path: str, tokenizer, seed: int = 0) -> JsonlSource:
    """The JSONL file at ``path`` (``data.path`` or ``data.eval_path``) read as ``data.format``, ``data.fields`` say."""
    d = cfg.data
    return JsonlSource(path, tokenizer, d.micro_batch_tokens + 1, seed, d.format, d.fields.mapping())


def _build_jsonl(cfg):
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    return jsonl_source(cfg, cfg.data.path, tokenizer, cfg.run.seed), tokenizer.vocab_size


def _validate_jsonl(cfg) -> None:
    if not cfg.data.path:
        raise ValueError("data.source=jsonl needs data.path=<file.jsonl>")


def check_jsonl(key: str, path: str, data) -> list[str]:
    """Every record of the file parses in ``data.format``, and some record carries loss (reading only:
    tokenizing, and so truncation to ``data.micro_batch_tokens``, is the ranks' work). Returns a note for each
    ``data.fields`` mapping whose column no record has."""
    fields = data.fields.mapping()
    records = trained = 0
    columns: set[str] = set()
    try:
        for lineno, record in read_records(path, key):
            columns.update(record if isinstance(record, dict) else ())
            try:
                sample = parse(record, data.format, fields)
            except ValueError as e:
                raise ValueError(f"{key}: {path}:{lineno}: {e}") from None
            records += 1
            trained += not isinstance(sample, Chat) or any(sample.loss)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    except ValueError as e:
        raise ValueError(f"{key}: {e}" if not str(e).startswith(key) else str(e)) from None
    if not records:
        raise ValueError(f"{key}={path!r} holds no record (one JSON object per line)")
    if not trained:
        raise ValueError(f"{key}={path!r}: none of its {records} records carries loss (a chat trains on its assistant "
                         "turns, and none has one)")
    # A mapping that renames nothing is reported, not refused: a sweep over files may share one mapping.
    return [f"note: data.fields.{name}={column} renames nothing in {key}={path!r}: no record has a column "
            f"{column!r} (columns found: {', '.join(sorted(columns))})"
            for name, column in fields.items() if column not in columns]


register(DataSource(
    "jsonl", build=_build_jsonl, vocab_size=lambda cfg: load_tokenizer(tokenizer_path(cfg)).vocab_size,
    validate=_validate_jsonl, preflight=lambda cfg: check_jsonl("data.path", cfg.data.path, cfg.data),
    reads=("tokenizer_path", "format", "fields"), unread="it shapes synthetic data and this run reads data.path",
    implied_by="path", finite=True, tokenized=True, held_out=True))
