"""The engine layer: each step schedules (`scheduler`), applies block operations and runs the
model (`executor`, `device_step`, `pipeline` for decode loops in flight), and processes outputs
(`output`); `llm_engine.LLMEngine` owns them all."""

from jpaged.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
