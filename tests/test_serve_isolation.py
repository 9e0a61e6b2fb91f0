"""The server side of "one request can never hurt another": a request the engine fails alone is an
error for that request only, and requests past the sampling caps are 400s naming the field."""

import pytest
from fastapi.testclient import TestClient

from jpaged import LLM, serve
from jpaged.engine.builder import default_model_dir
from jpaged.serve.async_engine import AsyncEngine
from tests.test_serve import ENGINE_FLAGS, GOOD, _metrics, _wait_idle


@pytest.fixture(scope="module")
def client():
    engine = LLM(None, **ENGINE_FLAGS).engine
    async_engine = AsyncEngine(engine, "tiny")
    app = serve.build_app(async_engine, serve.model_info(engine, default_model_dir(), "tiny"))
    with TestClient(app) as test_client:
        test_client.engine = engine
        yield test_client


def test_a_request_the_engine_fails_alone_is_an_error_for_it_alone(client):
    """An exception in one request's output processing fails that request (500) while the
    engine carries on: its blocks come back and the next request works."""
    output = client.engine.output
    append = output._append_samples

    def fail_once(*args):
        del output.__dict__["_append_samples"]
        raise RuntimeError("injected output failure")

    output._append_samples = fail_once
    try:
        reply = client.post("/v1/completions", json=GOOD)
    finally:
        output.__dict__.pop("_append_samples", None)
    assert reply.status_code == 500
    assert "injected output failure" in reply.json()["error"]["message"]
    assert output._append_samples == append
    assert _wait_idle(lambda: client.get("/metrics").text)["jpaged:num_kv_blocks_used"] == 0
    assert client.post("/v1/completions", json=GOOD).status_code == 200


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**31), ("top_p", 1e-46), ("temperature", 1e308), ("stop_token_ids", [2**31]),
    ("stop_token_ids", list(range(65_536))), ("stop", ["x"] * 1000),
])
def test_values_past_the_caps_are_400s_naming_the_field(client, field, value):
    reply = client.post("/v1/completions", json=GOOD | {field: value})
    assert reply.status_code == 400 and field in reply.json()["error"]["message"]
    assert client.post("/v1/completions", json=GOOD).status_code == 200
    assert _metrics(client.get("/metrics").text)["jpaged:num_kv_blocks_used"] == 0
