"""Models shipped with odcfsdp (for tests, examples and benchmarks)."""

from .llama import LLAMA_SIZES, Llama, LlamaConfig, causal_lm_loss, document_mask, llama_config

__all__ = ["LLAMA_SIZES", "Llama", "LlamaConfig", "causal_lm_loss", "document_mask", "llama_config"]
