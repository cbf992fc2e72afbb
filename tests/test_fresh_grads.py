"""[fresh-grads] (odcfsdp/sharding/groups/fresh_grads.py): a group's gradient buffer made at its push from autograd's
own gradient tensors, against the buffer written by hand; and training through it, against plain PyTorch, in the
parity tests (tests/test_parity.py and the others run with it by default)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from odcfsdp.sharding.groups.fresh_grads import buffer_from_grads, fresh_grads_apply


class _Layout:
    """Parameters at [N * offset, N * offset + numel) of an unsharded buffer of N * row_len (GroupLayout's rule)."""

    def __init__(self, world: int, shapes: list[tuple[int, ...]]):
        self.world, self.numels = world, [int(torch.Size(s).numel()) for s in shapes]
        self.shards = [-(-n // world) for n in self.numels]
        self.offsets = [sum(self.shards[:i]) for i in range(len(shapes))]
        self.unsharded_numel = world * (sum(self.shards) + 3)  # and a tail of padding

    def unsharded_range(self, i: int) -> tuple[int, int]:
        return self.world * self.offsets[i], self.world * self.offsets[i] + self.numels[i]


def _param(grad, trained=True):
    return SimpleNamespace(trained=trained, trainable=trained, unsharded=SimpleNamespace(grad=grad))


def test_the_buffer_holds_each_gradient_at_its_place_and_zeros_elsewhere(monkeypatch):
    """3 ranks, parameters of 5, 2 x 3 and 7 elements (padded to 6, 6, 9): the second has no gradient, the third is
    frozen, the padding and the tail hold poison until the copy; every place is what it should be, by hand."""
    g = torch.Generator().manual_seed(0)
    shapes = [(5,), (2, 3), (7,)]
    layout = _Layout(3, shapes)
    grads = [torch.randn(s, generator=g, dtype=torch.float64).to(torch.bfloat16) for s in shapes]
    params = [_param(grads[0]), _param(None), _param(grads[2], trained=False)]
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))  # the poison
    out = buffer_from_grads(layout, params, torch.bfloat16, torch.device("cpu"))
    expected = torch.zeros(layout.unsharded_numel, dtype=torch.bfloat16)
    start, end = layout.unsharded_range(0)
    expected[start:end] = grads[0]
    monkeypatch.undo()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert buffer_from_grads(layout, [_param(None), _param(None), _param(grads[2], trained=False)], torch.bfloat16,
                             torch.device("cpu")) is None  # nothing to push


def test_a_sparse_gradient_and_a_zero_size_parameter_take_their_places():
    """A sparse embedding's gradient (rows 1 and 3, row 1 twice) is added at its place as dense values; a trained
    zero-size parameter without a gradient takes no place and breaks nothing; all by hand."""
    layout = _Layout(2, [(4, 3), (0,), (5,)])
    sparse = torch.sparse_coo_tensor(torch.tensor([[1, 3, 1]]), torch.ones(3, 3), (4, 3))
    dense = torch.randn(5)
    out = buffer_from_grads(layout, [_param(sparse), _param(None), _param(dense)], torch.float32, torch.device("cpu"))
    expected = torch.zeros(layout.unsharded_numel)
    expected[3:6], expected[9:12] = 2.0, 1.0  # row 1 (twice) and row 3 of the (4, 3) embedding
    start, end = layout.unsharded_range(2)
    expected[start:end] = dense
    assert torch.equal(out, expected)
    out = buffer_from_grads(layout, [_param(None), _param(None), _param(dense)], torch.float32, torch.device("cpu"))
    assert torch.equal(out, torch.where(torch.arange(layout.unsharded_numel) < start, 0.0, expected))


def test_groups_whose_gradients_come_in_another_dtype_keep_the_zeroed_buffer():
    """A buffer narrower or wider than the parameters' gradients (autograd's are in the parameter's dtype) cannot
    take them by a copy; a group with nothing trained has nothing to push."""
    bf16 = torch.empty(4, dtype=torch.bfloat16)
    assert fresh_grads_apply([_param(None)], torch.bfloat16, bf16)
    assert not fresh_grads_apply([_param(None)], torch.float32, bf16)
    assert not fresh_grads_apply([_param(None, trained=False)], torch.bfloat16, bf16)
