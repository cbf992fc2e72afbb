"""Tokenizers: a dependency-free byte-level one, and Hugging Face tokenizers from a local path.

Both turn a chat (``[{"role", "content"}, ...]``) into token ids and a loss mask with
``encode_chat``; the turns flagged in ``loss`` carry it (default: the assistant turns; the
flags come from the data format, [data-formats] in ``formats.py``). ``chat_pieces`` is the
same chat as pieces of text and ids, each tokenized on its own, so that a record can be
tokenized only as far as the length cap keeps it ([truncate-first] in ``truncate.py``). A Hugging Face
tokenizer with a chat template renders the chat with it (tool calls and the ``tools``
offered included), as inference will (see [chat-loss]); the byte tokenizer, and HF
tokenizers without a template, mark turns with one role marker each and write tool calls
and tools as JSON text.

Design note [chat-loss]
-----------------------
For each assistant turn i that carries loss, the template renders ``messages[:i]`` with the generation prompt
(what a model sees before it answers) and ``messages[:i + 1]`` (the answer and its end
marker). If the whole rendering starts with the second and the second with the first,
the characters between the two renderings are turn i's answer: they carry loss, the rest
does not. The rendering is tokenized piece by piece at those boundaries, so a prompt's
tokens are exactly those inference produces for it. A template that rewrites earlier
turns when later ones come (not prefix-consistent) cannot be split this way and is an
error naming the turn.
"""

from __future__ import annotations

import json
from pathlib import Path

from .truncate import Piece, encode_pieces

ROLES = ("system", "user", "assistant", "tool")


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; then BOS, EOS and one marker per chat role."""

    def __init__(self) -> None:
        self.bos_id, self.eos_id = 256, 257
        self.role_ids = {role: 258 + i for i, role in enumerate(ROLES)}
        self.vocab_size = 258 + len(ROLES)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def role_marker(self, role: str) -> list[int]:
        return [self.role_ids[role]]

    def chat_pieces(self, messages: list[dict], loss: list[bool] | None = None,
                    tools: list | None = None) -> list[Piece]:
        """A chat as pieces with loss flags (role markers; see the module docstring)."""
        return marker_pieces(self, messages, loss, tools)

    def encode_chat(self, messages: list[dict], loss: list[bool] | None = None,
                    tools: list | None = None) -> tuple[list[int], list[bool]]:
        """Token ids and loss mask of a chat (role markers; see the module docstring)."""
        return encode_pieces(self, self.chat_pieces(messages, loss, tools))[:2]


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (never from the network)."""

    def __init__(self, path: str):
        if not Path(path).exists():
            raise FileNotFoundError(f"data.tokenizer_path={path!r} does not exist (only local tokenizers are used)")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError("data.tokenizer_path needs the `transformers` package") from e
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"the tokenizer at {path!r} has no EOS token")

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def role_marker(self, role: str) -> list[int]:
        return self.encode(f"<|{role}|>\n")

    def encode_chat(self, messages: list[dict], loss: list[bool] | None = None,
                    tools: list | None = None) -> tuple[list[int], list[bool]]:
        """Token ids and loss mask of a chat: the tokenizer's chat template (see [chat-loss]), or role markers."""
        return encode_pieces(self, self.chat_pieces(messages, loss, tools))[:2]

    def chat_pieces(self, messages: list[dict], loss: list[bool] | None = None,
                    tools: list | None = None) -> list[Piece]:
        """A chat as pieces with loss flags: the chat template's rendering cut at each trained answer's bounds (see
        [chat-loss]), or role markers."""
        if not getattr(self.tok, "chat_template", None):
            return marker_pieces(self, messages, loss, tools)

        def render(turns, prompt: bool) -> str:
            from jinja2 import TemplateError  # what a template's raise_exception raises (a transformers dependency)

            try:
                return self.tok.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=prompt)
            except TemplateError as e:  # e.g. a template without a tool role: the record's fault, named by line
                raise ValueError(f"the tokenizer's chat template refuses this chat: {e}") from None

        full = render(messages, False)
        pieces: list[Piece] = []
        at = 0
        for i, trained in enumerate(loss_flags(messages, loss)):
            if not trained:
                continue
            before, upto = render(messages[:i], True), render(messages[: i + 1], False)
            if not (full.startswith(upto) and upto.startswith(before)):
                raise ValueError(f"the chat template renders turn {i} differently once later turns follow; "
                                 "assistant-only loss needs a prefix-consistent template")
            pieces += [(full[at:len(before)], False), (full[len(before):len(upto)], True)]
            at = len(upto)
        return pieces + [(full[at:], False)]


def loss_flags(messages: list[dict], loss: list[bool] | None) -> list[bool]:
    """Which turns carry loss: ``loss`` as given (assistant turns only), or every assistant turn."""
    if loss is None:
        return [turn["role"] == "assistant" for turn in messages]
    if len(loss) != len(messages) or any(t and m["role"] != "assistant" for t, m in zip(loss, messages)):
        raise ValueError("loss flags must be one per turn, set on assistant turns only")
    return list(loss)


def turn_text(turn: dict) -> str:
    """A turn's content, then its tool calls as JSON, one a line (for tokenizers without a chat template)."""
    calls = [json.dumps(c, ensure_ascii=False) for c in turn.get("tool_calls") or ()]
    return "\n".join(([turn["content"]] if turn["content"] else []) + calls)


def marker_pieces(tokenizer, messages: list[dict], loss: list[bool] | None = None,
                  tools: list | None = None) -> list[Piece]:
    """BOS, then per turn its role marker (no loss) and its text + EOS (loss on the flagged turns), as pieces.

    The tools offered, if any, lead as a system turn holding their JSON schemas.
    """
    flags = loss_flags(messages, loss)
    if tools:
        messages = [{"role": "system", "content": json.dumps(tools, ensure_ascii=False)}, *messages]
        flags = [False, *flags]
    pieces: list[Piece] = [([tokenizer.bos_id], False)]
    for turn, trained in zip(messages, flags):
        pieces += [(tokenizer.role_marker(turn["role"]), False), (turn_text(turn), trained),
                   ([tokenizer.eos_id], trained)]
    return pieces


def load_tokenizer(path: str | None):
    """The byte tokenizer if ``path`` is None, else the Hugging Face tokenizer at ``path``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
