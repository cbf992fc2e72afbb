"""The checkpoint manifest: what a checkpoint holds and how to check it against a model.

A checkpoint directory ``step_00000123/`` holds one ``rank00000.safetensors`` per
rank of the shard group that wrote it and ``manifest.json``; with HSDP, the other
replicas' ranks add ``replica<k>-rank<r>.safetensors`` holding only their RNG states:

* ``format`` / ``version``: ``odcfsdp-checkpoint`` / 2 (1 is read too);
* ``world_size`` (the shard group's size), ``replicas`` (HSDP copies; absent: 1),
  ``step``, ``config`` and ``extra`` (e.g. the data position);
* ``params``: per parameter its name, shape, dtype, requires_grad, and where it
  sat in the writer's plan: group, row offset and shard length ``seg``. Rank q
  stored elements ``[q * seg, min((q + 1) * seg, numel))`` of the flattened
  parameter as ``<name>/master`` and, for each optimizer state tensor shaped like
  the parameter, ``<name>/<state key>`` (``exp_avg``, ``momentum_buffer``, ...);
* ``optimizer``: null, or the optimizer's class, ``param_groups`` (hyper-parameters
  and parameter names), ``tensor_states`` (the keys stored in the files) and
  ``scalar_states`` (per parameter, e.g. ``step``). Version 1 held odcfsdp's own
  AdamW: ``type``, ``step_count`` and its hyper-parameters;
* ``scheduler``: the LR scheduler's ``state_dict``, or null;
* ``files``: per rank file its size in bytes and CRC-32.

Design note [bound-files]
-------------------------
A manifest and its rank files are bound to each other (version 3), so that an edited manifest or a rank file
from another checkpoint is refused in one line, before anything is read (edits that resumed silently with a
jump in the loss, issue 32):

1. each rank file's safetensors header carries ``step``, ``world_size``, ``replicas`` and ``plan``, the SHA-256
   of the canonical JSON of the manifest's ``params`` (every parameter's shape, dtype, group, offset and ``seg``)
   as the writer had it;
2. on load, every rank reads every listed file's header (no tensor data) and compares: a file of another step or
   world size, or a manifest whose ``world_size``, ``replicas``, ``step`` or ``params`` were edited, is refused,
   alike on every rank; the file list must hold exactly one file per writer;
3. the CRC-32 of each file (``files``) still catches truncation and corruption when its tensors are read.
A rank file whose CRC-32 was rewritten in the manifest is caught by 2 unless its header was rewritten too; a
deliberate forgery of both is out of scope (whoever can write the directory can write a whole checkpoint).
Versions 1 and 2 carry no binding and load as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT = "odcfsdp-checkpoint"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
BOUND_KEYS = ("step", "world_size", "replicas", "plan")  # [bound-files] 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked: incomplete, corrupt, incompatible or for another model."""


def rank_file(rank: int, replica: int = 0) -> str:
    """The file of shard ``rank``; with HSDP ([hsdp]), replicas after the first write only their RNG states."""
    return f"rank{rank:05d}.safetensors" if replica == 0 else f"replica{replica:05d}-rank{rank:05d}.safetensors"


def read_manifest(path: Path) -> dict:
    """Load and check a checkpoint's manifest (format, version, required keys)."""
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint: {MANIFEST} is missing")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e.msg})") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r} is not {FORMAT!r}")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{file}: format version {manifest.get('version')!r} is not supported (this odcfsdp reads versions "
            f"{list(READABLE_VERSIONS)})"
        )
    missing = {"world_size", "step", "params", "files"} - set(manifest)
    if missing:
        raise CheckpointError(f"{file}: required keys {sorted(missing)} are missing")
    return manifest


def _has_adapters(names) -> bool:
    """Whether parameter ``names`` hold PEFT's LoRA adapters (``...lora_A.default.weight``)."""
    return any(".lora_A." in n or ".lora_B." in n for n in names)


def check_params(manifest: dict, slots: dict, where: Path) -> None:
    """Raise ``CheckpointError`` naming the first parameter that differs between manifest and model.

    ``slots`` maps each model parameter name to (shape, dtype name, requires_grad).
    """
    saved = {p["name"]: p for p in manifest["params"]}
    if _has_adapters(saved) != _has_adapters(slots):  # every name differs (PEFT renames the base weights too)
        r = ((manifest.get("config") or {}).get("model") or {}).get("lora", {}).get("r")
        raise CheckpointError(
            f"{where} was written {'with' if _has_adapters(saved) else 'without'} LoRA adapters and the model "
            f"{'has none' if _has_adapters(saved) else 'has them'}: resume with the adapters the run had"
            f"{f' (model.lora.r={r})' if r is not None else ''}")
    missing = sorted(set(slots) - set(saved))
    unexpected = sorted(set(saved) - set(slots))
    if missing:
        raise CheckpointError(f"{where}: parameter {missing[0]!r} of the model is not in the checkpoint "
                              f"({len(missing)} missing)")
    if unexpected:
        raise CheckpointError(f"{where}: parameter {unexpected[0]!r} of the checkpoint is not in the model "
                              f"({len(unexpected)} unexpected)")
    for name, (shape, dtype, trained) in slots.items():
        p = saved[name]
        if tuple(p["shape"]) != tuple(shape):
            raise CheckpointError(f"{where}: parameter {name!r} has shape {tuple(p['shape'])} in the checkpoint, "
                                  f"{tuple(shape)} in the model")
        if p["dtype"] != dtype:
            raise CheckpointError(
                f"{where}: parameter {name!r} is {p['dtype']} in the checkpoint, {dtype} in the model")
        if p["requires_grad"] != trained:
            raise CheckpointError(f"{where}: parameter {name!r} is {'trained' if p['requires_grad'] else 'frozen'} "
                                  f"in the checkpoint but not in the model")


def check_size(file: Path, info: dict) -> None:
    """Refuse a rank file whose size is not the manifest's (``info``: its ``files`` entry)."""
    size = file.stat().st_size
    if size != info["bytes"]:
        raise CheckpointError(f"{file}: {size} bytes, the manifest says {info['bytes']} (truncated or replaced)")


def plan_digest(params: list[dict]) -> str:
    """SHA-256 of the canonical JSON of a manifest's ``params`` ([bound-files] 1)."""
    return hashlib.sha256(json.dumps(params, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_binding(step: int, world_size: int, replicas: int, params: list[dict]) -> dict[str, str]:
    """The header metadata that binds a rank file to its checkpoint ([bound-files] 1)."""
    return {"step": str(step), "world_size": str(world_size), "replicas": str(replicas), "plan": plan_digest(params)}


def check_files_bound(path: Path, manifest: dict) -> None:
    """Refuse, naming the file, a rank file not written for this manifest ([bound-files] 2); versions 1-2: nothing."""
    if manifest.get("version", 0) < 3:
        return
    from safetensors import safe_open

    path = Path(path)
    replicas = manifest.get("replicas", 1)
    want = {rank_file(r, k) for r in range(manifest["world_size"]) for k in range(replicas)}
    infos = {f["file"]: f for f in manifest["files"]}
    listed = set(infos)
    if listed != want:
        extra, missing = sorted(listed - want), sorted(want - listed)
        raise CheckpointError(f"{path / MANIFEST}: lists {len(listed)} rank files for world_size "
                              f"{manifest['world_size']} x {replicas} replica(s)"
                              f"{f', not {missing[0]}' if missing else ''}{f', and {extra[0]}' if extra else ''}: "
                              "the manifest was edited or belongs to another checkpoint")
    expected = file_binding(manifest["step"], manifest["world_size"], replicas, manifest["params"])
    for name in sorted(listed):
        file, info = path / name, infos[name]
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        check_size(file, info)  # before the header: a truncated file is named as such
        try:
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # noqa: BLE001 - safetensors' own errors name no file
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
        for key in BOUND_KEYS:
            if meta.get(key) != expected[key]:
                what = "parameter plan (params: shapes, groups, offsets, segs)" if key == "plan" else key
                raise CheckpointError(f"{file}: written with {what} {meta.get(key)!r}, but the manifest says "
                                      f"{expected[key]!r}: the manifest was edited or the file is from another "
                                      "checkpoint")
