"""[step-gc]: Python's cycle collector at step boundaries (``StepGarbageCollection``), against Python's own
counters of collections by generation."""

from __future__ import annotations

import gc

import pytest

from odcfsdp.loop import StepGarbageCollection


class Collections:
    """Counts the collector's runs by generation (``gc.callbacks``), and apart those run while automatic collection
    was off (explicit ones)."""

    def __init__(self):
        self.by_generation = [0, 0, 0]
        self.while_off = [0, 0, 0]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.by_generation[info["generation"]] += 1
            if not gc.isenabled():
                self.while_off[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def churn(n: int = 5000) -> None:
    """Cyclic garbage, enough to start Python's automatic collections several times over."""
    for _ in range(n):
        a: list = []
        a.append(a)


def test_collections_only_between_steps_every_n():
    assert gc.isenabled()
    collector = StepGarbageCollection(every=3)
    with Collections() as seen, collector:
        assert not gc.isenabled()
        for done in range(1, 8):
            churn()  # a step's garbage: no automatic collection now
            collector.step(done)
        # after steps 3 and 6, the young generations only (the full collection on entry ran before the collector
        # was off; Python may have collected on its own before that too)
        assert seen.while_off == [0, 2, 0]
        assert seen.by_generation[2] >= 1
    assert gc.isenabled()


def test_every_zero_leaves_python_in_charge():
    with Collections() as seen, StepGarbageCollection(every=0) as collector:
        assert gc.isenabled()
        churn()
        collector.step(50)
    assert sum(seen.by_generation) > 0 and gc.isenabled()  # Python's own collections ran


def test_a_disabled_collector_stays_disabled_and_a_failure_restores_it():
    gc.disable()
    try:
        with StepGarbageCollection(every=2):
            pass
        assert not gc.isenabled()  # as the caller left it
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), StepGarbageCollection(every=2):
        raise RuntimeError("a failed step")
    assert gc.isenabled()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "50"])
def test_bad_frequencies_are_refused(bad):
    with pytest.raises(ValueError, match="gc every must be an int >= 0"):
        StepGarbageCollection(bad)


def test_the_trainer_collects_between_steps_only(tmp_path):
    """``run.gc_every``: ``odcfsdp.train``'s loop runs with automatic collection off and collects the young
    generations after every gc_every-th step (one rank, in this process), then leaves the collector as it was.
    (Before and after the loop Python collects on its own.)"""
    from odcfsdp.app.config import config_from
    from odcfsdp.app.trainer import train

    cfg = config_from({"run": {"steps": 5, "gc_every": 2, "out_dir": str(tmp_path / "run"), "world_size": 1},
                       "data": {"batch_size": 2, "micro_batch_tokens": 128, "lengths": {"max_len": 100}}})
    with Collections() as seen:
        rows = train(cfg)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert seen.while_off == [0, 2, 0]  # after steps 2 and 4, generation 1, and nothing else in the loop
    assert gc.isenabled()
