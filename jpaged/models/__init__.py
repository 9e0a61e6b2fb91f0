"""Llama-family models over the paged KV cache, and their Hugging Face loader."""

from jpaged.models.attention import AttentionMetadata, paged_attention
from jpaged.models.forward import sequence_logits, sequence_logprobs
from jpaged.models.llama import LlamaForCausalLM, with_matmul_precision
from jpaged.models.loader import checkpoint_tensors, load_model, load_tokenizer, random_model

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "checkpoint_tensors", "load_model",
           "load_tokenizer", "paged_attention", "random_model", "sequence_logits",
           "sequence_logprobs", "with_matmul_precision"]
