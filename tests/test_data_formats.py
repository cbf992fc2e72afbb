"""Data formats: each one's loss mask is its convention on hand-checked examples; errors are one line naming the fix."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from format_cases import FIELD_OVERRIDES, TOOL_TEMPLATE, format_cases, reference_example, table_cases
from hf_fixtures import write_jsonl
from warm_cli import cli

from odcfsdp.app.config import FieldsConfig, config_from, validate
from odcfsdp.data.formats import FORMATS, Chat, Completion, parse
from odcfsdp.data.jsonl import JsonlSource, encode_capped, encode_record, read_records
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
    # issue 44: prompts longer than the cap (512 positions) failed inside the ranks, rc 1; 600 bytes and BOS: the
    # first token trained on is token 601 (the file's second line is blank, so the other record is on line 3)
    (json.dumps({"prompt": "x" * 600, "completion": "y"}) + "\n\n" + json.dumps({"prompt": "z" * 700,
                                                                                  "completion": "y"}),
     "data.path: d.jsonl:1: its prompt fills data.micro_batch_tokens=512 (a sample's length cap), leaving nothing to "
     "train on, as does every other record of the file that trains on something: raise data.micro_batch_tokens to at "
     "least 601"),
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



def _tokenizers(tmp_path) -> dict:
    """The byte tokenizer and, with transformers, a Hugging Face BPE with the tool-calling chat template."""
    out = {"bytes": TOK}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return out
    from hf_fixtures import save_tokenizer

    from odcfsdp.data.tokenizer import HFTokenizer

    save_tokenizer(tmp_path / "tokenizer")
    out["hf"] = HFTokenizer(str(tmp_path / "tokenizer"))
    out["hf"].tok.chat_template = TOOL_TEMPLATE
    return out


def test_a_record_tokenized_up_to_the_cap_is_its_whole_encoding_cut_there(tmp_path):
    """[truncate-first]: a record of every format, tokenized only as far as a cap of L tokens keeps, is its whole
    encoding cut to L (the reference: tokenize whole, then cut), for every L from 0 past its end and for the byte
    and a Hugging Face tokenizer (chat template and all); and ``encode_capped``'s reading of the cap (shortened?
    a loss-bearing target kept? all that it trains on cut off?) is the whole encoding's."""
    for name, tok in _tokenizers(tmp_path).items():
        for fmt, pairs in format_cases(2).items():
            for record, _ in pairs:
                ids, mask = encode_record(record, tok, fmt, fields=FIELD_OVERRIDES)
                for cap in range(len(ids) + 3):
                    assert encode_record(record, tok, fmt, fields=FIELD_OVERRIDES, limit=cap) == (ids[:cap],
                                                                                                  mask[:cap])
                    if cap:
                        got = encode_capped(record, tok, fmt, cap, fields=FIELD_OVERRIDES)
                        kept = any(mask[1:cap])
                        assert (got.ids, got.mask, got.truncated, got.kept, got.lost) == (
                            ids[:cap], mask[:cap], len(ids) > cap, kept, not kept and any(mask[cap:])), (name, fmt)


def test_jsonl_source_under_a_cap_holds_the_whole_encodings_cut_there(tmp_path):
    """Every record of a file of all formats, loaded under caps that cut into prompts, answers and tool calls, is
    its whole encoding cut to the cap; those with nothing left to train on are dropped and counted."""
    records = [rec for pairs in format_cases(3).values() for rec, _ in pairs]
    path = write_jsonl(tmp_path / "all.jsonl", records)
    whole = [encode_record(r, TOK, "x", fields=FIELD_OVERRIDES) for r in records]
    for cap in (3, 17, 40, 90, 10_000):
        src = JsonlSource(str(path), TOK, cap, fields=FIELD_OVERRIDES)
        want = [(ids[:cap], mask[:cap]) for ids, mask in whole if any(mask[1:cap])]
        assert [(t.tolist(), m.tolist()) for t, m in src.records] == want, cap
        assert src.dropped == len(records) - len(want)
        assert (src.truncation_note is None) == all(len(ids) <= cap for ids, _ in whole)


def _write_parquet(path, records: list[dict]):
    """``records`` as one Parquet table (its schema inferred from every row, as ``datasets`` infers it)."""
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (the parquet and test extras)")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_struct_array(pa.array(records)), path)
    return path


def test_parquet_rows_are_read_as_the_jsonl_records_they_hold(tmp_path):
    """A Parquet file (HF datasets' format) holding records of every format reads as the same records as the JSONL
    file of them, nulls of the columns a row lacks dropped, and loads into the same samples with the byte and a
    Hugging Face tokenizer; under data.fields too."""
    for name, records in table_cases().items():
        jsonl = write_jsonl(tmp_path / f"{name}.jsonl", records)
        parquet = _write_parquet(tmp_path / f"{name}.parquet", records)
        assert [r for _, r in read_records(parquet)] == records == [r for _, r in read_records(jsonl)]
        assert [i for i, _ in read_records(parquet)] == list(range(1, len(records) + 1))  # rows name errors
        for tok in _tokenizers(tmp_path).values():
            a, b = JsonlSource(str(jsonl), tok, 10_000), JsonlSource(str(parquet), tok, 10_000)
            assert a.num_samples == b.num_samples == len(records)
            assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a.records, b.records))
    renamed = _write_parquet(tmp_path / "qa.parquet", [{"question": "1+1=", "answer": "2"}])
    row = next(read_records(renamed))[1]
    assert encode(row, fields=FIELD_OVERRIDES) == encode({"prompt": "1+1=", "completion": "2"})
    named = _write_parquet(tmp_path / "rows.bin", table_cases()["conversational"])  # Parquet's magic bytes, any name
    assert [r for _, r in read_records(named)] == table_cases()["conversational"]


def test_a_utf8_bom_is_skipped(tmp_path):
    """A byte-order mark (Windows editors write one) before a JSONL file, a JSON array, or a line of files joined
    with cat reads as the file without it (it was refused naming utf-8-sig, which no command line can apply)."""
    records = table_cases(2)["mixed"]
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    bom = b"\xef\xbb\xbf"
    files = {"plain.jsonl": b"".join(lines), "bom.jsonl": bom + b"".join(lines),
             "joined.jsonl": bom + b"".join(lines[:5]) + bom + b"".join(lines[5:]),
             "bom.json": bom + json.dumps(records, indent=1).encode()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        assert [r for _, r in read_records(tmp_path / name)] == records, name


def _losses(tmp_path, data: str) -> list[float]:
    """Per-step losses of a 3-step single-rank CLI run on ``data``."""
    out = tmp_path / f"run-{data}"
    proc = cli("run.steps=3", "run.world_size=1", "data.batch_size=4", f"data.path={data}", f"run.out_dir={out}",
               cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_parquet_and_a_bom_file_train_as_the_jsonl_file(tmp_path):
    """Issue 44: a Parquet file was refused, and so was a JSONL file starting with a BOM. The same records as JSONL,
    as JSONL with a BOM, and as Parquet now train to the same per-step losses through the CLI."""
    records = table_cases()["mixed"]
    _write_parquet(tmp_path / "d.parquet", records)
    write_jsonl(tmp_path / "d.jsonl", records)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "d.jsonl").read_bytes())
    want = _losses(tmp_path, "d.jsonl")
    assert len(want) == 3 and _losses(tmp_path, "bom.jsonl") == want and _losses(tmp_path, "d.parquet") == want


def test_a_parquet_file_without_pyarrow_is_one_line_naming_the_install(tmp_path):
    """Without pyarrow (here an importable package of that name that raises ImportError, ahead of the real one), a
    Parquet data.path is refused before any rank starts: exit code 2, one line naming the extra that installs it."""
    import os
    import subprocess
    import sys

    _write_parquet(tmp_path / "d.parquet", [{"text": "hello"}])
    (tmp_path / "fake" / "pyarrow").mkdir(parents=True)
    (tmp_path / "fake" / "pyarrow" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pyarrow'\", name='pyarrow')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "odcfsdp.train", "data.path=d.parquet", "run.out_dir=run"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: data.path='d.parquet': reading a Parquet file needs pyarrow, which is not installed (No module named "
        "'pyarrow'): pip install \"odcfsdp[parquet]\""], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_prompts_longer_than_the_cap_are_refused_before_ranks_start_naming_the_cap_that_fits(tmp_path):
    """A file whose every trained record has all it trains on past data.micro_batch_tokens is refused by the
    pre-start checks (data.path and data.eval_path), naming the first such record and the smallest cap that keeps
    a token to train on: at that cap the run is accepted, one below it refused (the reference: the position of the
    first loss-bearing token of the record's whole encoding). A file where some record fits is accepted: the ranks
    drop the others with a note, as before."""
    from odcfsdp.app.preflight import preflight

    long_chat = {"messages": [{"role": "system", "content": "be brief " * 40}, {"role": "user", "content": "2+3?"},
                              {"role": "assistant", "content": "5."}]}
    write_jsonl(tmp_path / "chat.jsonl", [long_chat])
    write_jsonl(tmp_path / "fits.jsonl", [long_chat, {"text": "short"}])
    for name, tok in _tokenizers(tmp_path).items():
        _, mask = encode_record(long_chat, tok, "x")
        first = mask.index(True)  # the reference: token 0 is BOS, no target
        base = {"run": {"out_dir": str(tmp_path / "run"), "world_size": 1},
                "data": {"tokenizer_path": str(tmp_path / "tokenizer") if name == "hf" else None}}
        for key in ("path", "eval_path"):
            def at(cap: int, data: str = "chat.jsonl"):
                files = {"path": str(tmp_path / "fits.jsonl")}  # a data.path that fits beside a data.eval_path
                files[key] = str(tmp_path / data)
                return config_from({**base, "data": {**base["data"], **files, "micro_batch_tokens": cap}})

            with pytest.raises(ValueError) as e:
                preflight(at(first - 1))
            assert str(e.value) == (
                f"data.{key}: {tmp_path / 'chat.jsonl'}:1: its prompt fills data.micro_batch_tokens={first - 1} (a "
                f"sample's length cap), leaving nothing to train on: raise data.micro_batch_tokens to at least "
                f"{first}"), name
            preflight(at(first))
            preflight(at(first - 1, "fits.jsonl"))
