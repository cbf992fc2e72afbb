"""Training runs end to end: the main job, configuration errors, sweeps, JSONL data, golden losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from odcfsdp.app.config import TrainConfig, config_from, validate
from odcfsdp.launch import spawn
from odcfsdp.app.plot import plot_run
from odcfsdp.app.train import _train_worker
from warm_cli import cli, cold_cli

GOLDEN = Path(__file__).parent / "golden" / "tiny_losses.json"
GOLDEN_OVERRIDES = {
    "run": {"steps": 6, "seed": 3},
    "data": {"batch_size": 8, "micro_batch_tokens": 256, "lengths": {"max_len": 200}},
    "balance": {"kind": "lb_micro"},
}


def run_ranks(overrides: dict, out_dir: str, world_size: int = 2) -> list[dict]:
    """Train with ``overrides`` on ``world_size`` spawned CPU ranks; rank 0's metrics."""
    cfg = {**overrides, "run": {**overrides.get("run", {}), "out_dir": str(out_dir)}}
    return spawn(_train_worker, world_size, cfg, timeout=600)[0]


def test_default_job_short_run(tmp_path):
    """The README's main command, shortened, in a new interpreter as a user runs it: 2 ranks it starts itself, loss
    falls, files written."""
    out = tmp_path / "run"
    proc = cold_cli("run.steps=15", f"run.out_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 16))
    assert sum(r["loss"] for r in rows[-3:]) / 3 < rows[0]["loss"] - 0.4
    for key in ("grad_norm", "lr", "tokens", "tokens_per_s", "peak_alloc_gib", "rank_compute_s", "rank_wait_s"):
        assert key in rows[0]
    assert len(rows[0]["rank_compute_s"]) == 2
    assert "15/15" in proc.stderr  # the progress bar reached the end
    assert json.loads((out / "summary.json").read_text())["tokens_per_s"] > 0
    assert "balance:" in (out / "config.yaml").read_text()
    for png in plot_run(out):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"balance": {"kind": "lb_maxi"}}, "balance.kind='lb_maxi' is not allowed; choose one of ('none', 'lb_micro', 'lb_mini')"),
        ({"shard": {"comm": "pigeon"}}, "shard.comm='pigeon' is not allowed"),
        ({"model": {"size": "70b"}}, "model.size='70b' is not allowed"),
        ({"data": {"batch_size": 0}}, "data.batch_size=0 must be > 0"),
        ({"shard": {"comm": "collective"}}, "shard.comm=collective needs equal micro-batch counts"),
        ({"data": {"source": "jsonl"}}, "data.source=jsonl needs data.path"),
        ({"model": {"name": "hf"}}, "model.name=hf needs one of model.path"),
        ({"model": {"compile": True}}, "model.compile=true needs shard.units=[DecoderLayer]"),
        ({"shard": {"replicas": 3}}, "shard.replicas=3 must divide run.world_size=2"),
        ({"shard": {"replicas": 0}}, "shard.replicas=0 must be > 0"),
    ],
)
def test_invalid_values_name_key_and_choices(overrides, message):
    with pytest.raises(ValueError) as e:
        validate(config_from(overrides))
    assert message in str(e.value)


def test_cli_rejects_bad_values_and_unknown_keys_at_start(tmp_path):
    proc = cli("balance.kind=lb_maxi", cwd=tmp_path)
    assert proc.returncode == 2 and "balance.kind='lb_maxi' is not allowed" in proc.stderr
    proc = cli("run.stepz=3", cwd=tmp_path)
    assert proc.returncode != 0 and "stepz" in proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


def test_experiment_preset_from_configs(tmp_path):
    out = tmp_path / "preset"
    proc = cli("+experiment=cpu_longtail", "run.steps=3", f"run.out_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median: 96" in (out / "config.yaml").read_text()


def test_multirun_sweep(tmp_path):
    proc = cli("--multirun", "run.steps=2", "run.world_size=1", "data.batch_size=2,4",
               f"run.out_dir={tmp_path}/bs${{data.batch_size}}", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for bs in (2, 4):
        assert len((tmp_path / f"bs{bs}" / "metrics.jsonl").read_text().splitlines()) == 2


def test_jsonl_chat_data_trains(tmp_path):
    data = tmp_path / "chat.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"what is {i}+{i}?"},
                           {"role": "assistant", "content": f"{i}+{i} is {2 * i}."}]} for i in range(40)]
    data.write_text("\n".join(json.dumps(x) for x in lines))
    rows = run_ranks({"data": {"source": "jsonl", "path": str(data), "batch_size": 8, "micro_batch_tokens": 64},
                      "run": {"steps": 12}}, tmp_path / "run")
    assert rows[0]["target_tokens"] < rows[0]["tokens"]  # only assistant turns carry loss
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0


def test_golden_losses(tmp_path):
    """A fixed-seed run reproduces the stored losses (regenerate with tests/golden/make_golden.py)."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["overrides"] == GOLDEN_OVERRIDES
    rows = run_ranks(GOLDEN_OVERRIDES, tmp_path / "shm")
    torch.testing.assert_close([r["loss"] for r in rows], golden["losses"], rtol=1e-5, atol=0)


def test_shm_and_collective_give_the_same_losses(tmp_path):
    shm = run_ranks(GOLDEN_OVERRIDES, tmp_path / "shm")
    coll = run_ranks({**GOLDEN_OVERRIDES, "shard": {"comm": "collective"}}, tmp_path / "coll")
    # Same data, plan and model; only the order of fp32 gradient sums differs.
    torch.testing.assert_close([r["loss"] for r in shm], [r["loss"] for r in coll], rtol=1e-6, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in shm], [r["grad_norm"] for r in coll], rtol=1e-5, atol=0)


def test_compiled_whole_layer_run_matches_the_golden_losses(tmp_path):
    """Whole-layer hooks and compiled layers (aot_eager: no C++ toolchain needed) train the same thing."""
    golden = json.loads(GOLDEN.read_text())
    rows = run_ranks({**GOLDEN_OVERRIDES, "shard": {"units": ["DecoderLayer"]},
                      "model": {"compile": True, "overrides": {"compile_backend": "aot_eager"}}}, tmp_path / "c")
    # compiled backward formulas round differently from eager kernels: fp32 noise, not bitwise
    torch.testing.assert_close([r["loss"] for r in rows], golden["losses"], rtol=1e-4, atol=0)


def test_unknown_unit_class_is_named():
    from odcfsdp.models import Llama, LlamaConfig
    from odcfsdp.app.shard_config import unit_classes

    with pytest.raises(ValueError, match=r"shard.units names \['DecoderLayr'\].*'DecoderLayer'"):
        unit_classes(Llama(LlamaConfig()), ["DecoderLayr"])


def test_lb_mini_lets_ranks_run_different_micro_batch_counts(tmp_path):
    rows = run_ranks({"data": {"batch_size": 6, "micro_batch_tokens": 200,
                               "lengths": {"kind": "lognormal", "median": 120, "sigma": 0.8, "max_len": 200}},
                      "balance": {"kind": "lb_mini"}, "run": {"steps": 4, "seed": 1}}, tmp_path / "run")
    counts = [r["rank_micro_batches"] for r in rows]
    assert any(len(set(c)) > 1 for c in counts), counts  # the point of one-sided communication
    assert all(sum(c) >= 1 for c in counts)


def test_default_config_is_valid():
    validate(TrainConfig())


def test_torn_metrics_line_is_skipped(tmp_path):
    from odcfsdp.app.metrics import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def _strict_json(line: str):
    """json.loads that refuses NaN / Infinity, which Python accepts but JSON does not have."""
    def refuse(constant):
        raise AssertionError(f"not valid JSON: {constant}")
    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nonfinite_loss_or_gradient_stops_with_the_step_named_and_nothing_nan_saved(tmp_path, mode):
    """optim.lr=1e6 drives the gradients non-finite: the update is never applied, the run exits with rc 3 and one
    line naming the step (skip: after run.max_skipped such minibatches in a row), metrics and summary stay valid
    JSON, and no checkpoint holds a non-finite value."""
    import re

    from safetensors.torch import load_file

    from odcfsdp.checkpoint import list_checkpoints

    out = tmp_path / "run"
    proc = cli("optim.lr=1e6", "run.steps=12", f"run.out_dir={out}", "checkpoint.interval=1",
               f"run.on_nonfinite={mode}", "run.max_skipped=2", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    stop = int(re.match(r"error: step (\d+): non-finite", errors[0]).group(1))
    rows = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    bad = [r["step"] for r in rows if r.get("nonfinite")]
    assert rows[-1]["step"] == stop and bad[-1] == stop
    assert len(bad) == (1 if mode == "stop" else 2) and (mode == "stop" or "2 such minibatches in a row" in errors[0])
    summary = _strict_json((out / "summary.json").read_text())
    assert summary["nonfinite_steps"] == bad and summary["stopped"] == errors[0].removeprefix("error: ")
    saved = list_checkpoints(out / "checkpoints")
    assert saved and int(saved[-1].name[5:]) < stop
    for path in saved:
        for file in path.glob("rank*.safetensors"):
            for name, value in load_file(file).items():
                assert value.dtype in (torch.uint8, torch.int64) or torch.isfinite(value).all(), (path.name, name)


def test_multirun_jobs_get_their_own_run_dirs(tmp_path):
    """Without a run.out_dir override every --multirun job writes to its own Hydra job directory, named in a banner."""
    proc = cli("--multirun", "run.steps=2", "run.world_size=1", "data.batch_size=2,4",
               f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in (0, 1):
        assert len((tmp_path / "sweep" / str(job) / "metrics.jsonl").read_text().splitlines()) == 2
        assert f"job {job} (" in proc.stderr and f"-> {tmp_path}/sweep/{job}" in proc.stderr


@pytest.mark.parametrize("case, args, message", [
    ("missing data", ["data.source=jsonl", "data.path=missing.jsonl"], "data.path='missing.jsonl' is not a file"),
    ("bad data", ["data.source=jsonl", "data.path=bad.jsonl"], "bad.jsonl:2: not valid JSON"),
    ("out_dir under a file", ["run.out_dir=afile/run"], "run.out_dir='afile/run' is not writable"),
    ("checkpoint.dir under a file", ["checkpoint.dir=afile/ck"], "checkpoint.dir='afile/ck' is not writable"),
    ("missing resume", ["checkpoint.resume=nowhere"], "checkpoint.resume='nowhere' does not exist"),
    ("resume an HF dir", ["checkpoint.resume=hfdir"], "fine-tune a Hugging Face directory with model.name=hf"),
    ("too many ranks", ["run.world_size=512"], "run.world_size=512 ranks on a machine with"),
    ("used out_dir", ["run.out_dir=used"], "run.out_dir='used' already holds a run"),
])
def test_bad_paths_and_sizes_fail_in_one_line_before_any_rank_starts(tmp_path, case, args, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (tmp_path / "afile").write_text("")
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "config.json").write_text("{}")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = cli("run.steps=2", *args, cwd=tmp_path)
    assert proc.returncode == 2, (case, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines() == [f"error: {proc.stderr.strip().removeprefix('error: ')}"]
    assert message in proc.stderr, (case, proc.stderr)
    assert not (tmp_path / "runs").exists()  # no rank started, nothing written


def test_overwrite_replaces_a_used_run_dir(tmp_path):
    first = cli("run.steps=2", "run.world_size=1", "run.out_dir=run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = cli("run.steps=3", "run.world_size=1", "run.out_dir=run", "run.overwrite=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _ranks_of(pid: int) -> list[int]:
    """The rank processes of the `python -m odcfsdp.train` ``pid``: the children of its fork server, by start."""
    servers = [c for c in _children(pid) if "forkserver" in _cmdline(c)]
    return sorted(r for s in servers for r in _children(s) if _alive(r))


def proc_state(pid: int) -> str | None:
    """Process ``pid``'s state letter from /proc (R, S, T, Z, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z")


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_ranks_do_not_outlive_their_parent(tmp_path, sig):
    """Killing `python -m odcfsdp.train` mid-run leaves no rank process after 10 s: SIGKILL (the ranks end at once and
    quietly, [launcher-link]: nothing on the terminal but progress, no step or checkpoint after the kill), or SIGTERM
    (passed on to the ranks, which finish the step and exit)."""
    import signal
    import time

    err = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "odcfsdp.train", "run.steps=100000", "run.out_dir=run",
                             "checkpoint.interval=1"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.2)
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 2
    ranks += [c for c in _children(proc.pid) if _alive(c)]  # multiprocessing's helpers: fork server, tracker
    rank_pids = ranks[:2]
    proc.send_signal(getattr(signal, sig))
    killed = time.monotonic()
    rc = proc.wait(timeout=30)
    assert rc != 0 if sig == "SIGKILL" else rc == 0  # SIGTERM: the ranks finish the step and the run ends cleanly
    steps = metrics.read_text().count("\n")
    while any(_alive(r) for r in rank_pids) and time.monotonic() < killed + 10:
        time.sleep(0.02)
    ranks_s = time.monotonic() - killed
    while any(_alive(r) for r in ranks) and time.monotonic() < killed + 10:
        time.sleep(0.2)
    left = [r for r in ranks if _alive(r)]
    for r in left:  # do not leave them behind for the rest of the suite
        os.kill(r, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their parent"
    if sig == "SIGKILL":
        err.close()
        lines = (tmp_path / "stderr.txt").read_text().splitlines()
        assert all(line.startswith(("step ", "note:")) for line in lines if line.strip()), lines[-20:]
        assert ranks_s < 3.0 and metrics.read_text().count("\n") == steps  # at once: no step after the kill
        saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*") if ".tmp" not in p.name)
        assert saved and int(saved[-1][5:]) <= steps, (saved, steps)


def test_sigterm_checkpoints_and_resume_continues_exactly(tmp_path):
    """SIGTERM to `python -m odcfsdp.train` mid-run (what a scheduler sends): every rank finishes the step, a
    checkpoint is saved, the exit is clean; checkpoint.resume=auto then ends with the losses of an uninterrupted run
    (collective transport: sums in a fixed order, so equal to the bit)."""
    import signal
    import time

    common = ["run.steps=14", "shard.comm=collective", "balance.kind=lb_micro", "data.batch_size=4"]
    whole = cli(*common, "run.out_dir=whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-2000:]
    proc = subprocess.Popen([sys.executable, "-m", "odcfsdp.train", *common, "run.out_dir=cut", "checkpoint.dir=ck"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    cut = len(metrics.read_text().splitlines())
    assert f"terminated (SIGTERM) after step {cut}" in err and cut < 14
    assert (tmp_path / "ck" / f"step_{cut:08d}" / "manifest.json").is_file()
    again = cli(*common, "run.out_dir=cut", "checkpoint.dir=ck", "checkpoint.resume=auto", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("whole", "cut")]
    assert len(losses[1]) == 14 and losses[1] == losses[0]


def test_a_stuck_rank_is_named_and_every_process_exits(tmp_path):
    """SIGSTOP rank 0 (the harder case: the store was once its) mid-run, wherever it is: the other rank names it
    after run.timeout_s (at its next meeting, or from the heartbeat while blocked inside a collective); the run exits
    non-zero with one line within timeout + 15 s, and no process is left (the stopped one is killed)."""
    import re
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "odcfsdp.train", "run.steps=100000", "run.out_dir=run",
                             "run.timeout_s=6"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.1)
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[0], signal.SIGSTOP)  # started first: rank 0
    stopped = time.monotonic()
    try:
        _, err = proc.communicate(timeout=6 + 15)
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)
    assert time.monotonic() - stopped < 6 + 15
    assert proc.returncode == 1, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"rank\(s\) \[0\] (did not reach the \w+ meeting of minibatch \d+ within 6 s"
                                          r"|stopped responding \(no sign of life for 6 s)", errors[0]), err[-2000:]
    assert "Traceback" not in err and (tmp_path / "run" / "error.log").is_file()
    time.sleep(1)
    assert not [r for r in ranks if _alive(r)]
