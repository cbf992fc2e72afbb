"""Tokenizing only the head of a record: the tokens a length cap keeps, without tokenizing what it cuts off.

Design note [truncate-first]
----------------------------
A sample keeps its first ``data.micro_batch_tokens + 1`` tokens. Tokenizing a large record
whole to keep a few thousand of its tokens holds the whole record's token list, its mask and
the tokenizer's buffers, several times the text, on every rank. ``encode_prefix`` tokenizes a
prefix of the text instead: cutting a text changes only the tokens next to the cut (a
tokenizer splits text into words, or bytes, before it merges neighbours into tokens), so
once a prefix yields ``margin(limit)`` tokens more than the ``limit`` kept, the kept ones are
the whole text's first ``limit``. The margin grows with the cap (a quarter of it, and 128 at
least), more than the tokens of one word cut short. A prefix that yields
too few tokens (long tokens, characters a normalizer drops) is doubled until it yields
enough or is the whole text, so no text is ever cut short of what the cap keeps.

``encode_pieces`` applies this to a record's pieces (BOS, prompt, completion, chat turns,
role markers), each tokenized on its own as before, and stops at the cap. The result is,
token for token and flag for flag, the whole record's encoding cut to the cap:
tests/test_data.py compares the two on hand-picked texts (long words, whitespace runs,
characters NFKC expands or drops) with several tokenizers.
"""

from __future__ import annotations

from typing import Sequence, Union

#: a record's piece: text (tokenized on its own) or token ids, and whether its tokens carry loss
Piece = tuple[Union[str, Sequence[int]], bool]
#: characters per token in the first prefix tried; more than most tokenizers' average, so one try usually does
CHARS_PER_TOKEN = 8


def margin(limit: int) -> int:
    """The tokens a prefix must yield beyond the ``limit`` kept for those to be the whole text's ([truncate-first]):
    the ones next to the cut may differ from the whole text's. More than one word cut short changes (WordPiece
    reads a word of over 100 characters as one unknown token, and so a word cut to 100 as up to 100 tokens)."""
    return 128 + limit // 4


def encode_prefix(tokenizer, text: str, limit: int) -> tuple[list[int], bool]:
    """``tokenizer.encode(text)[:limit]``, and whether ``text`` has more tokens than ``limit``, tokenizing only as
    long a prefix of ``text`` as that needs ([truncate-first])."""
    need = limit + margin(limit)
    chars = CHARS_PER_TOKEN * need
    while chars < len(text):
        ids = tokenizer.encode(text[:chars])
        if len(ids) >= need:
            return ids[:limit], True
        chars *= 2
    ids = tokenizer.encode(text) if text else []
    return ids[:limit], len(ids) > limit


def encode_pieces(tokenizer, pieces: Sequence[Piece], limit: int | None = None) -> tuple[list[int], list[bool], bool]:
    """Token ids and loss mask of ``pieces`` (each text tokenized on its own), only the first ``limit`` of them
    (None: all), and whether a loss-bearing token lies past those.

    Equal to encoding every piece whole and cutting the result to ``limit`` ([truncate-first]).
    """
    ids: list[int] = []
    mask: list[bool] = []
    for piece, loss in pieces:
        room = None if limit is None else limit - len(ids)
        if room == 0 and not loss:
            continue  # past the cap only whether a piece holds loss-bearing tokens matters
        if isinstance(piece, str):
            toks, more = (tokenizer.encode(piece) if piece else [], False) if room is None else \
                encode_prefix(tokenizer, piece, room)
        else:
            toks, more = list(piece[:room]), room is not None and len(piece) > room
        ids += toks
        mask += [loss] * len(toks)
        if more and loss:
            return ids, mask, True
    return ids, mask, False
