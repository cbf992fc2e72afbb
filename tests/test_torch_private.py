"""[torch-private]: the one module that touches torch's private APIs. Each of its uses is tested against the installed
torch (so an upgrade that moves one fails here, by name), and no other file of the package touches one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from odcfsdp import torch_private as tp

PACKAGE = Path(__file__).resolve().parents[1] / "odcfsdp"
# a private torch name: an underscore component after torch (torch._C, torch.utils._pytree, torch.cuda.memory._snapshot),
# a private attribute torch gives tensors, or the frame API; torch's documented multi-tensor ops (_foreach_*) excepted
PRIVATE = re.compile(r"torch(\.\w+)*\._(?!foreach_)\w+|from torch[\w.]* import _|\._local_tensor\b|\._version\b|"
                     r"\._is_param\b|sys\._getframe|_execution_engine")


def test_no_other_file_touches_a_private_torch_api():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "torch_private.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if PRIVATE.search(code) and not code.strip().startswith(("``", "*", '"""')) and "``" not in code:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
    assert found == []


def test_the_scan_catches_a_private_use():
    assert PRIVATE.search("x = torch._C._current_graph_task_id()") and PRIVATE.search("t._version")
    assert PRIVATE.search("from torch.utils._pytree import tree_flatten") and not PRIVATE.search("torch._foreach_zero_(x)")


def test_in_backward_and_the_end_of_backward_callback():
    seen = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad):
        seen.append(("in hook", tp.in_backward()))
        tp.queue_end_of_backward(lambda: seen.append(("end", tp.in_backward())))
        return grad

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert not tp.in_backward() and seen == [("in hook", True), ("end", True)]


def test_tensor_grad_slot_version_local_and_parameter_mark():
    t = torch.zeros(3, requires_grad=True)
    tp.TENSOR_GRAD.__set__(t, torch.ones(3))
    assert torch.equal(t.grad, torch.ones(3))
    v = tp.version_of(t.detach())
    t.detach().add_(1)
    assert tp.version_of(t.detach()) == v + 1
    assert tp.local_of(t) is t
    marked = torch.zeros(2).as_subclass(torch.Tensor)
    tp.mark_parameter(marked)
    assert isinstance(marked, torch.nn.Parameter)


def test_foreach_types_optimizer_hooks_frames_and_profiler():
    class Mine(torch.Tensor):
        pass

    tp.register_foreach_types(Mine)
    from torch.optim.optimizer import (_foreach_supported_types, register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    assert Mine in _foreach_supported_types
    pre = register_optimizer_step_pre_hook(lambda *a: None)
    post = register_optimizer_step_post_hook(lambda *a: None)
    assert tp.optimizer_hooks_present(pre.id, post.id)
    pre.remove()
    assert not tp.optimizer_hooks_present(pre.id, post.id)
    post.remove()

    def zero_grad():
        return inner()

    def inner():
        return tp.called_from("zero_grad", depth=2, skip=0)

    assert zero_grad() and not inner()
    assert not tp.profiler_enabled()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert tp.profiler_enabled()


def test_dtensor_spec_tree_leaves_and_wrapper_subclasses():
    leaves = tp.tree_leaves(({"a": torch.ones(1)}, [2, torch.zeros(1)]))
    assert len([x for x in leaves if isinstance(x, torch.Tensor)]) == 2
    assert not tp.is_traceable_wrapper_subclass(torch.ones(1))
    assert tp.DTensorSpec is not None and tp.TensorMeta is not None
    assert set(tp.TESTED_TORCH) >= {"2.13"}
    assert callable(tp.record_memory_history) and callable(tp.memory_snapshot)  # CUDA only: tests/test_memory.py
    g = torch.Generator().manual_seed(0)
    a = tp.standard_gamma(torch.full((1000,), 2.0), g)
    assert abs(a.mean().item() - 2.0) < 0.2  # Gamma(2, 1): mean 2
    keys = tp.IncompatibleKeys([], ["x"])
    assert keys.unexpected_keys == ["x"]
    assert tp.apply_to_tensors(lambda t: t * 2, {"a": torch.ones(1)})["a"].item() == 2.0


def test_values_on_read_keep_their_metadata_and_are_made_by_the_first_operation():
    like = torch.arange(24.0).view(4, 6)[:, :3]  # a strided view: its strides are kept
    reads = []

    def read():
        reads.append(1)
        return like

    held = tp.ValuesOnRead(like, read)
    assert (held.shape, held.stride(), held.dtype, held.device) == (like.shape, like.stride(), like.dtype, like.device)
    assert not held.requires_grad and not reads  # metadata made nothing
    assert torch.equal(held + 1, like + 1) and held.sum().item() == like.sum().item()
    assert torch.equal(torch._foreach_mul([held], 2.0)[0], like * 2) and repr(held) == repr(like)
    held.add_(1)  # in place: on the real tensor
    assert like[0, 0].item() == 1.0 and len(reads) == 5


def test_torchs_fully_shard_state_finds_a_registered_state():
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard  # never patched

    module, state = torch.nn.Linear(2, 2), object()
    assert torch_fully_shard.state(module) is None
    tp.register_fully_shard_state(module, state)
    assert torch_fully_shard.state(module) is state


def test_pyproject_states_the_tested_torch_range():
    """The supported range runs from the oldest torch this module was tested with to just past the newest one's minor
    version (issue 43: the range was torch>=2.4, tested on 2.11 and 2.13 only)."""
    import re

    text = (PACKAGE.parent / "pyproject.toml").read_text()
    floor, ceiling = re.search(r'"torch>=([\d.]+),<([\d.]+)"', text).groups()
    newest = tp.TESTED_TORCH[-1].split(".")
    assert floor == tp.TESTED_TORCH[0] and ceiling == f"{newest[0]}.{int(newest[1]) + 1}"
    assert torch.__version__.split("+")[0].rsplit(".", 1)[0] in tp.TESTED_TORCH  # this torch is a tested one


def test_the_implicit_events_reach_a_sink():
    """[implicit-events]: ``EventGrad``'s ``.grad`` reads and writes, a torch optimizer's step over the parameters
    and a read inside ``zero_grad`` reach the parameter's sink, and nothing else does; an optimizer over ``UNSHARDED``
    parameters is refused before it steps."""
    events = tp

    class Param(events.EventGrad, torch.nn.Parameter):
        pass

    class Sink:
        def __init__(self):
            self.seen = []

        def grad_read(self, sp):
            self.seen.append(("read", events.inside_zero_grad()))
            return events.stored_grad(sp.tensor)

        def grad_written(self, sp, value):
            self.seen.append(("written", value is None))
            events.store_grad(sp.tensor, value)

        def optimizer_stepped(self, sps):
            self.seen.append(("stepped", [sp.tensor is p for sp in sps]))

    class Record:  # what a sharded parameter's ``_odc`` is to the adapter: its tensor and its sink
        def __init__(self, tensor, sink):
            self.tensor, self.events = tensor, sink

    events.install_optimizer_hooks()
    sink = Sink()
    p = Param(torch.ones(2))
    p._odc = Record(p, sink)
    plain = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 0.5)
    plain.grad = torch.full((2,), 0.5)
    opt = torch.optim.SGD([p, plain], lr=1.0)
    opt.step()
    assert torch.equal(p.detach(), torch.full((2,), 0.5)) and torch.equal(plain.detach(), torch.full((2,), 0.5))
    stepped = sink.seen.index(("stepped", [True]))
    opt.zero_grad()
    assert sink.seen[0] == ("written", False) and ("read", False) in sink.seen[:stepped]  # the step read p.grad
    assert sink.seen[stepped + 1:] == [("read", True), ("written", True)]  # zero_grad's read, then its clearing
    assert p.grad is None and plain.grad is None

    def zero_grad():  # any function of that name, as an optimizer's or a module's
        return p.grad

    sink.seen.clear()
    zero_grad()
    assert sink.seen == [("read", True)]
    before = torch.nn.Parameter(torch.ones(1))
    events.UNSHARDED[id(before)] = before
    before.grad = torch.ones(1)
    with pytest.raises(RuntimeError, match="build the optimizer after wrapping"):
        torch.optim.SGD([before], lr=1.0).step()
    del events.UNSHARDED[id(before)]
