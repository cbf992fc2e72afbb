"""The training command line says what it does (issue 25): each silent misconfiguration is one line and exit code 2,
data.path means JSONL, run.epochs, the optimizer by name, --help, summary and progress that explain themselves."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_fixtures import write_jsonl
from odcfsdp.app.config import TrainConfig
from warm_cli import cli

TEXTS = [f"sample {i}: " + "ab" * (3 + i) for i in range(12)]  # byte tokenizer: len(text) + 1 targets (EOS) each


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


@pytest.fixture
def texts(tmp_path) -> Path:
    return write_jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in TEXTS])


def test_data_path_alone_trains_on_the_file(tmp_path, texts):
    """`data.path=x.jsonl` without data.source reads the file: the first minibatch (all 12 records) carries exactly
    the records' targets (len + EOS each, hand-counted), which synthetic data would not; config.yaml says jsonl."""
    proc = cli(f"data.path={texts}", "data.batch_size=12", "data.micro_batch_tokens=64", "run.steps=1",
               "run.out_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rows(tmp_path / "run")[0]["target_tokens"] == sum(len(t) + 1 for t in TEXTS)
    assert "source: jsonl" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.parametrize("args, message", [
    (["+optim.lrr=1e-3"], "optim.lrr is not a key of optim nor an argument of torch.optim.AdamW: did you mean "
                          "optim.lr?"),
    (["optim.lrr=1e-3"], "did you mean optim.lr?"),
    (["+run.stepz=3"], "run.stepz is not a key: did you mean run.steps?"),
    (["++data.batchsize=3"], "data.batchsize is not a key: did you mean data.batch_size?"),
    (["data.source=synthetic", "data.path=texts.jsonl"], "drop data.source (a data.path means jsonl) or drop "
                                                          "data.path"),
    (["data.path=texts.jsonl", "data.vocab_size=100"], "data.vocab_size is not used by this run: it shapes synthetic"),
    (["model.lora.alpha=8"], "model.lora.alpha is not used by this run: only model.name=hf reads it"),
    (["model.path=somewhere"], "model.path is not used by this run: only model.name=hf reads it"),
    (["optim.name=SGD", "optim.betas=[0.8,0.9]"], "torch.optim.SGD takes no argument 'betas'"),
    (["optim.name=sgd"], "optim.name='sgd' is not a torch.optim optimizer: did you mean SGD?"),
    (["optim.name=SGD", "optim.momentm=0.9"], "did you mean optim.momentum?"),
    (["data.path=texts.jsonl", "run.steps=3", "run.epochs=2"], "run.steps and run.epochs are both given"),
    (["run.epochs=2"], "run.epochs needs a JSONL data.path"),
    (["data.format=alpaca"], "data.format is not used by this run: synthetic data is not read from a file"),
    (["data.fields.prompt=question"], "data.fields.prompt is not used by this run: synthetic data is not read"),
    (["optim.name=Muon"], "optim.name=Muon: torch.optim.Muon orthogonalises each whole matrix"),
    (["shard.split_masters=true", "shard.param_dtype=float32"], "shard.split_masters=true splits fp32 masters on "
                                                                 "the device into bf16 rows and low bits"),
])
def test_unknown_and_unused_keys_fail_at_start_in_one_line(tmp_path, texts, args, message):
    """Hydra's `+key` append (which the typed config used to drop), typos, and keys this run would not read."""
    proc = cli(*args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and message in one_error_line(proc), proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists()  # no rank started, nothing written


def test_dict_valued_keys_need_no_plus(tmp_path):
    """model.overrides and optim.kwargs take new keys as typed (Hydra alone wants `+` or `++` for them)."""
    proc = cli("model.overrides={n_layers:1}", "model.overrides.n_heads=2", "optim.kwargs={amsgrad:true}",
               "run.steps=1", "run.world_size=1", "run.out_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "overrides:\n    n_layers: 1\n    n_heads: 2\n" in saved and "kwargs:\n    amsgrad: true\n" in saved


def test_settings_of_a_mode_that_is_off_are_reported(tmp_path):
    """A key of a mode that is off (a sweep over the mode holds it on purpose): one note line, and the run goes on."""
    proc = cli("optim.schedule=constant", "optim.min_lr_ratio=0.5", "run.steps=1", "run.world_size=1",
               "run.out_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[0] == ("note: optim.min_lr_ratio is not used by this run: only "
                                           "optim.schedule=cosine reads it")


def test_resume_auto_never_overwrites_a_run_without_checkpoints(tmp_path):
    """checkpoint.resume=auto on a finished run that saved no checkpoint: refused in one line, every file kept;
    run.overwrite=true then replaces the run and leaves none of the old one's outputs (summary, export) behind."""
    first = cli("run.steps=3", "run.world_size=1", "run.out_dir=run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    run = tmp_path / "run"
    (run / "hf").mkdir()
    (run / "hf" / "config.json").write_text("{}")  # an export of the old run
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = cli("run.steps=5", "run.world_size=1", "run.out_dir=run", "checkpoint.resume=auto", cwd=tmp_path)
    assert proc.returncode == 2 and "holds a run but" in one_error_line(proc) and "run.overwrite=true" in proc.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert (run / "hf" / "config.json").is_file()
    again = cli("run.steps=2", "run.world_size=1", "run.out_dir=run", "checkpoint.resume=auto", "run.overwrite=true",
                cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["step"] for r in rows(run)] == [1, 2] and not (run / "hf").exists()
    assert json.loads((run / "summary.json").read_text())["steps_requested"] == 2


def test_epochs_set_the_steps_and_visit_every_record_once_per_epoch(tmp_path, texts):
    """run.epochs=2 over 12 records at batch 4: 6 steps; each epoch's 3 minibatches hold every record once."""
    proc = cli(f"data.path={texts}", "run.epochs=2", "data.batch_size=4", "data.micro_batch_tokens=64",
               "run.out_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6] and "6 steps" in proc.stderr
    per_epoch = sum(len(t) + 1 for t in TEXTS)
    assert [sum(r["target_tokens"] for r in got[k:k + 3]) for k in (0, 3)] == [per_epoch, per_epoch]


def test_optimizer_by_name_matches_plain_torch_sgd(tmp_path):
    """optim.name=SGD optim.momentum=0.9 optim.nesterov=true on 2 ranks: the losses of plain torch.optim.SGD
    (same keyword arguments, param_groups' no-decay group, the warm-up schedule) on one process."""
    from odcfsdp.app.builders import build_source, cost_models
    from odcfsdp.app.config import config_from
    from odcfsdp.data.packing import pack
    from odcfsdp.loop import plan_step
    from odcfsdp.models import causal_lm_loss
    from odcfsdp.optim import param_groups
    from odcfsdp.optim import warmup_cosine
    from odcfsdp.app.specs import model_spec

    args = {"optim": {"name": "SGD", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            "run": {"steps": 3, "seed": 1}, "data": {"batch_size": 6, "micro_batch_tokens": 128},
            "balance": {"kind": "lb_micro"}}
    flat = ["optim.name=SGD", "optim.lr=0.05", "optim.momentum=0.9", "optim.nesterov=true", "optim.weight_decay=0.01",
            "run.steps=3", "run.seed=1", "data.batch_size=6", "data.micro_batch_tokens=128", "balance.kind=lb_micro"]
    proc = cli(*flat, "run.out_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kwargs:\n    momentum: 0.9\n    nesterov: true" in (tmp_path / "run" / "config.yaml").read_text()

    args["optim"] = {k: v for k, v in args["optim"].items() if k not in ("momentum", "nesterov")}
    cfg = config_from(args)
    source, vocab = build_source(cfg)
    torch.manual_seed(cfg.run.seed)
    built = model_spec("llama").build(cfg, vocab)
    model = built.model
    _, cost = cost_models(cfg, built)
    opt = torch.optim.SGD(param_groups(model), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(5, 3))
    want = []
    for step in range(3):
        mb = plan_step(source, step, 6, 128, "none", cost, 0, 1)
        total = 0.0
        for s in mb.samples:  # each sample on its own: no packing in the reference
            micro = pack([s])
            loss = causal_lm_loss(model(micro.tokens, micro.positions, doc_lengths=micro.doc_lengths), micro.targets,
                                  mb.global_targets)
            loss.backward()
            total += loss.item()
        want.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    torch.testing.assert_close([r["loss"] for r in rows(tmp_path / "run")], want, rtol=2e-5, atol=0)


def _leaf_keys(node, prefix=""):
    """Every leaf key of the config tree, walked independently of odcfsdp.app.cli."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_help_lists_presets_and_every_key_with_a_description(tmp_path):
    proc = cli("--help", cwd=tmp_path, timeout=60)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]
    presets = sorted(p.stem for p in (Path(__file__).parents[1] / "configs" / "experiment").glob("*.yaml"))
    assert presets and all(re.search(rf"^  {p}\s+\S", proc.stdout, re.M) for p in presets)
    lines = {m[1]: m[2] for m in re.finditer(r"^  ([\w.]+)=\S*\s+(.*)$", proc.stdout, re.M)}
    keys = list(_leaf_keys(TrainConfig()))
    assert len(keys) > 60 and set(keys) <= set(lines), sorted(set(keys) - set(lines))
    assert all(len(lines[k].strip()) > 8 for k in keys), [k for k in keys if len(lines[k].strip()) <= 8]


def test_progress_to_a_pipe_is_lines_and_the_summary_says_which_steps(tmp_path):
    """stderr to a pipe: whole lines, no carriage return; run.stop_after=5 of 6 steps: the summary names the steps
    run, the steps asked for, why it ended, and which steps its throughput covers."""
    proc = cli("run.steps=6", "run.stop_after=5", "run.world_size=1", "run.out_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stderr
    steps = [int(m) for m in re.findall(r"^step (\d+)/6 loss", proc.stderr, re.M)]
    assert steps[0] == 1 and steps[-1] == 5 and steps == sorted(steps)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["steps_requested"], summary["steps_run"], summary["last_step"]) == (6, 5, 5)
    assert summary["end"] == "run.stop_after=5" and summary["timed_steps"] == 3
    assert summary["timed_steps_are"].startswith("steps 3-5")


def test_lora_adapter_export_records_an_absolute_base_path(tmp_path):
    """model.path given relative to the working directory: adapter_config.json's base_model_name_or_path is the
    model directory's absolute path, so PeftModel.from_pretrained finds it from anywhere."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_fixtures import chat_records, save_pretrained_model, write_jsonl

    save_pretrained_model(tmp_path / "base", "llama")
    write_jsonl(tmp_path / "chat.jsonl", chat_records(8))
    proc = cli("model.name=hf", "model.path=base", "data.path=chat.jsonl", "model.lora.r=2",
               "model.lora.export=adapter", "run.export_hf=true", "run.steps=1", "run.world_size=1",
               "data.batch_size=4", "run.out_dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    adapter = json.loads((tmp_path / "run" / "hf" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "base").resolve())


class _Touch:
    """Unpickling it creates ``path``: what ``--experimental-rerun`` would run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _code_dirs(tmp_path: Path) -> dict[str, Path]:
    """A pickle, a PYTHONPATH directory and a preset directory, each of which leaves a marker file if its code runs."""
    import pickle

    (tmp_path / "rerun.pickle").write_bytes(pickle.dumps(_Touch(str(tmp_path / "ran-pickle"))))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(f"open({str(tmp_path / 'ran-site')!r}, 'w')\n")
    (tmp_path / "presets" / "experiment").mkdir(parents=True)
    (tmp_path / "presets" / "experiment" / "env.yaml").write_text(
        f"# @package _global_\nhydra:\n  job:\n    env_set:\n      PYTHONPATH: {tmp_path / 'site'}\n")
    (tmp_path / "presets" / "experiment" / "launch.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /hydra/launcher: basic\n")
    return {"site": tmp_path / "site", "presets": tmp_path / "presets"}


@pytest.mark.parametrize("args, message", [
    (["--experimental-rerun", "rerun.pickle"], "--experimental-rerun: refused, it unpickles a file and runs it"),
    (["+hydra.job.env_set.PYTHONPATH={site}"], "hydra.job.env_set.PYTHONPATH: refused, it would import code, set"),
    (["hydra.searchpath=[file://{presets}]"], "hydra.searchpath: refused"),
    (["+hydra/launcher=basic"], "hydra/launcher: refused"),
    (["--config-name", "other"], "--config-name: refused, the config is odcfsdp's typed one"),
    (["--config-dir", "{presets}", "+experiment=env"], "experiment/env.yaml: hydra.job.env_set.PYTHONPATH: refused"),
], ids=["rerun", "env_set", "searchpath", "launcher", "config_name", "preset_env_set"])
def test_the_cli_runs_no_code_from_its_arguments_or_presets(tmp_path, args, message):
    """Each way Hydra would run code from the command line or a preset is one line, exit code 2, and no code ran
    (the marker files that the pickle, a sitecustomize on the PYTHONPATH or a preset would write are absent)."""
    dirs = _code_dirs(tmp_path)
    proc = cli(*[a.format(**dirs) for a in args], f"run.out_dir={tmp_path / 'run'}", "run.steps=2", cwd=tmp_path,
               timeout=120)
    assert proc.returncode == 2 and message in one_error_line(proc), proc.stderr[-2000:]
    assert not (tmp_path / "ran-pickle").exists() and not (tmp_path / "ran-site").exists()
    assert not (tmp_path / "run").exists()


def test_a_config_dir_of_plain_presets_trains_and_odcfsdps_presets_pass_the_rule(tmp_path):
    """A user's --config-dir with a preset of odcfsdp's keys (and a hydra key a run takes) trains; the presets
    odcfsdp ships pass the same check, and the check reads a ``defaults`` override and a ``_target_``."""
    from odcfsdp.app.cli import check_config_dir, check_overrides

    check_config_dir(Path(__file__).resolve().parents[1] / "configs")
    (tmp_path / "mine" / "experiment").mkdir(parents=True)
    (tmp_path / "mine" / "experiment" / "short.yaml").write_text(
        "# @package _global_\nrun:\n  steps: 2\n  world_size: 1\nhydra:\n  job:\n    chdir: false\n")
    proc = cli("--config-dir", str(tmp_path / "mine"), "+experiment=short", f"run.out_dir={tmp_path / 'run'}",
               cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2]
    (tmp_path / "mine" / "experiment" / "bad.yaml").write_text("defaults:\n  - override /hydra/sweeper: basic\n")
    with pytest.raises(ValueError, match="bad.yaml: hydra/sweeper: refused"):
        check_config_dir(tmp_path / "mine")
    (tmp_path / "mine" / "experiment" / "bad.yaml").write_text("model:\n  x:\n    _target_: os.system\n")
    with pytest.raises(ValueError, match="bad.yaml: model.x._target_: the command line takes no keys that import"):
        check_config_dir(tmp_path / "mine")
    (tmp_path / "mine" / "experiment" / "bad.yaml").unlink()
    (tmp_path / "mine" / "hydra" / "job_logging").mkdir(parents=True)  # logging.config imports its handlers' classes
    (tmp_path / "mine" / "hydra" / "job_logging" / "x.yaml").write_text("handlers:\n  h:\n    class: os.system\n")
    with pytest.raises(ValueError, match="x.yaml: a preset of Hydra's own groups configures Hydra"):
        check_config_dir(tmp_path / "mine")
    assert check_overrides(["hydra/job_logging=disabled"]) == ["hydra/job_logging=disabled"]
    with pytest.raises(ValueError, match="hydra/job_logging=x: refused, a logging config of your own"):
        check_overrides(["hydra/job_logging=x"])


def test_help_into_a_closed_pipe_ends_quietly():
    """``python -m odcfsdp.train --help | head`` whose reader is gone: no BrokenPipeError traceback, exit 141 (128 +
    SIGPIPE, as a tool that SIGPIPE ends)."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "odcfsdp.train", "--help"], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")
