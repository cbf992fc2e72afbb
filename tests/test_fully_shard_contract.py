"""FSDP2's contract where torch's ``fully_shard`` runs the same script beside ours on 2 CPU ranks: the same misuse
raises FSDP2's exception type, in one line ([fully-shard] 1); what FSDP2 refuses only for want of support and ODC
does right (a non-contiguous parameter) trains as the plain model does; compiled blocks give the graphs, graph breaks
and recompiles FSDP2's give ([hooks])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from odcfsdp.launch import spawn


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.lin = nn.Linear(4, 4)


class _Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(6, 4).t())  # (4, 6), strides (1, 4): not contiguous

    def forward(self, x):
        return x @ self.w


def _cases():
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return {
        "3-D mesh": lambda: (nn.Linear(4, 4), dict(mesh=init_device_mesh("cpu", (1, 1, world),
                                                                          mesh_dim_names=("a", "b", "c")))),
        "2-D mesh without names": lambda: (nn.Linear(4, 4), dict(mesh=init_device_mesh("cpu", (1, world)))),
        "0-dim parameter": lambda: (_Scalar(), {}),
        "int reshard_after_forward": lambda: (nn.Linear(4, 4), dict(reshard_after_forward=3)),
        "not a module": lambda: (3, {}),
    }


def _errors() -> dict:
    from torch.distributed.fsdp import fully_shard as theirs

    from odcfsdp import fully_shard as ours

    out = {}
    for name, make in _cases().items():
        for impl, fs in (("torch", theirs), ("odc", ours)):
            module, kwargs = make()
            try:
                fs(module, **kwargs)
                out[name, impl] = None
            except Exception as e:  # noqa: BLE001 - the exception is what is compared
                out[name, impl] = (type(e), str(e))
    return out


def test_the_same_misuse_raises_fsdp2s_exception_type_in_one_line():
    for rank_errors in spawn(_errors, 2):
        for (name, impl), got in rank_errors.items():
            if impl != "odc":
                continue
            want = rank_errors[name, "torch"]
            assert want is not None and got is not None, (name, want, got)
            assert isinstance(got[0], type) and issubclass(got[0], want[0]), (name, want, got)
            assert "\n" not in got[1], (name, got)


def _transposed(impl: str) -> list[float]:
    from odcfsdp import fully_shard

    model = _Transposed()
    if impl == "odc":
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(8.0).view(2, 4) / 8
    losses = []
    for _ in range(3):
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_non_contiguous_parameter_trains_as_the_plain_model():
    """FSDP2 raises NotImplementedError for it; ODC copies values, not strides, into its rows: the same steps as
    one plain process (every rank the same data, so the mean gradient is the plain one)."""
    want = _transposed("plain")
    for got in spawn(_transposed, 2, "odc"):
        assert got == pytest.approx(want, rel=1e-6), (got, want)


def _compile_counts(impl: str, how: str) -> dict:
    """Graphs, graph breaks and recompiles of two training steps, each block compiled (inductor's front end only:
    backend "eager") the three ways torchtitan-style scripts do: ``block.compile()`` after ``fully_shard``, or
    ``torch.compile(block)`` put in the block's place before or after it."""
    from torch._dynamo.utils import counters

    from odcfsdp.models import Llama, LlamaConfig

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from odcfsdp import fully_shard
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2))
    for i, layer in enumerate(model.layers):
        if how == "wrapped_before":
            model.layers[i] = layer = torch.compile(layer, backend="eager", fullgraph=True)
        fully_shard(layer)
        if how == "module_compile":
            layer.compile(backend="eager")
        elif how == "wrapped_after":
            model.layers[i] = torch.compile(layer, backend="eager")
    fully_shard(model)
    x = torch.randint(0, 64, (2, 8))
    for _ in range(2):
        model(x).float().sum().backward()
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
            "recompiles": sum(v for k, v in counters["recompiles"].items())}


@pytest.mark.parametrize("how", ["module_compile", "wrapped_before", "wrapped_after"])
def test_compiled_blocks_break_no_graph_at_our_hooks(how):
    """As FSDP2's: one graph, no break, no recompile (ours broke it at each block's two hooks: a lambda around a
    disabled method was inlined, [hooks])."""
    ours = spawn(_compile_counts, 2, "odc", how)
    theirs = spawn(_compile_counts, 2, "torch", how)
    assert ours == theirs and ours[0]["breaks"] == 0, (ours, theirs)
