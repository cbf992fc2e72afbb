"""Issue 32: bad values refused in one line before any rank starts, and no checkpoint of non-finite weights."""

from __future__ import annotations

import pytest
import torch

from odcfsdp.checkpoint import list_checkpoints
from odcfsdp.app.config import checkpoint_dir, config_from, validate
from warm_cli import cli

BAD = [  # (overrides, the one line's message)
    ({"optim": {"lr": float("inf")}}, "optim.lr=inf must be a finite number >= 0"),
    ({"optim": {"lr": float("nan")}}, "optim.lr=nan must be a finite number >= 0"),
    ({"optim": {"max_norm": -1.0}}, "optim.max_norm=-1.0 must be > 0"),
    ({"optim": {"betas": [2.0, 3.0]}}, "optim.betas[0]=2.0 must be in [0, 1)"),
    ({"optim": {"eps": -1.0}}, "optim.eps=-1.0 must be >= 0"),
    ({"optim": {"warmup_steps": -1}}, "optim.warmup_steps=-1 must be >= 0"),
    ({"optim": {"min_lr_ratio": -0.5}}, "optim.min_lr_ratio=-0.5 must be in [0, 1]"),
    ({"data": {"micro_batch_tokens": 1}}, "data.micro_batch_tokens=1 must be >= 2"),
    ({"data": {"pool_tokens": -1}}, "data.pool_tokens=-1 must be > 0"),
    ({"data": {"lengths": {"sigma": -1.0}}}, "data.lengths.sigma=-1.0 must be >= 0"),
    ({"data": {"lengths": {"min_len": 600}}}, "data.lengths.min_len=600 must be <= data.lengths.max_len=512"),
    ({"balance": {"cost_a": float("nan")}}, "balance.cost_a=nan must be a finite number >= 0"),
    ({"run": {"timeout_s": float("nan")}}, "run.timeout_s=nan must be a number > 0"),
    ({"run": {"warmup_steps": -2}}, "run.warmup_steps=-2 must be >= 0"),
    ({"run": {"gc_every": -1}}, "run.gc_every=-1 must be >= 0"),
    ({"run": {"out_dir": ""}}, "run.out_dir is empty"),
    ({"optim": {"park_state": True, "park_fraction": 1.5}}, "optim.park_fraction=1.5: the share of the optimizer's"),
    ({"optim": {"park_budget": 0.0}}, "optim.park_budget=0.0: the share of the GPU's memory"),
    ({"shard": {"offload_policy": "cpu"}, "optim": {"park_fraction": 0.5}}, "optim.park_fraction parks the optimizer's"),
    ({"model": {"overrides": {"dim": 100, "n_heads": 3}}}, "model.overrides: dim=100 must be divisible by n_heads=3"),
    ({"model": {"overrides": {"n_kv_heads": 3}}}, "model.overrides: n_heads=4 must be divisible by n_kv_heads=3"),
    ({"model": {"overrides": {"n_layers": 0}}}, "model.overrides: n_layers=0 must be >= 1"),
    ({"model": {"overrides": {"dim": "wide"}}}, "model.overrides.dim='wide' must be int"),
    ({"model": {"overrides": {"depth": 4}}}, "model.overrides has unknown LlamaConfig fields ['depth']"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[m.split("=")[0].split(" ")[0] for _, m in BAD])
def test_values_that_make_no_sense_are_refused(overrides, message):
    with pytest.raises(ValueError) as e:
        validate(config_from(overrides))
    assert message in str(e.value)


def test_an_infinite_timeout_means_no_watchdog_and_is_accepted():
    validate(config_from({"run": {"timeout_s": float("inf")}}))


@pytest.mark.parametrize("arg, message", [
    ("optim.lr=inf", "optim.lr=inf must be a finite number >= 0"),
    ("optim.betas=[2,3]", "optim.betas[0]=2.0 must be in [0, 1)"),
    ("run.timeout_s=nan", "run.timeout_s=nan must be a number > 0"),
    ("optim.lr=abc", "optim.lr=abc: optim.lr takes a float, not 'abc'"),  # Hydra: 4-6 lines, rc 1
    ("run.steps=abc", "run.steps=abc: run.steps takes an int, not 'abc'"),
    ("data.path=/tmp/d\u00e9j\u00e0.jsonl", "data.path=/tmp/d\u00e9j\u00e0.jsonl: the value cannot be read; quote it"),
    ("+hydra.callbacks.x._target_=os.makedirs", "+hydra.callbacks.x._target_: the command line takes no hydra keys"),
    ("run.out_dir=/proc/odcfsdp", "run.out_dir='/proc/odcfsdp' is not writable"),
    ("model.overrides={dim:100,n_heads:3}", "model.overrides: dim=100 must be divisible by n_heads=3"),
    # 1e9 x 64 x 2 (embedding and head) parameters: 954 GiB of fp32 weights and gradients (the ranks tried to
    # allocate 102 GB at data.vocab_size=1e8)
    ("data.vocab_size=1000000000", "the model has 128.00B parameters (model.size=tiny, data.vocab_size=1000000000): "
                                   "its fp32 weights and gradients alone need 954 GiB on this machine"),
])
def test_the_cli_refuses_them_in_one_line_before_ranks_start(tmp_path, arg, message):
    out = [] if arg.startswith("run.out_dir") else [f"run.out_dir={tmp_path / 'run'}"]
    proc = cli(arg, *out, cwd=tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), proc.stderr
    assert not (tmp_path / "run").exists() and not list(tmp_path.iterdir())  # nothing written, no directory made


def test_a_run_whose_update_made_weights_non_finite_stops_without_saving_it(tmp_path, monkeypatch):
    """An update can make weights non-finite with a finite gradient norm (the guard's check): the save of that
    step is refused, the run stops as at a non-finite norm (NonFiniteError: rc 3 from the CLI), and the only
    checkpoints are the finite ones before it."""
    import odcfsdp.app.trainer as trainer

    build = trainer.build_optimizer

    def poisoned_after_step_2(*args, **kwargs):
        opt, *rest = build(*args, **kwargs)
        step, calls = opt.step, []

        def poisoned(*a, **k):
            out = step(*a, **k)
            calls.append(1)
            if len(calls) == 2:
                p = opt.param_groups[0]["params"][0]
                with torch.no_grad():
                    (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] = float("inf")
            return out

        opt.step = poisoned
        return (opt, *rest)

    monkeypatch.setattr(trainer, "build_optimizer", poisoned_after_step_2)
    cfg = config_from({"run": {"steps": 4, "world_size": 1, "out_dir": str(tmp_path / "run")},
                       "optim": {"warmup_steps": 1}, "checkpoint": {"interval": 1}})
    with pytest.raises(trainer.NonFiniteError, match=r"not saving step 2: 1 non-finite values .*first: "):
        trainer.train(cfg)
    assert [p.name for p in list_checkpoints(checkpoint_dir(cfg))] == ["step_00000001"]


DATA = [  # (file name, bytes, the one line's message)
    ("surrogate.jsonl", b'{"text": "\\ud800"}\n', "surrogate.jsonl:1: holds '\\\\ud800', a lone UTF-16 surrogate"),
    ("deep.jsonl", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "deep.jsonl:1: nested too deeply"),
    ("no_content.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "text": "yo"}]}\n',
     "no_content.jsonl:1: messages[1] (assistant) has no 'content'"),
    # Parquet trains now (tests/test_data_formats.py); a file named so that is none is refused naming it
    ("data.parquet", b"PAR1\x15\x04\x15\xff\xfe\x00", "data.parquet: not a Parquet file ("),
    ("rows.parquet", b'{"text": "hi"}\n', "rows.parquet: not a Parquet file ("),
    ("utf16.jsonl", '{"text": "hi"}\n'.encode("utf-16"), "utf16.jsonl: not UTF-8 text: data files are JSONL, a .json "
                                                         "array, or Parquet"),
]


@pytest.mark.parametrize("name, data, message", DATA, ids=[d[0] for d in DATA])
def test_bad_data_files_are_refused_before_ranks_start_naming_file_and_line(tmp_path, name, data, message):
    from odcfsdp.app.preflight import preflight

    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (the parquet and test extras)")
    (tmp_path / name).write_bytes(data)
    cfg = config_from({"data": {"path": str(tmp_path / name)}, "run": {"out_dir": str(tmp_path / "run")}})
    with pytest.raises(ValueError) as e:
        preflight(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_a_bad_data_file_in_one_line_before_ranks_start(tmp_path):
    """The ranks crashed on a lone surrogate; the CLI now exits 2 with one line naming file and line."""
    (tmp_path / "s.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "\\ud800"}\n')
    proc = cli(f"data.path={tmp_path / 's.jsonl'}", f"run.out_dir={tmp_path / 'run'}", cwd=tmp_path, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: data.path: ") and "s.jsonl:2: holds '\\\\ud800'" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_json_file_holding_one_array_trains_like_jsonl(tmp_path):
    """HF datasets' ``to_json(lines=False)`` writes one array: its records are read as JSONL's lines are."""
    import json

    from odcfsdp.data.jsonl import JsonlSource, read_records
    from odcfsdp.data.tokenizer import ByteTokenizer

    records = [{"prompt": f"q{i}", "completion": f"answer {i}"} for i in range(5)]
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [r for _, r in read_records(tmp_path / "a.json")] == records
    tok = ByteTokenizer()
    a, b = JsonlSource(str(tmp_path / "a.json"), tok, 64), JsonlSource(str(tmp_path / "a.jsonl"), tok, 64)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a.records, b.records))


def test_a_model_directory_without_tokenizer_files_is_refused_up_front(tmp_path):
    """Weights and config but no tokenizer: refused naming model.path and the files looked for (the ranks failed
    after ~17 s asking for sentencepiece or tiktoken)."""
    from odcfsdp.app.preflight import preflight

    from safetensors.torch import save_file

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, tmp_path / "model" / "model.safetensors")
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    cfg = config_from({"model": {"name": "hf", "path": str(tmp_path / "model")},
                       "data": {"path": str(tmp_path / "d.jsonl")}, "run": {"out_dir": str(tmp_path / "run")}})
    with pytest.raises(ValueError, match=r"model.path='.*model' holds no tokenizer \(none of tokenizer.json, "):
        preflight(cfg)
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    preflight(cfg)  # found: the rest is the tokenizer loader's to check


@pytest.mark.parametrize("files", ["single", "index"])
def test_a_truncated_safetensors_file_is_named_up_front(tmp_path, files):
    """A weights file cut short (a copy or a download that stopped) is named by the launcher from its header, in one
    line, before any rank starts (the ranks failed with a SafetensorError naming no file); load_hf says the same."""
    import json

    from safetensors.torch import save_file

    from odcfsdp.checkpoint import CheckpointError
    from odcfsdp.checkpoint.hf import check_weight_files
    from odcfsdp.app.preflight import preflight

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    name = "model.safetensors" if files == "single" else "model-00002-of-00002.safetensors"
    save_file({"a": torch.randn(64, 8)}, model / name)
    if files == "index":
        save_file({"b": torch.randn(3)}, model / "model-00001-of-00002.safetensors")
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"b": "model-00001-of-00002.safetensors", "a": name}}))
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    cfg = config_from({"model": {"name": "hf", "path": str(model)}, "data": {"path": str(tmp_path / "d.jsonl")},
                       "run": {"out_dir": str(tmp_path / "run")}})
    preflight(cfg)  # whole: accepted
    (tmp_path / "run").rmdir()  # the accepted checks kept the run's directory; the refused ones below make none
    whole = (model / name).read_bytes()
    (model / name).write_bytes(whole[:-100])
    with pytest.raises(ValueError) as e:
        preflight(cfg)
    assert str(e.value) == (f"model.path: {model / name} is not a whole safetensors file (its tensors need "
                            f"{len(whole)} bytes and the file has {len(whole) - 100}): copy or download it again")
    assert not (tmp_path / "run").exists()
    with pytest.raises(CheckpointError, match="is not a whole safetensors file"):
        check_weight_files(model)  # what load_hf calls first on every rank


@pytest.mark.parametrize("world", ["2", "1"])
def test_a_disk_that_fills_up_mid_run_is_one_line_naming_the_file(tmp_path, world):
    """run.out_dir's disk full when a step's metrics are written (metrics.jsonl -> /dev/full, which refuses every
    write with ENOSPC): exit code 1 and one error line naming the file, the report in error.log, with spawned ranks
    and in one process alike (run.world_size=1 printed Hydra's 23-line traceback and wrote no error.log); were
    error.log unwritable too, the report goes to a temporary file and the line says so."""
    from pathlib import Path

    from odcfsdp.app.train import _write_report

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to("/dev/full")
    proc = cli("run.out_dir=run", "run.steps=3", "optim.warmup_steps=1", f"run.world_size={world}", cwd=tmp_path,
               timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("step ")]
    assert proc.returncode == 1 and errors == [
        "error: rank 0 failed: OSError: [Errno 28] No space left on device: 'run/metrics.jsonl' "
        "(traceback in run/error.log)"], proc.stderr
    assert "No space left on device" in (tmp_path / "run" / "error.log").read_text()

    where = _write_report(Path("/proc/odcfsdp-run"), "the report")
    assert where.startswith("traceback in ") and ": /proc/odcfsdp-run/error.log could not be written (" in where, where
    written = Path(where.split()[2].rstrip(":"))
    assert written.read_text() == "the report"
    written.unlink()


def _probe_rounds(rank: int, root: str, rounds: int, barrier, failures) -> None:
    """One rank of a node: the pre-start checks on a new run.out_dir each round, at the same instant as its
    neighbour (a barrier, then a jitter of 0-200 us on rank 1)."""
    import time

    from odcfsdp.app.preflight import preflight

    cfg = config_from({"run": {"world_size": 1}})  # built once: each round changes only the directory
    for k in range(rounds):
        cfg.run.out_dir = f"{root}/round{k}/run"
        barrier.wait(timeout=60)
        if rank:
            time.sleep((k % 20) * 1e-5)
        try:
            preflight(cfg)
        except ValueError as e:
            failures.put(f"round {k}: {e}")
            barrier.abort()  # the neighbour stops at its next round, not at the barrier's timeout
            return


def test_ranks_that_check_one_new_out_dir_at_once_all_pass(tmp_path):
    """Every rank of a torchrun node runs the pre-start checks on one run.out_dir. They used to remove the directory
    they had just created and probed, so a neighbour between its mkdir and its probe file refused the run ("not
    writable: No such file or directory", 2 rounds in 400 here) and the other rank waited for it at
    init_process_group: CI's two-node test hung. Now an accepted check keeps what it made; a refused one removes it."""
    import multiprocessing as mp

    from odcfsdp.app.preflight import preflight

    accepted = config_from({"run": {"out_dir": str(tmp_path / "new" / "run"), "world_size": 1}})
    preflight(accepted)
    assert (tmp_path / "new" / "run").is_dir()
    refused = config_from({"run": {"out_dir": str(tmp_path / "other" / "run"), "world_size": 1},
                           "checkpoint": {"resume": str(tmp_path / "nowhere")}})
    with pytest.raises(ValueError, match="does not exist"):
        preflight(refused)
    assert not (tmp_path / "other").exists()  # a refusal leaves nothing behind

    ctx = mp.get_context("fork")
    barrier, failures = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_probe_rounds, args=(r, str(tmp_path / "race"), 400, barrier, failures))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert failures.empty(), failures.get()
    assert [p.exitcode for p in procs] == [0, 0]
