"""A local dataset file in any of the fine-tuning formats of ``formats.py``: JSONL, a JSON array, or Parquet.

Each line (each element of a JSON array, each row of a Parquet file, ``parquet.py``) is one
record: a chat (``messages``, ShareGPT ``conversations``, Alpaca), a prompt / completion
(TRL's), or plain ``text`` ([data-formats] in ``formats.py``); only the tokens the format
trains on carry loss (the tokenizer's chat template when it has one, see [chat-loss] in
``tokenizer.py``). Records are tokenized once at load, only as far as the ``max_len`` tokens
kept ([truncate-first] in ``truncate.py``), and visited in a seeded order that is
reshuffled every epoch. A UTF-8 byte-order mark, which Windows editors write, is skipped.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .formats import Chat, parse
from .packing import Sample
from .parquet import is_parquet, read_parquet
from .truncate import Piece, encode_pieces


def record_pieces(record: dict, tokenizer, where: str, data_format: str = "auto",
                  fields: dict[str, str] | None = None) -> list[Piece]:
    """One record as pieces with loss flags, each tokenized on its own (``where`` names the record in errors).

    A chat is the tokenizer's ``chat_pieces``; a prompt / completion (``text``: an empty prompt) is BOS, the
    prompt, the completion and EOS, with loss on the completion and the EOS.
    """
    try:
        example = parse(record, data_format, fields)
        if isinstance(example, Chat):
            return tokenizer.chat_pieces(example.turns, example.loss, example.tools)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return [([tokenizer.bos_id], False), (example.prompt, False), (example.completion, True),
            ([tokenizer.eos_id], True)]


def encode_record(record: dict, tokenizer, where: str, data_format: str = "auto",
                  fields: dict[str, str] | None = None, limit: int | None = None) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of one record (``where`` names it in errors): its pieces (``record_pieces``)
    tokenized and joined; with ``limit``, only the first ``limit`` of them, the same tokens and flags, from a
    tokenization that stops there ([truncate-first] in ``truncate.py``)."""
    return encode_pieces(tokenizer, record_pieces(record, tokenizer, where, data_format, fields), limit)[:2]


@dataclass
class Capped:
    """One record's encoding under a sample's length cap of ``max_len`` tokens."""

    ids: list[int]
    """its first ``max_len`` tokens"""
    mask: list[bool]
    """their loss flags"""
    truncated: bool
    """the record has more than ``max_len`` tokens"""
    kept: bool
    """a loss-bearing target lies within the cap (the first token is no target)"""
    lost: bool
    """none does, and a loss-bearing token lies past the cap: the cap cut off all that the record trains on"""


def encode_capped(record: dict, tokenizer, where: str, max_len: int, data_format: str = "auto",
                  fields: dict[str, str] | None = None) -> Capped:
    """``record`` encoded as a sample of at most ``max_len`` tokens, tokenizing only what the cap keeps (and one
    token more, to tell a record the cap shortened). The one reading of the cap: the sources' and the pre-start
    check's."""
    ids, mask, past = encode_pieces(tokenizer, record_pieces(record, tokenizer, where, data_format, fields),
                                    max_len + 1)
    kept = any(mask[1:max_len])
    return Capped(ids[:max_len], mask[:max_len], len(ids) > max_len, kept, not kept and (any(mask[max_len:]) or past))


#: the byte-order mark as text: Windows editors start UTF-8 files with it
BOM = "\ufeff"


def read_records(path: str | Path, key: str = "data.path") -> Iterator[tuple[int, dict]]:
    """(line number, parsed record) of every non-empty line of a JSONL file; of a ``.json`` file holding one array,
    (position from 1, record) of each element; of a Parquet file (``parquet.py``), (row from 1, record) of each row.

    A UTF-8 byte-order mark is skipped: at the start of the file, and at the start of a line (files joined with
    ``cat`` keep each one's). Raises ``FileNotFoundError`` naming ``key`` for a missing file, ``ImportError``
    naming the install command for a Parquet file without pyarrow, and ``ValueError`` naming the line (or
    position) for one that is not JSON, is nested too deeply to read, or holds a string that is not text (a lone
    UTF-16 surrogate such as ``"\\ud800"``, which no tokenizer can encode).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{key}={str(path)!r} is not a file")
    if is_parquet(p):
        yield from read_parquet(p)
        return
    # utf-8-sig: a leading BOM is no part of the text (json.loads refused it, naming a fix no command line applies)
    with p.open(encoding="utf-8-sig", errors="strict") as f:
        try:
            head = f.read(1 << 16).lstrip()
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text: data files are JSONL, a .json array, or Parquet (named "
                             "*.parquet)") from None
        f.seek(0)
        if head.startswith("["):  # one JSON array of records, as HF datasets' to_json(lines=False) writes
            text = f.read()
            records = _loads(text, f"{path}")
            if not isinstance(records, list):
                raise ValueError(f"{path}: a JSON file must hold one array of records, or one record per line")
            escapes = _may_hold_surrogates(text)
            yield from ((i, _text_only(r, f"{path}: record {i}") if escapes else r) for i, r in enumerate(records, 1))
            return
        for lineno, line in enumerate(f, 1):
            line = line.lstrip(BOM)
            if line.strip():
                record = _loads(line, f"{path}:{lineno}")
                yield lineno, _text_only(record, f"{path}:{lineno}") if _may_hold_surrogates(line) else record


def _loads(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to read (a record is a flat object of fields)") from None


def _may_hold_surrogates(text: str) -> bool:
    """Whether JSON ``text`` has a ``\\uD8xx``-``\\uDFxx`` escape, the only way a lone surrogate gets in (UTF-8
    input cannot hold one): the records of the rest need no second look."""
    return re.search(r"\\u[dD][89a-fA-F]", text) is not None


def _text_only(record, where: str):
    """``record`` unchanged, or ``ValueError`` where one of its strings holds a lone surrogate (not encodable)."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end].encode("unicode_escape").decode()
        raise ValueError(f"{where}: holds {bad!r}, a lone UTF-16 surrogate, not text") from None
    return record


class JsonlSource:
    """Samples from a local data file (JSONL, a JSON array, or Parquet: ``read_records``); index i is the i-th
    sample of a seeded endless stream of epochs.

    ``data_format`` and ``fields`` are ``data.format`` and ``data.fields`` (see ``formats.parse``).
    """

    def __init__(self, path: str, tokenizer, max_len: int, seed: int = 0, data_format: str = "auto",
                 fields: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        dropped = cut_off = truncated = 0  # no loss-bearing token; none left after truncation; truncated at all
        for lineno, record in read_records(path):
            sample = encode_capped(record, tokenizer, f"{path}:{lineno}", max_len, data_format, fields)
            truncated += sample.truncated
            if len(sample.ids) < 2 or not sample.kept:
                dropped += 1
                cut_off += sample.lost
                continue
            self.records.append((torch.tensor(sample.ids), torch.tensor(sample.mask)))
        cap = f"data.micro_batch_tokens={max_len - 1} caps a sample's length: raise it"
        if not self.records:
            parts = [f"{dropped - cut_off} record(s) without any loss-bearing token"] if dropped > cut_off else []
            parts += [f"{cut_off} whose loss-bearing tokens all lie past the first {max_len - 1} ({cap})"] if cut_off \
                else []
            raise ValueError(f"{path} holds no usable record: " + ("; ".join(parts) or "the file holds no record"))
        self.dropped = dropped
        # The run's start-up note: samples the cap shortened (or emptied of loss-bearing tokens and dropped).
        self.truncation_note = None if not truncated else (
            f"note: {path}: {truncated} of {len(self.records) + dropped} records are longer than {max_len - 1} tokens "
            f"and were truncated" + (f" ({cut_off} lost every loss-bearing token: dropped)" if cut_off else "")
            + f"; {cap}")
        self.seed = seed
        self.num_samples = len(self.records)
        self._orders: dict[int, list[int]] = {}

    def _record(self, index: int) -> int:
        epoch, pos = divmod(index, self.num_samples)
        if epoch not in self._orders:
            order = list(range(self.num_samples))
            random.Random(self.seed * 1_009 + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a run needs
        return self._orders[epoch][pos]

    def length(self, index: int) -> int:
        return self.records[self._record(index)][0].numel()

    def __getitem__(self, index: int) -> Sample:
        ids, mask = self.records[self._record(index)]
        return Sample(index, ids, mask)
