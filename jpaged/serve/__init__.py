"""The serving layer: an OpenAI-compatible HTTP server over the engine's public API.

`python -m jpaged.serve` runs it (`cli.main`). Modules: `cli` (flags, start-up), `app` (routes),
`openai_api` (requests), `fields` (typed body fields), `chat` (chat prompts), `tools_api`
(function calling), `tool_parsers` (tool calls in free text), `structured_api` (output
constraints), `replies` (replies and stream chunks), `tokenize_api` (the tokenizer endpoints),
`errors`, `async_engine` (the engine on its own thread), `data_parallel` (replicas behind one
interface).
"""

from jpaged.serve.app import build_app, model_info
from jpaged.serve.cli import (DEFAULT_MODEL_NAME, banner, build_engine, build_parser,
                              engine_options, main, parse_args)

__all__ = ["DEFAULT_MODEL_NAME", "banner", "build_app", "build_engine", "build_parser",
           "engine_options", "main", "model_info", "parse_args"]
