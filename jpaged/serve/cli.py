"""`python -m jpaged.serve`: flags (vLLM's names), engine construction and the uvicorn loop.

The engine runs on its own thread (`async_engine.AsyncEngine`); `app.build_app` holds the routes.
A dead engine ends the process with status 1 (`ExitOnDeadEngine`), as vLLM's server does, so its
supervisor starts a fresh one: a new engine in the same process would share the device and
runtime with the one that failed, and a server that answers but cannot serve is worse than none.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from jpaged.engine import LLMEngine
from jpaged.engine.builder import default_model_dir
from jpaged.options import BY_NAME, OPTIONS, Option, OptionError, check_options
from jpaged.serve.app import DEFAULT_MAX_REQUEST_BYTES, build_app, model_info
from jpaged.serve.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine
from jpaged.serve.data_parallel import DataParallelEngine
from jpaged.serve.tool_parsers import PARSERS

DEFAULT_MODEL_NAME = "jpaged-default"
DEFAULT_DEAD_ENGINE_EXIT_DELAY = 2.0   # seconds
EXIT_DEAD_ENGINE = 1


# ---- flags -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The server's own flags, then one flag per engine option of `jpaged.options.OPTIONS`."""
    parser = argparse.ArgumentParser(
        prog="python -m jpaged.serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                    "/health, /metrics) over the jpaged engine. Flags use vLLM's names.")
    add = parser.add_argument
    add("--model", default=None,
        help="model directory: config.json, tokenizer.json and safetensors or an orbax "
             "checkpoint/ folder. Omitted: the built-in default model, a tiny byte-level Llama "
             "trained on the Python standard library (docs/default_model.md)")
    add("--served-model-name", default=None,
        help=f"name clients send as 'model' (default: the --model path, or {DEFAULT_MODEL_NAME})")
    add("--tool-call-parser", default=None, choices=[*PARSERS, "none"],
        help="how tool_choice 'auto' finds a chat reply's tool calls in its text: hermes "
             "(Qwen2, Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1+), mistral. Omitted: the "
             "model family's (Qwen -> hermes, Llama with a Llama 3 chat template -> "
             "llama3_json, Mistral and Mixtral -> mistral); a family with none, or 'none', "
             "answers 'auto' with a 400")
    add("--host", default="127.0.0.1", help="address to bind")
    add("--port", type=int, default=8000, help="port to bind")
    add("--uvicorn-log-level", default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add("--api-key", default=None,
        help="if set, every /v1/ route needs 'Authorization: Bearer <key>' (else 401); /health "
             "and /metrics stay open. Default: the JPAGED_API_KEY environment variable, if set")
    add("--max-request-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted; a larger one is answered 413 before it is read")
    add("--dead-engine-exit-delay", type=_non_negative_float,
        default=DEFAULT_DEAD_ENGINE_EXIT_DELAY, metavar="SECONDS",
        help=f"once the engine is dead ({MAX_CONSECUTIVE_STEP_FAILURES} steps failed in a row, "
             "or its loop stopped on an error), the server answers /health and every new "
             "request 503 with the reason for this long, then exits with status "
             f"{EXIT_DEAD_ENGINE} so that a supervisor restarts it")
    engine = parser.add_argument_group("engine options (jpaged.options; LLM(...) takes the same)")
    for option in OPTIONS:
        if option.is_flag:
            add_option_flag(engine, option)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:   # NaN too
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def add_option_flag(group, option: Option):
    """--block-size etc.; a bool option gets --name and --no-name."""
    kwargs = dict(dest=option.name, default=option.default,
                  help=option.help.replace("%", "%%"))   # argparse formats help with %
    if option.type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=option.type, choices=option.choices)
    group.add_argument(option.flag, **kwargs)
    if option.off_flag:
        group.add_argument(option.off_flag, dest=option.name, action="store_const", const=False,
                           help=f"set {option.name} to False")


def parse_args(argv=None) -> argparse.Namespace:
    """Parse flags; a value the engine cannot use exits with an error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_options({o.name: getattr(args, o.name) for o in OPTIONS if o.is_flag},
                      for_server=True)
    except OptionError as err:
        parser.error(f"argument {BY_NAME[err.option].flag}: {err}")
    if args.api_key is None:   # the flag wins over the environment
        args.api_key = os.environ.get("JPAGED_API_KEY") or None
    return args


def engine_options(args: argparse.Namespace) -> dict:
    """The LLMEngine.from_pretrained options the flags set."""
    return {o.name: getattr(args, o.name) for o in OPTIONS if o.is_flag and o.is_keyword}


def build_engine(args: argparse.Namespace, name: str) -> AsyncEngine | DataParallelEngine:
    """One engine, or --data-parallel-size replicas behind one interface."""
    if args.data_parallel_size == 1:
        engine = LLMEngine.from_pretrained(args.model, **engine_options(args))
        if not engine.config.warmup:   # a first request must not wait for its compiles
            engine.compile_programs(first_only=True)
        return AsyncEngine(engine, name)
    return DataParallelEngine.from_pretrained(args.model, name,
                                              data_parallel_size=args.data_parallel_size,
                                              **engine_options(args))


# ---- entry point --------------------------------------------------------------------------------
class ExitOnDeadEngine:
    """Asked on every tick of the uvicorn loop whether to stop: once `delay` seconds passed since
    it first saw the engine dead (meanwhile /health and new requests get 503 with the reason, so
    probes and clients learn why). `reason` is set from then on."""

    def __init__(self, async_engine, delay: float):
        self._async_engine, self._delay = async_engine, delay
        self.reason: str | None = None
        self._since = 0.0

    def is_due(self) -> bool:
        if self.reason is None:
            self.reason = self._async_engine.dead_reason
            if self.reason is None:
                return False
            self._since = time.monotonic()
            print(f"jpaged: the engine is dead ({self.reason}); exiting with status "
                  f"{EXIT_DEAD_ENGINE} in {self._delay:g} s so that a supervisor restarts the "
                  "server", file=sys.stderr, flush=True)
        return time.monotonic() - self._since >= self._delay


def banner(host: str, port: int, model_name: str) -> str:
    url = f"http://{host}:{port}"
    body = json.dumps({"model": model_name, "prompt": "import os\n\n\ndef ", "max_tokens": 64,
                       "temperature": 0.7})
    return (f"jpaged: serving {model_name} at {url}  (OpenAI API under {url}/v1)\n"
            f"  try:  curl {url}/v1/completions -H 'Content-Type: application/json' "
            f"-d '{body}'\n"
            f"  also: {url}/v1/chat/completions, {url}/v1/models, {url}/health, {url}/metrics")


def configuration(args: argparse.Namespace, name: str, engine, tool_parser=None) -> str:
    """One line with what is being served and how, printed at start."""
    config = engine.config
    parser = tool_parser.name if tool_parser is not None else "none"
    return (f"jpaged: model {name} ({args.model or 'built-in default'}), dtype {args.dtype}, "
            f"kv dtype {config.kv_dtype}, {config.num_kv_blocks} KV blocks of "
            f"{config.block_size} tokens, max_model_len {config.max_model_len}, attention "
            f"backend {engine.executor.attention_backend}, data parallel "
            f"{args.data_parallel_size}, API key {'required' if args.api_key else 'off'}, "
            f"max request {args.max_request_bytes} bytes, tool-call parser {parser}")


def main(argv=None) -> int:
    import uvicorn

    class Server(uvicorn.Server):
        """Prints the banner once the socket accepts connections, not before; stops when the
        engine has been dead for --dead-engine-exit-delay seconds."""

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                print(banner(args.host, args.port, name), flush=True)

        async def on_tick(self, counter: int) -> bool:   # every 0.1 s
            return await super().on_tick(counter) or exit_on_dead_engine.is_due()

    args = parse_args(argv)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    model_dir = default_model_dir() if args.model is None else Path(args.model)
    async_engine = build_engine(args, name)
    model = model_info(async_engine.engine, model_dir, name, args.tool_call_parser)
    print(configuration(args, name, async_engine.engine, model.tool_parser), flush=True)
    app = build_app(async_engine, model, api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes)
    exit_on_dead_engine = ExitOnDeadEngine(async_engine, args.dead_engine_exit_delay)
    Server(uvicorn.Config(app, host=args.host, port=args.port,
                          log_level=args.uvicorn_log_level)).run()
    return 0 if exit_on_dead_engine.reason is None else EXIT_DEAD_ENGINE

