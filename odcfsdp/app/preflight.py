"""Checks of a training run that need the file system or the machine, made before any rank starts.

``validate`` (``config.py``) checks values against each other; ``preflight`` checks them
against the world: the files a run reads exist and parse (every record in its data format,
``odcfsdp/data/formats.py``, and not every prompt longer than the length cap; Parquet files have pyarrow to read
them; a pretrained model's safetensors files are whole), the model's weights and
gradients fit the machine's memory, the directories it writes are writable, a resume path is a
checkpoint, the world size fits the machine, and ``run.out_dir`` does not already hold another
run (a run's history is never overwritten unless ``run.overwrite`` says so:
``checkpoint.resume=auto`` continues a run only from one of its checkpoints; ``check_run_dir``, made
again under the lock the run takes before its ranks start, [run-lock] in ``odcfsdp/checkpoint/lock.py``,
which also refuses a directory that a running run holds). Each failure is a
``ValueError`` whose one line names the key and the fix; ``python -m odcfsdp.train`` prints it and
exits with code 2, as for config errors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from ..checkpoint import CheckpointError, latest_checkpoint, read_manifest
from ..checkpoint.hf import check_weight_files
from .config import TrainConfig, checkpoint_dir
from .resume_setup import note, refusal, setup_changes
from .sources import check_jsonl, source_of, tokenizer_path


def _writable(key: str, path: str | Path, made: list[Path]) -> None:
    """``path`` is a directory this process can write: created (with its parents) and a file made and removed in
    it. Trying, not ``os.access``: root passes every access check, yet cannot write /proc or a read-only mount.
    The topmost directory it created is appended to ``made``: ``preflight`` removes it only if it refuses the run,
    since every rank of a node may be probing the same directory at once (removing it here made a rank that
    was between its ``mkdir`` and its probe file refuse a run its neighbour had just checked)."""
    p = Path(path).absolute()
    top = p
    while not top.parent.exists() and top.parent != top:
        top = top.parent
    if not top.exists():
        made.append(top)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".odcfsdp-write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"{key}={str(path)!r} is not writable: {e.strerror or e}") from None


#: files one of which a Hugging Face tokenizer directory holds (fast tokenizer, sentencepiece, tiktoken, BPE vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "spiece.model")


def _tokenizer_files(cfg: TrainConfig) -> None:
    """A JSONL run that reads its tokenizer from a directory finds one there (else the ranks fail after their
    start-up, asking for sentencepiece or tiktoken)."""
    path = tokenizer_path(cfg) if source_of(cfg).tokenized else None
    if path and Path(path).is_dir() and not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        key = "data.tokenizer_path" if cfg.data.tokenizer_path else "model.path"
        raise ValueError(f"{key}={path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
                         "model's tokenizer files there, or give data.tokenizer_path=<a tokenizer directory>")


def _gpu_memory(count: int) -> int | None:
    """The smallest total memory of the first ``count`` GPUs in bytes, from ``nvidia-smi`` (no CUDA context in the
    launcher, whose children own the GPUs); None where it cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.split()
        return min(int(mib) for mib in out[:count]) << 20
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _gpu_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability from ``nvidia-smi`` (no CUDA context in the launcher); None where it
    cannot tell (then the ranks' own check, in ``ODCShard``, decides)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.split()
        major, minor = out[0].split(".")
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _float8(cfg: TrainConfig, cuda: bool) -> None:
    """``shard.float8`` asks for what this machine has: a GPU of compute capability 8.9+ and torchao
    ([float8] in ``odcfsdp/sharding/groups/float8.py``); else one line naming the fix (``pip install odcfsdp[fp8]``)."""
    if cfg.shard.float8 in (None, "none"):
        return
    from ..sharding.groups.float8 import INSTALL_HINT, float8_problem, torchao_installed

    capability = _gpu_capability() if cuda else None
    if cuda and capability is None:  # the GPU is the ranks' to judge (ODCShard asks CUDA); torchao is not
        problem = None if torchao_installed() else f"float8 training needs torchao, which is not installed: " \
            f"{INSTALL_HINT}"
    else:
        problem = float8_problem("cuda" if cuda else "cpu", capability)
    if problem:
        raise ValueError(f"shard.float8={cfg.shard.float8}: {problem}")


def _fits_memory(cfg: TrainConfig, cuda: bool) -> None:
    """The model's fp32 weights and gradient accumulators (8 bytes a parameter, sharded over the ranks; optimizer
    state and activations come on top) fit the memory they live in: the GPUs', or the host's where the ranks run on
    CPU or offload. A lower bound, so it refuses only what cannot run (``data.vocab_size=1e8`` asked 102 GB of
    one machine after the ranks started)."""
    from .specs import model_spec

    vocab = source_of(cfg).config_vocab(cfg)
    if vocab is None:  # a tokenizer's vocabulary is the model's; reading it is the ranks' work
        return
    params = model_spec(cfg.model.name).parameters(cfg, vocab)
    if not params:
        return
    # under torchrun the ranks are its (WORLD_SIZE), and this machine runs LOCAL_WORLD_SIZE of them
    ranks = int(os.environ.get("WORLD_SIZE", cfg.run.world_size))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    on_gpu = cuda and not cfg.shard.offload_policy
    have = _gpu_memory(local) if on_gpu else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    need = 8 * params / ranks if on_gpu else 8 * params * local / ranks  # the host holds its ranks' shards
    if have and need > have:
        where = f"each of {local} GPUs has {have / 2**30:.0f} GiB" if on_gpu else \
            f"this machine has {have / 2**30:.0f} GiB of memory"
        raise ValueError(f"the model has {params / 1e9:.2f}B parameters (model.size={cfg.model.size}, data.vocab_size="
                         f"{cfg.data.vocab_size}): its fp32 weights and gradients alone need {need / 2**30:.0f} GiB "
                         f"{'per GPU' if on_gpu else 'on this machine'} and {where}: choose a smaller model or "
                         "vocabulary, or more machines")


def _resumes_alike(cfg: TrainConfig) -> list[str]:
    """A resumed checkpoint was written by this run's setup ([resume-setup] in ``resume_setup.py``): a changed
    model, data, optimizer class or seed is refused in one line, a changed hyper-parameter applied with a note
    (returned). LoRA first: PEFT renames every base weight, so the ranks could only say that all are missing."""
    ck = cfg.checkpoint
    path = latest_checkpoint(checkpoint_dir(cfg)) if ck.resume == "auto" else \
        None if ck.resume == "none" else Path(ck.resume)
    try:
        saved = read_manifest(path).get("config") or {} if path else {}
    except CheckpointError:
        return []  # the ranks name what is wrong with the checkpoint itself
    r = ((saved.get("model") or {}).get("lora") or {}).get("r")
    if r is not None and bool(r) != bool(cfg.model.lora.r):
        raise ValueError(f"checkpoint.resume: {path} was written {'with' if r else 'without'} LoRA adapters "
                         f"(model.lora.r={r}) and this run has model.lora.r={cfg.model.lora.r}: resume with "
                         f"model.lora.r={r}")
    refused, applied = setup_changes(saved, OmegaConf.to_container(OmegaConf.structured(cfg)))
    if refused:
        raise ValueError(refusal(str(path), refused))
    return [note(applied)] if applied else []


def used_run_dir(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` already holds a run's metrics."""
    return (Path(out_dir) / "metrics.jsonl").is_file()


def check_run_dir(cfg: TrainConfig) -> None:
    """``run.out_dir`` holds no run that this one would replace without ``run.overwrite``. Made here and again by
    the run once it holds the directory's lock ([run-lock] in ``odcfsdp/checkpoint/lock.py``): another run may
    have written there between the two."""
    r, ck = cfg.run, cfg.checkpoint
    if used_run_dir(r.out_dir) and ck.resume == "none" and not r.overwrite:
        raise ValueError(f"run.out_dir={r.out_dir!r} already holds a run: choose another run.out_dir, continue it "
                         "with checkpoint.resume=auto, or replace it with run.overwrite=true")
    ck_dir = checkpoint_dir(cfg)
    if used_run_dir(r.out_dir) and ck.resume == "auto" and not r.overwrite and latest_checkpoint(ck_dir) is None:
        # a fresh start here would replace the run's metrics, config and summary, and leave its export stale
        raise ValueError(f"checkpoint.resume=auto: run.out_dir={r.out_dir!r} holds a run but {str(ck_dir)!r} holds no "
                         "checkpoint to continue it from: choose another run.out_dir, or replace the run with "
                         "run.overwrite=true")


def preflight(cfg: TrainConfig, *, torchrun: bool = False) -> list[str]:
    """Raise ``ValueError`` (one line: key and fix) for anything that would fail only after the ranks started;
    return the note lines for what the run will ignore. A refused run leaves no directory the checks created;
    an accepted one keeps them (the run writes there next)."""
    made: list[Path] = []
    try:
        return _checks(cfg, torchrun, made)
    except BaseException:
        for top in made:
            shutil.rmtree(top, ignore_errors=True)
        raise


def _checks(cfg: TrainConfig, torchrun: bool, made: list[Path]) -> list[str]:
    """``preflight``'s checks, in order; the directories they create are appended to ``made``."""
    d, m, ck, r = cfg.data, cfg.model, cfg.checkpoint, cfg.run
    notes = []
    notes += source_of(cfg).preflight(cfg)  # the data source's own files ([data-sources]); auto resolved or not
    if d.eval_path:
        notes += check_jsonl("data.eval_path", d.eval_path, cfg)
    for key, path in (("model.path", m.path), ("model.hf_config", m.hf_config),
                      ("data.tokenizer_path", d.tokenizer_path)):
        if path and not Path(path).exists():
            raise ValueError(f"{key}={path!r} does not exist (local paths only)")
    if m.path and not (Path(m.path) / "config.json").is_file():
        raise ValueError(f"model.path={m.path!r} holds no config.json: it must be a Hugging Face model directory")
    if m.path:
        try:  # headers only: a truncated copy is named here, not as a SafetensorError of some rank
            check_weight_files(m.path)
        except CheckpointError as e:
            raise ValueError(f"model.path: {e}") from None
    _tokenizer_files(cfg)
    _writable("run.out_dir", r.out_dir, made)
    if ck.dir:
        _writable("checkpoint.dir", ck.dir, made)
    if ck.resume not in ("none", "auto"):
        p = Path(ck.resume)
        if not p.exists():
            raise ValueError(f"checkpoint.resume={ck.resume!r} does not exist")
        if not (p / "manifest.json").is_file():
            hint = (f": fine-tune a Hugging Face directory with model.name=hf model.path={ck.resume}"
                    if (p / "config.json").is_file() else " (a step_XXXXXXXX directory written by a run)")
            raise ValueError(f"checkpoint.resume={ck.resume!r} is not a training checkpoint{hint}")
    notes += _resumes_alike(cfg)
    check_run_dir(cfg)
    import torch

    cuda = r.device == "cuda" or (r.device == "auto" and torch.cuda.is_available())
    _float8(cfg, cuda)
    if not torchrun:  # under torchrun the launcher, not this process, placed the ranks
        have = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
        if r.world_size > 1 and r.world_size > have:
            raise ValueError(f"run.world_size={r.world_size} ranks on a machine with {have} "
                             f"{'GPUs' if cuda else 'CPU cores'}: use at most {have} (each rank is a process "
                             "with its own copy of the data pipeline)")
    _fits_memory(cfg, cuda)  # under torchrun too, for the ranks it placed here (the README's 8B line ran out of memory)
    return notes
