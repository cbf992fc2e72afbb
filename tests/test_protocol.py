"""The one-sided protocol under the plain PyTorch loop: where ranks meet, and where they do not.

Every collective that torch.distributed issues (including the functional ones DTensor
uses for the norm) is counted per phase of a minibatch.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from odcfsdp import ODCShard, param_groups
from odcfsdp.launch import spawn
from parity import ParityModel, Run, causal_lm_loss

COLLECTIVES = [
    "all_reduce", "barrier", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_object",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
]
FUNCTIONAL = ["all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast"]


@contextlib.contextmanager
def counting(calls: list, with_groups: bool = False):
    """Record the name of every collective called inside (torch.distributed's and the functional ones), with
    ``with_groups`` as (name, the ``group=`` keyword argument)."""
    patched = [(dist, n) for n in COLLECTIVES if hasattr(dist, n)] + [(funcol, n) for n in FUNCTIONAL
                                                                     if hasattr(funcol, n)]
    originals = [(mod, n, getattr(mod, n)) for mod, n in patched]

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, kwargs.get("group")) if with_groups else name)
            return fn(*args, **kwargs)
        return wrapper

    for mod, n, fn in originals:
        setattr(mod, n, wrap(f"{'funcol.' if mod is funcol else ''}{n}", fn))
    try:
        yield
    finally:
        for mod, n, fn in originals:
            setattr(mod, n, fn)


@contextlib.contextmanager
def counting_device_waits(model, calls: list):
    """Record ``"quiesce"`` for every call of the model's transport's ``quiesce``: where a rank waits for its
    device (``torch.cuda.synchronize`` on the nvshmem transport; the shm transport's memory fence on CPU)."""
    transport = model.transport
    original = transport.quiesce

    def quiesce():
        calls.append("quiesce")
        return original()

    transport.quiesce = quiesce
    try:
        yield
    finally:
        del transport.quiesce  # the class's method again


def _count_by_phase(comm: str, micro_batches: list[int], zero_grad_first: bool = False) -> list[dict[str, list[str]]]:
    """Per step, per phase of the standard loop: the collectives called and the device waits (``quiesce``)."""
    rank = dist.get_rank()
    run = Run(len(micro_batches), micro_batches)
    model = ODCShard(ParityModel(), 4096, comm=comm)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    per_step = []

    def phase(phases, name):
        calls = phases.setdefault(name, [])
        return _both(counting(calls), counting_device_waits(model, calls))

    for step in range(2):
        phases: dict[str, list[str]] = {}
        if zero_grad_first:
            with phase(phases, "zero_grad"):
                opt.zero_grad()
        with phase(phases, "micro-batches"):
            for x, y in run.data[step][rank]:
                causal_lm_loss(model(x), y, run.tokens(step)).backward()
        with phase(phases, "clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with phase(phases, "step"):
            opt.step()
        if not zero_grad_first:
            with phase(phases, "zero_grad"):
                opt.zero_grad()
        per_step.append(phases)
    with phase(per_step[-1], "next forward"):
        model(run.data[0][0][0][0][:1, :2])
    model.close()
    return per_step


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


@pytest.mark.parametrize("micro_batches, zero_grad_first", [([3, 1], False), ([2, 0], False), ([2, 0], True)])
def test_one_sided_ranks_meet_only_where_gradients_are_read_and_consumed(micro_batches, zero_grad_first):
    """No collective and no device wait during the micro-batches (nor in a forward after the step);
    clip_grad_norm_ is one meeting (the sync, after one device wait: this rank's pushes complete) plus the norm's
    one all-reduce; the optimizer step one meeting (the finish, in its hook, after one device wait: the new rows
    visible), and zero_grad nothing at all, after the step or at the top of the next step ([zero-grad-pass]),
    although param_groups' no-decay group makes it two passes over the parameters. A rank without micro-batches
    meets and waits at the same points."""
    for per_step in spawn(_count_by_phase, 2, "shm", micro_batches, zero_grad_first):
        for phases in per_step:
            assert phases["micro-batches"] == []
            assert sorted(phases["clip"]) == ["all_gather_single", "funcol.all_reduce", "quiesce"]
            assert sorted(phases["step"]) == ["all_gather_single", "quiesce"]
            assert phases["zero_grad"] == []
        assert per_step[-1]["next forward"] == []


def test_collective_transport_is_detected_by_the_same_check():
    """The counter is not blind: the collective transport calls collectives in every micro-batch."""
    for per_step in spawn(_count_by_phase, 2, "collective", [2, 2]):
        assert all(len(phases["micro-batches"]) > 2 for phases in per_step)


def _read_grad_mid_minibatch(micro_batches: list[int]) -> str:
    rank = dist.get_rank()
    run = Run(len(micro_batches), micro_batches)
    model = ODCShard(ParityModel(), 4096, comm="shm")
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    try:
        for x, y in run.data[0][rank]:
            causal_lm_loss(model(x), y, run.tokens(0)).backward()
            if rank == 0:
                next(model.parameters()).grad  # noqa: B018 - a read in the middle of rank 0's micro-batches
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    finally:
        model.close()
    return "no error"


def test_grad_read_in_the_middle_of_a_minibatch_is_refused():
    """A .grad read is where one-sided ranks meet: a rank that reads it and then runs another micro-batch is
    stopped with a clear error at that forward (the other rank took the read for the end of the minibatch)."""
    with pytest.raises(RuntimeError, match="rank 0 failed(.|\n)*a forward pass after gradients were read"):
        spawn(_read_grad_mid_minibatch, 2, [2, 1], timeout=120)


def _zero_grad_between_micro_batches(micro_batches: list[int]) -> str:
    """A loop that calls zero_grad() after every micro-batch slot (a misuse: in plain PyTorch it drops the
    gradients): ranks with micro-batches sync there, a rank without skips those passes ([zero-grad-pass])."""
    rank = dist.get_rank()
    run = Run(len(micro_batches), micro_batches)
    model = ODCShard(ParityModel(), 4096, comm="shm")
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3)
    try:
        mine = run.data[0][rank]
        for k in range(max(micro_batches)):
            if k < len(mine):
                causal_lm_loss(model(mine[k][0]), mine[k][1], run.tokens(0)).backward()
            opt.zero_grad()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    finally:
        model.close()
    return "no error"


def test_zero_grad_between_micro_batches_is_refused_on_every_rank():
    """The skipped zero_grad passes are counted at the next meeting: where ranks disagree, every rank raises the
    same error naming zero_grad, instead of one rank syncing where the other does not (mixed minibatches). Rank 1
    skipped two zero_grad() calls of two passes each (param_groups' no-decay group goes back in model order)."""
    with pytest.raises(RuntimeError, match=r"rank [01] failed(.|\n)*minibatch 0, 0 zero_grad\(\) pass\(es\) "
                                           r"without gradients(.|\n)*minibatch 0, 4 zero_grad"):
        spawn(_zero_grad_between_micro_batches, 2, [2, 0], timeout=120)


def _tiny() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _tiny_data(steps: int, micro_batches: list[int]) -> list[list[list[torch.Tensor]]]:
    """data[step][rank] = that rank's micro-batches."""
    g = torch.Generator().manual_seed(1)
    return [[[torch.randn(4, 8, generator=g) for _ in range(n)] for n in micro_batches] for _ in range(steps)]


def _train_tiny(model, inner, data_of_rank, zero_grad_first: bool, skip_bias: bool, evaluate: bool):
    """SGD with momentum and weight decay, clipping; optional plain-PyTorch idioms around the step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    norms = []
    for step, micro in enumerate(data_of_rank):
        if zero_grad_first:
            opt.zero_grad()
        for x in micro:
            model(x).pow(2).sum().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        if skip_bias:
            inner[0].bias.grad = None  # the optimizer skips this parameter this step
        opt.step()
        if not zero_grad_first:
            opt.zero_grad()
        if evaluate:
            with torch.no_grad():
                model(torch.ones(2, 8))
    return norms


def _tiny_sharded(micro_batches, zero_grad_first, skip_bias):
    rank = dist.get_rank()
    model = ODCShard(_tiny(), comm="shm")
    model.set_gradient_divide_factor(1.0)  # sum: the reference sums over ranks (one loss over the union)
    data = [per_rank[rank] for per_rank in _tiny_data(3, micro_batches)]
    norms = _train_tiny(model, model.module, data, zero_grad_first, skip_bias, evaluate=rank == 0)
    out = norms, model.full_state_dict()
    model.close()
    return out


@pytest.mark.parametrize("micro_batches, zero_grad_first, skip_bias", [([1, 0], True, False), ([2, 1], False, True)])
def test_plain_loop_idioms_match_plain_pytorch(micro_batches, zero_grad_first, skip_bias):
    """zero_grad at the top of the loop or after the step, an evaluation forward that only rank 0 runs after each
    step (no meeting, no hang), a .grad set to None to skip one parameter in a step, uneven micro-batch counts
    including a rank without any: the run equals plain PyTorch on the union of the micro-batches."""
    ref = _tiny()
    union = [[x for per_rank in step for x in per_rank] for step in _tiny_data(3, micro_batches)]
    ref_norms = _train_tiny(ref, ref, union, zero_grad_first, skip_bias, evaluate=False)
    for norms, state in spawn(_tiny_sharded, 2, micro_batches, zero_grad_first, skip_bias, timeout=120):
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", ["subset optimizer", "two optimizers at different rates"])
def test_gradients_left_unconsumed_are_an_error(case):
    """A trained parameter whose gradient no optimizer steps on and no zero_grad clears would have to accumulate
    across minibatches, which the accumulators cannot do: the next forward says so and names the parameters."""
    model = ODCShard(_tiny())
    inner = model.module
    fast = torch.optim.SGD(inner[2].parameters(), lr=0.1)
    slow = torch.optim.SGD(inner[0].parameters(), lr=0.1) if case != "subset optimizer" else None
    model(torch.randn(4, 8)).sum().backward()
    fast.step()
    fast.zero_grad()
    with pytest.raises(RuntimeError, match=r"no optimizer step consumed .*\['0.weight', '0.bias'\].*freeze it"):
        model(torch.randn(4, 8))
    if slow is not None:  # stepping the other one too completes the minibatch
        slow.step()
        model(torch.randn(4, 8)).sum().backward()
    model.close()


def test_an_optimizer_built_before_wrapping_is_refused():
    """Its parameters are the unsharded ones: stepping would silently train nothing."""
    inner = _tiny()
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    model = ODCShard(inner)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="build the optimizer after wrapping"):
        opt.step()
    model.close()


def test_a_model_dropped_without_close_is_freed_and_models_add_no_hooks():
    """Optimizer steps reach a model through its parameters ([optimizer-events]): one pair of global hooks for the
    process, none per model, so a model dropped without close() is freed and leaves nothing registered."""
    import gc
    import weakref

    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    def hooks() -> int:
        return len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks)

    model = ODCShard(_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    registered = hooks()
    ref = weakref.ref(model)
    del model, opt
    gc.collect()
    assert ref() is None
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.ones(2)
    torch.optim.SGD([weight], lr=0.5).step()  # a plain optimizer is untouched by the hooks
    assert torch.equal(weight.detach(), torch.full((2,), 0.5))
    other = ODCShard(_tiny())
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other.close()
    opt.step()  # the closed model's shards are empty: its protocol takes no event any more
    assert hooks() == registered


def test_the_design_notes_transition_table_is_the_protocols():
    """[step-protocol]'s table of states and transitions is ``TRANSITIONS`` verbatim: each row's method is the
    ``Minibatch`` method the table runs."""
    import re

    from odcfsdp.sharding.runtime import minibatch, protocol

    rows = re.findall(r"^(ACCUMULATING|EMPTY|READY) +([A-Z]+) +(_\w+)", protocol.__doc__, re.M)
    assert len(rows) == 8
    assert sorted(rows) == sorted((s.name, e.name, method.__name__) for (s, e), method in minibatch.TRANSITIONS.items())
    assert all(getattr(minibatch.Minibatch, m.__name__) is m for m in minibatch.TRANSITIONS.values())


def test_each_lifecycle_step_is_a_profiler_range():
    """[lifecycle]: a profiled step of the standard loop shows each phase as an ``odc::`` range, as FSDP2's show in a
    trace: gather and reshard per site in forward, re-gather and push per site in backward, the flush at the end of
    each backward, then one sync and one finish per minibatch (two micro-batches here), each with its wait for the
    device (quiesce) and its meeting, the finish with its publish."""
    from torch.profiler import ProfilerActivity, profile

    model = ODCShard(_tiny(), units=(torch.nn.Linear,), reshard_after_forward=True)
    opt = torch.optim.SGD(param_groups(model), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()  # a first step outside the trace: nothing left to set up in it
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("odc::"):
            counts[event.name] = counts.get(event.name, 0) + 1
    sites = 2  # the two Linear units (Tanh holds no parameter)
    # a push range per site whose inputs need a gradient, per backward: the last Linear's (the Tanh's output); the
    # first Linear's inputs are data, so its groups are pushed at the end of backward, in the flush
    assert counts == {"odc::gather": 2 * sites, "odc::reshard": 2 * sites, "odc::pre_backward": 2 * sites,
                      "odc::push": 2 * 1, "odc::flush": 2, "odc::sync": 1, "odc::finish": 1, "odc::quiesce": 2,
                      "odc::meet": 2, "odc::publish": 1}, counts
    model.close()


def test_pushes_in_flight_takes_none_or_a_count():
    """[streams] 2: ``model.comm.pushes_in_flight`` is a number of sites >= 0 (1, FSDP2's bound, the default) or None
    (unbounded);
    anything else is refused in one line. (The bound itself acts on CUDA's push stream:
    tests/test_gpu.py::test_bounded_pushes_train_what_unbounded_ones_do.)"""
    model = ODCShard(ParityModel(torch.float32), 1 << 12, comm="shm")
    try:
        assert model.comm.pushes_in_flight == 1
        model.comm.pushes_in_flight = None
        assert model.comm.pushes_in_flight is None
        for bad in (-1, 1.5, True, "1"):
            with pytest.raises(ValueError, match=r"^pushes_in_flight must be None \(unbounded\) or an int >= 0"):
                model.comm.pushes_in_flight = bad
    finally:
        model.close()
