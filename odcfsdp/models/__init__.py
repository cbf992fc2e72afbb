"""Models shipped with odcfsdp (for tests, examples and benchmarks)."""

from .llama import LLAMA_SIZES, Llama, LlamaConfig, document_mask, llama_config
from .loss import LinearCrossEntropyHead, causal_lm_loss, linear_cross_entropy

__all__ = ["LLAMA_SIZES", "Llama", "LlamaConfig", "LinearCrossEntropyHead", "causal_lm_loss", "document_mask",
           "linear_cross_entropy", "llama_config"]
