"""The fused output projection + cross-entropy against ``F.cross_entropy`` on full logits (value and gradients)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from odcfsdp.models import Llama, LlamaConfig, LinearCrossEntropyHead, causal_lm_loss, linear_cross_entropy


def _reference(h, w, b, t, scale):
    """The unfused loss in float64: full logits, log-softmax, the target's term, summed over valid rows."""
    z = F.linear(h.double(), w.double(), None if b is None else b.double())
    keep = t != -100
    nll = -z.log_softmax(-1).gather(-1, t.clamp(min=0)[..., None])[..., 0]
    return (nll * keep).sum() * scale


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_value_and_gradients_match_float64_reference(bias, chunk_rows):
    torch.manual_seed(0)
    vocab, dim = 97, 24
    h = torch.randn(3, 41, dim, requires_grad=True)
    w = (torch.randn(vocab, dim) * 0.3).requires_grad_()
    b = torch.randn(vocab, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (3, 41))
    t[0, :9] = -100   # ignored rows: no loss, no gradient
    t[2, -1] = -100
    inputs = [x for x in (h, w, b) if x is not None]
    ref = _reference(h, w, b, t, 0.37)
    ref_grads = torch.autograd.grad(ref, inputs)
    out = linear_cross_entropy(h, w, t, b, chunk_bytes=4 * vocab * chunk_rows) * 0.37  # chunks of chunk_rows
    grads = torch.autograd.grad(out, inputs)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)  # r: the float64 gradient, rounded to fp32
    assert grads[0][0, :9].abs().max() == 0  # ignored rows get no gradient


def test_equals_the_unfused_loss_in_the_same_dtype():
    """Same ops as ``causal_lm_loss(lm_head(h))`` chunk by chunk: bf16 logits upcast, so values agree closely."""
    torch.manual_seed(1)
    h = torch.randn(1, 300, 32, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(211, 32) * 0.2).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 211, (1, 300))
    ref = causal_lm_loss(F.linear(h, w), t)
    ref_grads = torch.autograd.grad(ref / 300, (h, w))
    out = linear_cross_entropy(h, w, t, chunk_bytes=4 * 211 * 64)
    grads = torch.autograd.grad(out / 300, (h, w))
    assert grads[0].dtype == grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-3)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-4)


def test_without_grad_only_the_loss_is_computed():
    h, w = torch.randn(5, 8), torch.randn(11, 8)
    t = torch.tensor([1, -100, 3, 10, 0])
    with torch.no_grad():
        out = linear_cross_entropy(h, w, t)
    torch.testing.assert_close(out, causal_lm_loss(F.linear(h, w)[None], t[None]))
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(h, w, t[:4])


def test_head_gives_logits_without_targets_and_adopts_a_linear_in_place():
    torch.manual_seed(2)
    lin = nn.Linear(8, 13)
    ref = lin(torch.ones(2, 8))
    names = [n for n, _ in lin.named_parameters()]
    head = LinearCrossEntropyHead.adopt(lin)
    assert head is lin and [n for n, _ in head.named_parameters()] == names
    torch.testing.assert_close(head(torch.ones(2, 8)), ref)
    t = torch.tensor([3, 12])
    torch.testing.assert_close(head(torch.ones(2, 8), t), causal_lm_loss(ref[None], t[None]))
    with pytest.raises(TypeError, match="plain nn.Linear"):
        LinearCrossEntropyHead.adopt(nn.Bilinear(2, 2, 2))


@pytest.mark.parametrize("tie", [False, True])
def test_llama_with_targets_matches_logits_then_loss(tie):
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, tie_embeddings=tie)
    model = Llama(cfg)
    tokens = torch.randint(0, 300, (1, 40))
    targets = torch.roll(tokens, -1, 1)
    targets[0, 17] = -100
    ref = causal_lm_loss(model(tokens, doc_lengths=[17, 23]), targets)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    model.lm_head.chunk_bytes = 4 * 300 * 6  # several chunks
    out = model(tokens, doc_lengths=[17, 23], targets=targets)
    grads = torch.autograd.grad(out, list(model.parameters()))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bf16 matmuls with an fp32 output)")
def test_bf16_on_cuda_matches_the_unfused_loss():
    """On CUDA the weight gradient accumulates through ``addmm(out_dtype=fp32)``: same loss and gradients as the
    unfused bf16 head up to bf16 rounding, over many chunks."""
    torch.manual_seed(4)
    h = torch.randn(1, 4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(5000, 256, device="cuda") * 0.06).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 5000, (1, 4096), device="cuda")
    t[:, ::5] = -100
    ref = causal_lm_loss(F.linear(h, w), t)
    ref_grads = torch.autograd.grad(ref / 4096, (h, w))
    out = linear_cross_entropy(h, w, t, chunk_bytes=4 * 5000 * 512)  # 8 chunks
    grads = torch.autograd.grad(out / 4096, (h, w))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-2)
    for g, r in zip(grads, ref_grads):
        assert (g.float() - r.float()).abs().max() <= 2e-2 * r.float().abs().max()


def test_under_no_grad_no_gradient_is_computed(monkeypatch):
    """Evaluation runs under ``no_grad`` with parameters that require grad: the fused head computes the loss only
    (no fp32 weight-gradient accumulator, no extra matmul)."""
    import odcfsdp.models.loss as loss_module

    calls = []
    monkeypatch.setattr(loss_module, "_accumulate_weight_grad", lambda *a: calls.append(1))
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    t = torch.tensor([1, -100, 3, 10, 0, 2])
    with torch.no_grad():
        out = linear_cross_entropy(h, w, t)
    assert calls == [] and not out.requires_grad
    torch.testing.assert_close(out, causal_lm_loss(F.linear(h, w)[None], t[None]).detach())
    linear_cross_entropy(h, w, t).backward()
    assert calls and w.grad is not None  # the spy is on the path: grad mode computes it
