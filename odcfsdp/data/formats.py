"""The fine-tuning data formats people have, each read into one of two normal forms.

A JSONL record is read as one of these formats (``data.format``; ``auto``: recognised
from the record's fields, in this order):

* ``messages``: ``{"messages": [{"role", "content"}, ...], "tools"?: [...]}`` (OpenAI / TRL
  conversational). Roles system, user, assistant, tool; ``content`` a string or a list of
  parts (``{"type": "text", "text"}``; the text parts joined); an assistant turn may carry
  ``tool_calls`` (its ``content`` may then be empty), a tool turn ``tool_call_id`` / ``name``.
* ``sharegpt``: ``{"conversations": [{"from", "value"}, ...], "system"?, "tools"?}``; ``from``
  human, gpt, system, function_call (an assistant turn), observation (a tool turn).
* ``alpaca``: ``{"instruction", "input"?, "output", "system"?}``: one user turn (the
  instruction, then a blank line and the input when there is one) and one assistant turn.
* ``prompt_completion``: ``{"prompt", "completion"}`` (TRL's), both strings, or both lists
  of messages (TRL's conversational prompt / completion).
* ``text``: ``{"text"}``.

``data.fields`` maps these field names to a file's own (``data.fields.prompt=question``).

Design note [data-formats]
--------------------------
Every format becomes a ``Chat`` (turns, which of them carry loss, the tools offered) or a
``Completion`` (a prompt without loss, then a completion with loss); ``text`` is a
completion with an empty prompt, so every token carries loss. The loss follows each
format's convention: assistant turns only for the chat formats (never the system, user or
tool turns), the completion only for prompt / completion (in a conversational completion,
its assistant turns). Tokenizing is the tokenizer's (``encode_chat``, [chat-loss] in
``tokenizer.py``); this module only reads records, so ``preflight`` checks every record of
a file with it before any rank starts. A record that fits no format is one error line
naming the fields it has and the formats known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .tokenizer import ROLES

# Each format's fields (the required ones first, then the optional ones), in detection order: its reader sees
# only these.
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "messages": (("messages",), ("tools",)),
    "sharegpt": (("conversations",), ("system", "tools")),
    "prompt_completion": (("prompt", "completion"), ("tools",)),
    "alpaca": (("instruction", "output"), ("input", "system")),
    "text": (("text",), ()),
}
FORMAT_CHOICES = ("auto", *FORMATS)
# ShareGPT's speaker names (and OpenAI's legacy function role) as chat roles.
ROLE_NAMES = {**{r: r for r in ROLES}, "human": "user", "gpt": "assistant", "function_call": "assistant",
              "observation": "tool", "function": "tool"}
TURN_KEYS = ("tool_calls", "tool_call_id", "name")  # passed on to the chat template as they are


@dataclass
class Chat:
    """Turns (``{"role", "content"}`` plus any of ``TURN_KEYS``), a loss flag per turn, and the tools offered."""

    turns: list[dict]
    loss: list[bool]
    tools: list | None = None


@dataclass
class Completion:
    """A prompt (no loss) and its completion (loss on it and on the EOS that ends it)."""

    prompt: str
    completion: str


def known_formats() -> str:
    """The formats and their required fields, for error messages."""
    return ", ".join(f"{name} ({', '.join(required)})" for name, (required, _) in FORMATS.items())


def detect(record: dict) -> str | None:
    """The first format whose required fields ``record`` has, or None."""
    return next((name for name, (required, _) in FORMATS.items() if all(f in record for f in required)), None)


def rename(record: dict, fields: dict[str, str] | None) -> dict:
    """``record`` with each column ``fields`` names moved to its format field name (``{"prompt": "question"}``)."""
    if not fields:
        return record
    out = dict(record)
    for name, column in fields.items():
        if column in out:
            out[name] = out.pop(column)
    return out


def parse(record, data_format: str = "auto", fields: dict[str, str] | None = None) -> Chat | Completion:
    """``record`` in ``data_format`` (or the one its fields say) as a ``Chat`` or a ``Completion``.

    Raises ``ValueError`` (one line) for a record that fits no format, or not the one named.
    """
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    record = rename(record, fields)
    name = detect(record) if data_format == "auto" else data_format
    found = ", ".join(record) or "none"
    if name is None:
        raise ValueError(f"fits no data format: fields found: {found}; formats known: {known_formats()}; "
                         "name other columns with data.fields.<field>=<column> (e.g. data.fields.prompt=question)")
    required, optional = FORMATS[name]
    missing = [f for f in required if f not in record]
    if missing:
        raise ValueError(f"data.format={name} needs field(s) {', '.join(missing)}; fields found: {found} "
                         "(name other columns with data.fields.<field>=<column>)")
    return _READERS[name]({k: record[k] for k in (*required, *optional) if k in record})  # only the format's fields


def _string(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def _text(content, where: str) -> str:
    """A message's content as text: a string, None (no text), or a list of parts whose text parts are joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where} has a {kind!r} part: only text parts are read (a text-only model)")
        return "".join(out)
    raise ValueError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")


def _turns(messages, key: str) -> list[dict]:
    """A list of messages (``role``/``content`` or ShareGPT's ``from``/``value``) as chat turns."""
    if not isinstance(messages, list):
        raise ValueError(f"field {key!r} must be a list of messages, got {type(messages).__name__}")
    turns = []
    for i, m in enumerate(messages):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with a role and a content, got {m!r}")
        speaker = m.get("role", m.get("from"))
        role = ROLE_NAMES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise ValueError(f"{where} has role {speaker!r}; known: {', '.join(ROLE_NAMES)}")
        if "content" not in m and "value" not in m and not m.get("tool_calls"):  # a typo'd key trained on nothing
            raise ValueError(f"{where} ({role}) has no 'content' (nor 'value', nor 'tool_calls'); keys: {sorted(m)}")
        turn = {"role": role, "content": _text(m["content"] if "content" in m else m.get("value"), where)}
        turn.update((k, m[k]) for k in TURN_KEYS if m.get(k) is not None)
        turns.append(turn)
    return turns


def _tools(record: dict) -> list | None:
    tools = record.get("tools")
    if isinstance(tools, str):  # LLaMA-Factory stores them as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise ValueError(f"field 'tools' is a string that is not JSON ({e.msg})") from None
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"field 'tools' must be a list of tool schemas, got {type(tools).__name__}")
    return tools or None


def _chat(turns: list[dict], record: dict, trained_from: int = 0) -> Chat:
    """Assistant turns from index ``trained_from`` on carry loss; a ``system`` field leads as a system turn."""
    if record.get("system") and not (turns and turns[0]["role"] == "system"):
        turns = [{"role": "system", "content": _string(record, "system")}, *turns]
        trained_from += 1
    return Chat(turns, [i >= trained_from and t["role"] == "assistant" for i, t in enumerate(turns)], _tools(record))


def _messages(record: dict) -> Chat:
    return _chat(_turns(record["messages"], "messages"), record)


def _sharegpt(record: dict) -> Chat:
    return _chat(_turns(record["conversations"], "conversations"), record)


def _alpaca(record: dict) -> Chat:
    given = record.get("input")
    prompt = _string(record, "instruction") + (f"\n\n{_string(record, 'input')}" if given else "")
    turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": _string(record, "output")}]
    return _chat(turns, record)


def _prompt_completion(record: dict) -> Chat | Completion:
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return Completion(prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):  # TRL's conversational prompt / completion
        prompt_turns = _turns(prompt, "prompt")
        return _chat(prompt_turns + _turns(completion, "completion"), record, trained_from=len(prompt_turns))
    raise ValueError("fields 'prompt' and 'completion' must both be strings or both be lists of messages, got "
                     f"{type(prompt).__name__} and {type(completion).__name__}")


def _plain_text(record: dict) -> Completion:
    return Completion("", _string(record, "text"))


_READERS = {"messages": _messages, "sharegpt": _sharegpt, "prompt_completion": _prompt_completion,
            "alpaca": _alpaca, "text": _plain_text}
