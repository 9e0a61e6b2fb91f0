"""`python -m jpaged.serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over LLMEngine.

The engine runs on its own thread (`async_engine.AsyncEngine`); handlers validate requests
(`openai_api`), queue them, and stream or collect the outputs. A client that disconnects has its
requests aborted, which frees their KV blocks at once.
"""

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jpaged import openai_api as api
from jpaged.async_engine import AsyncEngine, EngineError, RequestGroup
from jpaged.data_parallel import DataParallelEngine
from jpaged.engine import LLMEngine
from jpaged.engine_config import ATTENTION_BACKENDS, PREEMPTION_MODES, default_model_dir
from jpaged.models.loader import LOAD_FORMATS

DEFAULT_MODEL_NAME = "jpaged-default"


# ---- flags -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
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
    add("--host", default="127.0.0.1", help="address to bind")
    add("--port", type=int, default=8000, help="port to bind")
    add("--block-size", type=int, default=16, help="tokens per KV-cache block")
    add("--num-kv-blocks", type=int, default=None,
        help="KV blocks in the pool (overrides --gpu-memory-utilization sizing)")
    add("--gpu-memory-utilization", type=float, default=0.9,
        help="fraction of accelerator memory for weights + KV cache + activations")
    add("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    add("--max-model-len", type=int, default=None,
        help="longest prompt + output (default: the model's limit)")
    add("--max-num-batched-tokens", type=int, default=None,
        help="most tokens in one step (default: max(2048, block size))")
    add("--preemption-mode", default="auto", choices=PREEMPTION_MODES,
        help="when KV blocks run out, a victim's blocks are swapped to host memory (swap), "
             "dropped and prefilled again later (recompute), or whichever the start-up measured "
             "transfer and prefill rates say is cheaper for that victim (auto)")
    add("--swap-space", type=float, default=4.0,
        help="GiB of host memory for swapped-out KV blocks (0: never swap)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV blocks of prompt prefixes already computed (automatic prefix "
             "caching)")
    add("--load-format", default="auto", choices=LOAD_FORMATS,
        help="auto: the weights in --model; dummy: random weights of the config's shapes "
             "(the directory needs only config.json, plus tokenizer.json for text), for "
             "benchmarks")
    add("--dtype", default="auto", help="weight dtype: auto (the config's), float32, bfloat16, "
                                        "float16")
    add("--kv-cache-dtype", default="auto", help="KV-cache dtype (auto: the weight dtype)")
    add("--seed", type=int, default=0, help="seed for requests that give none")
    add("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
        help="auto: Pallas on GPU/TPU, the jnp reference on CPU")
    add("--num-scheduler-steps", type=int, default=1,
        help="decode steps run on the device per scheduler step (multi-step decoding)")
    add("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
        help="start the next decode loop while the host processes the last one's tokens")
    add("--async-depth", type=int, default=2,
        help="with --async-scheduling, decode loops kept in flight behind the host")
    add("--tensor-parallel-size", type=int, default=1,
        help="devices each engine splits the model and KV cache over (Megatron-style heads and "
             "MLP columns; see docs/parallelism.md)")
    add("--data-parallel-size", type=int, default=1,
        help="independent engine replicas on disjoint groups of --tensor-parallel-size devices; "
             "each request goes to the replica with the most free KV blocks")
    add("--compilation-cache-dir", default=None,
        help="persist compiled steps here so a restart skips compiling (process-wide JAX cache)")
    add("--uvicorn-log-level", default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse flags; a value the engine cannot use exits with an error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.swap_space < float("inf"):
        parser.error(f"argument --swap-space: must be a non-negative number of GiB, got "
                     f"{args.swap_space}")
    if args.preemption_mode == "swap" and args.swap_space == 0:
        parser.error("argument --preemption-mode: 'swap' needs --swap-space > 0")
    for flag in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1")
    return args


def engine_options(args: argparse.Namespace) -> dict:
    """The LLMEngine.from_pretrained options the flags set."""
    return dict(dtype=args.dtype, load_format=args.load_format, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                num_scheduler_steps=args.num_scheduler_steps,
                async_scheduling=args.async_scheduling, async_depth=args.async_depth,
                compilation_cache_dir=args.compilation_cache_dir,
                preemption_mode=args.preemption_mode, swap_space=args.swap_space,
                enable_prefix_caching=args.enable_prefix_caching,
                tensor_parallel_size=args.tensor_parallel_size)


def build_engine(args: argparse.Namespace, name: str) -> AsyncEngine | DataParallelEngine:
    """One engine, or --data-parallel-size replicas behind one interface."""
    if args.data_parallel_size == 1:
        return AsyncEngine(LLMEngine.from_pretrained(args.model, **engine_options(args)), name)
    return DataParallelEngine.from_pretrained(args.model, name,
                                              data_parallel_size=args.data_parallel_size,
                                              **engine_options(args))


def model_info(engine: LLMEngine, model_dir, name: str) -> api.ModelInfo:
    return api.ModelInfo(name=name, tokenizer=engine.tokenizer,
                         vocab_size=engine.model_config.vocab_size,
                         max_model_len=engine.config.max_model_len,
                         chat_template=api.ChatTemplate.from_model_dir(model_dir))


# ---- the app -----------------------------------------------------------------------------------
class _AbortingStreamingResponse(StreamingResponse):
    """Runs `on_close` however the stream ends: finished, client gone, or cancelled."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def build_app(async_engine: AsyncEngine | DataParallelEngine, model: api.ModelInfo) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the engine thread."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(title="jpaged", lifespan=lifespan)

    @app.exception_handler(api.APIError)
    async def api_error(_request, err: api.APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(EngineError)
    async def engine_error(_request, err: EngineError):
        return JSONResponse(api.APIError(str(err), status=500, type="internal_server_error")
                            .body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, err: StarletteHTTPException):
        return JSONResponse(api.APIError(str(err.detail), status=err.status_code).body(),
                            status_code=err.status_code)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if async_engine.is_alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                            "owned_by": "jpaged",
                                            "max_model_len": model.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, api.parse_completion(await _json_body(request), model))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, api.parse_chat(await _json_body(request), model))

    async def _generate(request: Request, parsed: api.ParsedRequest):
        builder = api.ReplyBuilder(parsed, model)
        request_ids = [f"{builder.id}-{i}" for i in range(len(parsed.prompts))]
        group = RequestGroup(async_engine, request_ids, parsed.params, parsed.prompts)
        try:
            await group.accepted()
        except ValueError as err:
            raise api.APIError(str(err)) from err
        except BaseException:
            group.abort_unfinished()
            raise
        if parsed.stream:
            return _AbortingStreamingResponse(_stream(group, builder, parsed),
                                              on_close=group.abort_unfinished,
                                              media_type="text/event-stream")
        try:
            outputs = await _unless_disconnected(request, group.final_outputs())
        finally:
            group.abort_unfinished()
        if outputs is None:
            return Response(status_code=499)  # the client is gone: nobody reads this
        return JSONResponse(builder.full(outputs))

    return app


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise api.APIError(f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise api.APIError("the request body must be a JSON object")
    return body


async def _stream(group: RequestGroup, builder: api.ReplyBuilder, parsed: api.ParsedRequest):
    for chunk in builder.first_chunks():
        yield api.sse(chunk)
    try:
        async for prompt_index, output in group.events():
            for chunk in builder.chunks(prompt_index, output):
                yield api.sse(chunk)
    except EngineError as err:
        yield api.sse(api.APIError(str(err), status=500, type="internal_server_error").body())
    else:
        if parsed.include_usage:
            yield api.sse(builder.usage_chunk(group.outputs))
    yield api.sse("[DONE]")


async def _unless_disconnected(request: Request, work):
    """The result of `work`, or None if the client disconnects first (work is then cancelled)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    tasks = [asyncio.ensure_future(work), asyncio.ensure_future(disconnected())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    return tasks[0].result() if tasks[0].done() and not tasks[0].cancelled() else None


# ---- entry point --------------------------------------------------------------------------------
def banner(host: str, port: int, model_name: str) -> str:
    url = f"http://{host}:{port}"
    body = json.dumps({"model": model_name, "prompt": "import os\n\n\ndef ", "max_tokens": 64,
                       "temperature": 0.7})
    return (f"jpaged: serving {model_name} at {url}  (OpenAI API under {url}/v1)\n"
            f"  try:  curl {url}/v1/completions -H 'Content-Type: application/json' "
            f"-d '{body}'\n"
            f"  also: {url}/v1/chat/completions, {url}/v1/models, {url}/health, {url}/metrics")


def main(argv=None) -> int:
    import uvicorn

    args = parse_args(argv)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    print(banner(args.host, args.port, name), flush=True)
    model_dir = default_model_dir() if args.model is None else Path(args.model)
    async_engine = build_engine(args, name)
    app = build_app(async_engine, model_info(async_engine.engine, model_dir, name))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
