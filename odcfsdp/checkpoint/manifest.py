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
"""

from __future__ import annotations

import json
from pathlib import Path

FORMAT = "odcfsdp-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
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


def check_params(manifest: dict, slots: dict, where: Path) -> None:
    """Raise ``CheckpointError`` naming the first parameter that differs between manifest and model.

    ``slots`` maps each model parameter name to (shape, dtype name, requires_grad).
    """
    saved = {p["name"]: p for p in manifest["params"]}
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
            raise CheckpointError(f"{where}: parameter {name!r} is {p['dtype']} in the checkpoint, {dtype} in the model")
        if p["requires_grad"] != trained:
            raise CheckpointError(f"{where}: parameter {name!r} is {'trained' if p['requires_grad'] else 'frozen'} "
                                  f"in the checkpoint but not in the model")
