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
from ..data.jsonl import JsonlSource, encode_capped, encode_record, read_records
from ..data.lengths import LengthDistribution
from ..data.parquet import is_parquet
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
    """The data file at ``path`` (``data.path`` or ``data.eval_path``: JSONL, a JSON array, or Parquet) read as
    ``data.format``, ``data.fields`` say."""
    d = cfg.data
    return JsonlSource(path, tokenizer, d.micro_batch_tokens + 1, seed, d.format, d.fields.mapping())


def _build_jsonl(cfg):
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    return jsonl_source(cfg, cfg.data.path, tokenizer, cfg.run.seed), tokenizer.vocab_size


def _validate_jsonl(cfg) -> None:
    if not cfg.data.path:
        raise ValueError("data.source=jsonl needs data.path=<file.jsonl>")


_UNLOADED = object()  # check_jsonl's tokenizer before it is needed (None: one that does not load)


def _run_tokenizer(cfg):
    """The tokenizer the ranks will load, or None where it does not load: what is wrong with it is the ranks'
    loader's to say (a missing tokenizer directory or file is named by ``preflight`` itself)."""
    try:
        return load_tokenizer(tokenizer_path(cfg))
    except Exception:  # noqa: BLE001 - any loader failure: the ranks raise it, with its own message
        return None


def check_jsonl(key: str, path: str, cfg) -> list[str]:
    """Every record of the file (JSONL, a JSON array, or Parquet) parses in ``data.format``, some record carries
    loss, and some keeps a loss-bearing token within ``data.micro_batch_tokens`` (the ranks refused a file of
    prompts longer than the cap only after they started). Records are tokenized, only as far as the cap keeps
    them ([truncate-first] in ``odcfsdp/data/truncate.py``), in file order until one fits: usually the first.
    Returns a note for each ``data.fields`` mapping whose column no record has."""
    data = cfg.data
    fields = data.fields.mapping()
    max_len = data.micro_batch_tokens + 1
    records = trained = 0
    columns: set[str] = set()
    tokenizer, fits, cut = _UNLOADED, False, None  # cut: the first record the cap left nothing to train on
    try:
        for lineno, record in read_records(path, key):
            columns.update(record if isinstance(record, dict) else ())
            try:
                sample = parse(record, data.format, fields)
            except ValueError as e:
                raise ValueError(f"{key}: {path}:{lineno}: {e}") from None
            records += 1
            carries_loss = not isinstance(sample, Chat) or any(sample.loss)
            trained += carries_loss
            if carries_loss and not fits:
                if tokenizer is _UNLOADED:  # loaded only for a file with records to tokenize
                    tokenizer = _run_tokenizer(cfg)
                if tokenizer is not None:
                    capped = encode_capped(record, tokenizer, f"{path}:{lineno}", max_len, data.format, fields)
                    fits = capped.kept
                    if capped.lost and cut is None:
                        cut = (f"{path}:{lineno}", record)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    except ImportError as e:  # a Parquet file without pyarrow: the message names the install command
        raise ValueError(f"{key}={path!r}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{key}: {e}" if not str(e).startswith(key) else str(e)) from None
    if not records:
        kind = "no row" if is_parquet(path) else "no record (one JSON object per line)"
        raise ValueError(f"{key}={path!r} holds {kind}")
    if not trained:
        raise ValueError(f"{key}={path!r}: none of its {records} records carries loss (a chat trains on its assistant "
                         "turns, and none has one)")
    if tokenizer is not None and not fits:
        raise ValueError(_cut_off(key, cut, trained, tokenizer, data) if cut else
                         f"{key}={path!r}: none of its {records} records has a loss-bearing token once tokenized")
    # A mapping that renames nothing is reported, not refused: a sweep over files may share one mapping.
    return [f"note: data.fields.{name}={column} renames nothing in {key}={path!r}: no record has a column "
            f"{column!r} (columns found: {', '.join(sorted(columns))})"
            for name, column in fields.items() if column not in columns]


#: how far past the cap the refusal of an over-long prompt looks for the first token trained on, to name the cap
#: that fits it (a bounded tokenization even of a prompt of megabytes)
PROMPT_PROBE = 8


def _cut_off(key: str, cut: tuple[str, dict], trained: int, tokenizer, data) -> str:
    """The refusal of a file whose ``trained`` records (those that carry loss) all have what they train on past the
    cap, naming the first of them (``cut``: where, record) and the ``data.micro_batch_tokens`` that keeps some of
    it."""
    where, record = cut
    cap = data.micro_batch_tokens
    probe = PROMPT_PROBE * (cap + 1)
    _, mask = encode_record(record, tokenizer, where, data.format, data.fields.mapping(), limit=probe)
    first = next((i for i, m in enumerate(mask) if m and i), None)  # token 0 is no target: a sample keeps 1 + cap
    fix = f"to at least {first}" if first else f"(its prompt alone is over {probe} tokens)"
    others = ", as does every other record of the file that trains on something" if trained > 1 else ""
    return (f"{key}: {where}: its prompt fills data.micro_batch_tokens={cap} (a sample's length cap), leaving "
            f"nothing to train on{others}: raise data.micro_batch_tokens {fix}")


register(DataSource(
    "jsonl", build=_build_jsonl, vocab_size=lambda cfg: load_tokenizer(tokenizer_path(cfg)).vocab_size,
    validate=_validate_jsonl, preflight=lambda cfg: check_jsonl("data.path", cfg.data.path, cfg),
    reads=("tokenizer_path", "format", "fields"), unread="it shapes synthetic data and this run reads data.path",
    implied_by="path", finite=True, tokenized=True, held_out=True))
