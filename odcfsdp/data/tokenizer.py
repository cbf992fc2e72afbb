"""Tokenizers: a dependency-free byte-level one, and Hugging Face tokenizers from a local path."""

from __future__ import annotations

from pathlib import Path

ROLES = ("system", "user", "assistant")


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


def load_tokenizer(path: str | None):
    """The byte tokenizer if ``path`` is None, else the Hugging Face tokenizer at ``path``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
