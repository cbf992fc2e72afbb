"""Checkpoints: sharded save / exact resume / resharding, and Hugging Face style export / import."""

from .hf import export_hf, export_pretrained, hf_llama_config, llama_to_hf_name, load_hf
from .manifest import CheckpointError, read_manifest
from .sharded import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError", "export_hf", "export_pretrained", "hf_llama_config", "latest_checkpoint", "list_checkpoints",
    "llama_to_hf_name", "load_checkpoint", "load_hf", "read_manifest", "save_checkpoint",
]
