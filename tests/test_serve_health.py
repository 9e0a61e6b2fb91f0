"""/health tells the truth. A dead engine (MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row, or
its loop stopped on an error) is a 503 naming the reason at /health, the requests in flight get
500s and new ones 503s (OpenAI error bodies), and `jpaged:engine_errors_total` counts the
failures; one failed step fails its requests alone and the server stays healthy."""

from fastapi.testclient import TestClient

from jpaged import serve
from jpaged.engine.builder import default_model_dir
from jpaged.engine.llm_engine import LLMEngine
from jpaged.serve.async_engine import AsyncEngine
from jpaged.serve.data_parallel import DataParallelEngine
from tests.test_serve import ENGINE_FLAGS, GOOD, _error, _metrics


def test_an_engine_loop_stopped_by_an_error_is_a_dead_engine():
    """The loop fails outside a step (here has_unfinished, right after a request was queued):
    that request gets a 500, /health a 503 with the reason, a new request a 503."""
    engine = LLMEngine.from_pretrained(None, **ENGINE_FLAGS)
    async_engine = AsyncEngine(engine, "tiny")
    app = serve.build_app(async_engine, serve.model_info(engine, default_model_dir(), "tiny"))
    add_request = engine.add_request

    def broken():
        raise RuntimeError("injected loop failure")

    def add_then_break(*args, **kwargs):
        added = add_request(*args, **kwargs)
        engine.has_unfinished = broken
        return added

    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine.add_request = add_then_break
        error = _error(client.post("/v1/completions", json=GOOD), 500)
        reason = "the engine loop failed: RuntimeError: injected loop failure"
        assert reason in error["message"]
        health = _error(client.get("/health"), 503)
        assert health == {"message": reason, "type": "service_unavailable", "param": None,
                          "code": "engine_dead"}
        assert not async_engine.is_alive
        assert _error(client.post("/v1/completions", json=GOOD), 503)["code"] == "engine_dead"
        assert _metrics(client.get("/metrics").text)["jpaged:engine_errors_total"] == 1
        assert engine.num_unfinished_requests == 0   # the failed request was aborted


def test_one_dead_replica_makes_the_data_parallel_server_dead():
    class Replica:
        model_name, engine, metrics = "tiny", None, None

        def __init__(self, dead_reason):
            self.dead_reason = dead_reason

    assert DataParallelEngine([Replica(None), Replica(None)]).dead_reason is None
    router = DataParallelEngine([Replica(None), Replica("the engine loop failed: E")])
    assert router.dead_reason == "replica 1: the engine loop failed: E"
