"""Records in each data format, each beside the chat or prompt / completion it means, written out by hand.

The references are what the formats' conventions say a record is (TRL, ShareGPT, Alpaca),
built here without ``odcfsdp.data.formats``; tests compare the library's reading against them.
"""

from __future__ import annotations

import torch

# The ChatML-style template of hf_fixtures with tools, tool calls and {% generation %} marks around what an
# assistant turn says (its end marker included), so transformers' own return_assistant_tokens_mask is a reference.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a plus b",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
FIELD_OVERRIDES = {"prompt": "question", "completion": "answer"}  # the prompt_completion file's own column names


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def format_cases(n: int = 4, seed: int = 0) -> dict[str, list[tuple[dict, tuple]]]:
    """Per file name: ``n`` (record, reference) pairs; a reference is ("chat", messages, tools) or ("completion",
    prompt, completion). Chats train on assistant turns; a completion on itself and the EOS after it."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[tuple[dict, tuple]]] = {k: [] for k in ("messages", "sharegpt", "alpaca", "prompt_completion",
                                                                "conversational", "text")}
    for i in range(n):
        a, b = (int(x) for x in torch.randint(0, 50, (2,), generator=g))
        q, ans = f"what is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        # messages: OpenAI-style content parts, an assistant tool call, a tool turn (no loss), then the answer
        parts = [{"type": "text", "text": "what is "}, {"type": "text", "text": f"{a} plus {b}?"}]
        turns = [{"role": "user", "content": parts},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "content": str(a + b)},
                 _assistant(ans)]
        want = [_user(q), {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": str(a + b)}, _assistant(ans)]
        out["messages"].append(({"messages": turns, **({"tools": TOOLS} if i % 2 else {})},
                                ("chat", want, TOOLS if i % 2 else None)))
        # ShareGPT: human / gpt speakers and a system field, which leads as a system turn
        conv = [{"from": "human", "value": q}, {"from": "gpt", "value": ans},
                {"from": "human", "value": "and times two?"}, {"from": "gpt", "value": f"that is {2 * (a + b)}."}]
        out["sharegpt"].append(({"system": "answer briefly", "conversations": conv},
                                ("chat", [{"role": "system", "content": "answer briefly"}, _user(q), _assistant(ans),
                                          _user("and times two?"), _assistant(f"that is {2 * (a + b)}.")], None)))
        # Alpaca: the instruction, a blank line and the input (when there is one) as the user turn
        given = f"{a} {b}" if i % 2 else ""
        out["alpaca"].append(({"instruction": "add the numbers", "input": given, "output": str(a + b)},
                              ("chat", [_user("add the numbers" + (f"\n\n{given}" if given else "")),
                                        _assistant(str(a + b))], None)))
        # TRL's prompt / completion, under the file's own column names (data.fields maps them)
        out["prompt_completion"].append(({"question": q, "answer": f" {a + b}."}, ("completion", q, f" {a + b}.")))
        # TRL's conversational prompt / completion
        out["conversational"].append(({"prompt": [{"role": "system", "content": "answer briefly"}, _user(q)],
                                       "completion": [_assistant(ans)]},
                                      ("chat", [{"role": "system", "content": "answer briefly"}, _user(q),
                                                _assistant(ans)], None)))
        out["text"].append(({"text": f"{q} {ans}"}, ("completion", "", f"{q} {ans}")))
    return out


def reference_example(tok, ref: tuple) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask as transformers makes them: a chat's assistant-token mask from the template's
    {% generation %} marks; TRL's prompt / completion (the pair tokenized as one string, the completion's tokens
    after the prompt's) between BOS and EOS."""
    kind, *rest = ref
    if kind == "chat":
        messages, tools = rest
        out = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    prompt, completion = rest
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"]) if prompt else 0
    body = tok(prompt + completion, add_special_tokens=False)["input_ids"]
    ids = [tok.bos_token_id, *body, tok.eos_token_id]
    return ids, [False] * (1 + n_prompt) + [True] * (len(ids) - 1 - n_prompt)


def table_cases(n: int = 3) -> dict[str, list[dict]]:
    """Records of every format as a Hugging Face dataset holds them, in two tables (each one Parquet file): ``mixed``
    (text, prompt / completion strings, Alpaca, ShareGPT and messages rows with tool calls and tools, so every row
    lacks most of the table's columns: null in Arrow) and ``conversational`` (TRL's prompt / completion as lists
    of messages, whose ``prompt`` column cannot share a table with string prompts)."""
    mixed, conversational = [], []
    for i in range(n):
        a, b = 3 * i + 1, 7 * i + 2
        q, ans = f"what is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        mixed += [
            {"text": f"{q} {ans}"},
            {"prompt": q, "completion": f" {a + b}."},
            {"instruction": "add the numbers", "input": f"{a} {b}" if i % 2 else "", "output": str(a + b)},
            {"system": "answer briefly",
             "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": ans}]},
            {"messages": [_user(q), {"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "content": str(a + b)}, _assistant(ans)],
             **({"tools": TOOLS} if i % 2 else {})},
            {"messages": [{"role": "system", "content": "answer briefly"}, _user(q), _assistant(ans)]},
        ]
        conversational.append({"prompt": [{"role": "system", "content": "answer briefly"}, _user(q)],
                               "completion": [_assistant(ans)]})
    return {"mixed": mixed, "conversational": conversational}
