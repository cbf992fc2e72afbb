"""[park-backward]: a parked optimizer's state brought back under the last micro-batch's backward, in the memory it
frees, through the model's ``register_post_backward_hook``: the hook's calls, the room never exceeded, and training
through ``odcfsdp.loop.train_step`` equal to the bit to the same run with resident state (single process, CPU; the
device's allocated bytes are a model of one whose backward frees a fixed amount per unit)."""

from __future__ import annotations

import pytest
import torch

from odcfsdp import ODCShard
from odcfsdp.data.packing import Sample
from odcfsdp.loop import Minibatch, train_step
from odcfsdp.models import Llama, LlamaConfig
from odcfsdp.optim import ParkedOptimizerState, parking_of
from odcfsdp.optim.park_backward import BackwardReturn
from odcfsdp.optim.park_fit import CudaMemory
from odcfsdp.optim.parking import Where
from odcfsdp.sharding import fully_shard

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2)


def _model(front: str = "odcshard"):
    torch.manual_seed(0)
    inner = Llama(CFG)
    if front == "odcshard":
        return ODCShard(inner, group_bytes=8 << 10)
    for layer in inner.layers:
        fully_shard(layer)
    return fully_shard(inner)


def _minibatch(step: int, micro: int = 2, length: int = 9, vocab: int = CFG.vocab_size) -> Minibatch:
    """``micro`` micro-batches of one sample of ``length`` tokens each, drawn from ``step``."""
    g = torch.Generator().manual_seed(step)
    samples = [Sample(i, torch.randint(0, vocab, (length,), generator=g), torch.ones(length, dtype=torch.bool))
               for i in range(micro)]
    return Minibatch(samples, [[i] for i in range(micro)], sum(s.n_targets for s in samples))


class FreeingBackward(CudaMemory):
    """A device whose allocated bytes fall by ``per_unit`` at each unit's end of backward from ``base``, plus the
    state that came back (the parking's own count of it); every reading is kept with the room it left."""

    def __init__(self, per_unit: int, base: int = 1 << 30):
        self.per_unit, self.base, self.units = per_unit, base, 0
        self.parking: ParkedOptimizerState | None = None
        self.readings: list[tuple[int, int]] = []  # (allocated, state brought back before this reading)

    def peak(self, device):
        return None  # no fitted share: a fixed one

    def allocated(self, device):
        self.units += 1
        brought = sum(self.footprint(e.host.nbytes) for e in self.parking._parked[:self.parking._arrived])
        self.readings.append((self.base - self.per_unit * self.units + brought, brought))
        return self.readings[-1][0]


@pytest.mark.parametrize("front", ["odcshard", "fully_shard"])
def test_post_backward_hook_runs_after_each_unit_until_removed(front):
    """The hook runs after each site's backward (ODCShard without units: each module holding parameters; fully_shard:
    each layer, and the root's own parameters), as often in every backward, in the backward's thread, and not after
    ``remove()``; two hooks both run. ``backward_pushes`` counts the backward's pushes so far: never fewer at a
    later call, from 0 again in the next backward, all of them once it is over (each group once)."""
    model = _model(front)
    calls, phases, pushes = [], [], []
    handle = model.register_post_backward_hook(lambda: calls.append(torch.is_grad_enabled()))
    other = model.register_post_backward_hook(lambda: (phases.append(model._control_lifecycle().phase.name),
                                                       pushes.append(model.backward_pushes())))
    tokens = torch.randint(0, CFG.vocab_size, (2, 8))
    model(tokens).float().pow(2).mean().backward()
    first = len(calls)
    groups = len(model.engine.groups if front == "odcshard" else model._odc_engine.groups)
    assert model.backward_pushes() == groups
    model(tokens).float().pow(2).mean().backward()
    leaves = sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    assert first >= (leaves - 1 if front == "odcshard" else CFG.n_layers + 1)
    assert len(calls) == 2 * first and set(phases) == {"BACKWARD"} and len(phases) == len(calls)
    assert pushes[:first] == pushes[first:] == sorted(pushes[:first]) and pushes[-1] <= groups
    handle.remove()
    model(tokens).float().pow(2).mean().backward()
    assert len(calls) == 2 * first and len(phases) == 3 * first
    other.remove()


def _train(steps: int, park: bool, per_unit: int = 0, under_backward: bool = True, front: str = "fully_shard",
           micro: int = 2):
    model = _model(front)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    memory = None
    if park:
        memory = FreeingBackward(per_unit)
        memory.parking = ParkedOptimizerState(opt, 1.0, memory=memory, under_backward=under_backward)
    losses, early = [], []
    for step in range(steps):
        out = train_step(model, opt, None, _minibatch(step, micro), torch.device("cpu"), max_norm=1.0)
        losses.append(out["loss"])
        if memory is not None:
            early.append(max((b for _, b in memory.readings), default=0))
            # [park-backward] 1-2: no reading after the first (the level) is above it, state brought back included
            assert all(a <= memory.readings[0][0] for a, _ in memory.readings), memory.readings
            memory.readings.clear()
            memory.units = 0
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return losses, state, opt, early


def test_state_comes_back_under_the_last_backward_within_the_room_and_trains_like_resident_state():
    """fully_shard's 3 layers and root: from the second step on (the first creates the state) the parked state
    starts back at the units' ends of backward of the last micro-batch, in order, never past the level minus what
    the backward freed; training equals the resident run to the bit."""
    ref_losses, ref_state, ref_opt, _ = _train(4, park=False)
    per_tensor = max(t.nbytes for s in ref_opt.state.values() for t in s.values() if t.dim() > 0)
    losses, state, opt, early = _train(4, park=True, per_unit=2 * per_tensor)
    assert losses == ref_losses
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k
    parking = parking_of(opt)
    assert parking.where is Where.PARKED and parking._arrived == 0
    assert early[0] == 0 and all(b > 0 for b in early[1:])  # nothing parked before the first step
    state_bytes = sum(t.nbytes for s in ref_opt.state.values() for t in s.values() if t.dim() > 0)
    assert all(b < state_bytes for b in early)  # the room was less than the state: the rest came after


def test_the_room_is_the_level_less_what_is_allocated():
    """``BackwardReturn`` alone: the first reading sets the level, a higher one raises it, a lower one leaves room
    for whole blocks in order, and what came back counts as allocated from then on."""
    model = _model("odcshard")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    memory = FreeingBackward(0)
    parking = memory.parking = ParkedOptimizerState(opt, 1.0, memory=memory)
    model(torch.randint(0, CFG.vocab_size, (2, 8))).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    sizes = [memory.footprint(e.host.nbytes) for e in parking._parked]
    readings = iter([100, 120, 120 - sizes[0] - 1, 120 - sizes[0] - sizes[1]])  # backward's own bytes

    class Scripted(CudaMemory):
        def allocated(self, device):
            return next(readings) + sum(sizes[:parking._arrived])

    parking.memory = Scripted()
    back = BackwardReturn(parking)
    back(), back()
    assert back.level == 120 and parking._arrived == 0
    back()  # room for the first block and a byte
    assert parking._arrived == 1 and back.brought == sizes[0]
    back()  # room for exactly the second block (its byte freed again): not for the third
    assert parking._arrived == 2 and back.brought == sizes[0] + sizes[1]
    assert parking.parked_bytes == sum(e.host.nbytes for e in parking._parked[2:])
    hosts = [e.host.clone() for e in parking._parked]
    parking.settle()  # a skipped step: what came back is freed again, all of it parked
    assert parking._arrived == 0 and parking.parked_bytes == sum(h.nbytes for h in hosts)
    assert all(e.local.untyped_storage().nbytes() == 0 for e in parking._parked)
    entries = list(parking._parked)
    parking.unpark()
    assert parking.where is Where.RESIDENT
    assert all(torch.equal(e.local, h) for e, h in zip(entries, hosts))


class ScriptedBackward(CudaMemory):
    """A device whose readings are scripted: each reading takes the next (allocated, bytes held for pushes, pushes of
    the backward so far) and adds the state brought back; ``held`` and ``pushes`` are the last reading's (the model's
    ``gradient_bytes_in_flight`` and ``backward_pushes``)."""

    def __init__(self, parking: ParkedOptimizerState, readings):
        self.parking, self.readings, self.current = parking, iter(readings), (0, 0, 0)

    def allocated(self, device):
        self.current = next(self.readings)
        back = self.parking._parked[:self.parking._arrived]
        return self.current[0] + sum(self.footprint(e.host.nbytes) for e in back)

    def held(self) -> int:
        return self.current[1]

    def pushes(self) -> int:
        return self.current[2]


def _parked_after_a_step(front: str):
    """The model and its optimizer's parking, all of the state parked after one step (nothing back yet)."""
    model = _model(front)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    parking = ParkedOptimizerState(opt, 1.0, memory=FreeingBackward(0))
    model(torch.randint(0, CFG.vocab_size, (2, 8))).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, parking


@pytest.mark.parametrize("front", ["odcshard", "fully_shard"])
def test_the_room_leaves_the_buffers_of_pushes_in_flight_unfilled(front):
    """Step 2's h_k: the room is the level less the reading less the bytes held for pushes in flight. With 30 held,
    a reading 20 under the level brings nothing back; with one byte less held than the first block's footprint F, a
    reading F under brings nothing back (it would without h_k); with F held, a reading 2F under brings the first
    block. The models' ``gradient_bytes_in_flight`` is what ``train_step`` passes: None on a CPU (no push stream),
    and where pushes are held, the streams' count of held buffers is their bytes."""
    model, parking = _parked_after_a_step(front)
    assert model.gradient_bytes_in_flight() is None
    f = parking.memory.footprint(parking._parked[0].host.nbytes)
    for held, readings, arrived in ((30, [120, 100], 0), (f - 1, [120 + 2 * f, 120 + f], 0),
                                    (f, [120 + 2 * f, 120], 1)):
        memory = parking.memory = ScriptedBackward(parking, [(r, held, 1) for r in readings])
        back = BackwardReturn(parking, memory.held, memory.pushes)
        back(), back()
        assert parking._arrived == arrived, (held, readings)
        parking.settle()
    streams = model.engine.comm if front == "odcshard" else model._odc_engine.comm
    streams.push_stream = object()  # as on a GPU with bounded pushes (no stream is used here)
    streams._held.append((None, [torch.empty(100, dtype=torch.bfloat16)]))
    streams._site.append(torch.empty(10))
    assert model.gradient_bytes_in_flight() == 240
    for unheld in (None, 0):  # unbounded, or no site in flight: nothing is held
        streams.pushes_in_flight = unheld
        assert model.gradient_bytes_in_flight() is None
    streams._held.clear(), streams._site.clear()
    streams.push_stream = None


@pytest.mark.parametrize("held", [0, 8])
def test_a_reading_before_the_backwards_first_push_does_not_count(held):
    """Step 1: a reading before anything of the backward was pushed (the head's site, its gradients not all in,
    higher than the layers') neither sets the level nor brings anything back, where counting it would bring blocks
    back at the next reading; from the first push on the level is the highest reading, and a reading one block's
    footprint F (plus what is held) under it brings the first block back. Alike with pushes held (8 bytes) and not
    (unbounded or on a CPU: 0)."""
    _, parking = _parked_after_a_step("odcshard")
    f = parking.memory.footprint(parking._parked[0].host.nbytes)
    memory = parking.memory = ScriptedBackward(parking, [(100 + 3 * f, held, 0), (100, held, 1), (100 + f, held, 2),
                                                         (100 - held, held, 3)])
    back = BackwardReturn(parking, memory.held, memory.pushes)
    back()
    assert back.level is None and parking._arrived == 0
    back()
    assert back.level == 100 and parking._arrived == 0
    back()
    assert back.level == 100 + f and parking._arrived == 0
    back()
    assert parking._arrived == 1 and back.brought == f
    parking.settle()


def test_state_stays_parked_through_the_backward_with_under_backward_off_or_without_units():
    """``under_backward=False``, and a model without units (no ``register_post_backward_hook``): all of it comes
    back once the micro-batches are done, as before."""
    _, _, opt, early = _train(3, park=True, per_unit=1 << 40, under_backward=False)
    assert early == [0, 0, 0] and parking_of(opt).where is Where.PARKED
    torch.manual_seed(0)
    plain = Llama(CFG)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    memory = FreeingBackward(1 << 40)
    memory.parking = ParkedOptimizerState(opt, 1.0, memory=memory)
    for step in range(2):
        train_step(plain, opt, None, _minibatch(step), torch.device("cpu"), max_norm=1.0)
    assert memory.readings == []


def test_the_largest_micro_batch_runs_last_where_state_comes_back_under_it():
    """[park-backward] 0: ``plan_step(largest_last=True)`` moves this rank's largest micro-batch (by positions, the
    first of equals) to the end and keeps the others in the plan's order, over the same samples; without it the plan
    is as planned. ``wants_largest_last`` says so for an optimizer whose parked state comes back under the backward,
    not for one without parking, with ``under_backward`` off, with a fitted share of nothing, or on a device whose
    memory reads nothing (the CPU)."""
    from odcfsdp.data.balance import CostModel
    from odcfsdp.loop import plan_step
    from odcfsdp.optim.park_backward import wants_largest_last

    g = torch.Generator().manual_seed(0)
    source = [Sample(i, torch.randint(0, CFG.vocab_size, (n,), generator=g), torch.ones(n, dtype=torch.bool))
              for i, n in enumerate([41, 10, 31, 18, 26, 12])]
    cost = CostModel(a=1.0, b=1.0)
    plain = plan_step(source, 0, 6, 48, "lb_mini", cost, 0, 1)
    moved = plan_step(source, 0, 6, 48, "lb_mini", cost, 0, 1, largest_last=True)
    positions = [sum(plain.samples[i].n_inputs for i in mb) for mb in plain.mine]
    assert len(plain.mine) >= 3 and positions == sorted(positions, reverse=True)  # the balancer's order
    big = positions.index(max(positions))
    assert moved.mine == plain.mine[:big] + plain.mine[big + 1:] + [plain.mine[big]] != plain.mine
    assert moved.global_targets == plain.global_targets
    class Readable(CudaMemory):  # a device whose allocated bytes read (none of the fitted share's peaks)
        def peak(self, device):
            return None

        def allocated(self, device):
            return 0

    model = Llama(CFG)
    assert not wants_largest_last(torch.optim.AdamW(model.parameters()))
    built = {}
    for name, kwargs in {"parked": {}, "late": {"under_backward": False}, "fit of nothing": {"fraction": None},
                         "cpu": {"memory": CudaMemory()}}.items():
        built[name] = torch.optim.AdamW(model.parameters())
        ParkedOptimizerState(built[name], **{"memory": Readable(), **kwargs})
    assert {name: wants_largest_last(opt) for name, opt in built.items()} == {
        "parked": True, "late": False, "fit of nothing": False, "cpu": False}
