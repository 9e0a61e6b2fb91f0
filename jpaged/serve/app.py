"""The HTTP app: OpenAI-compatible routes over an `AsyncEngine` (or data-parallel replicas).

Handlers validate requests (`openai_api`), queue them, and stream or collect the outputs. A client
that disconnects has its requests aborted, which frees their KV blocks at once.
"""

import asyncio
import contextlib
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jpaged.serve import openai_api as api
from jpaged.serve.async_engine import AsyncEngine, EngineError, RequestGroup
from jpaged.serve.data_parallel import DataParallelEngine


def model_info(engine, model_dir, name: str) -> api.ModelInfo:
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
            yield api.sse(builder.usage_chunk(group.num_prompt_tokens,
                                              group.num_output_tokens))
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
