"""The step-time simulator (benchmarks/step_sim.py, [step-sim]): a hand-computed case, its bounds, its validation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import step_sim_model as S
from benchmarks import step_sim_fit as F

from odcfsdp.data.lengths import LengthDistribution  # noqa: E402

TINY = S.TimeModel(a=1.0, b=0.0, c=0.5)  # a sample of s positions costs s^2, a micro-batch 0.5 more


def test_hand_computed_tiny_case():
    """Sizes [4, 3, 2, 1] on 2 ranks under a cap of 5, worked by hand from each balancer's definition.

    LB-Mini: LPT on costs 16, 9, 4, 1 gives {4} and {3, 2, 1}; the second packs into 2 micro-batches: 16.5 vs 15.
    LB-Micro: 2 bins under the cap, [4, 1] (17) and [3, 2] (13), one per rank: 17.5. Fixed: ranks [4, 3] and
    [2, 1], one sample per micro-batch: max(16.5, 4.5) + max(9.5, 1.5) = 26. Dynamic (verl): token-balanced equal
    shares {3, 2} and {4, 1}, one micro-batch each: 17.5. Bound: max((30 + 0.5 * 2) / 2, 16 + 0.5) = 16.5.
    """
    sizes = [4, 3, 2, 1]
    plans = S.plans(sizes, 2, 5, TINY)
    assert sorted(plans["odc_lb_mini"]) == [[[3], [2, 1]], [[4]]]  # even packing: [3] + [2, 1]
    assert S.one_sided_step(plans["odc_lb_mini"], TINY, 0.0, 0.0) == 16.5
    assert sorted(plans["fsdp2_lb_micro"]) == [[[3, 2]], [[4, 1]]]
    assert S.collective_step(plans["fsdp2_lb_micro"], TINY, 0.0, 0.0) == 17.5
    assert plans["fsdp2_fixed"] == [[[4], [3]], [[2], [1]]]
    assert S.collective_step(plans["fsdp2_fixed"], TINY, 0.0, 0.0) == 26.0
    assert sorted(plans["fsdp2_dynamic"]) == [[[3, 2]], [[4, 1]]]
    assert S.collective_step(plans["fsdp2_dynamic"], TINY, 0.0, 0.0) == 17.5
    assert S.balance_bound(sizes, 2, 5, TINY, 0.0) == 16.5
    # collective: micro-batch k ends with its slowest rank; one-sided: the slowest rank's sum; floors and optimizer
    hand = [[[4], [1]], [[3], [2]]]
    assert S.collective_step(hand, TINY, 0.0, 0.25) == 16.5 + 4.5 + 0.25
    assert S.one_sided_step(hand, TINY, 0.0, 0.25) == 18.0 + 0.25
    assert S.one_sided_step(hand, TINY, 10.0, 0.0) == 16.5 + 10.0  # a 10 s communication floor lifts [1] to 10
    assert S.one_sided_step(hand, S.TimeModel(1.0, 0.0, 0.5, h=5.0), 0.0, 0.0) == 16.5 + 5.0


def test_karmarkar_karp_by_hand():
    """Largest differencing on 8, 7, 6, 5, 4 into 2 sets: (8|7), (6|5), then 4 with (8|7) -> (11|8), with (6|5) ->
    16 | 14 (the textbook result, though 15 | 15 exists); equal sizes keep the counts."""
    sets = S.karmarkar_karp([8.0, 7.0, 6.0, 5.0, 4.0], 2)
    assert sorted(sorted(s) for s in sets) == [[0, 2], [1, 3, 4]]
    assert [sum([8, 7, 6, 5, 4][i] for i in s) for s in sets] == [16, 14]
    eq = S.karmarkar_karp([4.0, 3.0, 2.0, 1.0, 9.0, 1.0], 3, equal_size=True)
    assert sorted(i for s in eq for i in s) == list(range(6)) and all(len(s) == 2 for s in eq)
    with pytest.raises(ValueError, match="equal size"):
        S.karmarkar_karp([1.0, 2.0, 3.0], 2, equal_size=True)


def _minibatches(per_point: int = 6):
    """(distribution, N, sizes) over the three distributions, several GPU counts and samples per GPU."""
    for dist in S.DISTRIBUTIONS.values():
        sampler = LengthDistribution(dist.lengths, 3)
        for n in (2, 3, 8):
            for k in (1, 2, 5):
                for m in range(per_point):
                    yield dist, n, S.minibatch_sizes(sampler, dist.cap, m, n * k)


def test_balance_bound_is_a_lower_bound():
    """No balancer's step (one-sided or collective, with overheads and floors) is ever below the bound."""
    tm = S.TimeModel(a=7e-10, b=1.6e-5, c=0.02, h=0.07)
    for dist, n, sizes in _minibatches():
        bound = S.balance_bound(sizes, n, dist.cap, tm, 0.01)
        for name, plan in S.plans(sizes, n, dist.cap, tm, study=True).items():
            assert sorted(s for rank in plan for mb in rank for s in mb) == sorted(sizes), name  # every sample once
            for floor in (0.0, 0.05):
                for step in (S.one_sided_step, S.collective_step):
                    assert step(plan, tm, floor, 0.01) >= bound * (1 - 1e-12), (dist.name, n, name)


def test_lb_mini_against_lb_micros_plan():
    """On the same samples (compute only), per minibatch: LB-Mini's slowest rank is never slower than LB-Micro's
    plan run one-sidedly ([never-worse] in odcfsdp/data/balance.py), which is never slower than FSDP2 running that
    plan in lockstep; and LB-Mini beats LB-Micro's partition on some minibatches, or balancing would be moot."""
    tm = S.TimeModel(a=7e-10, b=1.6e-5, c=0.0)
    wins = 0
    for dist, n, sizes in _minibatches():
        plans = S.plans(sizes, n, dist.cap, tm)
        mini = S.one_sided_step(plans["odc_lb_mini"], tm, 0.0, 0.0)
        micro = S.one_sided_step(plans["odc_lb_micro"], tm, 0.0, 0.0)
        lockstep = S.collective_step(plans["fsdp2_lb_micro"], tm, 0.0, 0.0)
        assert micro <= lockstep * (1 + 1e-12)  # sum_k max_r >= max_r sum_k
        assert mini <= micro * (1 + 1e-12), (dist.name, n, len(sizes))
        wins += mini < micro * (1 - 1e-6)
    assert wins > 0


@pytest.fixture(scope="module")
def validation():
    """The 1B validation over the committed runs (``refit``: replay, fit, predict)."""
    return F.refit("1b")


def test_validation_on_the_committed_runs(validation):
    """Replayed plans reproduce the recorded ones (else replay raises); the measured column is the JSON's own
    step_s_mean; every prediction is within 5% except d89966a's lb_mini, whose rank 0 ran host-bound in step 2; the
    tables: in-sample (the fit's run), held out (4 <-> 8 samples per GPU), same stream (other plans, 2 <-> 4 GPUs)."""
    v = validation
    assert v["fit"]["runs"] == list(F.SETUPS["1b"].fit) and len(v["fit_rows"]) == 6
    assert len(v["held_out_rows"]) == 2 * 6 and len(v["same_stream_rows"]) == 4 * 6
    assert all(r["note"].startswith("not held out:") for r in v["same_stream_rows"])
    assert {r["samples_per_gpu"] for r in v["held_out_rows"]} == {4, 8}
    for r in v["fit_rows"] + v["held_out_rows"] + v["same_stream_rows"]:
        if r["quantity"] == "odc + lb_mini step s":
            data = json.loads((F.E2E / r["target"] / "e2e_bench.json").read_text())
            want = next(x for x in data["results"] if (x["method"], x["balance"]) == ("odc", "lb_mini"))
            assert r["measured"] == pytest.approx(want["step_s_mean"], rel=1e-9)
        if r["target"] != "n2_longtail_cudnn_compiled_d89966a" or r["quantity"].startswith("speedup"):
            assert abs(r["error"]) <= 0.05, r
    n4 = [r for r in v["same_stream_rows"] if r["target"] == "n4_longtail_ba211a2"
          and r["quantity"] == "speedup: odc lb_mini over fsdp2 lb_micro"]
    assert len(n4) == 1 and n4[0]["measured"] > 1.2 and abs(n4[0]["error"]) < 0.02  # 2 GPUs predict 4


def test_gain_errors_closed_form(validation):
    """The error in the gain (speedup - 1): percentage points and relative, by hand and on every speedup row."""
    pp, rel = F.gain_errors(1.2, 1.25)  # gains 20% and 25%
    assert pp == pytest.approx(-5.0) and rel == pytest.approx(0.2 / 0.25 - 1)
    assert F.gain_errors(1.5, 1.0) == (pytest.approx(50.0), None)  # no measured gain: no relative error
    rows = validation["fit_rows"] + validation["held_out_rows"] + validation["same_stream_rows"]
    speedups = [r for r in rows if r["quantity"].startswith("speedup")]
    assert speedups and all(r["gain_pp"] is None for r in rows if r not in speedups)
    for r in speedups:
        p, m = r["predicted"], r["measured"]
        assert r["gain_pp"] == pytest.approx(100 * ((p - 1) - (m - 1)))
        assert r["gain_rel"] == pytest.approx((p - 1) / (m - 1) - 1)
        assert r["error"] == pytest.approx(p / m - 1)


def test_held_out_refuses_the_same_stream(monkeypatch):
    """A held-out pair of one run, or of the fit's seed and samples per GPU, is refused in one line; another
    samples-per-GPU count is held out; refit refuses such a pair declared held-out."""
    n2, n4 = F.replay("n2_longtail_ba211a2"), F.replay("n4_longtail_ba211a2")  # seed 0, 4 per GPU, 2 and 4 GPUs
    with pytest.raises(ValueError, match="not held out: .* is a fit run itself") as e:
        F.check_held_out([n2], n2)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="seed 0 and 4 samples per GPU .*the same data stream"):
        F.check_held_out([n2], n4)
    F.check_held_out([F.replay("n2_longtail_compiled_40df8df")], F.replay("n2_longtail_b16_compiled_40df8df"))
    bad = F.Setup(("n2_longtail_ba211a2",), F.SETUPS["1b"].host_run,
                  held_out=((("n2_longtail_ba211a2",), "n4_longtail_ba211a2", "2 -> 4 GPUs"),))
    monkeypatch.setitem(F.SETUPS, "bad", bad)
    with pytest.raises(ValueError, match="not held out"):
        F.refit("bad")
    with pytest.raises(ValueError, match="is a fit run itself"):
        F.refit("1b", extra_held_out=(F.SETUPS["1b"].fit[0],))


def test_refit_8b_on_the_committed_runs():
    """The 8B entry point on today's runs: the HF 8B run replays (its own vocabulary and model shape), is refused
    as held out (the fit's seed and samples per GPU) and priced as a same-stream check; every step within 5%."""
    pytest.importorskip("transformers", reason="the HF run's model shape needs transformers (test extra)")
    v = F.refit("8b")
    assert v["fit"]["runs"] == ["n2_8b_longtail_memory_949626a"] and v["fit"]["model"] == "Llama 8b"
    assert v["held_out_rows"] == [] and "sim_heldout_8b" in v["pending"]
    quantities = {r["quantity"] for r in v["fit_rows"]}
    assert {"fsdp2_nosync + lb_micro step s", "speedup: odc lb_mini over fsdp2_nosync lb_micro"} <= quantities
    hf = v["same_stream_rows"]
    assert hf and all(r["target"] == "n2_hf_8b_longtail_9921c73" and "seed 0" in r["note"] for r in hf)
    assert "speedup: odc lb_mini over hf_fsdp2 lb_micro" in {r["quantity"] for r in hf}
    assert all(abs(r["error"]) <= 0.05 for r in v["fit_rows"] + hf)


def test_replay_refuses_a_run_it_cannot_reproduce(tmp_path, monkeypatch):
    """A recorded micro-batch count the replay does not reproduce is refused with a one-line error."""
    name = "n2_longtail_ba211a2"
    (tmp_path / name).mkdir()
    data = json.loads((F.E2E / name / "e2e_bench.json").read_text())
    data["results"][0]["steps"][-1]["rank_micro_batches"][0] += 1
    (tmp_path / name / "e2e_bench.json").write_text(json.dumps(data))
    monkeypatch.setattr(F, "E2E", tmp_path)
    with pytest.raises(ValueError, match="does not replay"):
        F.replay(name)
    shutil.rmtree(tmp_path / name)


def test_cli_validate_and_refusals(tmp_path):
    """The CLI in a subprocess: --validate writes its table; a GPU count the node model cannot place exits 2."""
    env_cmd = [sys.executable, "-m", "benchmarks.step_sim"]
    ok = subprocess.run([*env_cmd, "--validate", "--out", str(tmp_path / "v")], capture_output=True, text=True,
                        timeout=300, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    md = (tmp_path / "v" / "step_sim.md").read_text()
    assert md.count("| `n2_longtail") + md.count("| `n4_longtail") == 42 and "within 5%; largest gain error" in md
    assert "## Fit (in-sample)" in md and "## Held out (another data stream)" in md and "gain error (pp)" in md
    refused = subprocess.run([*env_cmd, "--validate", "--held-out", "n2_longtail_cudnn_compiled_d89966a", "--out",
                              str(tmp_path / "r")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert refused.returncode == 1 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "not held out" in refused.stderr and not (tmp_path / "r").exists()
    bad = subprocess.run([*env_cmd, "--gpus", "12", "--out", str(tmp_path / "b")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "multiple of 8" in bad.stderr


def test_a_planned_run_is_the_committed_run_it_plans_priced_alike(tmp_path):
    """``--predict`` (issue 45): planning the committed 8B fit run's settings (2 GPUs, 4 per GPU, seed 0, 2 measured
    steps after 1 warm-up) gives the plans its replay gives, step by step, and the same predicted steps as
    ``predict`` of the replayed run; the CLI writes the table and refuses --predict with --validate."""
    from benchmarks import step_sim, step_sim_predict as P

    name = "n2_8b_longtail_memory_949626a"
    replayed, fit = F.replay(name), F.fit_runs([name], F.SETUPS["8b"].host_run)
    planned = P.planned_run("8b", 2, 4, 0, steps=2, warmup=1)
    assert (planned.world, planned.per_gpu, planned.cap, planned.shape) == (
        replayed.world, replayed.per_gpu, replayed.cap, replayed.shape)
    for key in P.PLANNED:
        assert [plan for plan, _ in planned.steps[key]] == [plan for plan, _ in replayed.steps[key]], key
    priced, want = P.priced_steps(planned, fit), F.predict(replayed, fit)
    for key in P.PLANNED:
        assert sum(priced[key]) / 2 == pytest.approx(want[key], rel=1e-12), key
    rows = P.prediction_rows(planned, fit, "longtail")
    fsdp2 = next(r for r in rows if r["method"] == "fsdp2")
    assert fsdp2["odc_speedup_mean"] == pytest.approx(want[("fsdp2", "lb_micro")] / want[F.MINI], rel=1e-12)
    data = step_sim.main(["--predict", "--size", "8b", "--gpus", "2", "--per-gpu", "4", "--seeds", "0", "--steps", "2",
                          "--out", str(tmp_path)])
    assert [r["mean_step_s"] for r in data["rows"]] == pytest.approx([r["mean_step_s"] for r in rows])
    assert "| planned: longtail, 8b, 2 GPUs, 4 per GPU, seed 0 | fsdp2 | lb_micro |" in (
        tmp_path / "step_sim.md").read_text()
    with pytest.raises(SystemExit):
        step_sim.parse(["--predict", "--validate", "--size", "8b", "--out", str(tmp_path)])
