"""Causal attention per document: bucket lengths, exact end padding, cuDNN against flash attention on GPUs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from odcfsdp.models import LlamaConfig
from odcfsdp.models.attention import _per_document, bucket_length, causal_attention, warm_attention


def test_bucket_length_rounds_up_by_less_than_an_eighth_or_128():
    seen = set()
    for n in range(1, 70000):
        b = bucket_length(n)
        assert n <= b and b - n < max(128, b / 8)  # an eighth, or less than 128 tokens
        seen.add(b)
    for p in range(7, 17):  # powers of two from 128 up are their own bucket
        assert bucket_length(1 << p) == 1 << p
    assert len([b for b in seen if 32768 < b <= 65536]) == 8  # 8 buckets per doubling
    assert bucket_length(4096) == 4096 and bucket_length(4097) == 4608 and bucket_length(70) == 128
    with pytest.raises(ValueError, match="length must be >= 1"):
        bucket_length(0)


def _reference(q, k, v, lengths):
    """Per-document causal attention from its definition (float64, repeated key/value heads)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    outs = []
    for qd, kd, vd in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2)):
        scores = qd @ kd.transpose(-1, -2) / qd.shape[-1] ** 0.5
        n = qd.shape[2]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append(scores.softmax(-1) @ vd)
    return torch.cat(outs, 2)


@pytest.mark.parametrize("pad", [False, True])
def test_documents_padded_to_their_bucket_give_the_exact_outputs_and_gradients(pad):
    torch.manual_seed(0)
    lengths = [5, 130, 1, 17]  # 130 pads to 144, 5/1/17 to 128
    q = torch.randn(1, 4, sum(lengths), 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, sum(lengths), 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, sum(lengths), 8, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(1, 4, sum(lengths), 8, dtype=torch.float64)
    rep = lambda t: t.repeat_interleave(2, 1)  # noqa: E731
    out = _per_document(q, rep(k), rep(v), lengths, contextlib.nullcontext, pad=pad, gqa=False)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = _reference(q, k, v, lengths)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_cpu_attention_matches_the_definition_and_backend_names_are_checked():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 12, 8, dtype=torch.float64), torch.randn(1, 2, 12, 8, dtype=torch.float64), \
        torch.randn(1, 2, 12, 8, dtype=torch.float64)
    torch.testing.assert_close(causal_attention(q, k, v, [4, 8]), _reference(q, k, v, [4, 8]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(causal_attention(q, k, v), _reference(q, k, v, [12]), rtol=1e-10, atol=1e-10)
    assert warm_attention([100, 5000], 4, 2, 8, torch.device("cpu")) == 0  # nothing to build on a CPU
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        LlamaConfig(attention_backend="fa3")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_cudnn_padded_documents_match_flash_attention():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is used from Hopper on")
    torch.manual_seed(0)
    lengths = [4096, 1000, 8191, 3]
    make = lambda h: torch.randn(1, h, sum(lengths), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(32), make(8), make(8)
    dout = torch.randn_like(q)
    results = {}
    for backend in ("cudnn", "flash"):
        out = causal_attention(q, k, v, lengths, backend)
        results[backend] = [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]
    rng = torch.cuda.get_rng_state()
    assert warm_attention(lengths + [300], 32, 8, 64, q.device, "cudnn") == 5  # 4096, 1024, 8192, 128, 384
    assert warm_attention([290], 32, 8, 64, q.device, "cudnn") == 0  # built already
    assert torch.equal(rng, torch.cuda.get_rng_state())  # a model initialised next gets the same weights
    # The two kernels order their sums differently: agreement to bf16 rounding (measured ~3e-3 of the max).
    for got, want in zip(results["cudnn"], results["flash"]):
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < 2e-2
    with torch.no_grad():  # and both against a float64 computation from the definition
        ref = _reference(q.double().cpu(), k.double().cpu(), v.double().cpu(), lengths)
    for backend in ("cudnn", "flash"):
        err = (results[backend][0].double().cpu() - ref).abs().max() / ref.abs().max()
        assert err.item() < 1e-2, backend
