"""A local JSONL dataset in any of the fine-tuning formats of ``formats.py``.

Each line is one record: a chat (``messages``, ShareGPT ``conversations``, Alpaca), a
prompt / completion (TRL's), or plain ``text`` ([data-formats] in ``formats.py``); only
the tokens the format trains on carry loss (the tokenizer's chat template when it has one,
see [chat-loss] in ``tokenizer.py``). Records are tokenized once at load, truncated to
``max_len`` tokens, and visited in a seeded order that is reshuffled every epoch.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Iterator

import torch

from .formats import Chat, parse
from .packing import Sample


def encode_record(record: dict, tokenizer, where: str, data_format: str = "auto",
                  fields: dict[str, str] | None = None) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of one record (``where`` names it in errors).

    A chat is the tokenizer's ``encode_chat``; a prompt / completion (``text``: an empty
    prompt) is BOS + prompt + completion + EOS, each tokenized on its own, with loss on the
    completion and the EOS.
    """
    try:
        example = parse(record, data_format, fields)
        if isinstance(example, Chat):
            return tokenizer.encode_chat(example.turns, example.loss, example.tools)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    prompt = tokenizer.encode(example.prompt) if example.prompt else []
    body = tokenizer.encode(example.completion) + [tokenizer.eos_id]
    return [tokenizer.bos_id] + prompt + body, [False] * (1 + len(prompt)) + [True] * len(body)


def read_records(path: str | Path, key: str = "data.path") -> Iterator[tuple[int, dict]]:
    """(line number, parsed record) of every non-empty line of a JSONL file; of a ``.json`` file holding one array,
    (position from 1, record) of each element.

    Raises ``FileNotFoundError`` naming ``key`` for a missing file and ``ValueError`` naming the line (or position)
    for one that is not JSON, is nested too deeply to read, or holds a string that is not text (a lone UTF-16
    surrogate such as ``"\\ud800"``, which no tokenizer can encode).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{key}={str(path)!r} is not a file")
    with p.open(encoding="utf-8", errors="strict") as f:
        try:
            head = f.read(1 << 16).lstrip()
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text: data files are JSONL, or a .json array ({PARQUET_HINT})") \
                from None
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
            if line.strip():
                record = _loads(line, f"{path}:{lineno}")
                yield lineno, _text_only(record, f"{path}:{lineno}") if _may_hold_surrogates(line) else record


#: what a binary data file (parquet, arrow) is told to become
PARQUET_HINT = "convert a parquet file with pandas.read_parquet(...).to_json(path, orient='records', lines=True)"


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
    """Samples from a local JSONL file; index i is the i-th sample of a seeded endless stream of epochs.

    ``data_format`` and ``fields`` are ``data.format`` and ``data.fields`` (see ``formats.parse``).
    """

    def __init__(self, path: str, tokenizer, max_len: int, seed: int = 0, data_format: str = "auto",
                 fields: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        dropped = cut_off = truncated = 0  # no loss-bearing token; none left after truncation; truncated at all
        for lineno, record in read_records(path):
            ids, mask = encode_record(record, tokenizer, f"{path}:{lineno}", data_format, fields)
            truncated += len(ids) > max_len
            kept = any(mask[1:max_len])  # a loss-bearing target left after truncation
            lost = not kept and any(mask[max_len:])
            ids, mask = ids[:max_len], mask[:max_len]
            if len(ids) < 2 or not kept:
                dropped += 1
                cut_off += lost
                continue
            self.records.append((torch.tensor(ids), torch.tensor(mask)))
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
