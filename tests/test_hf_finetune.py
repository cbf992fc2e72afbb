"""Fine-tuning pretrained Hugging Face checkpoints through the CLI, against plain transformers + torch AdamW."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="fine-tuning HF models needs transformers (test extra)")

from hf_fixtures import chat_records, save_pretrained_model, write_jsonl  # noqa: E402
from warm_cli import cli  # noqa: E402

from odcfsdp import ODCShard  # noqa: E402
from odcfsdp.checkpoint import export_hf, load_hf  # noqa: E402
from odcfsdp.data.jsonl import JsonlSource  # noqa: E402
from odcfsdp.data.tokenizer import load_tokenizer  # noqa: E402
from odcfsdp.app.builders import build_optimizer, build_source  # noqa: E402
from odcfsdp.app.config import config_from  # noqa: E402

STEPS = 3


def overrides(model_dir: Path, data: Path, held_out: Path, out: Path, comm: str) -> dict:
    return {"model": {"name": "hf", "path": str(model_dir)},
            "data": {"source": "jsonl", "path": str(data), "eval_path": str(held_out), "batch_size": 8,
                     "micro_batch_tokens": 96},
            "balance": {"kind": "lb_micro" if comm == "collective" else "lb_mini"},
            # eps 1e-6: k_proj biases get gradients of pure rounding noise (softmax ignores a shift of every
            # score), which Adam with a tiny eps would turn into lr-sized steps of either sign
            "optim": {"lr": 3e-3, "warmup_steps": 1, "eps": 1e-6},
            "shard": {"comm": comm, "group_bytes": 8192},
            "checkpoint": {"interval": STEPS},
            "run": {"steps": STEPS, "out_dir": str(out), "export_hf": True, "eval_interval": 2}}


def as_cli(tree: dict, prefix: str = "") -> list[str]:
    """Nested overrides as Hydra command-line arguments."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += as_cli(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def held_out_loss(model, source) -> float:
    """Mean next-token loss of ``model`` over every target of ``source``'s samples, each on its own."""
    total, targets = 0.0, 0
    with torch.no_grad():
        for i in range(source.num_samples):
            s = source[i]
            logits = model(input_ids=s.tokens[:-1][None]).logits[0]
            total += F.cross_entropy(logits.float(), torch.where(s.loss_mask[1:], s.tokens[1:], -100),
                                     ignore_index=-100, reduction="sum").item()
            targets += s.n_targets
    return total / targets


def reference(tree: dict, model_dir: Path, model=None) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Plain transformers (each sample on its own, no packing) + torch AdamW on the run's minibatches; the held-out
    loss after steps 2 and 3 (if the run has a held-out file)."""
    cfg = config_from(tree)
    source, _ = build_source(cfg)
    held_out = JsonlSource(cfg.data.eval_path, load_tokenizer(str(model_dir)), 10_000) if cfg.data.eval_path else None
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
    opt, sched = build_optimizer(cfg, model, torch.device("cpu"))
    losses, evals = [], []
    batch, cap = cfg.data.batch_size, cfg.data.micro_batch_tokens
    for step in range(STEPS):
        samples = [source[step * batch + i].truncated(cap + 1) for i in range(batch)]
        targets = sum(s.n_targets for s in samples)
        total = 0.0
        for s in samples:
            logits = model(input_ids=s.tokens[:-1][None]).logits[0]
            labels = torch.where(s.loss_mask[1:], s.tokens[1:], -100)  # the loss the run's packing computes
            loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / targets
            loss.backward()
            total += loss.item()
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        if held_out is not None and step + 1 in (2, STEPS):
            evals.append(held_out_loss(model, held_out))
    return losses, evals, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch, comm, dtype, sharded_files", [
    ("llama", "shm", torch.float32, False),
    ("qwen2", "collective", torch.bfloat16, True),
])
def test_cli_fine_tune_matches_plain_transformers(tmp_path, arch, comm, dtype, sharded_files):
    """`python -m odcfsdp.train model.name=hf model.path=<dir>` on 2 CPU ranks: weights (fp32 single file, or bf16
    sharded with an index), rotary buffers and the tokenizer's chat template come from the directory; losses equal
    plain transformers' on the same minibatches (the first one: the pretrained model's own loss), and so does the
    held-out loss (run.eval_interval=2, data.eval_path; 7 records, uneven over the ranks); the exported
    directory and the checkpoint's export (`python -m odcfsdp.export`) load with from_pretrained, equal each other
    bit for bit, and equal the reference's trained weights."""
    model_dir = save_pretrained_model(tmp_path / arch, arch, dtype=dtype,
                                      max_shard_size="40KB" if sharded_files else None)
    assert (model_dir / "model.safetensors.index.json").exists() == sharded_files
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(48))
    held_out = write_jsonl(tmp_path / "held_out.jsonl", chat_records(7, seed=5))
    tree = overrides(model_dir, data, held_out, tmp_path / "run", comm)
    run = cli(*as_cli(tree), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["target_tokens"] < rows[0]["tokens"]  # only assistant turns carry loss

    want_losses, want_evals, want_params = reference(tree, model_dir)
    torch.testing.assert_close([r["loss"] for r in rows], want_losses, rtol=1e-5, atol=0)
    assert [("eval_loss" in r) for r in rows] == [False, True, True]  # every 2 steps, and at the end
    torch.testing.assert_close([r["eval_loss"] for r in rows[1:]], want_evals, rtol=1e-5, atol=0)

    exported = tmp_path / "run" / "hf"
    again = tmp_path / "again"
    cmd = subprocess.run([sys.executable, "-m", "odcfsdp.export", str(tmp_path / "run" / "checkpoints" /
                                                                         f"step_{STEPS:08d}"), str(again)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert cmd.returncode == 0, cmd.stderr[-3000:]
    first = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    second = transformers.AutoModelForCausalLM.from_pretrained(again, dtype=torch.float32)
    assert type(first).__name__.lower().startswith(arch)
    for name, want in want_params.items():
        got = dict(first.named_parameters())[name]
        assert torch.equal(got, dict(second.named_parameters())[name]), name
        # atol 2e-6: the run's fused head + loss scales the logits' gradient after its matmuls, the reference
        # before: fp32 roundings that Adam's normalisation lifts to ~1e-6 on a few elements after 3 steps.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6, msg=lambda m: f"{name}: {m}")
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert tok.chat_template and tok.apply_chat_template(chat_records(1)[0]["messages"], tokenize=False)
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == 3


def test_meta_built_hf_model_rebuilds_rotary_buffers_and_loads_weights(tmp_path):
    """The big-model route on a plain transformers model: meta device, ODCShard(device=), load_hf. Rotary
    frequencies are computed buffers (in no file): they are rebuilt, so logits equal from_pretrained's."""
    model_dir = save_pretrained_model(tmp_path / "llama", "llama")
    want = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    model = ODCShard(meta, device=torch.device("cpu"))
    load_hf(model, model_dir)
    x = torch.randint(0, 280, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, want(x).logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="export_hf"):
        model.module.save_pretrained(tmp_path / "shards")
    export_hf(model, tmp_path / "full")  # the supported way: config.json from the model's own config
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), want.parameters()))
    model.close()


def test_decoder_layers_are_the_default_units(tmp_path):
    from odcfsdp.models.hf import HFCausalLM
    from odcfsdp.app.shard_config import unit_classes

    model_dir = save_pretrained_model(tmp_path / "qwen", "qwen2")
    with torch.device("meta"):
        model = HFCausalLM(str(model_dir))
    assert [c.__name__ for c in unit_classes(model, [])] == ["Qwen2DecoderLayer"]
    assert [c.__name__ for c in unit_classes(model, ["Qwen2MLP"])] == ["Qwen2MLP"]


def test_lora_fine_tune_trains_only_the_adapters(tmp_path):
    """model.lora.r=4 through the CLI (PEFT): base weights frozen (out of the optimizer and of the pushes), adapters
    started as PEFT starts them; losses equal plain transformers + PEFT + torch AdamW from the same adapters; the
    merged export changes only the adapted projections, and equals the base model + the adapter export."""
    peft = pytest.importorskip("peft")
    from odcfsdp.models.hf import HFCausalLM

    model_dir = save_pretrained_model(tmp_path / "llama", "llama")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_records(48))
    tree = overrides(model_dir, data, data, tmp_path / "run", "shm")
    tree["data"].pop("eval_path")
    tree["run"].pop("eval_interval")
    tree["model"]["lora"] = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    tree["optim"]["lr"] = 1e-2
    run = cli(*as_cli(tree), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    ref = HFCausalLM(str(model_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref.model.load_state_dict(base.state_dict())
    ref.add_lora(4, 8.0, 0.0, ["q_proj", "v_proj"])
    ref.load_state_dict(ref.initial_adapters(0), strict=False)
    want_losses, _, _ = reference(tree, model_dir, ref.model)
    torch.testing.assert_close([r["loss"] for r in rows], want_losses, rtol=1e-5, atol=0)
    assert rows[-1]["loss"] < rows[0]["loss"]

    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{STEPS:08d}"
    saved = json.loads((checkpoint / "manifest.json").read_text())["optimizer"]["param_groups"]
    assert {n for g in saved for n in g["params"]} and all(".lora_" in n for g in saved for n in g["params"])

    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32)
    base_params = dict(base.named_parameters())
    for name, p in merged.named_parameters():
        adapted = any(f"self_attn.{m}." in name for m in ("q_proj", "v_proj"))
        assert torch.equal(p, base_params[name]) != adapted, name
    adapter_dir = tmp_path / "adapter"
    cmd = subprocess.run([sys.executable, "-m", "odcfsdp.export", str(checkpoint), str(adapter_dir), "--lora",
                          "adapter"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert cmd.returncode == 0, cmd.stderr[-3000:]
    with_adapter = peft.PeftModel.from_pretrained(base, adapter_dir)
    x = torch.randint(0, 280, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=x).logits, merged(input_ids=x).logits, rtol=1e-5, atol=1e-5)

    # Issue 32: resuming this checkpoint without LoRA is one line before ranks start (it was "21 missing")
    tree["model"]["lora"] = {"r": 0}
    tree["run"]["out_dir"] = str(tmp_path / "run_without_lora")
    again = cli(*as_cli(tree), f"checkpoint.resume={checkpoint}", cwd=tmp_path, timeout=120)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1, again.stderr[-3000:]
    assert lines[0] == (f"error: checkpoint.resume: {checkpoint} was written with LoRA adapters (model.lora.r=4) "
                        "and this run has model.lora.r=0: resume with model.lora.r=4"), lines
    assert not (tmp_path / "run_without_lora").exists()


def test_generate_and_resume_from_an_hf_directory(tmp_path):
    """wrapped.generate on the CLI's model class equals plain transformers' greedy generation; pointing
    checkpoint.resume at an HF directory names model.path."""
    from odcfsdp.checkpoint import CheckpointError
    from odcfsdp.models.hf import HFCausalLM
    from odcfsdp.app.trainer import resume

    model_dir = save_pretrained_model(tmp_path / "qwen", "qwen2")
    with torch.device("meta"):
        inner = HFCausalLM(str(model_dir))
    model = ODCShard(inner, device=torch.device("cpu"), units=inner.decoder_layer_classes())
    load_hf(model, model_dir)
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = torch.tensor([[0, 17, 42, 99, 5]])
    want = plain.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), want)
    cfg = config_from({"checkpoint": {"resume": str(model_dir)}})
    with pytest.raises(CheckpointError, match="model.path="):
        resume(cfg, tmp_path, model, None, None)
    model.close()
