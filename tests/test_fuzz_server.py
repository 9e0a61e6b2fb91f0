"""Fuzzes the OpenAI routes in-process: whatever the body (invalid JSON, wrong types, extreme
numbers, lone surrogates, huge lists, deep nesting), the reply is never a 5xx, a 4xx carries
OpenAI's error body, /health answers, and afterwards the engine is idle with every KV block free.

Strategies lean toward bodies rejected before the engine (cheap); the ones that reach it ask for
at most 4 tokens, so the whole run stays within about a minute on a 2-core CPU."""

import json
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jpaged import LLM
from jpaged.engine.builder import default_model_dir
from jpaged.serve import build_app, model_info
from jpaged.serve.async_engine import AsyncEngine
from tests.engine_hold import GUARD_SECONDS
from tests.test_serve import ENGINE_FLAGS

MAX_REQUEST_BYTES = 1 << 20
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def client():
    engine = LLM(None, **ENGINE_FLAGS).engine
    app = build_app(AsyncEngine(engine, "tiny"), model_info(engine, default_model_dir(), "tiny"),
                    max_request_bytes=MAX_REQUEST_BYTES)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        test_client.engine = engine
        yield test_client


# ---- strategies ---------------------------------------------------------------------------------
ODD_TEXT = st.sampled_from(["\ud800", "a\udc00b", "\udfff\ud800", "\x00", "\ufeff", "\U0010ffff",
                            "🙂" * 3, "é", "\u202e", "\r\n", "<|endoftext|>", "{{ x }}"])
TEXT = st.one_of(st.text(max_size=12), ODD_TEXT, st.builds(lambda n: "ab" * n,
                                                            st.integers(130, 20_000)))
EXTREME_INT = st.sampled_from([0, -1, 1, 2**31 - 1, -2**31, 2**53, 2**63, -2**63, 10**30])
EXTREME_FLOAT = st.sampled_from([0.0, -0.0, 1e-300, 1e300, -1e300, 5e-324, 0.5, -2.5])
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), EXTREME_INT, st.floats(
    allow_nan=False, allow_infinity=False), EXTREME_FLOAT, TEXT)
JSON_VALUE = st.recursive(SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
HUGE_LIST = st.builds(lambda n, item: [item] * n, st.integers(257, 100_000),
                      st.sampled_from([1, "a", 5000, None, [1]]))

# Values past what the device holds (top_k and stop ids beyond int32, too many stop ids, subnormal
# top_p / min_p, huge temperatures) are among the extremes: SamplingParams rejects them by name.
JUNK = st.one_of(st.none(), st.booleans(), TEXT, st.lists(st.integers(-3, 3), max_size=3),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
SAMPLING = {
    # never null: that means "the rest of the context", hundreds of tokens on the chat route
    "max_tokens": st.one_of(st.integers(1, 4), st.integers(-3, 0), EXTREME_INT.filter(
        lambda v: v > 4), JUNK.filter(lambda v: v is not None)),
    "n": st.one_of(st.integers(1, 2), st.integers(-2, 0), st.integers(5, 10**6), JUNK),
    "temperature": st.one_of(st.sampled_from([0, 0.0, 0.7, 1, 1.5, 2.0, -1, -0.5, 1e308,
                                              1e-300, 1e4]), JUNK),
    "top_p": st.one_of(st.sampled_from([1, 0.9, 0.5, 0.01, 0, -1, 1.5, 1e-46]), JUNK),
    "top_k": st.one_of(st.integers(-5, 300), EXTREME_INT, JUNK),
    "min_p": st.one_of(st.sampled_from([0, 0.1, 0.5, 1, -0.1, 2, 1e-46]), JUNK),
    "seed": st.one_of(st.integers(-2**70, 2**70), JUNK),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), JUNK),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 2**31 - 1), max_size=6),
                                st.lists(EXTREME_INT, max_size=3), HUGE_LIST, JUNK),
    "ignore_eos": st.one_of(st.booleans(), JUNK),
    "skip_special_tokens": st.one_of(st.booleans(), JUNK),
    "stream": st.one_of(st.booleans(), JUNK),
    "stream_options": st.one_of(st.just({"include_usage": True}), JSON_VALUE),
    "model": st.one_of(st.just("tiny"), TEXT, JUNK),
    "echo": st.one_of(st.booleans(), JUNK),
    "prompt_logprobs": st.one_of(st.integers(-2, 30), JUNK),
    "logit_bias": st.one_of(st.just({}), JSON_VALUE, st.dictionaries(
        st.sampled_from(["0", "5", "255", "-1", "x", "05", "99999", "1e3"]),
        st.one_of(st.floats(-150, 150), JUNK), max_size=3)),
    "best_of": st.one_of(st.integers(-1, 3), JUNK),
    "response_format": st.one_of(JSON_VALUE, st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 0,
                                                           "maximum": 9}}},
        {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}])),
    "structured_outputs": st.one_of(JSON_VALUE, st.fixed_dictionaries({}, optional={
        "choice": st.one_of(st.lists(TEXT, max_size=3), JUNK), "regex": st.one_of(TEXT, JUNK),
        "grammar": st.one_of(st.just('root ::= "a" "b"?'), TEXT, JUNK)})),
    "guided_choice": st.one_of(st.lists(TEXT, max_size=3), JUNK),
    "guided_regex": st.one_of(st.sampled_from(["[0-9]{1,3}", "(", "a|b"]), TEXT, JUNK),
}
COMPLETION_ONLY = {"logprobs": st.one_of(st.integers(-2, 30), JUNK),
                   "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=3),
                                       st.lists(st.integers(-2, 600), max_size=6),
                                       st.lists(st.lists(st.integers(0, 600), max_size=4),
                                                max_size=3), HUGE_LIST, JUNK)}
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]),
                                             TEXT, JUNK),
                           "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                               {"type": st.just("text"), "text": TEXT}), max_size=2), JUNK)}),
    JSON_VALUE)
CHAT_ONLY = {"messages": st.one_of(st.lists(MESSAGE, max_size=3), HUGE_LIST, JUNK),
             "logprobs": st.one_of(st.booleans(), JUNK),
             "top_logprobs": st.one_of(st.integers(-2, 30), JUNK),
             "max_completion_tokens": st.one_of(st.integers(-2, 4), JUNK)}


def _request(fields: dict) -> st.SearchStrategy:
    """A dict with a random subset of `fields`; 'max_tokens' is always there (so nothing that
    reaches the engine generates more than 4 tokens)."""
    optional = {name: strategy for name, strategy in fields.items() if name != "max_tokens"}
    return st.builds(lambda required, rest: {**required, **rest},
                     st.fixed_dictionaries({"max_tokens": fields["max_tokens"]}),
                     st.fixed_dictionaries({}, optional=optional))


# Near-valid bodies: every field valid, then at most one field from the fuzzing table above, so
# about a third of all examples reach the engine (and must still leave it clean).
SHORT_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
VALID = {"n": st.integers(1, 2), "temperature": st.sampled_from([0, 0.7, 1.0]),
         "top_p": st.sampled_from([1, 0.9, 0.5]), "top_k": st.sampled_from([-1, 1, 5, 50]),
         "min_p": st.sampled_from([0, 0.1]), "seed": st.integers(0, 2**32),
         "stop": st.lists(SHORT_TEXT, max_size=2), "stop_token_ids": st.lists(
             st.integers(0, 255), max_size=3), "ignore_eos": st.booleans(),
         "skip_special_tokens": st.booleans(), "stream": st.booleans()}
VALID_COMPLETION = {**VALID, "logprobs": st.integers(0, 5), "prompt": st.one_of(
    SHORT_TEXT, st.lists(st.integers(0, 255), min_size=1, max_size=6),
    st.lists(SHORT_TEXT, min_size=1, max_size=2))}
VALID_CHAT = {**VALID, "logprobs": st.booleans(), "messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": SHORT_TEXT}),
    min_size=1, max_size=2)}


def _near_valid(valid: dict, required: str, fuzzed: dict) -> st.SearchStrategy:
    def build(base, tweak):
        return {**base, **dict([tweak])} if tweak else base
    base = st.fixed_dictionaries({required: valid[required], "max_tokens": st.integers(1, 4)},
                                 optional={k: v for k, v in valid.items() if k != required})
    tweak = st.one_of(st.none(), st.sampled_from(sorted(fuzzed)).flatmap(
        lambda name: fuzzed[name].map(lambda value: (name, value))))
    return st.builds(build, base, tweak)


def _deep(depth: int, opener: str) -> str:
    closer = {"[": "]", "{\"a\":": "}"}[opener]
    return "{\"prompt\": " + opener * depth + "1" + closer * depth + "}"


def _raw(body) -> bytes:
    return json.dumps(body).encode()   # ensure_ascii: a lone surrogate goes as "\ud800"


RAW_BODY = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=40).map(str.encode),
    st.builds(_deep, st.integers(1, 3000), st.sampled_from(["[", "{\"a\":"])),
    st.sampled_from([b"", b"null", b"[]", b"1", b"\"x\"", b"{\"prompt\": NaN}",
                     b"{\"prompt\": \"a\", \"max_tokens\": 1e999}", b"{\"prompt\": \"a\"",
                     b"{\"prompt\": \"\\ud800\"}", b"{\"prompt\": \"a\\udc00\"}",
                     b"{\"prompt\": \"\xed\xa0\x80\"}", b"{\"prompt\": 1" + b"0" * 5000 + b"}",
                     b"\xef\xbb\xbf{\"prompt\": \"a\", \"max_tokens\": 1}",
                     b"{\"prompt\": \"a\", \"max_tokens\": 1, \"max_tokens\": 99999}"]),
    st.builds(lambda n: b"{\"prompt\": \"" + b"a" * n + b"\"}",
              st.sampled_from([MAX_REQUEST_BYTES, 2 * MAX_REQUEST_BYTES])),
)
ROUTE_AND_BODY = st.one_of(
    st.tuples(st.just("completions"), _near_valid(VALID_COMPLETION, "prompt", {
        **SAMPLING, **COMPLETION_ONLY}).map(_raw)),
    st.tuples(st.just("chat/completions"), _near_valid(VALID_CHAT, "messages", {
        **SAMPLING, **CHAT_ONLY}).map(_raw)),
    st.tuples(st.just("completions"), _request({**SAMPLING, **COMPLETION_ONLY}).map(_raw)),
    st.tuples(st.just("chat/completions"), _request({**SAMPLING, **CHAT_ONLY}).map(_raw)),
    st.tuples(st.sampled_from(["completions", "chat/completions"]), RAW_BODY),
    st.tuples(st.sampled_from(["completions", "chat/completions"]), JSON_VALUE.map(_raw)),
)


# ---- checks -------------------------------------------------------------------------------------
def _check_reply(reply):
    assert reply.status_code < 500, reply.text[:500]
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"]
        assert error["param"] is None or isinstance(error["param"], str)
    elif reply.headers["content-type"].startswith("text/event-stream"):
        assert reply.text.rstrip().endswith("data: [DONE]")
        assert "internal_server_error" not in reply.text, reply.text[-500:]
    else:
        assert reply.json()["choices"]


def _wait_idle(engine):
    """Nothing running or waiting, and every usable block free (num_free_blocks counts cached
    blocks no request holds, which a new request may evict; one block is the padding sink).
    The deadline only guards against a hang."""
    usable = engine.config.num_kv_blocks - 1
    deadline = time.monotonic() + GUARD_SECONDS
    while engine.num_unfinished_requests or engine.num_free_blocks != usable:
        assert time.monotonic() < deadline, (engine.num_unfinished_requests, engine.stats())
        time.sleep(0.01)


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.large_base_example])
@given(case=ROUTE_AND_BODY)
def test_no_body_gives_a_5xx_or_leaks_blocks(client, case):
    route, raw = case
    reply = client.post(f"/v1/{route}", content=raw, headers={"Content-Type": "application/json"})
    event(f"HTTP {reply.status_code}")
    _check_reply(reply)
    assert client.get("/health").status_code == 200
    _wait_idle(client.engine)
