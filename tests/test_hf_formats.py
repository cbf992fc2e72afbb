"""Fine-tuning a tiny pretrained HF checkpoint on each data format through the CLI, against plain transformers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="fine-tuning HF models needs transformers (test extra)")

from format_cases import FIELD_OVERRIDES, TOOL_TEMPLATE, format_cases, reference_example  # noqa: E402
from hf_fixtures import save_pretrained_model, write_jsonl  # noqa: E402
from warm_cli import cli  # noqa: E402

RECORDS = 4  # per file: one global minibatch, so the first step sees every record whatever the shuffle


def first_step_loss(model, examples: list[tuple[list[int], list[bool]]]) -> tuple[float, int, int]:
    """Plain transformers' loss over a minibatch (each sample on its own, summed, divided by all its targets);
    with the minibatch's input positions and targets."""
    targets = sum(sum(mask[1:]) for _, mask in examples)
    total = 0.0
    with torch.no_grad():
        for ids, mask in examples:
            x = torch.tensor(ids)
            labels = torch.where(torch.tensor(mask[1:]), x[1:], -100)
            logits = model(input_ids=x[:-1][None]).logits[0]
            total += F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum").item()
    return total / targets, sum(len(ids) - 1 for ids, _ in examples), targets


def test_each_format_fine_tunes_with_plain_transformers_first_step_loss(tmp_path):
    """One `--multirun` command, one 2-rank CPU fine-tune per file, every format auto-detected: messages (content
    parts, tool calls, tool turns, tools), ShareGPT, Alpaca, TRL's prompt / completion under other column names
    (data.fields), TRL's conversational prompt / completion, text. Each run's first-step loss, input positions and
    target tokens equal plain transformers' on the records as the format's convention reads them."""
    model_dir = save_pretrained_model(tmp_path / "model", "llama")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOL_TEMPLATE  # a template that renders tools and tool calls, like Qwen's or Llama 3's
    tok.save_pretrained(model_dir)
    cases = format_cases(RECORDS)
    for name, pairs in cases.items():
        write_jsonl(tmp_path / f"{name}.jsonl", [record for record, _ in pairs])
    args = ["--multirun", "model.name=hf", f"model.path={model_dir}", "data.source=jsonl",
            f"data.path={','.join(f'{name}.jsonl' for name in cases)}",
            *(f"data.fields.{field}={column}" for field, column in FIELD_OVERRIDES.items()),
            f"data.batch_size={RECORDS}", "data.micro_batch_tokens=400", "run.steps=1", "optim.warmup_steps=1",
            "shard.group_bytes=8192", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    run = cli(*args, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    for job, (name, pairs) in enumerate(cases.items()):
        rows = [json.loads(line) for line in (tmp_path / "sweep" / str(job) / "metrics.jsonl").read_text().splitlines()]
        examples = [reference_example(tok, ref) for _, ref in pairs]
        assert max(len(ids) for ids, _ in examples) <= 401  # nothing truncated
        loss, positions, targets = first_step_loss(model, examples)
        assert (rows[0]["tokens"], rows[0]["target_tokens"]) == (positions, targets), name
        assert (targets == positions) == (name == "text"), name  # only text trains on every token after BOS
        torch.testing.assert_close(rows[0]["loss"], loss, rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}")
