"""Hugging Face causal LMs through odcfsdp: per-document attention of packed rows, masks, and sharded training
(needs transformers)."""

from __future__ import annotations

import pytest
import torch

from odcfsdp.data.packing import Sample, pack
from odcfsdp.models.hf_attention import DOCUMENT_ATTENTION_MODEL_TYPES

transformers = pytest.importorskip("transformers", reason="the HF model path needs transformers (test extra)")


def tiny_config_dir(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


# A tiny config of any family (keys a family does not know are kept as plain attributes).
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, moe_intermediate_size=32, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, num_experts_per_tok=2, num_experts=4, num_local_experts=4)


def tiny_hf(tmp_path, arch: str = "llama", dtype=torch.float64, **extra):
    """An HFCausalLM of a tiny ``arch`` config and a plain transformers model (SDPA) with its weights."""
    from odcfsdp.models.hf import HFCausalLM

    cfg = transformers.AutoConfig.for_model(arch, **{**TINY, **extra})
    cfg.save_pretrained(tmp_path / arch)
    torch.manual_seed(0)
    model = HFCausalLM(str(tmp_path / arch)).to(dtype)
    plain = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)
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


def pack_docs(docs):
    """``docs`` packed into one micro-batch (inputs: one token fewer each)."""
    return pack([Sample(i, d, torch.ones_like(d, dtype=torch.bool)) for i, d in enumerate(docs)])


def packed(lengths, seed: int = 0):
    """Random documents of ``lengths`` tokens, and their packed micro-batch."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in lengths]
    return docs, pack_docs(docs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "granite"])  # granite: scores scaled by 0.3, not 1/sqrt(8)
@pytest.mark.parametrize("given", ["doc_lengths", "document_ids"])
def test_packed_rows_run_attention_per_document_like_plain_transformers(tmp_path, monkeypatch, arch, given):
    """A packed row's loss and gradients equal plain transformers (SDPA) on each document alone, float64; the
    attention runs per document (no S x S mask, no query longer than a document), whether the documents come as
    the training loop's host-side lengths or as document ids."""
    model, plain = tiny_hf(tmp_path, arch, **({"attention_multiplier": 0.3} if arch == "granite" else {}))
    assert model.model.config._attn_implementation == "odc_documents"
    docs, mb = packed((6, 9, 4))
    calls = sdpa_spy(monkeypatch)
    if given == "doc_lengths":
        logits = model(mb.tokens, mb.positions, doc_lengths=mb.doc_lengths)
    else:
        logits = model(mb.tokens, mb.positions, mb.document_ids)
    assert calls and not any(masked for _, masked in calls) and max(n for n, _ in calls) == 8
    torch.nn.functional.cross_entropy(logits[0], mb.targets[0], reduction="sum").backward()
    ref = sum(torch.nn.functional.cross_entropy(plain(input_ids=d[:-1][None]).logits[0], d[1:], reduction="sum")
              for d in docs)
    ref.backward()
    grads = {n: p.grad for n, p in model.model.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("arch", sorted(DOCUMENT_ATTENTION_MODEL_TYPES))
def test_every_listed_family_attends_per_document_like_plain_transformers(tmp_path, monkeypatch, arch):
    """Each family on the list takes the per-document attention (keyword arguments reach it; no mask is built)
    and gives plain transformers' logits on each document alone (float32: MoE kernels have no float64), for one
    row given by lengths and for two rows packed differently, given by document ids."""
    model, plain = tiny_hf(tmp_path, arch, torch.float32, **({"sliding_window": None} if arch == "mistral" else {}))
    model.eval(), plain.eval()  # no router noise (phimoe), no dropout
    assert model.model.config._attn_implementation == "odc_documents"
    docs, mb = packed((8, 13, 6))
    swapped = pack_docs([docs[1], docs[0], docs[2]])
    calls = sdpa_spy(monkeypatch)
    with torch.no_grad():
        one = model(mb.tokens, doc_lengths=mb.doc_lengths)[0]
        two = model(torch.cat([mb.tokens, swapped.tokens]), document_ids=torch.cat([mb.document_ids,
                                                                                    swapped.document_ids]))
        alone = [plain(input_ids=d[:-1][None]).logits[0] for d in docs]
    assert calls and not any(masked for _, masked in calls)
    for got, want in ((one, torch.cat(alone)), (two[0], torch.cat(alone)),
                      (two[1], torch.cat([alone[1], alone[0], alone[2]]))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_positions_without_lengths_take_hf_masks(tmp_path, monkeypatch):
    """Calling the HF model itself with packed positions, no lengths and no cache (HF detects packing only then):
    HF builds its mask, which the attention then applies through SDPA (nothing dropped), equal to the documents alone."""
    model, plain = tiny_hf(tmp_path)
    docs, mb = packed((6, 9, 4))
    calls = sdpa_spy(monkeypatch)
    with torch.no_grad():
        logits = model.model(input_ids=mb.tokens, position_ids=mb.positions, use_cache=False).logits[0]
        alone = torch.cat([plain(input_ids=d[:-1][None]).logits[0] for d in docs])
    assert calls[0] == (16, True)
    torch.testing.assert_close(logits, alone, rtol=1e-9, atol=1e-9)


def test_the_mask_function_builds_every_mask_hf_asks_for():
    """No mask only where the attention needs none: lengths given without padding, or a plain causal mask HF may
    skip; a mask HF wants materialised, a custom mask function, padding or a cache offset get HF's SDPA mask."""
    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask

    from odcfsdp.models.hf_attention import document_mask_function, lengths_given

    def no_first_key(b, h, q, kv):
        return kv > 0

    common = dict(batch_size=1, q_length=5, kv_length=5)
    assert document_mask_function(**common, mask_function=causal_mask_function) is None
    custom = and_masks(causal_mask_function, no_first_key)
    padding = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.bool)
    for kwargs in (dict(mask_function=causal_mask_function, allow_is_causal_skip=False),
                   dict(mask_function=custom, allow_is_causal_skip=False),  # as HF calls it with a custom function
                   dict(mask_function=causal_mask_function, attention_mask=padding)):
        want = sdpa_mask(**common, **kwargs)
        assert want is not None and torch.equal(document_mask_function(**common, **kwargs), want)
    with lengths_given():
        assert document_mask_function(**common, mask_function=custom) is None
        offset = document_mask_function(batch_size=1, q_length=1, kv_length=5, q_offset=4,
                                        mask_function=causal_mask_function, allow_is_causal_skip=False)
        assert torch.equal(offset, sdpa_mask(batch_size=1, q_length=1, kv_length=5, q_offset=4,
                                             mask_function=causal_mask_function, allow_is_causal_skip=False))


def test_attention_dropout_drops_in_training_only(tmp_path):
    """attention_dropout applies per document in training (two passes differ) and not in eval (plain's logits)."""
    model, plain = tiny_hf(tmp_path, attention_dropout=0.5)
    assert model.model.config._attn_implementation == "odc_documents"
    docs, mb = packed((6, 9))
    with torch.no_grad():
        train = [model.train()(mb.tokens, mb.positions, doc_lengths=mb.doc_lengths) for _ in range(2)]
        evaluated = model.eval()(mb.tokens, mb.positions, doc_lengths=mb.doc_lengths)[0]
        alone = torch.cat([plain.eval()(input_ids=d[:-1][None]).logits[0] for d in docs])
    assert not torch.allclose(train[0], train[1])
    torch.testing.assert_close(evaluated, alone, rtol=1e-9, atol=1e-9)


def test_compiled_layers_do_not_recompile_for_new_documents(tmp_path):
    """Decoder layers compiled as `model.compile=true` does: after two micro-batches (static shapes, then dynamic)
    new numbers and lengths of documents compile nothing more, one-document micro-batches included (a size-1
    lengths tensor would be specialised; a list of lengths recompiled at every one), and losses and gradients
    equal the eager model's."""
    import copy

    from torch._dynamo.utils import counters

    eager, _ = tiny_hf(tmp_path)
    compiled = copy.deepcopy(eager)
    for layer in compiled.model.model.layers:
        layer.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    frames = []
    for lengths in ([5, 7], [9, 3, 4], [12], [2, 6, 3, 8, 4], [3] * 7, [4, 11], [20]):
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
    assert frames[1] == frames[-1], frames


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


def test_hf_attention_bench_runs_on_cpu(tmp_path):
    """benchmarks/hf_attention_bench.py end to end on a CPU (tiny config): both implementations timed, the same
    loss and gradient norm (fp32), and its tables written."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    run = subprocess.run([sys.executable, "-m", "benchmarks.hf_attention_bench", "--out", str(tmp_path), "--size",
                          "tiny", "--tokens", "192", "--device", "cpu", "--warmup", "1", "--iters", "1", "--impls",
                          "sdpa", "odc_documents"], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads((tmp_path / "hf_attention_bench.json").read_text())
    assert set(data) == {"meta", "rows"} and {"date", "commit", "command", "device"} <= set(data["meta"])
    assert data["meta"]["command"].startswith("python -m benchmarks.hf_attention_bench --out")
    (row,) = data["rows"]
    ours = row["results"]["odc_documents"]
    assert row["documents"] > 1 and ours["tokens_per_s"] > 0 and row["results"]["sdpa"]["tokens_per_s"] > 0
    assert ours["loss_rel_diff_vs_sdpa"] < 1e-5 and ours["grad_norm_rel_diff_vs_sdpa"] < 1e-5
    assert "odc_documents" in (tmp_path / "hf_attention_bench.md").read_text()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "granite"])  # granite scales its logits: the unfused path
def test_loss_with_targets_equals_plain_transformers(tmp_path, arch):
    """``model(..., targets=t)`` (the head fused with the loss where the family allows) equals plain transformers'
    logits and cross-entropy, value and every gradient, float64."""
    model, plain = tiny_hf(tmp_path, arch, **({"logits_scaling": 4.0} if arch == "granite" else {}))
    assert model.fused_loss == (arch != "granite")
    model.model.lm_head.chunk_bytes = 8 * 64 * 5  # a few chunks of 5 rows
    docs, mb = packed((6, 9, 4))
    mb.targets[0, 3] = -100
    loss = model(mb.tokens, mb.positions, doc_lengths=mb.doc_lengths, targets=mb.targets)
    loss.backward()
    targets = mb.targets[0].split([5, 8, 3])
    ref = sum(torch.nn.functional.cross_entropy(plain(input_ids=d[:-1][None]).logits[0], t, reduction="sum")
              for d, t in zip(docs, targets))
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
    grads = {n: p.grad for n, p in model.model.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_lora_on_the_head_falls_back_to_logits_and_loss(tmp_path):
    """LoRA on ``lm_head`` replaces the fused head with PEFT's wrapper: ``targets=`` then takes the logits + loss
    path (a scalar, equal to the loss of the model's own logits), not the fused head's."""
    pytest.importorskip("peft")
    model, _ = tiny_hf(tmp_path)
    model.add_lora(4, 8, 0.0, ["q_proj", "lm_head"])
    docs, mb = packed((6, 9, 4))
    loss = model(mb.tokens, mb.positions, doc_lengths=mb.doc_lengths, targets=mb.targets)
    logits = model(mb.tokens, mb.positions, doc_lengths=mb.doc_lengths)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits[0], mb.targets[0], reduction="sum"))


def _save_with_full_values(out: str) -> dict:
    import torch.distributed as dist
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from odcfsdp import fully_shard

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        model.save_pretrained(out)
        alone = "written"
    except RuntimeError as e:
        alone = str(e)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:  # as Hugging Face's Trainer saves an FSDP2 model: the main process, full values
        model.save_pretrained(out, state_dict=full)
    dist.barrier()
    return {"alone": alone}


def test_save_pretrained_writes_a_full_state_dict_and_refuses_shards(tmp_path):
    """Hugging Face's Trainer saves an FSDP2 model as save_pretrained(dir, state_dict=full values): with odcfsdp's
    fully_shard that was refused, so TRL's default save_steps ended a run. Given full values it writes them (loaded
    back by plain transformers: the plain model's weights); alone it still refuses to write one rank's shards."""
    import transformers

    from odcfsdp.launch import spawn

    outs = spawn(_save_with_full_values, 2, str(tmp_path / "saved"))
    assert all(o["alone"].startswith("save_pretrained of a wrapped model would write this rank's shards") for o in outs)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    want, got = plain.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)
