"""Models shipped with odcfsdp (for tests, examples and benchmarks)."""

from .llama import Llama, LlamaConfig, causal_lm_loss, document_mask

__all__ = ["Llama", "LlamaConfig", "causal_lm_loss", "document_mask"]
