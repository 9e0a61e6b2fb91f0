"""/health tells the truth. A dead engine (MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row, or
its loop stopped on an error) is a 503 naming the reason at /health, the requests in flight get
500s and new ones 503s (OpenAI error bodies), `jpaged:engine_errors_total` counts the failures, and
the server exits with status 1 for its supervisor to restart it; one failed step fails its
requests alone and the server stays healthy."""

import time

import httpx
from fastapi.testclient import TestClient

from jpaged import serve
from jpaged.engine.builder import default_model_dir
from jpaged.engine.llm_engine import LLMEngine
from jpaged.serve.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine
from jpaged.serve.cli import EXIT_DEAD_ENGINE
from jpaged.serve.data_parallel import DataParallelEngine
from tests.engine_hold import GUARD_SECONDS
from tests.server_process import server_process
from tests.test_serve import ENGINE_FLAGS, GOOD, _error, _metrics

# Seconds from death to exit: the checks made while the dead server still answers (a few
# requests, well under a second alone) need it, so it is a wide guard, not a measurement.
EXIT_DELAY = 15.0


def test_a_server_whose_steps_keep_failing_says_so_then_exits_non_zero(tmp_path):
    """A real server (tests/failing_server.py injects the step failures): one failed step, then
    steps that always fail."""
    control, log_path = tmp_path / "fail", tmp_path / "server.log"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE_FLAGS.items()]
    flags += ["--no-warmup", f"--dead-engine-exit-delay={EXIT_DELAY}",
              "--uvicorn-log-level=warning"]
    with server_process(flags, log_path,
                        command=("-m", "tests.failing_server", str(control))) as (url, process), \
            httpx.Client(base_url=url, timeout=120) as http:
        def engine_errors() -> float:
            return _metrics(http.get("/metrics").text)["jpaged:engine_errors_total"]

        assert http.post("/v1/completions", json=GOOD).status_code == 200
        assert engine_errors() == 0

        control.write_text("once")   # a transient failure: its request alone fails
        error = _error(http.post("/v1/completions", json=GOOD), 500)
        assert "injected step failure (once)" in error["message"]
        assert error["type"] == "internal_server_error"
        assert http.get("/health").status_code == 200 and engine_errors() == 1
        assert http.post("/v1/completions", json=GOOD).status_code == 200  # ends the run of 1

        control.write_text("always")
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
            assert http.get("/health").status_code == 200   # not dead before the last
            error = _error(http.post("/v1/completions", json=GOOD), 500)   # in flight
            assert "injected step failure (always)" in error["message"]
        assert f"{MAX_CONSECUTIVE_STEP_FAILURES} engine steps failed in a row" in error["message"]

        health = _error(http.get("/health"), 503)
        assert health["code"] == "engine_dead" and health["type"] == "service_unavailable"
        assert (f"{MAX_CONSECUTIVE_STEP_FAILURES} engine steps failed in a row, the last with "
                "RuntimeError: injected step failure (always)") == health["message"]
        assert http.head("/health").status_code == 503
        assert engine_errors() == 1 + MAX_CONSECUTIVE_STEP_FAILURES
        refused = _error(http.post("/v1/completions", json=GOOD), 503)
        assert refused["code"] == "engine_dead" and health["message"] in refused["message"]
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        assert _error(chat, 503)["code"] == "engine_dead"

        # The replies above came from the dead server, so its exit waited; the client's open
        # connection must not hold the exit up (the wait's limit only guards against a hang).
        assert process.wait(timeout=EXIT_DELAY + GUARD_SECONDS) == EXIT_DEAD_ENGINE
    log = log_path.read_text()
    assert f"the engine is dead ({health['message']}); exiting with status 1" in log


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
        deadline = time.monotonic() + GUARD_SECONDS   # the loop ends just after it says so
        while async_engine.is_alive:
            assert time.monotonic() < deadline, "the engine loop did not end"
            time.sleep(0.01)
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
