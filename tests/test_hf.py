"""Hugging Face causal LMs through odcfsdp: packing masks, and sharded training (needs transformers)."""

from __future__ import annotations

import pytest
import torch

from odcfsdp.data.packing import Sample, pack

transformers = pytest.importorskip("transformers", reason="the HF model path needs transformers (test extra)")


def tiny_config_dir(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_packed_logits_equal_documents_one_by_one(tmp_path):
    from odcfsdp.models.hf import HFCausalLM

    torch.manual_seed(0)
    model = HFCausalLM(str(tiny_config_dir(tmp_path))).double().eval()
    docs = [torch.randint(0, 64, (n,)) for n in (6, 9, 4)]
    mb = pack([Sample(i, d, torch.ones_like(d, dtype=torch.bool)) for i, d in enumerate(docs)])
    with torch.no_grad():
        packed = model(mb.tokens, mb.positions, mb.document_ids)[0]
        alone = torch.cat([model(d[:-1][None])[0] for d in docs])
    torch.testing.assert_close(packed, alone, rtol=1e-9, atol=1e-9)


def test_sharded_training_of_an_hf_model(tmp_path):
    from test_train import run_ranks

    rows = run_ranks({"model": {"name": "hf", "hf_config": str(tiny_config_dir(tmp_path))},
                      "data": {"vocab_size": 64, "batch_size": 8, "micro_batch_tokens": 256,
                               "lengths": {"max_len": 128}},
                      "run": {"steps": 12}}, tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
