"""Hugging Face style weights: consolidated export and sharded import.

``export_hf`` writes ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors``
plus ``model.safetensors.index.json`` past ``max_shard_bytes``) with the original
parameter names (mapped to Hugging Face names for our Llama) and dtypes, and a
``config.json`` when the model has one. Parameters are gathered group by group, so
rank 0 holds at most one output shard and one group at a time.

``export_pretrained`` adds what ``from_pretrained`` needs besides (generation config,
tokenizer files). ``load_hf`` fills an ``ODCShard`` or a ``fully_shard`` model (built on the meta device if the
model is large) from such files: each rank reads only the slices of each tensor that its rows need.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from ..models.llama import Llama, LlamaConfig
from ..sharding.api.sharded_model import ShardedModel, sharded
from .files import naming
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


def peft_to_base_name(name: str) -> str | None:
    """A PEFT model's parameter name as the base model's file name; None for an adapter (in no base file)."""
    if not name.startswith("base_model.model."):
        return name
    if ".lora_" in name:
        return None
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def default_name_map(model: nn.Module) -> Callable[[str], str | None]:
    """How parameter names become file names: HF names for our Llama and for wrapped HF and PEFT models.

    None means the parameter has no place in the base model's files (LoRA adapters).
    """
    model = sharded(model)  # an ODCShard or a fully_shard model ([sharded-model])
    from ..models.hf import HFCausalLM

    if isinstance(model.module, Llama):
        return llama_to_hf_name
    if isinstance(model.module, HFCausalLM):
        return lambda name: peft_to_base_name(name.removeprefix("model."))
    return peft_to_base_name


def transformers_model(model: nn.Module):
    """The ``transformers`` model inside ``model`` (an ``HFCausalLM``'s, or the wrapped module itself), or None."""
    model = sharded(model)  # an ODCShard or a fully_shard model ([sharded-model])
    from ..models.hf import HFCausalLM

    inner = model.module.model if isinstance(model.module, HFCausalLM) else model.module
    if callable(getattr(inner, "get_base_model", None)):  # PEFT: the base model's config and generation config
        inner = inner.get_base_model()
    config = getattr(inner, "config", None)
    return inner if callable(getattr(config, "to_dict", None)) else None


def _config_json(model: ShardedModel, dtype: torch.dtype) -> dict | None:
    name = str(dtype).removeprefix("torch.")
    if isinstance(model.module, Llama):
        return {**hf_llama_config(model.module.config), "torch_dtype": name}
    hf = transformers_model(model)
    if hf is None:
        return None
    config = hf.config.to_dict()
    config["dtype" if "dtype" in config else "torch_dtype"] = name
    return config


def _lora_layers(model: ShardedModel) -> list[tuple[str, nn.Module]]:
    """(name prefix, module) of every PEFT LoRA layer of ``model`` (names as ``model``'s parameters have them)."""
    return [(name, mod) for name, mod in model.module.named_modules()
            if hasattr(mod, "lora_A") and hasattr(mod, "base_layer") and hasattr(mod, "scaling")]


def _adapters_full(model: ShardedModel) -> dict[str, torch.Tensor]:
    """Full values of the trained parameters (the adapters, for a LoRA model): small; collective."""
    return model.shard_state.full_state_dict(trained_only=True)


def _adapter_merges(model: ShardedModel) -> dict[str, torch.Tensor]:
    """{base weight name: scale * B @ A} of every LoRA layer (collective: gathers the adapters)."""
    layers = _lora_layers(model)
    if not layers:
        return {}
    full = _adapters_full(model)
    out = {}
    for name, mod in layers:
        for adapter, scale in mod.scaling.items():
            a, b = full[f"{name}.lora_A.{adapter}.weight"], full[f"{name}.lora_B.{adapter}.weight"]
            delta = scale * (b @ a)
            key = f"{name}.base_layer.weight"
            out[key] = out[key] + delta if key in out else delta
    return out


def export_lora_adapter(model: nn.Module, out_dir: str | Path) -> Path:
    """Write the LoRA adapters alone as PEFT does (``adapter_model.safetensors`` + ``adapter_config.json``).

    ``PeftModel.from_pretrained(base_model, out_dir)`` loads them. Collective; rank 0 writes.
    """
    model = sharded(model)  # an ODCShard or a fully_shard model ([sharded-model])
    from peft import get_peft_model_state_dict

    from ..models.hf import HFCausalLM

    peft_model = model.module.model if isinstance(model.module, HFCausalLM) else model.module
    prefix = "model." if isinstance(model.module, HFCausalLM) else ""
    full = _adapters_full(model)
    out_dir = Path(out_dir)
    if _writes(model):
        out_dir.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(peft_model, state_dict={k.removeprefix(prefix): v for k, v in full.items()})
        with naming(out_dir / "adapter_model.safetensors"):  # a failed write names its file
            save_file({k: v.contiguous() for k, v in state.items()}, out_dir / "adapter_model.safetensors",
                      metadata={"format": "pt"})
        peft_model.peft_config["default"].save_pretrained(out_dir)
    model.mesh.everyone.barrier()
    return out_dir


def _writes(model: ShardedModel) -> bool:
    """Whether this rank writes whole-model files: rank 0 of all ranks (with HSDP, of replica 0's shard group)."""
    return model.mesh.everyone.rank == 0


def export_hf(model: nn.Module, out_dir: str | Path, *, max_shard_bytes: int = 5 << 30,
              dtype: torch.dtype | None = None, name_map: Callable[[str], str | None] | None = None,
              merge_adapters: bool = True) -> list[Path]:
    """Write consolidated weights of ``model`` under ``out_dir`` (rank 0 writes; collective).

    ``dtype`` casts every tensor (default: each parameter's original dtype). Tied
    parameters are written once, under their first name; parameters that ``name_map``
    maps to None are left out. For a model with LoRA adapters (PEFT) the base weights
    are written with the adapters folded in (``W + scale * B @ A``), a plain model, unless
    ``merge_adapters=False`` (the base weights as they are; see ``export_lora_adapter``).
    Returns the files written.
    """
    model = sharded(model)  # an ODCShard or a fully_shard model ([sharded-model])
    name_map = name_map or default_name_map(model)
    out_dir = Path(out_dir)
    writer = _writes(model)
    merge = _adapter_merges(model) if merge_adapters else {}
    sizes = [(s.name, s.numel * torch.empty((), dtype=dtype or lay.dtype).element_size())
             for lay in model.layouts for s in lay.slots if name_map(s.name) is not None]
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
    if writer:
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
            with naming(out_dir / files[next_shard]):  # a failed write names its file
                save_file({name_map(n): pending.pop(n) for n in names}, out_dir / files[next_shard],
                          metadata={"format": "pt"})
            written.append(out_dir / files[next_shard])
            next_shard += 1

    for g, values in model.shard_state.full_values():  # collective, every rank: one group at a time
        if writer:
            kept = [name for name in values if name in shard_of]
            for name in kept:
                value = values[name]
                if name in merge:
                    value = value + merge[name]
                pending[name] = value.to(dtype or g.layout.dtype).cpu().clone()
            if kept:
                flush(min(shard_of[name] for name in kept))  # shards wholly before this group are done
        del values
    if writer:
        flush(len(shards))
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(n for _, n in sizes)},
                     "weight_map": {name_map(n): files[k] for n, k in shard_of.items()}}
            (out_dir / INDEX).write_text(json.dumps(index, indent=1))
        config = _config_json(model, dtype or model.layouts[0].dtype)
        if config is not None:
            (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    model.mesh.everyone.barrier()
    return written


def export_pretrained(model: nn.Module, out_dir: str | Path, *, tokenizer_path: str | None = None,
                      dtype: torch.dtype | None = None, max_shard_bytes: int = 5 << 30,
                      lora: str = "merged") -> Path:
    """A complete Hugging Face directory of ``model`` that ``from_pretrained`` loads (collective).

    ``export_hf``'s weights and ``config.json``, plus ``generation_config.json`` (for a
    ``transformers`` model that has one) and the tokenizer's files (from
    ``tokenizer_path``, a local Hugging Face tokenizer). A model with LoRA adapters is
    written merged (``lora="merged"``: a plain model) or as the adapters alone
    (``lora="adapter"``: PEFT's files, for ``PeftModel.from_pretrained`` on the base
    model). Returns ``out_dir``.
    """
    model = sharded(model)  # an ODCShard or a fully_shard model ([sharded-model])
    out_dir = Path(out_dir)
    if lora == "adapter" and _lora_layers(model):
        export_lora_adapter(model, out_dir)
    else:
        export_hf(model, out_dir, max_shard_bytes=max_shard_bytes, dtype=dtype)
    if _writes(model):
        hf = transformers_model(model)
        if hf is not None and getattr(hf, "generation_config", None) is not None:
            hf.generation_config.to_json_file(out_dir / "generation_config.json")
        if tokenizer_path is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True).save_pretrained(out_dir)
    model.mesh.everyone.barrier()
    return out_dir


def check_weight_file(file: Path) -> None:
    """``file`` is a whole safetensors file: its header parses and its tensors end where the file does (a copy cut
    short, or a download that stopped, is named here rather than failing deep in a rank). Reads the header only."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"its header claims {n} bytes of a {size}-byte file")
            header = json.loads(f.read(n))
        ends = [info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"]
        if 8 + n + max(ends, default=0) != size:
            raise ValueError(f"its tensors need {8 + n + max(ends, default=0)} bytes and the file has {size}")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{file} is not a whole safetensors file ({e}): copy or download it again") from None


def check_weight_files(path: str | Path) -> None:
    """Every safetensors file of the Hugging Face model directory ``path`` is whole (``check_weight_file``)."""
    for file in sorted(set(_weight_map(Path(path)).values())):  # a single file is checked before it is opened
        if not file.is_file():
            raise CheckpointError(f"{file} is named by {Path(path) / INDEX} but does not exist")
        check_weight_file(file)


def _weight_map(path: Path) -> dict[str, Path]:
    if (path / INDEX).is_file() and (path / SINGLE).is_file():
        raise CheckpointError(f"{path} holds both {SINGLE} and {INDEX}: which export is current is ambiguous")
    if (path / INDEX).is_file():
        index = json.loads((path / INDEX).read_text())
        return {name: path / file for name, file in index["weight_map"].items()}
    if (path / SINGLE).is_file():
        check_weight_file(path / SINGLE)
        with safe_open(str(path / SINGLE), framework="pt") as f:
            return {name: path / SINGLE for name in f.keys()}
    raise CheckpointError(f"{path} holds neither {SINGLE} nor {INDEX}")


def load_hf(model: nn.Module, path: str | Path, *, name_map: Callable[[str], str] | None = None) -> None:
    """Set ``model``'s parameters from Hugging Face style files; each rank reads only its slices (collective).

    Persistent buffers the files hold are read too (whole, on every rank); computed ones
    are rebuilt when a meta-built model is wrapped (see [meta-buffers]).
    """
    model = sharded(model)  # an ODCShard or a fully_shard model ([sharded-model])
    name_map = name_map or default_name_map(model)
    path = Path(path)
    check_weight_files(path)
    where = _weight_map(path)
    # One file open at a time: a file's pages this rank touched stay mapped (and resident) while it is open,
    # and parameters mostly come in file order.
    handles: dict[Path, object] = {}

    def open_slice(key: str):
        file = where[key]
        if file not in handles:
            handles.clear()
            handles[file] = safe_open(str(file), framework="pt")
        return file, handles[file].get_slice(key)

    state = model.shard_state
    for sp in state.params:  # every name and shape checked before any value changes
        key = name_map(sp.name)
        if key is None:
            continue
        if key not in where:
            raise CheckpointError(f"{path}: no tensor {key!r} for parameter {sp.name!r}")
        file, sl = open_slice(key)
        if tuple(sl.get_shape()) != sp.shape:
            raise CheckpointError(f"{file}: {key!r} has shape {tuple(sl.get_shape())}, the model's "
                                  f"{sp.name!r} has {sp.shape}")
    with state.changing(), torch.no_grad():
        # Parameters that are no base weight (LoRA adapters: name_map gives None) are left as they are.
        for sp, lo, hi, dest in state.write_targets(lambda name: name_map(name) is not None):
            s = sp.slot
            _, sl = open_slice(name_map(s.name))
            if hi > lo:  # this rank's shard is whole dim-0 rows: read just those
                rows = sl[lo // s.row_numel : hi // s.row_numel]
                dest.copy_(rows.reshape(-1))
        for name, buf in model.persistent_buffers().items():  # replicated: every rank reads them whole
            key = name_map(name)
            if key is not None and key in where:
                with safe_open(str(where[key]), framework="pt") as f:
                    buf.copy_(f.get_tensor(key))
