"""Data formats: each one's loss mask is its convention on hand-checked examples; errors are one line naming the fix."""

from __future__ import annotations

import dataclasses
import json

import pytest

from format_cases import FIELD_OVERRIDES, TOOL_TEMPLATE, format_cases, reference_example
from hf_fixtures import write_jsonl
from test_train import cli

from odcfsdp.app.config import FieldsConfig, config_from, validate
from odcfsdp.data.formats import FORMATS, Chat, Completion, parse
from odcfsdp.data.jsonl import JsonlSource, encode_record
from odcfsdp.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
B, E = TOK.bos_id, TOK.eos_id
S, U, A, T = (TOK.role_ids[r] for r in ("system", "user", "assistant", "tool"))


def encode(record: dict, data_format: str = "auto", fields: dict | None = None):
    return encode_record(record, TOK, "x.jsonl:1", data_format, fields)


def spans(*parts: tuple[list[int] | bytes | str, bool]) -> tuple[list[int], list[bool]]:
    """Token ids and mask written as (tokens, carries loss) pieces; text pieces are their UTF-8 bytes."""
    ids, mask = [], []
    for piece, loss in parts:
        piece = list(piece.encode() if isinstance(piece, str) else piece)
        ids += piece
        mask += [loss] * len(piece)
    return ids, mask


def test_messages_with_content_parts_tool_calls_and_tool_turns():
    """Loss on what the assistant says (its tool call as JSON, its answer, each with its EOS), never on the tool's
    output, the user's turn (text parts joined) or the tools offered (a leading system turn of their JSON)."""
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    record = {"tools": [{"name": "f"}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "w"}, {"type": "text", "text": "x?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "ok"}]}
    assert encode(record) == spans(([B, S], False), ('[{"name": "f"}]', False), ([E, U], False), ("wx?", False),
                                   ([E, A], False), ('{"type": "function", "function": {"name": "f", "arguments": {}}}',
                                                     True), ([E], True), ([T], False), ("1", False), ([E, A], False),
                                   ("ok", True), ([E], True))


def test_sharegpt_alpaca_and_trl_formats():
    chat = spans(([B, S], False), ("be brief", False), ([E, U], False), ("hi", False), ([E, A], False), ("yo", True),
                 ([E], True))
    conversations = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    assert encode({"system": "be brief", "conversations": conversations}) == chat
    assert encode({"system": "be brief", "instruction": "hi", "output": "yo"}) == chat  # alpaca, no input
    assert encode({"instruction": "add", "input": "1 2", "output": "3"}) == spans(
        ([B, U], False), ("add\n\n1 2", False), ([E, A], False), ("3", True), ([E], True))
    # TRL's conversational prompt / completion: a few-shot assistant turn in the prompt carries no loss ...
    shot = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    few_shot = spans(([B, U], False), ("a", False), ([E, A], False), ("b", False), ([E, U], False), ("c", False),
                     ([E, A], False), ("d", True), ([E], True))
    assert encode({"prompt": shot, "completion": [{"role": "assistant", "content": "d"}]}) == few_shot
    # ... while as plain messages every assistant turn does
    ids, mask = encode({"messages": [*shot, {"role": "assistant", "content": "d"}]})
    assert ids == few_shot[0] and mask == [m or i in (5, 6) for i, m in enumerate(few_shot[1])]  # "b" and its EOS
    completion = spans(([B], False), ("1+1=", False), ("2", True), ([E], True))  # TRL's standard prompt / completion
    assert encode({"prompt": "1+1=", "completion": "2"}) == completion
    assert encode({"question": "1+1=", "answer": "2"}, fields=FIELD_OVERRIDES) == completion  # data.fields
    assert encode({"text": "ab"}) == spans(([B], False), ("ab", True), ([E], True))  # text: every token


def test_auto_detection_and_a_named_format():
    both = {"text": "t", "prompt": "p", "completion": "c"}
    assert parse(both) == Completion("p", "c")  # prompt / completion comes before text
    assert parse(both, "text") == Completion("", "t")
    assert parse({"conversations": [{"role": "user", "content": "q"}]}) == Chat([{"role": "user", "content": "q"}],
                                                                                [False])
    for name in ("messages", "sharegpt", "alpaca", "prompt_completion", "text"):  # every reader is reachable
        with pytest.raises(ValueError, match=rf"data.format={name} needs field"):
            parse({"unrelated": 1}, name)


@pytest.mark.parametrize("record, fmt, message", [
    ({"question": "q", "answer": "a"}, "auto",
     "fits no data format: fields found: question, answer; formats known: messages (messages), sharegpt "
     "(conversations), prompt_completion (prompt, completion), alpaca (instruction, output), text (text); name other "
     "columns with data.fields.<field>=<column> (e.g. data.fields.prompt=question)"),
    ({"prompt": "p"}, "prompt_completion", "data.format=prompt_completion needs field(s) completion; fields found: "
                                           "prompt (name other columns with data.fields.<field>=<column>)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "auto",
     "messages[0] has a 'image_url' part: only text parts are read (a text-only model)"),
    ({"conversations": [{"from": "narrator", "value": "x"}]}, "auto", "conversations[0] has role 'narrator'; known: "
     "system, user, assistant, tool, human, gpt, function_call, observation, function"),
    ({"prompt": "p", "completion": [{"role": "assistant", "content": "c"}]}, "auto",
     "fields 'prompt' and 'completion' must both be strings or both be lists of messages, got str and list"),
    ({"text": 3}, "auto", "field 'text' must be a string, got int"),
    ([1, 2], "auto", "a record must be a JSON object, got list"),
])
def test_records_that_fit_no_format_fail_in_one_line(record, fmt, message):
    with pytest.raises(ValueError) as e:
        encode(record, fmt)
    assert str(e.value) == f"x.jsonl:1: {message}"


def test_config_keys():
    """data.fields has one key per format field (each its own help comment's subject); data.format is checked."""
    assert {f.name for f in dataclasses.fields(FieldsConfig)} == {f for req, opt in FORMATS.values() for f in req + opt}
    assert config_from({"data": {"fields": {"prompt": "question"}}}).data.fields.mapping() == {"prompt": "question"}
    with pytest.raises(ValueError, match=r"data.format='chatml' is not allowed; choose one of \('auto', 'messages'"):
        validate(config_from({"data": {"format": "chatml"}}))


def test_jsonl_source_reads_every_format(tmp_path):
    """A file may mix formats under auto; each record's sample is its own encoding."""
    cases = format_cases(2)
    records = [rec for name, pairs in cases.items() if name != "prompt_completion" for rec, _ in pairs]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    src = JsonlSource(str(path), TOK, max_len=10_000)
    got = sorted((src[i].tokens.tolist(), src[i].loss_mask.tolist()) for i in range(src.num_samples))
    assert got == sorted(encode(r) for r in records)


def test_hf_chat_template_mask_equals_transformers_assistant_mask(tmp_path):
    """With a Hugging Face tokenizer and its chat template, the loss mask of every chat format equals transformers'
    own assistant-token mask ({% generation %} marks), tokens included; e.g. what carries loss in a tool-calling
    chat is exactly the assistant's tool call and answer, each with its end marker."""
    pytest.importorskip("transformers", reason="HF tokenizers need transformers (test extra)")
    from hf_fixtures import save_tokenizer

    from odcfsdp.data.tokenizer import HFTokenizer

    save_tokenizer(tmp_path)
    tok = HFTokenizer(str(tmp_path))
    tok.tok.chat_template = TOOL_TEMPLATE
    for name, pairs in format_cases(2).items():
        for record, (kind, *ref) in pairs:
            ids, mask = encode_record(record, tok, name, fields=FIELD_OVERRIDES)
            if kind == "completion":
                continue  # no template involved: the byte-level cases above
            want_ids, want_mask = reference_example(tok.tok, (kind, *ref))
            assert ids == want_ids, name
            assert mask == want_mask, name
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    chat = {"messages": [{"role": "user", "content": "2+3?"},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5."}]}
    ids, mask = encode_record(chat, tok, "x")
    assert tok.decode(ids) == ("<s><|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n<tool_call>{\"name\": "
                               "\"add\", \"arguments\": {\"a\": 2, \"b\": 3}}</tool_call><|im_end|>\n<|im_start|>tool\n"
                               "5<|im_end|>\n<|im_start|>assistant\n5.<|im_end|>\n")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>\n5.<|im_end|>\n')


def test_a_field_mapping_that_renames_nothing_is_reported(tmp_path):
    """data.fields naming a column no record of the file has is a note at start (a sweep over files may share one
    mapping); one that some record has is silent."""
    from odcfsdp.app.preflight import preflight

    path = write_jsonl(tmp_path / "a.jsonl", [{"instruction": "add", "output": "5"}, {"question": "q", "answer": "a"}])
    cfg = config_from({"data": {"path": str(path), "fields": {"prompt": "question", "completion": "answer",
                                                               "system": "persona"}},
                       "run": {"out_dir": str(tmp_path / "run"), "world_size": 1}})
    assert preflight(cfg) == [
        f"note: data.fields.system=persona renames nothing in data.path={str(path)!r}: no record has a column "
        "'persona' (columns found: answer, instruction, output, question)"]


def test_a_file_that_fits_no_format_fails_at_start_in_one_line(tmp_path):
    (tmp_path / "qa.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    proc = cli("data.source=jsonl", "data.path=qa.jsonl", "run.out_dir=run", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: data.path: qa.jsonl:1: fits no data format: fields found: question, answer; formats known: messages "
        "(messages), sharegpt (conversations), prompt_completion (prompt, completion), alpaca (instruction, output), "
        "text (text); name other columns with data.fields.<field>=<column> (e.g. data.fields.prompt=question)"]
    assert not (tmp_path / "run").exists()  # no rank started


@pytest.mark.parametrize("lines, message", [
    ("", "data.path='d.jsonl' holds no record (one JSON object per line)"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n' * 3,
     "data.path='d.jsonl': none of its 3 records carries loss (a chat trains on its assistant turns, and none has one)"),
])
def test_a_file_with_nothing_to_train_on_fails_at_start_in_one_line(tmp_path, lines, message):
    (tmp_path / "d.jsonl").write_text(lines)
    proc = cli("data.path=d.jsonl", "run.out_dir=run", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"error: {message}"], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_truncation_by_the_token_cap_is_said_and_named():
    """A record whose answer lies past the cap is dropped, and when every record is, the error names the cap;
    records it shortened are counted in the start-up note."""
    chat = {"messages": [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "yes"}]}
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        only = Path(d) / "only.jsonl"
        only.write_text(json.dumps(chat) + "\n")
        with pytest.raises(ValueError, match=r"1 whose loss-bearing tokens all lie past the first 20 "
                                             r"\(data.micro_batch_tokens=20 caps a sample's length: raise it\)"):
            JsonlSource(str(only), TOK, 21)
        f = Path(d) / "c.jsonl"
        f.write_text(json.dumps(chat) + "\n" + json.dumps({"text": "a short one"}) + "\n")
        source = JsonlSource(str(f), TOK, 21)
        assert source.num_samples == 1 and source.truncation_note == (
            f"note: {f}: 1 of 2 records are longer than 20 tokens and were truncated (1 lost every loss-bearing "
            "token: dropped); data.micro_batch_tokens=20 caps a sample's length: raise it")
        assert JsonlSource(str(f), TOK, 1000).truncation_note is None
