"""Checkpoints: sharded save / exact resume / resharding, and Hugging Face style export / import."""

from .hf import (
    export_hf, export_lora_adapter, export_pretrained, hf_llama_config, llama_to_hf_name, load_hf, peft_to_base_name,
)
from .manifest import CheckpointError, read_manifest
from .nonfinite import NonFiniteStateError
from .sharded import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint

__all__ = [
    "CheckpointError", "export_hf", "export_lora_adapter", "export_pretrained", "hf_llama_config", "latest_checkpoint",
    "list_checkpoints", "llama_to_hf_name", "load_checkpoint", "load_hf", "NonFiniteStateError", "peft_to_base_name",
    "read_manifest",
    "save_checkpoint",
]
