"""Hugging Face style weights: consolidated export and sharded import.

``export_hf`` writes ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors``
plus ``model.safetensors.index.json`` past ``max_shard_bytes``) with the original
parameter names (mapped to Hugging Face names for our Llama) and dtypes, and a
``config.json`` when the model has one. Parameters are gathered group by group, so
rank 0 holds at most one output shard and one group at a time.

``export_pretrained`` adds what ``from_pretrained`` needs besides (generation config,
tokenizer files). ``load_hf`` fills an ``ODCShard`` (built on the meta device if the model is large)
from such files: each rank reads only the slices of each tensor that its rows need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..models.llama import Llama, LlamaConfig
from ..sharding.shard import ODCShard
from .manifest import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def llama_to_hf_name(name: str) -> str:
    """Our Llama's parameter names are Hugging Face's LlamaForCausalLM names without the ``model.`` prefix."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def hf_llama_config(cfg: LlamaConfig, max_positions: int = 131072) -> dict:
    """``config.json`` contents for Hugging Face's LlamaForCausalLM with the same shapes."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": max_positions, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False,
    }


def default_name_map(model: ODCShard) -> Callable[[str], str]:
    """How parameter names become file names: HF names for our Llama and for wrapped HF models."""
    from ..models.hf import HFCausalLM

    if isinstance(model.module, Llama):
        return llama_to_hf_name
    if isinstance(model.module, HFCausalLM):
        return lambda name: name.removeprefix("model.")
    return lambda name: name


def transformers_model(model: ODCShard):
    """The ``transformers`` model inside ``model`` (an ``HFCausalLM``'s, or the wrapped module itself), or None."""
    from ..models.hf import HFCausalLM

    inner = model.module.model if isinstance(model.module, HFCausalLM) else model.module
    config = getattr(inner, "config", None)
    return inner if callable(getattr(config, "to_dict", None)) else None


def _config_json(model: ODCShard, dtype: torch.dtype) -> dict | None:
    name = str(dtype).removeprefix("torch.")
    if isinstance(model.module, Llama):
        return {**hf_llama_config(model.module.config), "torch_dtype": name}
    hf = transformers_model(model)
    if hf is None:
        return None
    config = hf.config.to_dict()
    config["dtype" if "dtype" in config else "torch_dtype"] = name
    return config


def export_hf(model: ODCShard, out_dir: str | Path, *, max_shard_bytes: int = 5 << 30,
              dtype: torch.dtype | None = None, name_map: Callable[[str], str] | None = None) -> list[Path]:
    """Write consolidated weights of ``model`` under ``out_dir`` (rank 0 writes; collective).

    ``dtype`` casts every tensor (default: each parameter's original dtype). Tied
    parameters are written once, under their first name. Returns the files written.
    """
    name_map = name_map or default_name_map(model)
    out_dir = Path(out_dir)
    rank = model.rank
    sizes = [(s.name, s.numel * torch.empty((), dtype=dtype or lay.dtype).element_size())
             for lay in model.layouts for s in lay.slots]
    shards, current, used = [], [], 0  # plan the shard files from sizes alone, the same on every rank
    for name, nbytes in sizes:
        if current and used + nbytes > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    shards.append(current)
    files = [SINGLE] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                                for k in range(len(shards))]
    shard_of = {name: k for k, names in enumerate(shards) for name in names}
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*out_dir.glob("model*.safetensors"), out_dir / INDEX]:  # an earlier export must not mix in
            stale.unlink(missing_ok=True)

    pending: dict[str, torch.Tensor] = {}
    written: list[Path] = []
    next_shard = 0

    def flush(upto: int) -> None:
        nonlocal next_shard
        while next_shard < upto:
            names = shards[next_shard]
            save_file({name_map(n): pending.pop(n) for n in names}, out_dir / files[next_shard],
                      metadata={"format": "pt"})
            written.append(out_dir / files[next_shard])
            next_shard += 1

    for g in model.groups:
        full = g.layout.unpack(model.mesh.all_gather_rows(g.read_master()))  # collective, every rank
        if rank == 0:
            for i, s in enumerate(g.layout.slots):
                pending[s.name] = g.layout.param_view(full, i).to(dtype or g.layout.dtype).cpu().clone()
            flush(min(shard_of[s.name] for s in g.layout.slots))  # shards wholly before this group are done
        del full
    if rank == 0:
        flush(len(shards))
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(n for _, n in sizes)},
                     "weight_map": {name_map(n): files[k] for n, k in shard_of.items()}}
            (out_dir / INDEX).write_text(json.dumps(index, indent=1))
        config = _config_json(model, dtype or model.layouts[0].dtype)
        if config is not None:
            (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    model.mesh.barrier()
    return written


def export_pretrained(model: ODCShard, out_dir: str | Path, *, tokenizer_path: str | None = None,
                      dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30) -> Path:
    """A complete Hugging Face directory of ``model`` that ``from_pretrained`` loads (collective).

    ``export_hf``'s weights and ``config.json``, plus ``generation_config.json`` (for a
    ``transformers`` model that has one) and the tokenizer's files (from
    ``tokenizer_path``, a local Hugging Face tokenizer). Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    export_hf(model, out_dir, max_shard_bytes=max_shard_bytes, dtype=dtype)
    if model.rank == 0:
        hf = transformers_model(model)
        if hf is not None and getattr(hf, "generation_config", None) is not None:
            hf.generation_config.to_json_file(out_dir / "generation_config.json")
        if tokenizer_path is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True).save_pretrained(out_dir)
    model.mesh.barrier()
    return out_dir


def _weight_map(path: Path) -> dict[str, Path]:
    if (path / INDEX).is_file() and (path / SINGLE).is_file():
        raise CheckpointError(f"{path} holds both {SINGLE} and {INDEX}: which export is current is ambiguous")
    if (path / INDEX).is_file():
        index = json.loads((path / INDEX).read_text())
        return {name: path / file for name, file in index["weight_map"].items()}
    if (path / SINGLE).is_file():
        with safe_open(str(path / SINGLE), framework="pt") as f:
            return {name: path / SINGLE for name in f.keys()}
    raise CheckpointError(f"{path} holds neither {SINGLE} nor {INDEX}")


def load_hf(model: ODCShard, path: str | Path, *, name_map: Callable[[str], str] | None = None) -> None:
    """Set ``model``'s parameters from Hugging Face style files; each rank reads only its slices (collective).

    Persistent buffers the files hold are read too (whole, on every rank); computed ones
    are rebuilt when a meta-built model is wrapped (see [meta-buffers]).
    """
    name_map = name_map or default_name_map(model)
    path = Path(path)
    where = _weight_map(path)
    handles: dict[Path, object] = {}
    with model.protocol.rows_changing(), torch.no_grad():
        for g in model.groups:
            master = g.read_master()
            for s in g.layout.slots:
                key = name_map(s.name)
                if key not in where:
                    raise CheckpointError(f"{path}: no tensor {key!r} for parameter {s.name!r}")
                file = where[key]
                if file not in handles:
                    handles[file] = safe_open(str(file), framework="pt")
                sl = handles[file].get_slice(key)
                if tuple(sl.get_shape()) != s.shape:
                    raise CheckpointError(f"{file}: {key!r} has shape {tuple(sl.get_shape())}, the model's "
                                          f"{s.name!r} has {s.shape}")
                lo, hi = s.local_range(model.rank)
                dest = master[s.offset : s.offset + s.seg]
                dest.zero_()
                if hi > lo:  # this rank's shard is whole dim-0 rows: read just those
                    rows = sl[lo // s.row_numel : hi // s.row_numel]
                    dest[: hi - lo].copy_(rows.reshape(-1))
        for name, buf in model.persistent_buffers().items():  # replicated: every rank reads them whole
            key = name_map(name)
            if key in where:
                with safe_open(str(where[key]), framework="pt") as f:
                    buf.copy_(f.get_tensor(key))
