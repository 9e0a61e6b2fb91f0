"""jpaged: a PagedAttention serving engine for JAX."""

from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from jpaged.request import CompletionOutput, RequestOutput
from jpaged.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
