"""Sharded checkpoints: every rank writes and reads only its own slices.

Save (collective), as numbered steps:

1. the ranks agree that no gradient is pending; rank 0 picks ``step_<k>.tmp-<token>/``
   (clearing leftovers of an earlier, killed save of the same step);
2. each rank writes ``rank<r>.safetensors``: per parameter, its segment of the fp32
   master row and of the AdamW moments (views of the rows: no full model anywhere),
   plus its RNG states (rank 0 also the persistent buffers); then fsyncs it and
   reports size and CRC-32;
3. rank 0 writes ``manifest.json``, renames the directory to ``step_<k>/`` (atomic),
   fsyncs the parent, moves checkpoints of *later* steps aside (a rollback) and
   prunes to ``keep_last`` complete checkpoints, never the one just written.

A checkpoint is complete exactly when ``step_<k>/manifest.json`` exists, so a save
killed at any point leaves the previous checkpoints as they were and a ``.tmp-``
directory that loading ignores.

Load reads, for each parameter segment this rank owns under its *current* plan,
the overlapping slices of the writers' segments (safetensors reads slices without
reading whole tensors), so any world size and any ``group_bytes`` can resume any
checkpoint. Files are checked against the manifest's sizes and checksums first.
"""

from __future__ import annotations

import json
import random
import re
import secrets
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..optim.adamw import AdamW
from ..sharding.shard import ODCShard
from .files import crc32_of, fsync_path, write_json_durably
from .manifest import FORMAT, MANIFEST, VERSION, CheckpointError, check_params, rank_file, read_manifest

_COMPLETE = re.compile(r"^step_(\d{8})$")
_ASIDE = re.compile(r"^step_(\d{8})\.old-[0-9a-f]+$")  # the previous copy of a step saved twice
MOMENTS = ("exp_avg", "exp_avg_sq")


def _segment(numel: int, seg: int, rank: int) -> tuple[int, int]:
    """Elements [lo, hi) of a flattened parameter that ``rank`` holds (hi <= lo when none)."""
    lo = rank * seg
    return lo, min(lo + seg, numel)


def _model_slots(model: ODCShard) -> dict:
    return {s.name: (s.shape, str(lay.dtype).removeprefix("torch."), lay.requires_grad)
            for lay in model.layouts for s in lay.slots}


def _moments(optimizer: AdamW | None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Group index -> (exp_avg, exp_avg_sq) rows."""
    if optimizer is None:
        return {}
    return {g.index: (m, v) for g, m, v in zip(optimizer.groups, optimizer.exp_avg, optimizer.exp_avg_sq)}


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints under ``directory``, oldest first.

    A step whose re-save was cut between its two renames survives as ``step_<k>.old-*``
    and is listed in place of the missing ``step_<k>``.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in directory.iterdir():
        m = _COMPLETE.match(p.name) or _ASIDE.match(p.name)
        if m and (p / MANIFEST).is_file() and (_COMPLETE.match(p.name) or int(m.group(1)) not in found):
            found[int(m.group(1))] = p
    return [found[k] for k in sorted(found)]


def _step_of(path: Path) -> int:
    return int(path.name[5:13])


def _commit(directory: Path, tmp: Path, final: Path, token: str) -> None:
    """Make ``tmp`` visible as ``final`` by renames (a step saved again replaces the old copy last)."""
    old = None
    if final.exists():
        old = directory / f"{final.name}.old-{token}"
        final.rename(old)
    tmp.rename(final)
    fsync_path(directory)
    if old is not None:
        shutil.rmtree(old)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (None if there is none)."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def save_checkpoint(
    directory: str | Path,
    model: ODCShard,
    optimizer: AdamW | None = None,
    *,
    step: int,
    config: dict | None = None,
    extra: dict | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint ``step`` of ``model`` (and ``optimizer``) under ``directory``; collective.

    Call it between optimizer steps. ``config`` and ``extra`` (e.g. the data
    position) are stored in the manifest. Returns the checkpoint's path.
    """
    mesh = model.mesh
    pending = mesh.all_reduce_sum(torch.tensor([float(model.pending_pushes)], device=mesh.device))
    if pending.item():  # decided together: a rank raising alone would leave the others waiting
        raise CheckpointError("save_checkpoint was called with gradients pending; save between optimizer steps")
    directory = Path(directory)
    rank, world = model.rank, model.world_size
    token = mesh.broadcast_object(secrets.token_hex(4))
    final = directory / f"step_{step:08d}"
    tmp = directory / f"{final.name}.tmp-{token}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(f"{final.name}.tmp-*"):  # an earlier, killed save of this step
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    model.reshard_all()
    mesh.barrier()

    tensors: dict[str, torch.Tensor] = {}
    moments = _moments(optimizer)
    for g in model.groups:
        rows = {"master": g.read_master(), **dict(zip(MOMENTS, moments.get(g.index, ())))}  # once per group
        for s in g.layout.slots:
            lo, hi = _segment(s.numel, s.seg, rank)
            if hi <= lo:
                continue
            for kind, row in rows.items():
                tensors[f"{s.name}/{kind}"] = row[s.offset : s.offset + hi - lo].detach().cpu()
    if rank == 0:  # persistent buffers are replicated: one copy, read back by every rank
        for name, buf in model.persistent_buffers().items():
            tensors[f"__buffer__/{name}"] = buf.detach().cpu()
    tensors["__rng__/torch"] = torch.get_rng_state()
    if mesh.device.type == "cuda":
        tensors["__rng__/cuda"] = torch.cuda.get_rng_state(mesh.device)
    path = tmp / rank_file(rank)
    save_file(tensors, path, metadata={"rank": str(rank), "python_random": json.dumps(random.getstate())})
    fsync_path(path)
    files = mesh.all_gather_object({"file": path.name, "bytes": path.stat().st_size, "crc32": crc32_of(path)})

    if rank == 0:
        manifest = {
            "format": FORMAT, "version": VERSION, "world_size": world, "step": step,
            "param_dtype": str(model.param_dtype).removeprefix("torch."),
            "params": [
                {"name": s.name, "shape": list(s.shape), "dtype": str(lay.dtype).removeprefix("torch."),
                 "requires_grad": lay.requires_grad, "group": lay.index, "offset": s.offset, "seg": s.seg}
                for lay in model.layouts for s in lay.slots
            ],
            "aliases": model.aliases,
            "optimizer": None if optimizer is None else {
                "type": "AdamW", "step_count": optimizer.step_count, "lr": optimizer.base_lr,
                "betas": list(optimizer.betas), "eps": optimizer.eps, "weight_decay": optimizer.weight_decay,
            },
            "files": files, "config": config, "extra": extra or {},
        }
        write_json_durably(tmp / MANIFEST, manifest)
        fsync_path(tmp)
        _commit(directory, tmp, final, token)
        later = [p for p in list_checkpoints(directory) if _step_of(p) > step]
        if later:  # a rollback: those belong to the abandoned continuation; keep them, but out of the way
            for p in later:
                p.rename(p.with_name(f"{p.name.split('.')[0]}.abandoned-{token}"))
            warnings.warn(f"saved step {step} below existing checkpoints; moved {[p.name for p in later]} aside "
                          f"as *.abandoned-{token} so that resuming picks this one")
        if keep_last:
            for old in list_checkpoints(directory)[:-keep_last]:  # never the one just written: it is the newest
                shutil.rmtree(old)
                for leftover in directory.glob(f"{old.name.split('.')[0]}.tmp-*"):
                    shutil.rmtree(leftover, ignore_errors=True)
    mesh.barrier()
    return final


class _Files:
    """The writer files of one checkpoint, opened on first use and verified once."""

    def __init__(self, path: Path, manifest: dict, verify: bool):
        self.path, self.verify = path, verify
        self.info = {f["file"]: f for f in manifest["files"]}
        self.open: dict[int, object] = {}

    def get(self, rank: int):
        if rank not in self.open:
            name = rank_file(rank)
            file = self.path / name
            if name not in self.info or not file.is_file():
                raise CheckpointError(f"{file} is missing")
            info = self.info[name]
            if self.verify:
                size = file.stat().st_size
                if size != info["bytes"]:
                    raise CheckpointError(f"{file}: {size} bytes, the manifest says {info['bytes']} (truncated or replaced)")
                if crc32_of(file) != info["crc32"]:
                    raise CheckpointError(f"{file}: checksum mismatch (the file was altered or corrupted)")
            self.open[rank] = safe_open(str(file), framework="pt")
        return self.open[rank]

    def read(self, rank: int, key: str, lo: int, hi: int) -> torch.Tensor:
        f = self.get(rank)
        if key not in f.keys():
            raise CheckpointError(f"{self.path / rank_file(rank)}: tensor {key!r} is missing")
        return f.get_slice(key)[lo:hi]


def load_checkpoint(path: str | Path, model: ODCShard, optimizer: AdamW | None = None, *,
                    verify: bool = True) -> dict:
    """Load a checkpoint into ``model`` (and ``optimizer``), resharding as needed; collective.

    Works for any world size and ``group_bytes`` of the writer and the reader. RNG
    states are restored when the world size is unchanged. Returns the manifest.
    """
    path = Path(path)
    manifest = read_manifest(path)
    check_params(manifest, _model_slots(model), path)
    if optimizer is not None and manifest.get("optimizer") is None:
        raise CheckpointError(f"{path}: holds no optimizer state, but an optimizer was given")
    old_world = manifest["world_size"]
    old_seg = {p["name"]: p["seg"] for p in manifest["params"]}
    files = _Files(path, manifest, verify)
    moments = _moments(optimizer)
    rank = model.rank

    with model.protocol.rows_changing():
        for g in model.groups:
            with g.updating_master() as master:
                rows = {"master": master, **dict(zip(MOMENTS, moments.get(g.index, ())))}
                for s in g.layout.slots:
                    lo, hi = _segment(s.numel, s.seg, rank)
                    for kind, row in rows.items():
                        dest = row[s.offset : s.offset + s.seg]
                        dest.zero_()  # padding past the parameter's end stays zero
                        seg = old_seg[s.name]
                        for q in range(lo // seg, min(old_world, -(-hi // seg))) if hi > lo else ():
                            qlo, qhi = _segment(s.numel, seg, q)
                            a, b = max(lo, qlo), min(hi, qhi)
                            if a < b:
                                dest[a - lo : b - lo].copy_(files.read(q, f"{s.name}/{kind}", a - qlo, b - qlo))
        buffers = model.persistent_buffers()
        if buffers:
            f0 = files.get(0)
            for name, buf in buffers.items():
                key = f"__buffer__/{name}"
                if key not in f0.keys():
                    raise CheckpointError(f"{path / rank_file(0)}: buffer {name!r} of the model is not in the checkpoint")
                with torch.no_grad():
                    buf.copy_(f0.get_tensor(key))
        if optimizer is not None:
            optimizer.step_count = manifest["optimizer"]["step_count"]
        if old_world == model.world_size:
            _restore_rng(files.get(rank), model.mesh.device)
    return manifest


def _restore_rng(f, device: torch.device) -> None:
    torch.set_rng_state(f.get_tensor("__rng__/torch"))
    if device.type == "cuda" and "__rng__/cuda" in f.keys():
        torch.cuda.set_rng_state(f.get_tensor("__rng__/cuda"), device)
    state = json.loads(f.metadata()["python_random"])
    random.setstate((state[0], tuple(state[1]), state[2]))
