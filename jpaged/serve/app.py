"""The HTTP app: OpenAI-compatible routes over an `AsyncEngine` (or data-parallel replicas).

Handlers validate requests (`openai_api`), queue them, and stream or collect the outputs. A client
that disconnects has its requests aborted, which frees their KV blocks at once.

A dead engine (`AsyncEngine.dead_reason`) makes /health a 503 naming the reason and every new
request a 503; `cli.main` then exits so that a supervisor restarts the server.

/tokenize, /detokenize and /tokenizer_info (`tokenize_api`) answer from the tokenizer alone.

No request may hurt another: bodies are capped while they are read (413), and parsing,
tokenisation and chat-template rendering run on worker threads, so the event loop (and /health)
stays responsive whatever a client sends. Every error is OpenAI's JSON error body.
"""

import asyncio
import contextlib
import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jpaged.serve import openai_api as api
from jpaged.serve import chat, replies, tokenize_api, tool_parsers
from jpaged.serve.async_engine import AsyncEngine, EngineDeadError, EngineError, RequestGroup
from jpaged.serve.data_parallel import DataParallelEngine
from jpaged.serve.request_body import parse_body

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
logger = logging.getLogger(__name__)


def model_info(engine, model_dir, name: str,
               tool_call_parser: str | None = None) -> api.ModelInfo:
    """tool_call_parser: a `tool_parsers.PARSERS` name for tool_choice "auto" (None: the model
    family's, if it has one); an unknown name is a ValueError."""
    chat_template = chat.ChatTemplate.from_model_dir(model_dir)
    parser = tool_parsers.tool_call_parser(tool_call_parser, engine.model_config.model_type,
                                           chat_template.source)
    return api.ModelInfo(name=name, tokenizer=engine.tokenizer,
                         vocab_size=engine.model_config.vocab_size,
                         max_model_len=engine.config.max_model_len,
                         chat_template=chat_template,
                         max_token_chars=api.max_token_chars(engine.tokenizer),
                         tokenizer_info=tokenize_api.tokenizer_info(
                             model_dir, chat_template.source, engine.tokenizer,
                             engine.model_config.eos_token_ids),
                         constraints=engine.inputs.constraints,
                         tool_parser=parser,
                         tool_markers_are_special=tool_parsers.markers_are_special(
                             parser, engine.tokenizer))



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


_TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class _RequireAPIKey:
    """ASGI middleware: every /v1/ route and the tokenizer endpoints answer 401 unless
    `Authorization: Bearer <key>`; /health and /metrics stay open (as in vLLM)."""

    def __init__(self, app, api_key: str):
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope["path"] if scope["type"] == "http" else ""
        if path.startswith("/v1") or path in _TOKENIZER_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                error = api.APIError("Incorrect or missing API key: send 'Authorization: Bearer "
                                     "<key>'", status=401, code="invalid_api_key")
                response = JSONResponse(error.body(), status_code=401)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(async_engine: AsyncEngine | DataParallelEngine, model: api.ModelInfo, *,
              api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The ASGI app; its lifespan starts and stops the engine thread. With `api_key`, /v1/ routes
    and the tokenizer endpoints need it as a bearer token; bodies over `max_request_bytes` are
    answered 413."""
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

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_request, err: EngineDeadError):
        return JSONResponse(_unavailable(str(err)).body(), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, err: StarletteHTTPException):
        return JSONResponse(api.APIError(str(err.detail), status=err.status_code).body(),
                            status_code=err.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(_request, err: Exception):
        # A bug, never the client's doing: still OpenAI's body, and the traceback in the log.
        logger.error("unhandled error in a request", exc_info=err)
        error = api.APIError(f"internal error: {type(err).__name__}: {err}"[:500], status=500,
                             type="internal_server_error")
        return JSONResponse(error.body(), status_code=500)

    if api_key:
        app.add_middleware(_RequireAPIKey, api_key=api_key)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        reason = async_engine.dead_reason
        if reason is None:
            return Response(status_code=200)
        return JSONResponse(_unavailable(reason).body(), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(async_engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    model_card = {"id": model.name, "object": "model", "created": 0, "owned_by": "jpaged",
                  "max_model_len": model.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str):
        api.check_model({"model": model_id}, model.name)
        return model_card

    async def parse_request(request: Request, parse):
        """parse(body, model) on a worker thread (a ParsedRequest, or a tokenizer endpoint's
        reply): tokenising a long prompt or rendering a template must not hold up the event
        loop, which answers every other client."""
        raw = await _read_body(request, max_request_bytes)
        return await asyncio.to_thread(lambda: parse(parse_body(raw), model))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return JSONResponse(await parse_request(request, tokenize_api.tokenize))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return JSONResponse(await parse_request(request, tokenize_api.detokenize))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return JSONResponse(model.tokenizer_info)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, await parse_request(request, api.parse_completion))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, await parse_request(request, api.parse_chat))

    async def _generate(request: Request, parsed: api.ParsedRequest):
        builder = replies.ReplyBuilder(parsed, model)
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


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as its Content-Length or the bytes read so far pass
    `limit`: a huge body is never held in memory."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise api.APIError("the Content-Length header is not a number")
    if declared is not None and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _unavailable(message: str) -> api.APIError:
    return api.APIError(message, status=503, type="service_unavailable", code="engine_dead")


def _too_large(limit: int) -> api.APIError:
    return api.APIError(f"the request body is larger than this server's limit of {limit} bytes "
                        "(--max-request-bytes)", status=413, code="request_too_large")


async def _stream(group: RequestGroup, builder: replies.ReplyBuilder, parsed: api.ParsedRequest):
    for chunk in builder.first_chunks():
        yield replies.sse(chunk)
    try:
        async for prompt_index, output in group.events():
            for chunk in builder.chunks(prompt_index, output):
                yield replies.sse(chunk)
    except EngineError as err:
        yield replies.sse(api.APIError(str(err), status=500, type="internal_server_error").body())
    else:
        if parsed.include_usage:
            yield replies.sse(builder.usage_chunk(group.num_prompt_tokens,
                                              group.num_output_tokens))
    yield replies.sse("[DONE]")


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
