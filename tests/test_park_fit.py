"""The share of the optimizer's state parked to fit the device ([park-fit]): chosen by the closed form from the
peaks a device reports, never lowered, blind to the step's own peak, and nothing parked where the run fits or the
device reports no memory (the CPU); training stays the resident run's to the bit. A simulated device stands for
CUDA's memory statistics: its peak is the activations a test declares plus the state tensors' real storage."""

from __future__ import annotations

import math

import pytest
import torch

from odcfsdp.optim import ParkedOptimizerState, prefetch_parked, settle_parked, unparked
from odcfsdp.optim.park_fit import ParkFit
from odcfsdp.optim.parking import Where
from odcfsdp.torch_private import local_of

from checkpoint_state import CFG, build


def _state_storage_bytes(opt, scalars: bool = False) -> int:
    """Bytes of element-wise state the device holds now (a parked tensor's storage is empty); with ``scalars`` the
    0-dim state (``step``) too, which the device holds as well."""
    return sum(local_of(v).untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and (scalars or v.dim() > 0))


class SimulatedDevice:
    """A device's memory as ``ParkFit`` reads it: the peak is the most of (declared activations + the state's
    storage) seen at the end of each backward, and of the state alone at any other reading."""

    def __init__(self, opt, limit: int):
        self.opt, self.limit_bytes, self.max = opt, limit, 0

    def backward_done(self, activations: int) -> None:
        self.max = max(self.max, activations + _state_storage_bytes(self.opt, scalars=True))

    def spike(self, to: int) -> None:  # an allocation in the step (the state's creation, a temporary)
        self.max = max(self.max, to)

    def peak(self, device):
        self.max = max(self.max, _state_storage_bytes(self.opt, scalars=True))
        return self.max

    def limit(self, device, budget):
        return self.limit_bytes

    def footprint(self, nbytes):
        return nbytes


def _steps(model, opt, activations: list[int], device: SimulatedDevice | None = None, seed: int = 1,
           spikes: dict[int, int] | None = None, skip: tuple[int, ...] = ()) -> list[float]:
    """One minibatch of two micro-batches per entry of ``activations``, as ``train_step`` runs it."""
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step, act in enumerate(activations):
        for _ in range(2):
            loss = model(torch.randint(0, CFG.vocab_size, (2, 9), generator=g)).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        if device is not None:
            device.backward_done(act)
        prefetch_parked(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if device is not None and spikes and step in spikes:  # after the reading, before the step's post-hook
            device.spike(spikes[step])
        if step in skip:  # as train_step skips a non-finite norm: the prefetched state goes back unused
            settle_parked(opt)
        else:
            opt.step()
        opt.zero_grad()
    return losses


def _expected_share(need: int, state: int, limit: int, grain: float = 0.05) -> float:
    """(2) of [park-fit], computed here from the definition."""
    over = (need + state - limit) / state
    return 0.0 if over <= 0 else min(1.0, grain * math.ceil(over / grain - 1e-9))


def _state_bytes_after_one_step() -> int:
    model, opt = build()
    _steps(model, opt, [0])
    return _state_storage_bytes(opt)


def _fitting(build_peak=None) -> tuple:
    """(state, base, limit, model, opt, device, parking): a model whose optimizer parks the share that fits a
    simulated device, whose limit leaves room for 63% of the state (S) beside activations of ``base`` = 10 S, so
    37% must be parked: 40% on the grain. ``build_peak(state, base)``: the device's peak before the parking."""
    state = _state_bytes_after_one_step()
    base = 10 * state
    limit = base + int(0.63 * state)
    model, opt = build()
    device = SimulatedDevice(opt, limit)
    device.max = build_peak(state, base) if build_peak else 0
    return state, base, limit, model, opt, device, ParkedOptimizerState(opt, fraction=None, memory=device)


def test_the_share_is_the_least_that_fits_and_only_grows():
    """Minibatch 1 runs without state (A = its peak); the share for the next is (2); a longer minibatch raises it,
    a shorter one does not lower it; each minibatch's peak stays under the limit; losses equal the resident run's."""
    state, base, limit, model, opt, device, parking = _fitting()
    ref_model, ref_opt = build()
    plan = [base, base, base + state // 10, base - state // 2]
    shares = []
    losses = []
    for k, act in enumerate(plan):
        losses += _steps(model, opt, [act], device, seed=k)
        shares.append(parking.fraction)
        # with the share chosen, a minibatch no longer than those seen would peak under the limit
        assert max(plan[:k + 1]) + _state_storage_bytes(opt) <= limit
    ref_losses = sum((_steps(ref_model, ref_opt, [act], seed=k) for k, act in enumerate(plan)), [])
    assert losses == ref_losses
    assert shares[0] == pytest.approx(_expected_share(base, state, limit)) == pytest.approx(0.40)
    assert shares[1] == shares[0]
    assert shares[2] == pytest.approx(_expected_share(base + state // 10, state, limit)) == pytest.approx(0.50)
    assert shares[3] == shares[2]  # never lowered
    assert parking.fit.need == base + state // 10
    # what is parked is the share: its bytes reach 50% of the state, within one tensor
    assert parking.where is Where.PARKED and state / 2 <= parking.parked_bytes < state
    assert device.max <= limit + state // 10  # only the longer minibatch, measured before its share, went over


def test_nothing_is_parked_while_the_run_fits():
    state = _state_bytes_after_one_step()
    model, opt = build()
    device = SimulatedDevice(opt, limit=4 * state + state)
    parking = ParkedOptimizerState(opt, fraction=None, memory=device)
    _steps(model, opt, [4 * state] * 3, device)
    assert parking.fraction == 0.0 and parking.where is Where.RESIDENT and parking.parked_bytes == 0
    assert _state_storage_bytes(opt) == state


def test_the_steps_own_peak_is_set_aside():
    """A spike inside a step (all of the state resident, the activations gone) says nothing of forward and
    backward: the share stays what the backward peaks ask for."""
    state, base, limit, model, opt, device, parking = _fitting()
    _steps(model, opt, [base, base, base], device, spikes={0: limit - 1, 1: limit - 1})
    assert parking.fraction == pytest.approx(0.40)
    assert parking.fit.need == base


def test_a_reset_of_the_peak_statistics_is_read_as_a_new_peak():
    fit = ParkFit(memory=type("M", (), {"peak": lambda self, d: self.value, "limit": lambda self, d, b: 100,
                                        "value": 50})())
    fit.begin(torch.device("cpu"))
    fit.memory.value = 30  # reset by the user, then a backward peaked at 30 with 10 bytes of state resident
    fit.observe(torch.device("cpu"), resident_bytes=10)
    assert fit.need == 20
    assert fit.share(state_bytes=100) == pytest.approx(0.20)


def test_the_cpu_reports_no_memory_and_parks_nothing():
    """The default memory reader (CUDA's) on a CPU model: nothing is read, nothing parked, training unchanged."""
    model, opt = build()
    ref_model, ref_opt = build()
    parking = ParkedOptimizerState(opt, fraction=None)
    assert _steps(model, opt, [0, 0, 0]) == _steps(ref_model, ref_opt, [0, 0, 0])
    assert parking.fraction == 0.0 and parking.where is Where.RESIDENT and parking.fit.need == 0


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="budget=1.5"):
        ParkedOptimizerState(build()[1], fraction=None, budget=1.5)
    with pytest.raises(ValueError, match="budget=0"):
        ParkFit(budget=0)


def test_the_cli_parks_what_does_not_fit_by_default():
    """``optim.park_state`` defaults to true with ``optim.park_fraction`` null: a fitting parking with
    ``optim.park_budget``; a number sets the share; ``park_state=false`` none; offloaded masters none."""
    from odcfsdp.app.builders import build_optimizer
    from odcfsdp.app.config import config_from
    from odcfsdp.app.validation import unused_key
    from odcfsdp.optim import parking_of

    model, _ = build()
    cpu = torch.device("cpu")
    default = parking_of(build_optimizer(config_from({"optim": {"park_budget": 0.8}}), model, cpu)[0])
    assert default.fit is not None and default.fit.budget == 0.8 and default.fraction == 0.0
    fixed = parking_of(build_optimizer(config_from({"optim": {"park_fraction": 0.5}}), model, cpu)[0])
    assert fixed.fit is None and fixed.fraction == 0.5
    assert parking_of(build_optimizer(config_from({"optim": {"park_state": False}}), model, cpu)[0]) is None
    offloaded = config_from({"shard": {"offload_policy": "cpu"}})
    assert parking_of(build_optimizer(offloaded, model, cpu)[0]) is None
    assert unused_key(config_from({"optim": {"park_fraction": 0.5}}), "optim.park_budget") == (
        "only optim.park_fraction=null (the share that fits) reads it", False)
    assert unused_key(config_from({"optim": {"park_state": False}}), "optim.park_budget") == (
        "only optim.park_state=true reads it", False)
    assert unused_key(config_from({}), "optim.park_budget") is None


def test_a_roomier_device_later_does_not_lower_the_share():
    """Memory freed outside torch (the limit rises) keeps the share: shares that go down and up would re-pin host
    buffers at every change."""
    state, base, _, model, opt, device, parking = _fitting()
    _steps(model, opt, [base, base], device)
    assert parking.fraction == pytest.approx(0.40)
    device.limit_bytes = base + state  # now all of it would fit
    _steps(model, opt, [base, base], device)
    assert parking.fraction == pytest.approx(0.40) and parking.where is Where.PARKED


def test_a_skipped_step_leaves_the_next_minibatch_measured():
    """A step skipped for a non-finite norm has no post-hook: the next minibatch (longer than any before) is still
    read, and the share follows it."""
    state, base, limit, model, opt, device, parking = _fitting()
    _steps(model, opt, [base, base, base + state // 2, base], device, skip=(1,))
    assert parking.fit.need == base + state // 2
    assert parking.fraction == pytest.approx(_expected_share(base + state // 2, state, limit)) == pytest.approx(0.9)


def test_a_resumed_run_parks_all_until_its_first_reading():
    """A fresh process loading a checkpoint holds state before any reading: all of it is parked after the load, so
    its first minibatch runs without it and measures A; the share after it is the closed form."""
    state = _state_bytes_after_one_step()
    base = 10 * state
    limit = base + int(0.63 * state)
    model, opt = build()
    _steps(model, opt, [0])
    saved = opt.state_dict()
    model2, opt2 = build()
    opt2.load_state_dict(opt.state_dict())  # the parameters' state, before the parking exists: a resumed optimizer
    device = SimulatedDevice(opt2, limit)
    parking = ParkedOptimizerState(opt2, fraction=None, memory=device)
    opt2.load_state_dict(saved)  # through the parking's hooks, as a checkpoint load goes
    assert parking.where is Where.PARKED and parking.parked_bytes == state and parking.fraction == 0.0
    _steps(model2, opt2, [base], device)
    assert parking.fit.need == base and parking.fraction == pytest.approx(0.40)


def test_a_peak_before_training_is_taken_as_the_first_minibatchs():
    """A model built whole on the device peaked higher than the first minibatch: that reading counts for it (more
    parked, never less), where taking it as survived would leave the second minibatch unparked."""
    state, base, limit, model, opt, device, parking = _fitting(build_peak=lambda state, base: base + state // 4)
    _steps(model, opt, [base], device)
    assert parking.fit.need == base + state // 4 and parking.fraction == pytest.approx(0.65)


def test_reading_the_state_between_steps_is_no_backward_peak():
    """``unparked`` brings the state back to be read (a checkpoint, a log): that peak is set aside."""
    state, base, _, model, opt, device, parking = _fitting()
    _steps(model, opt, [base, base], device)
    with unparked(opt):
        device.spike(base + state)  # the state back beside something large
    _steps(model, opt, [base], device)
    assert parking.fit.need == base and parking.fraction == pytest.approx(0.40)


def test_a_reader_of_the_state_leaves_the_fitted_share_as_it_was():
    """``unparked(opt)`` (a reader, ``changes=False``) between steps: the state comes back and the same share goes
    back out, with no copy (the host holds its values); the share's other host buffers, allocated for a share that
    may grow but never filled, are not parked with it. Training then continues as the resident run to the bit."""
    state, base, limit, model, opt, device, parking = _fitting()
    ref_model, ref_opt = build()
    losses = _steps(model, opt, [base, base], device)
    parked = {id(e.local) for e in parking._parked}
    assert 0 < parking.parked_bytes < state  # a share (40%), not all of it
    with unparked(opt):
        values = {id(local_of(v)): local_of(v).clone() for s in opt.state.values() for v in s.values()
                  if torch.is_tensor(v) and v.dim() > 0}
    assert {id(e.local) for e in parking._parked} == parked and 0 < parking.parked_bytes < state
    with unparked(opt):
        for s in opt.state.values():
            for v in s.values():
                if torch.is_tensor(v) and v.dim() > 0:
                    assert torch.equal(local_of(v), values[id(local_of(v))])
    losses += _steps(model, opt, [base], device, seed=2)
    assert losses == _steps(ref_model, ref_opt, [base, base]) + _steps(ref_model, ref_opt, [base], seed=2)
