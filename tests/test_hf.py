"""Hugging Face causal LMs through odcfsdp: per-document attention of packed rows, masks, and sharded training
(needs transformers)."""

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


def tiny_hf(tmp_path, arch: str = "llama", **extra):
    """An HFCausalLM of a tiny ``arch`` config (float64) and a plain transformers model (SDPA) with its weights."""
    from odcfsdp.models.hf import HFCausalLM

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, **extra)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig, "granite": transformers.GraniteConfig}[arch](**common)
    cfg.save_pretrained(tmp_path / arch)
    torch.manual_seed(0)
    model = HFCausalLM(str(tmp_path / arch)).double()
    plain = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double()
    plain.load_state_dict(model.model.state_dict())
    return model, plain


def sdpa_spy(monkeypatch):
    """Record (query length, whether a mask was given) of every SDPA call."""
    import torch.nn.functional as F

    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[-2], kwargs.get("attn_mask") is not None))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "granite"])  # granite: scores scaled by 0.3, not 1/sqrt(8)
@pytest.mark.parametrize("given", ["doc_lengths", "document_ids", "position_ids"])
def test_packed_rows_run_attention_per_document_like_plain_transformers(tmp_path, monkeypatch, arch, given):
    """A packed row's loss and gradients equal plain transformers (SDPA) on each document alone, float64; the
    attention runs per document (no S x S mask, no query longer than a document), whichever way the documents
    are given: the training loop's host-side lengths, document ids, or HF's own packed position_ids."""
    model, plain = tiny_hf(tmp_path, arch, **({"attention_multiplier": 0.3} if arch == "granite" else {}))
    assert model.model.config._attn_implementation == "odc_documents"
    docs = [torch.randint(0, 64, (n,)) for n in (6, 9, 4)]
    mb = pack([Sample(i, d, torch.ones_like(d, dtype=torch.bool)) for i, d in enumerate(docs)])
    calls = sdpa_spy(monkeypatch)
    if given == "doc_lengths":
        logits = model(mb.tokens, mb.positions, doc_lengths=mb.doc_lengths)
    elif given == "document_ids":
        logits = model(mb.tokens, mb.positions, mb.document_ids)
    else:
        logits = model.model(input_ids=mb.tokens, position_ids=mb.positions).logits
    assert calls and not any(masked for _, masked in calls) and max(n for n, _ in calls) == 8
    torch.nn.functional.cross_entropy(logits[0], mb.targets[0], reduction="sum").backward()
    ref = sum(torch.nn.functional.cross_entropy(plain(input_ids=d[:-1][None]).logits[0], d[1:], reduction="sum")
              for d in docs)
    ref.backward()
    grads = {n: p.grad for n, p in model.model.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_compiled_layers_do_not_recompile_for_new_documents(tmp_path):
    """Decoder layers compiled as `model.compile=true` does: after three micro-batches (static shapes, one document
    (dynamo specialises sizes 1), dynamic shapes) new numbers and lengths of documents compile nothing more (a list
    of lengths recompiled at every one), and losses and gradients equal the eager model's."""
    import copy

    from torch._dynamo.utils import counters

    eager, _ = tiny_hf(tmp_path)
    compiled = copy.deepcopy(eager)
    for layer in compiled.model.model.layers:
        layer.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    frames = []
    for lengths in ([5, 7], [12], [9, 3, 4], [2, 6, 3, 8, 4], [3] * 7, [4, 11]):
        tokens = torch.randint(0, 64, (1, sum(lengths)), generator=g)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        losses = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model(tokens, positions, doc_lengths=lengths).sum()
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-9, atol=1e-9)
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=name)
        frames.append(counters["frames"]["total"])
    assert frames[2] == frames[-1], frames


def test_padded_generation_matches_plain_transformers(tmp_path):
    """A 2-D padding mask and decoding with a cache take HF's SDPA path: greedy generation of a left-padded batch
    equals plain transformers'."""
    model, plain = tiny_hf(tmp_path)
    prompts, mask = torch.tensor([[5, 6, 7, 8], [1, 1, 8, 9]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    ours = model.generate(prompts, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=1)
    theirs = plain.generate(prompts, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=1)
    assert torch.equal(ours, theirs)


def test_sliding_window_models_run_sdpa_on_hf_packed_masks(tmp_path):
    """Per-document attention computes no sliding window: such a model stays on SDPA, with the masks HF builds per
    layer type from per-document positions; two packed rows given by document ids (positions derived from them)
    equal their documents one by one through plain transformers, window applied (documents longer than it)."""
    model, plain = tiny_hf(tmp_path, "mistral", sliding_window=4)
    assert model.model.config._attn_implementation == "sdpa"
    rows = [[torch.randint(0, 64, (n,)) for n in lengths] for lengths in ((6, 9), (10, 5))]
    mbs = [pack([Sample(i, d, torch.ones_like(d, dtype=torch.bool)) for i, d in enumerate(docs)]) for docs in rows]
    with torch.no_grad():
        packed = model(torch.cat([mb.tokens for mb in mbs]), document_ids=torch.cat([mb.document_ids for mb in mbs]))
        alone = [torch.cat([plain(input_ids=d[:-1][None]).logits[0] for d in docs]) for docs in rows]
    torch.testing.assert_close(packed, torch.stack(alone), rtol=1e-9, atol=1e-9)


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
