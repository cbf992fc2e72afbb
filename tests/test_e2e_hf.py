"""The e2e benchmark on Hugging Face models (``--model hf:<name>``, benchmarks/e2e_hf.py) on CPU.

odc, hf_fsdp2 and hf_ddp train the same HF model to the same losses, and the first step's loss is plain
transformers' loss of that model on the same samples (each on its own, no packing); the named shapes have
the released models' parameter counts.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")

from benchmarks import e2e_bench
from benchmarks import e2e_hf
from benchmarks import e2e_summary

from odcfsdp.models import llama_config  # noqa: E402

ARGS = ["--cpu-ranks", "2", "--model", "hf:tiny", "--steps", "2", "--warmup", "1", "--batch", "8", "--seq", "64",
        "--cap", "512", "--pool", "20000", "--group-bytes", "8192", "--lr", "1e-2"]


def reference_first_loss(workload: str, seed: int = 0) -> float:
    """transformers' fp32 loss of the seeded tiny model on the workload's first minibatch, each sample alone."""
    source, cap = e2e_bench.workload_source(workload, 256, seed, 20000, 64, 512)
    samples = [source[i].truncated(cap + 1) for i in range(8)]
    torch.manual_seed(seed)  # as e2e_bench seeds before building every method's model
    model = transformers.AutoModelForCausalLM.from_config(e2e_hf.hf_config("tiny"), dtype=torch.float32)
    total = 0.0
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=s.tokens[:-1][None]).logits[0]
            labels = torch.where(s.loss_mask[1:], s.tokens[1:], -100)
            total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
    return total / sum(s.n_targets for s in samples)


def test_odc_and_hf_baselines_train_the_same_hf_model(tmp_path):
    """One 2-rank CPU run of both workloads: odc (lb_mini, lb_micro), hf_fsdp2 and hf_ddp agree step by step."""
    e2e_bench.main([*ARGS, "--methods", "odc", "hf_fsdp2", "hf_ddp", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "e2e_bench.json").read_text())
    runs = data["rows"]
    assert {(r["workload"], r["method"], r["balance"]) for r in runs} == set(
        e2e_bench.runs_for(["balanced", "longtail"], ["odc", "hf_fsdp2", "hf_ddp"]))
    assert data["meta"]["model"] == "HF tiny (LlamaForCausalLM)"
    assert data["meta"]["params"] == sum(p.numel() for p in
                                         transformers.LlamaForCausalLM(e2e_hf.hf_config("tiny")).parameters())
    for workload in ("balanced", "longtail"):
        rows = [r for r in runs if r["workload"] == workload]
        ref = next(r for r in rows if r["method"] == "hf_fsdp2")
        want = reference_first_loss(workload)
        assert abs(ref["losses"][0] - want) <= 1e-5 * want, (workload, ref["losses"][0], want)
        for r in rows:  # fp32 on CPU: the same model, data and optimizer give the same losses and gradient norms
            for a, b in zip(r["losses"], ref["losses"]):
                assert abs(a - b) <= 1e-4 * abs(b), (workload, r["method"], r["balance"], r["losses"], ref["losses"])
            for a, b in zip([s["grad_norm"] for s in r["steps"]], [s["grad_norm"] for s in ref["steps"]]):
                assert abs(a - b) <= 1e-4 * abs(b), (workload, r["method"], "grad norms", a, b)
            assert r["losses"][-1] < r["losses"][0]  # it trains
    md = (tmp_path / "e2e_bench.md").read_text()
    assert "| longtail | hf_fsdp2 | lb_micro |" in md and "1.00x" in md
    assert "- longtail: odc lb_mini / hf_fsdp2 lb_micro = " in md and "of it" in md
    rows = e2e_summary.rows(tmp_path / "e2e_bench.json")  # HF runs in the summary: hf_fsdp2 / hf_ddp are the baselines
    for row, workload in zip(rows, ("balanced", "longtail")):
        by = {(r["method"], r["balance"]): r["tokens_per_s"] for r in runs if r["workload"] == workload}
        cells = [c.strip() for c in row.split("|")]
        assert cells[5] == f"{by['hf_fsdp2', 'lb_micro']:.0f}" and cells[9] == (
            f"{by['hf_ddp', 'lb_micro'] / by['hf_fsdp2', 'lb_micro']:.2f}x"), row
        assert cells[-2].endswith("(HF tiny (LlamaForCausalLM))"), row


def test_compiled_recomputed_hf_layers_train_the_same_model(tmp_path):
    """--compile (aot_eager on CPU) and HF's gradient checkpointing under odc and hf_fsdp2: the same losses as eager."""
    e2e_bench.main([*ARGS, "--workloads", "longtail", "--methods", "odc", "hf_fsdp2", "--compile", "aot_eager",
                    "--activation-checkpointing", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "e2e_bench.json").read_text())["rows"]
    assert len(runs) == 3
    want = reference_first_loss("longtail")
    for r in runs:
        assert abs(r["losses"][0] - want) <= 1e-5 * want, (r["method"], r["losses"], want)
        for a, b in zip(r["losses"], runs[0]["losses"]):
            assert abs(a - b) <= 1e-4 * abs(b), (r["method"], r["balance"], r["losses"], runs[0]["losses"])


@pytest.mark.parametrize("name,size", [("llama-1b", "1b"), ("llama3-8b", "8b")])
def test_hf_shapes_match_our_llama(name, size):
    """The HF Llama shapes have our Llama's parameter and matmul counts at the same vocabulary (its closed forms)."""
    args = e2e_bench.parse(["--model", f"hf:{name}"])
    assert args.vocab == 128256 and args.methods == ["odc", "hf_fsdp2"]
    bm = e2e_hf.bench_model(args)
    ours = llama_config(size, 128256)
    assert (bm.params, bm.matmul_params, bm.layers, bm.dim) == (ours.num_params(), ours.matmul_params(),
                                                                  ours.n_layers, ours.dim)
    assert (bm.heads, bm.kv_heads, bm.head_dim) == (ours.n_heads, ours.n_kv_heads, ours.head_dim)


def test_qwen_shape_counts_its_biases():
    """Qwen2.5-7B: 7.62B parameters by hand (q/k/v biases, untied 152064-token embeddings)."""
    bm = e2e_hf.bench_model(e2e_bench.parse(["--model", "hf:qwen2.5-7b"]))
    d, f, kv, v, n = 3584, 18944, 4 * 128, 152064, 28
    layer = 2 * d * d + 2 * d * kv + 3 * d * f + (d + 2 * kv) + 2 * d  # q, o; k, v; mlp; qkv biases; norms
    assert bm.params == n * layer + 2 * v * d + d
    assert bm.matmul_params == bm.params - v * d - n * (d + 2 * kv + 2 * d) - d  # no lookup, biases or norms


@pytest.mark.parametrize("argv,message", [
    (["--model", "hf:tiny", "--methods", "odc", "fsdp2"], "do not apply to an HF model"),
    (["--methods", "hf_fsdp2"], "do not apply to our Llama"),
    (["--model", "hf:nope"], "not one of"),
    (["--model", "hf:tiny", "--attention", "flash"], "--attention applies to our Llama only"),
    (["--model-path", "/nonexistent"], "no config.json there"),
])
def test_misfit_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        e2e_bench.parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("tied", [True, False])
def test_cli_counts_the_flops_the_bench_counts(tmp_path, tied):
    """The CLI's HF spec (MFU of ``python -m odcfsdp.train``) counts the matmul parameters e2e_hf counts: a tied
    LM head is a matmul too, listed once under the input embedding."""
    from odcfsdp.app.config import config_from
    from odcfsdp.app.specs import model_spec

    config = e2e_hf.hf_config("tiny")
    config.tie_word_embeddings = tied
    config.save_pretrained(tmp_path)
    cfg = config_from({"model": {"name": "hf", "hf_config": str(tmp_path / "config.json")}})
    with torch.device("meta"):
        built = model_spec("hf").build(cfg, 256)
    d, f, kv, v = 64, 192, 2 * 16, 256
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f
    assert built.matmul_params == 2 * per_layer + v * d  # the LM head once, the input lookup never
    args = e2e_bench.parse(["--model-path", str(tmp_path)])
    assert e2e_hf.bench_model(args).matmul_params == built.matmul_params
