"""Data sources, tokenizers and packing: determinism, loss masks, and no attention across documents."""

from __future__ import annotations

import json
import math

import pytest
import torch

from odcfsdp.data.jsonl import JsonlSource
from odcfsdp.data.lengths import LengthConfig, LengthDistribution
from odcfsdp.data.packing import IGNORE, Sample, pack
from odcfsdp.data.synthetic import MarkovTokens, SyntheticSFT
from odcfsdp.data.tokenizer import ByteTokenizer
from odcfsdp.models import Llama, LlamaConfig


def test_lengths_are_seeded_and_in_range():
    cfg = LengthConfig(kind="lognormal", min_len=16, max_len=512, median=64, sigma=1.0)
    a, b = LengthDistribution(cfg, 3), LengthDistribution(cfg, 3)
    xs = [a.sample(i) for i in range(2000)]
    assert xs == [b.sample(i) for i in range(2000)]
    assert min(xs) >= 16 and max(xs) <= 512
    assert xs != [LengthDistribution(cfg, 4).sample(i) for i in range(2000)]
    xs.sort()
    assert 48 <= xs[1000] <= 80  # the median lands near 64
    hist = LengthDistribution(LengthConfig(kind="histogram"), 0)
    ys = [hist.sample(i) for i in range(4000)]
    assert 8192 <= min(ys) and max(ys) <= 65536
    share_short = sum(y < 16384 for y in ys) / len(ys)
    assert 0.5 < share_short < 0.6  # the first bin's weight is 0.55


def test_length_config_errors():
    with pytest.raises(ValueError, match="data.lengths.kind='pareto' is not one of"):
        LengthDistribution(LengthConfig(kind="pareto"), 0)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        LengthDistribution(LengthConfig(min_len=100, max_len=10), 0)


def test_synthetic_samples_are_deterministic_with_prompt_masks():
    dist = LengthDistribution(LengthConfig(kind="lognormal", max_len=300), 0)
    a = SyntheticSFT(64, dist, seed=0, pool_tokens=5000, prompt_fraction=0.25)
    b = SyntheticSFT(64, dist, seed=0, pool_tokens=5000, prompt_fraction=0.25)
    for i in range(20):
        x, y = a[i], b[i]
        assert torch.equal(x.tokens, y.tokens) and x.tokens.numel() == a.length(i)
        n = x.tokens.numel()
        assert not x.loss_mask[: int(n * 0.25)].any() and x.loss_mask[int(n * 0.25) :].all()
        assert int(x.tokens.max()) < 64


def test_markov_chain_with_few_successors_matches_its_dense_matrix():
    """Large vocabularies keep ``successors`` next tokens per token; the entropy merges repeats."""
    chain = MarkovTokens(600, seed=3, successors=16)
    dense = torch.zeros(600, 600, dtype=torch.float64)
    dense.scatter_add_(1, chain.next_tokens, chain.transition.double())
    torch.testing.assert_close(dense.sum(1), torch.ones(600, dtype=torch.float64))
    p = dense.clamp_min(1e-300)
    assert abs(chain.entropy_rate() - float(-(p * p.log()).sum(1).mean())) < 1e-9
    stream = chain.stream(5000, index=1)
    assert torch.equal(stream, chain.stream(5000, index=1))
    steps = dense[stream[:-1], stream[1:]]
    assert (steps > 0).all()  # every transition taken is one the chain allows
    big = MarkovTokens(32000, seed=0)  # would be 4 GB dense; here 32000 x 256
    assert big.transition.shape == (32000, 256) and 0 < big.entropy_rate() < math.log(256)


def test_jsonl_text_and_chat(tmp_path):
    path = tmp_path / "data.jsonl"
    records = [
        {"text": "héllo"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo!"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},  # no loss: dropped
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    tok = ByteTokenizer()
    src = JsonlSource(str(path), tok, max_len=100, seed=0)
    assert src.num_samples == 2 and src.dropped == 1
    by_len = {src[i].tokens.numel(): src[i] for i in range(2)}
    text = by_len[1 + len("héllo".encode()) + 1]
    assert text.tokens.tolist() == [tok.bos_id, *"héllo".encode(), tok.eos_id]
    assert text.loss_mask.tolist() == [False] + [True] * (len(text.tokens) - 1)
    chat = by_len[1 + 1 + 2 + 1 + 1 + 3 + 1]
    ids = [tok.bos_id, tok.role_ids["user"], *b"hi", tok.eos_id, tok.role_ids["assistant"], *b"yo!", tok.eos_id]
    assert chat.tokens.tolist() == ids
    assert chat.loss_mask.tolist() == [False] * 6 + [True] * 4  # the assistant's content and its EOS
    assert sorted(src[i].index for i in range(4)) == [0, 1, 2, 3]  # indices run on across epochs


def test_jsonl_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"oops": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: fits no data format: fields found: oops; formats known: "
                                         r"messages \(messages\), sharegpt \(conversations\)"):
        JsonlSource(str(bad), ByteTokenizer(), 100)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON"):
        JsonlSource(str(bad), ByteTokenizer(), 100)
    with pytest.raises(FileNotFoundError, match="data.path"):
        JsonlSource(str(tmp_path / "missing.jsonl"), ByteTokenizer(), 100)


def test_pack_layout_closed_form():
    a = Sample(7, torch.tensor([1, 2, 3, 4]), torch.tensor([False, False, True, True]))
    b = Sample(9, torch.tensor([5, 6, 7]), torch.tensor([True, True, True]))
    mb = pack([a, b])
    assert mb.tokens.tolist() == [[1, 2, 3, 5, 6]]
    assert mb.targets.tolist() == [[IGNORE, 3, 4, 6, 7]]  # a's first target (2) is prompt: no loss
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.document_ids.tolist() == [[0, 0, 0, 1, 1]]
    assert mb.n_targets == a.n_targets + b.n_targets == 4
    assert mb.sample_indices == [7, 9]


def test_packed_logits_equal_documents_run_one_by_one():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)).double()
    docs = [torch.randint(0, 50, (n,)) for n in (7, 3, 12, 5)]
    samples = [Sample(i, d, torch.ones_like(d, dtype=torch.bool)) for i, d in enumerate(docs)]
    mb = pack(samples)
    assert mb.doc_lengths == [6, 2, 11, 4]
    with torch.no_grad():
        masked = model(mb.tokens, mb.positions, mb.document_ids)[0]  # dense document mask
        per_doc = model(mb.tokens, mb.positions, doc_lengths=mb.doc_lengths)[0]  # attention per document
        alone = torch.cat([model(d[:-1][None])[0] for d in docs])
        leaky = model(mb.tokens)[0]  # plain causal attention over the packed row
    torch.testing.assert_close(masked, alone, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(per_doc, alone, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(leaky, alone)  # the checks above would notice attention across documents
    with pytest.raises(ValueError, match="doc_lengths must describe one packed row"):
        model(mb.tokens, doc_lengths=[3, 3])


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    plain = Llama(cfg).double()
    ckpt = Llama(LlamaConfig(**{**cfg.__dict__, "activation_checkpointing": True})).double()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 50, (2, 9))
    for m in (plain, ckpt):
        m(x).pow(2).mean().backward()
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14, msg=n)
