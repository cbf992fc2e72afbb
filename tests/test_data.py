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


# -- [truncate-first]: a record is tokenized only as far as the cap keeps it ----------------------------------------
class _Tokenizers:
    """A ``tokenizers`` tokenizer called as odcfsdp's are: ``encode(text)``, no special tokens added."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def _corpus() -> list[str]:
    """Text the test tokenizers learn from: prose, numbers, and long runs (long tokens for the BPEs)."""
    words = ["the", "sample", "token", "cap", "keeps", "prefix", "whole", "record", "tokenizer", "merges"]
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) + f" {i * 37} {i}." for i in range(300)]
    return lines + ["a" * n for n in (2, 4, 8, 16, 32, 64)] + ["ab" * 40, "\u4e2d\u6587\u5b57" * 20, "  \n\t" * 10]


def _test_tokenizers() -> dict:
    """Tokenizers of the kinds models ship: byte-level BPE (GPT-2, Llama 3, Qwen), a BPE with no pre-tokenizer
    (merges across spaces), a Unigram with Metaspace and NFKC (sentencepiece, T5), a WordPiece with BERT's
    normalizer (drops control and format characters), and odcfsdp's byte tokenizer."""
    pytest.importorskip("tokenizers", reason="the test extra's transformers brings tokenizers")
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    def trained(model, trainer, pre=None, norm=None) -> _Tokenizers:
        tok = Tokenizer(model)
        if pre is not None:
            tok.pre_tokenizer = pre
        if norm is not None:
            tok.normalizer = norm
        tok.train_from_iterator(_corpus(), trainer)
        return _Tokenizers(tok)

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return {
        "bytes": ByteTokenizer(),
        "bpe_bytelevel": trained(models.BPE(), trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet,
                                                                  show_progress=False),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False)),
        "bpe_no_pretokenizer": trained(models.BPE(unk_token="?"), trainers.BpeTrainer(
            vocab_size=600, special_tokens=["?"], show_progress=False)),
        "unigram_metaspace": trained(models.Unigram(), trainers.UnigramTrainer(
            vocab_size=300, unk_token="<unk>", special_tokens=["<unk>"], show_progress=False),
            pre_tokenizers.Metaspace(), normalizers.NFKC()),
        "wordpiece_bert": trained(models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer(
            vocab_size=400, special_tokens=["[UNK]"], show_progress=False),
            pre_tokenizers.BertPreTokenizer(), normalizers.BertNormalizer()),
    }


def _hard_texts() -> dict[str, str]:
    """Texts where cutting is most likely to change the tokens before the cut."""
    g = torch.Generator().manual_seed(0)
    letters = "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (20_000,), generator=g))
    return {
        "prose": " ".join(_corpus()) * 3,
        "one_long_word": letters,
        "one_letter_run": "a" * 30_000,  # merged by the BPEs into their longest tokens; one unknown word to WordPiece
        "whitespace_runs": ("x" + " " * 50 + "\n\t") * 600,
        "nfkc_expands": "\ufdfa " * 3_000,  # NFKC writes each as 18 characters
        "normalizer_drops": "\u200b" * 50_000 + " the whole record " * 40,  # BERT's normalizer drops U+200B
        "cjk_and_emoji": ("\u4e2d\u6587\u5b57 \U0001f600\U0001f680 caf\u00e9 " * 2_000),
    }


def test_a_text_tokenized_up_to_the_cap_is_the_whole_texts_tokens_cut_there():
    """[truncate-first]: ``encode_prefix(tok, text, n)`` is ``tok.encode(text)[:n]`` (the reference: tokenize the
    whole text, then cut), and says whether tokens were cut, for tokenizers of every kind models ship and for the
    texts most likely to differ (one word of 20K letters, runs of a BPE's longest token, whitespace runs,
    characters a normalizer expands 18-fold or drops) at caps from 0 to past the text's end."""
    from odcfsdp.data.truncate import encode_prefix

    for name, tok in _test_tokenizers().items():
        for kind, text in _hard_texts().items():
            whole = tok.encode(text)
            for limit in (0, 1, 5, 63, 64, 65, 200, 511, 1_000, 4_000, len(whole), len(whole) + 10):
                ids, more = encode_prefix(tok, text, limit)
                assert ids == whole[:limit], (name, kind, limit)
                assert more == (len(whole) > limit), (name, kind, limit)


def test_the_tokenizer_sees_a_bounded_prefix_unless_the_prefix_holds_too_few_tokens():
    """A 5M-character text under a cap of 512 tokens: the tokenizer is given at most 8 characters a token of the cap
    and its margin (not 5M); a text whose characters all vanish but the last few (BERT's normalizer drops U+200B) is
    tokenized in prefixes that double until the whole text, so its tokens are still the whole text's."""
    from odcfsdp.data.truncate import CHARS_PER_TOKEN, encode_prefix, margin

    class Spy(ByteTokenizer):
        def __init__(self, drop: str = ""):
            super().__init__()
            self.drop, self.seen = drop, []

        def encode(self, text: str) -> list[int]:
            self.seen.append(len(text))
            return super().encode(text.replace(self.drop, "") if self.drop else text)

    text = "one long record " * 312_500
    tok = Spy()
    assert encode_prefix(tok, text, 512) == (list(text[:512].encode()), True)
    assert tok.seen == [CHARS_PER_TOKEN * (512 + margin(512))] and max(tok.seen) < len(text) / 500
    vanishing = "\u200b" * 1_000_000 + "tail"
    tok = Spy(drop="\u200b")
    assert encode_prefix(tok, vanishing, 3) == (list(b"tai"), True)
    assert tok.seen[-1] == len(vanishing) and all(b == 2 * a for a, b in zip(tok.seen, tok.seen[1:-1]))


def test_a_50_mb_record_is_cut_before_it_is_tokenized(tmp_path):
    """Issue 44: one 50 MB record took 1.93 GiB a rank, tokenized whole before the cap cut it. Loaded now in a
    process of its own (bounded), it adds less than 0.4 GiB to the peak (the line read, its JSON string), and its
    sample is the record's first tokens."""
    import subprocess
    import sys

    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"text": "fifty megabytes of one record " * 1_700_000}) + "\n")
    script = (
        "import json, resource\n"
        "from odcfsdp.data.jsonl import JsonlSource\n"
        "from odcfsdp.data.tokenizer import ByteTokenizer\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"src = JsonlSource({str(path)!r}, ByteTokenizer(), 4097)\n"
        "grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20\n"  # KiB -> GiB
        "print(json.dumps([grown, src.num_samples, src.records[0][0].tolist()]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown, samples, tokens = json.loads(proc.stdout)
    assert path.stat().st_size > 50e6 and grown < 0.4, grown
    text = "fifty megabytes of one record " * 137
    assert samples == 1 and tokens == [ByteTokenizer().bos_id, *text.encode()[:4096]]
