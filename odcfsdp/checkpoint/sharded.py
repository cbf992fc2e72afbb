"""Sharded checkpoints: every rank writes and reads only its own slices.

Save (collective), as numbered steps:

1. the ranks agree that no gradient is pending and that no parameter shard or optimizer state holds a NaN or an
   infinity (one all-reduce; refused with ``NonFiniteStateError`` naming the first); rank 0 picks
   ``step_<k>.tmp-<token>/``
   (clearing leftovers of an earlier, killed save of the same step);
2. each rank writes ``rank<r>.safetensors``: per parameter, its dim-0 shard of the
   fp32 master and of every optimizer state tensor shaped like the parameter (AdamW's
   moments, SGD's momentum, ...; views of the rows and of the optimizer's DTensors:
   no full model anywhere), plus its RNG states (rank 0 also the persistent
   buffers); then fsyncs it and reports size and CRC-32. With HSDP ([hsdp]) the
   shards are replica 0's; the other replicas' ranks write only their RNG states
   (``replica<k>-rank<r>.safetensors``), and every meeting of the save spans all ranks;
3. rank 0 writes ``manifest.json`` (with the optimizer's parameter groups, scalar
   states such as ``step``, and the LR scheduler's state), renames the directory to
   ``step_<k>/`` (atomic), fsyncs the parent, moves checkpoints of *later* steps aside
   (a rollback) and prunes to ``keep_last`` complete checkpoints, never the one just
   written.

A checkpoint is complete exactly when ``step_<k>/manifest.json`` exists, so a save
killed at any point leaves the previous checkpoints as they were and a ``.tmp-`` directory
that loading ignores and the run's next start removes (``sweep.py``, as rollbacks' ``.abandoned-``).

Load reads, for each parameter shard this rank owns under its *current* plan, the
overlapping slices of the writers' shards (safetensors reads slices without reading
whole tensors), so any world size and any ``group_bytes`` can resume any checkpoint;
optimizer state is rebuilt the same way and handed to the optimizer's own
``load_state_dict``. Files are checked against the manifest's sizes and checksums
first. Version 1 checkpoints (written with odcfsdp's former own AdamW) load into
``torch.optim.AdamW``.
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
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from ..optim.parked import owned_loads
from ..sharding.placement.layout import overlapping_shards, shard_range
from ..sharding.groups.param import as_global
from ..sharding.api.sharded_model import ShardedModel, sharded
from .files import crc32_of, fsync_path, naming, write_json_durably
from .optimizer_state import jsonable, optimizer_params, optimizer_tensors
from .nonfinite import NonFiniteStateError, first_nonfinite
from .manifest import (
    FORMAT, MANIFEST, VERSION, CheckpointError, check_files_bound, check_params, check_size, file_binding, rank_file,
    read_manifest,
)

_COMPLETE = re.compile(r"^step_(\d{8})$")
_ASIDE = re.compile(r"^step_(\d{8})\.old-[0-9a-f]+$")  # the previous copy of a step saved twice


def _plan(model: ShardedModel) -> list[dict]:
    """The manifest's ``params``: each parameter and where it sat in the writer's plan (the same on every rank)."""
    return [{"name": s.name, "shape": list(s.shape), "dtype": str(lay.dtype).removeprefix("torch."),
             "requires_grad": lay.requires_grad, "group": lay.index, "offset": s.offset, "seg": s.shard}
            for lay in model.layouts for s in lay.slots]


def _model_slots(model: ShardedModel) -> dict:
    return {s.name: (s.shape, str(lay.dtype).removeprefix("torch."), lay.requires_grad)
            for lay in model.layouts for s in lay.slots}


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
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    scheduler=None,
    config: dict | None = None,
    extra: dict | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write checkpoint ``step`` of ``model`` (and ``optimizer``, ``scheduler``) under ``directory``; collective.

    Call it between optimizer steps. ``optimizer`` is any ``torch.optim`` optimizer
    over the model's parameters; ``scheduler`` an LR scheduler (its ``state_dict``
    goes into the manifest). ``config`` and ``extra`` (e.g. the data position) are
    stored in the manifest. Returns the checkpoint's path.
    """
    model = sharded(model)  # an ODCShard or a fully_shard model ([sharded-model])
    mesh, everyone = model.mesh, model.mesh.everyone  # HSDP: replica 0 writes the shards, every rank its RNG
    # Every rank checks the optimizer's state (a refusal comes alike everywhere); replica 0 copies it.
    opt_entry, opt_tensors = (None, {}) if optimizer is None else optimizer_tensors(model, optimizer,
                                                                                    copy=mesh.replica == 0)
    masters = [(sp.name, shard) for sp, shard in model.shard_state.shards()]
    bad = first_nonfinite(masters + [(k.rpartition("/")[0] + f" ({k.rpartition('/')[2]})", v)
                                      for k, v in opt_tensors.items()])
    # One meeting decides both refusals alike on every rank (a rank raising alone would leave the others waiting).
    counts = everyone.all_reduce_sum(torch.tensor([float(model.pending_pushes), float(bad[1])], device=mesh.device))
    if counts[0].item():
        raise CheckpointError("save_checkpoint was called with gradients pending; save between optimizer steps")
    if counts[1].item():  # step 1's guard: a checkpoint never holds a NaN or an infinity
        where = next(w for w in everyone.all_gather_object(bad[0] and f"{bad[0]} on rank {everyone.rank}") if w)
        raise NonFiniteStateError(f"not saving step {step}: {int(counts[1].item())} non-finite values in the "
                                  f"parameters or optimizer state (first: {where}); earlier checkpoints are kept")
    directory = Path(directory)
    rank, world = model.rank, model.world_size
    token = everyone.broadcast_object(secrets.token_hex(4))
    final = directory / f"step_{step:08d}"
    tmp = directory / f"{final.name}.tmp-{token}"
    first = everyone.rank == 0  # replica 0's rank 0
    if first:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(f"{final.name}.tmp-*"):  # an earlier, killed save of this step
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    everyone.barrier()

    tensors: dict[str, torch.Tensor] = {}
    for sp, shard in (model.shard_state.shards() if mesh.replica == 0 else ()):
        if shard.numel():
            tensors[f"{sp.name}/master"] = shard.detach().cpu()
    tensors.update({k: v for k, v in opt_tensors.items() if v.numel()})
    if first:  # persistent buffers are replicated: one copy, read back by every rank
        for name, buf in model.persistent_buffers().items():
            tensors[f"__buffer__/{name}"] = buf.detach().cpu()
    tensors["__rng__/torch"] = torch.get_rng_state()
    if mesh.device.type == "cuda":
        tensors["__rng__/cuda"] = torch.cuda.get_rng_state(mesh.device)
    path = tmp / rank_file(rank, mesh.replica)
    plan = _plan(model)
    with naming(path):  # a failed write names its file (safetensors' own error names none)
        save_file(tensors, path, metadata={"rank": str(rank), "python_random": json.dumps(random.getstate()),
                                           **file_binding(step, world, mesh.replicas, plan)})
    fsync_path(path)
    files = everyone.all_gather_object({"file": path.name, "bytes": path.stat().st_size, "crc32": crc32_of(path)})

    if first:
        manifest = {
            "format": FORMAT, "version": VERSION, "world_size": world, "replicas": mesh.replicas, "step": step,
            "param_dtype": str(model.param_dtype).removeprefix("torch."),
            "params": plan,
            "aliases": model.aliases, "optimizer": opt_entry,
            "scheduler": None if scheduler is None else {k: jsonable(v) for k, v in scheduler.state_dict().items()},
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
                          f"as *.abandoned-{token} so that resuming picks this one (the run's next start removes them)")
        if keep_last:
            for old in list_checkpoints(directory)[:-keep_last]:  # never the one just written: it is the newest
                shutil.rmtree(old)
                for leftover in directory.glob(f"{old.name.split('.')[0]}.tmp-*"):
                    shutil.rmtree(leftover, ignore_errors=True)
    everyone.barrier()
    return final


class _Files:
    """The writer files of one checkpoint, opened on first use and verified once."""

    def __init__(self, path: Path, manifest: dict, verify: bool):
        self.path, self.verify = path, verify
        self.info = {f["file"]: f for f in manifest["files"]}
        self.open: dict[int, object] = {}

    def get(self, rank: int, replica: int = 0):
        if (rank, replica) not in self.open:
            name = rank_file(rank, replica)
            file = self.path / name
            if name not in self.info or not file.is_file():
                raise CheckpointError(f"{file} is missing")
            info = self.info[name]
            if self.verify:
                check_size(file, info)
                if crc32_of(file) != info["crc32"]:
                    raise CheckpointError(f"{file}: checksum mismatch (the file was altered or corrupted)")
            self.open[rank, replica] = safe_open(str(file), framework="pt")
        return self.open[rank, replica]

    def read(self, rank: int, key: str, lo: int, hi: int) -> torch.Tensor:
        f = self.get(rank)
        if key not in f.keys():
            raise CheckpointError(f"{self.path / rank_file(rank)}: tensor {key!r} is missing")
        return f.get_slice(key)[lo:hi]


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    scheduler=None, verify: bool = True) -> dict:
    """Load a checkpoint into ``model`` (and ``optimizer``, ``scheduler``), resharding as needed; collective.

    Works for any world size and ``group_bytes`` of the writer and the reader. The
    optimizer must group the model's parameters as the saved one did (same
    parameters in the same groups); its hyper-parameters are restored from the
    checkpoint, as ``load_state_dict`` does. RNG states are restored when the shard
    group size and the number of HSDP replicas are unchanged. Returns the manifest.
    """
    model = sharded(model)  # an ODCShard or a fully_shard model ([sharded-model])
    path = Path(path)
    manifest = read_manifest(path)
    check_params(manifest, _model_slots(model), path)
    check_files_bound(path, manifest)  # every rank, every file's header: a mismatch is refused alike everywhere
    saved_opt = manifest.get("optimizer")
    if optimizer is not None and saved_opt is None:
        raise CheckpointError(f"{path}: holds no optimizer state, but an optimizer was given")
    if scheduler is not None and manifest.get("scheduler") is None:
        raise CheckpointError(f"{path}: holds no LR scheduler state, but a scheduler was given")
    old_world = manifest["world_size"]
    old_seg = {p["name"]: p["seg"] for p in manifest["params"]}
    files = _Files(path, manifest, verify)
    rank = model.rank

    state = model.shard_state
    with state.changing():
        for sp, lo, hi, dest in state.write_targets():
            _read_slices(files, old_world, old_seg[sp.name], sp.slot.numel, f"{sp.name}/master", lo, hi, dest)
        buffers = model.persistent_buffers()
        if buffers:
            f0 = files.get(0)
            for name, buf in buffers.items():
                key = f"__buffer__/{name}"
                if key not in f0.keys():
                    raise CheckpointError(
                        f"{path / rank_file(0)}: buffer {name!r} of the model is not in the checkpoint")
                with torch.no_grad():
                    buf.copy_(f0.get_tensor(key))
    if optimizer is not None:
        _load_optimizer(path, manifest, files, model, optimizer, old_world, old_seg)
    if scheduler is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    if old_world == model.world_size and manifest.get("replicas", 1) == model.mesh.replicas:
        _restore_rng(files.get(rank, model.mesh.replica), model.mesh.device)
    return manifest


def _read_slices(files: "_Files", old_world: int, seg: int, numel: int, key: str, lo: int, hi: int,
                 out: torch.Tensor) -> None:
    """``out`` = elements ``[lo, hi)`` of the flattened tensor ``key``, from the writers that hold them."""
    for q, a, b in overlapping_shards(lo, hi, numel, seg, old_world):
        qlo = shard_range(numel, seg, q)[0]
        out[a - lo : b - lo].copy_(files.read(q, key, a - qlo, b - qlo))


def _load_optimizer(path: Path, manifest: dict, files: "_Files", model: ShardedModel, optimizer, old_world: int,
                    old_seg: dict[str, int]) -> None:
    """Rebuild this rank's optimizer state from the checkpoint and hand it to ``optimizer.load_state_dict``."""
    saved = manifest["optimizer"]
    groups = optimizer_params(model, optimizer)
    if manifest["version"] == 1:  # odcfsdp's own AdamW: exp_avg / exp_avg_sq rows, one step count
        saved = {"param_groups": [{k: v for k, v in g.items() if k != "params"} | {"params": [sp.name for sp in sps]}
                                  for g, sps in zip(optimizer.param_groups, groups)],
                 "tensor_states": ["exp_avg", "exp_avg_sq"],
                 "scalar_states": {sp.name: {"step": saved["step_count"]} for sps in groups for sp in sps}}
    names = [[sp.name for sp in sps] for sps in groups]
    if [g["params"] for g in saved["param_groups"]] != names:
        raise CheckpointError(f"{path}: the optimizer's parameter groups differ from the saved ones (the same "
                              "parameters must be in the same groups, in the same order)")
    rank, mesh = model.rank, model.mesh.device_mesh
    state, index = {}, 0
    for sps in groups:
        for sp in sps:
            entry = {}
            for key in saved["tensor_states"]:
                lo, hi = sp.slot.local_range(rank)
                local = torch.zeros(sp.local.shape, dtype=sp.local.dtype)
                _read_slices(files, old_world, old_seg[sp.name], sp.slot.numel, f"{sp.name}/{key}", lo, hi,
                             local.view(-1))
                entry[key] = as_global(local.to(sp.local.device), sp.shape, mesh)
            for key, value in saved["scalar_states"].get(sp.name, {}).items():
                entry[key] = torch.tensor(value, dtype=torch.float32) if key == "step" else value
            state[index] = entry
            index += 1
    param_groups, index = [], 0
    for g in saved["param_groups"]:
        hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k != "params"}
        param_groups.append({**hyper, "params": list(range(index, index + len(g["params"])))})
        index += len(g["params"])
    with owned_loads(optimizer):  # the state built here is the optimizer's alone: parked as it is ([parking])
        optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def _restore_rng(f, device: torch.device) -> None:
    torch.set_rng_state(f.get_tensor("__rng__/torch"))
    if device.type == "cuda" and "__rng__/cuda" in f.keys():
        torch.cuda.set_rng_state(f.get_tensor("__rng__/cuda"), device)
    state = json.loads(f.metadata()["python_random"])
    random.setstate((state[0], tuple(state[1]), state[2]))
