"""jpaged: a PagedAttention serving engine for JAX."""

from jpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jpaged.engine import LLMEngine
from jpaged.llm import LLM
from jpaged.request import CompletionOutput, Logprob, RequestOutput
from jpaged.sampling_params import RequestOutputKind, SamplingParams
from jpaged.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "RequestOutputKind", "Logprob",
           "CompletionOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "StructuredOutputsParams"]
__version__ = "0.1.0"
