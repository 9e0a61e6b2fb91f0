"""The OpenAI-compatible server: one real uvicorn subprocess on a free loopback port (official
openai client, greedy parity with LLM.generate, 64 concurrent streams with disconnects, aborts
freeing blocks) and an in-process app (bad input, metrics, streams, engine errors, flags)."""

import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from jpaged import LLM, SamplingParams
from jpaged.serve import chat
from jpaged.serve import openai_api as api
from jpaged import serve
from jpaged.serve.async_engine import AsyncEngine
from jpaged.engine.builder import default_model_dir
from tests.logprob_compare import assert_equal_but_floats_close
from tests.engine_hold import GUARD_SECONDS, held_steps, watched_aborts
from tests.server_process import running_server

ROOT = Path(__file__).resolve().parent.parent
# Small settings keep the number of compiled shapes (and so the test time) down.
ENGINE_FLAGS = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256)
PROMPTS = ["def main(", "import os\nimport sys\n\n", "class Config:\n    def "]
GREEDY = dict(temperature=0, max_tokens=24)


def _metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def _wait_idle(get_metrics) -> dict:
    """Poll /metrics until nothing is running or waiting and no block is held (the deadline
    only guards against a hang)."""
    deadline = time.monotonic() + GUARD_SECONDS
    while True:
        values = _metrics(get_metrics())
        idle = (values["vllm:num_requests_running"] == 0
                and values["vllm:num_requests_waiting"] == 0
                and values["jpaged:num_kv_blocks_used"] == 0)
        if idle:
            return values
        assert time.monotonic() < deadline, f"not idle after {GUARD_SECONDS} s: {values}"
        time.sleep(0.05)


# ---- the real server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python -m jpaged.serve` (the built-in model, Hermes tool calls for tool_choice "auto")
    on a free 127.0.0.1 port: (URL, log path)."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE_FLAGS.items()]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with running_server([*flags, "--tool-call-parser=hermes", "--uvicorn-log-level=warning"],
                        log_path) as url:
        # Compile the server's step shapes (with and without logprobs) while this process
        # builds its own engine, so the two compile on the machine's cores in parallel.
        warm = threading.Thread(target=_warm_up, args=(url,), daemon=True)
        warm.start()
        yield url, log_path


def _warm_up(url: str):
    for extra in ({}, {"logprobs": 1, "n": 2}):
        httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"prompt": "x", "max_tokens": 3, "ignore_eos": True, **extra})


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def offline_llm():
    return LLM(None, **ENGINE_FLAGS)


@pytest.fixture(scope="module")
def offline_greedy(offline_llm):
    outputs = offline_llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    return [output.outputs[0].text for output in outputs]


@pytest.fixture(scope="module")
def offline_banned(offline_llm) -> tuple[dict, object]:
    """({token: -100} for PROMPTS[0]'s greedy tokens, its greedy output with them banned)."""
    plain = offline_llm.generate(PROMPTS[0], SamplingParams(**GREEDY), use_tqdm=False)
    bias = {token: -100 for token in plain[0].outputs[0].token_ids}
    banned = offline_llm.generate(PROMPTS[0], SamplingParams(**GREEDY, logit_bias=bias),
                                  use_tqdm=False)
    return bias, banned[0].outputs[0]


@pytest.fixture(scope="module")
def openai_client(url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_banner_is_printed_and_models_lists_the_default(server):
    url, log_path = server
    banner = log_path.read_text()
    assert url in banner and f"curl {url}/v1/completions" in banner
    configuration = banner[:banner.index("try:")]   # printed before it, once the port is bound
    for item in ("jpaged-default", "dtype", "KV blocks", "max_model_len 256", "attention backend",
                 "tool-call parser hermes"):
        assert item in configuration, item
    assert httpx.head(f"{url}/health").status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [serve.DEFAULT_MODEL_NAME]


def test_openai_client_completions_equal_offline_greedy(openai_client, offline_greedy):
    for prompt, expected in zip(PROMPTS, offline_greedy):
        reply = openai_client.completions.create(model=serve.DEFAULT_MODEL_NAME, prompt=prompt,
                                                 **GREEDY)
        assert reply.choices[0].text == expected
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert reply.usage.prompt_tokens == len(prompt.encode())  # byte-level tokenizer
        assert reply.usage.completion_tokens <= GREEDY["max_tokens"]


def test_openai_client_streaming_n_and_logprobs(openai_client, offline_greedy):
    stream = openai_client.completions.create(model=serve.DEFAULT_MODEL_NAME, prompt=PROMPTS[0],
                                              stream=True, **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in stream) == offline_greedy[0]
    reply = openai_client.completions.create(
        model=serve.DEFAULT_MODEL_NAME, prompt=PROMPTS[1], n=3, temperature=1.0, seed=7,
        max_tokens=8, logprobs=2)
    assert sorted(choice.index for choice in reply.choices) == [0, 1, 2]
    for choice in reply.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert reply.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in reply.choices)


def test_openai_client_chat_plain_and_streaming(openai_client):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def add(a, b):"}]
    reply = openai_client.chat.completions.create(
        model=serve.DEFAULT_MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
        logprobs=True, top_logprobs=2)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert len(choice.logprobs.content) == reply.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 for item in choice.logprobs.content)
    stream = openai_client.chat.completions.create(
        model=serve.DEFAULT_MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_openai_client_logit_bias_bans_and_forces_tokens(openai_client, offline_banned, url):
    bias, banned = offline_banned
    assert banned.token_ids and not set(banned.token_ids) & set(bias)
    reply = openai_client.completions.create(
        model=serve.DEFAULT_MODEL_NAME, prompt=PROMPTS[0], **GREEDY,
        logit_bias={str(token): value for token, value in bias.items()})
    assert reply.choices[0].text == banned.text
    forced = openai_client.chat.completions.create(
        model=serve.DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
        max_tokens=5, temperature=0, logit_bias={"65": 100})
    expected = httpx.post(f"{url}/detokenize", json={"tokens": [65] * 5}).json()["prompt"]
    assert forced.choices[0].message.content == expected and len(expected) == 5


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_openai_client_structured_outputs_parse_and_validate(openai_client, temperature):
    jsonschema = pytest.importorskip("jsonschema")
    common = dict(model=serve.DEFAULT_MODEL_NAME, max_tokens=100, temperature=temperature,
                  seed=11)
    chat = openai_client.chat.completions.create(
        messages=[{"role": "user", "content": "Who?"}], **common, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                   "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    assert chat.choices[0].finish_reason == "stop"
    anything = openai_client.completions.create(prompt="x = ", **common, extra_body={
        "response_format": {"type": "json_object"}})
    assert isinstance(json.loads(anything.choices[0].text), dict)
    choice = openai_client.completions.create(prompt="a", **common, extra_body={
        "structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")
    regex = openai_client.completions.create(prompt="b", **common,
                                             extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.choices[0].text)
    grammar = openai_client.completions.create(prompt="c", **common, extra_body={
        "guided_grammar": 'root ::= "<" ("a" | "b") [ab]? [ab]? ">"'})
    assert re.fullmatch(r"<[ab]{1,3}>", grammar.choices[0].text)
    assert {c.choices[0].finish_reason for c in (anything, choice, regex, grammar)} == {"stop"}


def test_a_constrained_stream_equals_the_full_reply(app_client):
    body = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 100,
            "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON}}}
    full = app_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    with app_client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == full["message"]["content"] and json.loads(text)["age"] <= 150
    assert events[-1]["choices"][0]["finish_reason"] == full["finish_reason"] == "stop"


# Compact: the default template writes the functions into the prompt (max_model_len 256).
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]
TOOL_SCHEMAS = {"add": ADD, "now": {"type": "object", "maxProperties": 0}}
ASK = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_openai_client_tool_calls_parse_and_match_their_function(openai_client, temperature):
    jsonschema = pytest.importorskip("jsonschema")
    user = {"role": "user", "content": "Add?"}
    common = dict(model=serve.DEFAULT_MODEL_NAME, tools=TOOLS, max_tokens=40,
                  temperature=temperature, seed=5)
    named = openai_client.chat.completions.create(
        messages=[user], tool_choice={"type": "function", "function": {"name": "add"}}, **common)
    (call,) = named.choices[0].message.tool_calls
    assert (call.type, call.function.name) == ("function", "add") and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    assert named.choices[0].message.content is None
    assert named.choices[0].finish_reason == "stop"
    required = openai_client.chat.completions.create(
        messages=[user], tool_choice="required", parallel_tool_calls=False, **common)
    (call,) = required.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    assert required.choices[0].finish_reason == "tool_calls"
    # The call and its result go back into the conversation; "none" answers in text.
    answer = openai_client.chat.completions.create(
        messages=[user, required.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "5"}],
        tool_choice="none", **{**common, "tools": TOOLS[1:], "max_tokens": 4})
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"


def _joined_calls(deltas: list[dict]) -> list[dict]:
    """The calls a client accumulates from a stream's deltas: by index, the header's id, type
    and name, the arguments' fragments joined."""
    calls = {}
    for delta in deltas:
        for call in delta["delta"].get("tool_calls", []):
            joined = calls.setdefault(call["index"], {"function": {"arguments": ""}})
            joined |= {key: call[key] for key in ("id", "type") if key in call}
            joined["function"] |= {"name": call["function"]["name"]} if "name" in call[
                "function"] else {}
            joined["function"]["arguments"] += call["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[index] for index in range(len(calls))]


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "add"}},
                                    "required"])
def test_a_tool_call_stream_joins_to_the_full_reply(app_client, choice):
    body = {"messages": [{"role": "user", "content": "Add?"}], "tools": TOOLS, "max_tokens": 40,
            "temperature": 0, "tool_choice": choice, "parallel_tool_calls": False}
    full = app_client.post("/v1/chat/completions", json=body).json()["choices"][0]
    with app_client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        deltas = [json.loads(line[6:])["choices"][0] for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    calls = _joined_calls(deltas)
    assert [call["function"] for call in calls] == [
        call["function"] for call in full["message"]["tool_calls"]]
    assert all(call["id"].startswith("call_") and call["type"] == "function" for call in calls)
    fragments = [d for d in deltas[:-1] for call in d["delta"].get("tool_calls", [])
                 if "id" not in call and call["function"]["arguments"]]
    assert fragments, "the arguments stream before the last chunk"
    assert not any(d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == full["finish_reason"] == (
        "stop" if isinstance(choice, dict) else "tool_calls")
    if isinstance(choice, dict):
        cut = app_client.post("/v1/chat/completions", json={**body, "max_tokens": 3}).json()
        message = cut["choices"][0]["message"]    # cut short: no call, the text as it came
        assert "tool_calls" not in message and message["content"].startswith("{")
        assert cut["choices"][0]["finish_reason"] == "length"


# The tiny model writes no tool calls of its own: a regex makes it write two Hermes-style ones.
BRIEF_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
               {"type": "function", "function": {"name": "now"}}]
HERMES_CALLS = (r'Sure\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9]\}\}\n'
                r'</tool_call>\n<tool_call>\n\{"name": "now", "arguments": \{\}\}\n</tool_call>')


def test_openai_client_auto_finds_the_calls_in_the_text_and_streams_them(openai_client):
    common = dict(model=serve.DEFAULT_MODEL_NAME, tools=BRIEF_TOOLS, max_tokens=150,
                  temperature=0, messages=[{"role": "user", "content": "Add?"}])
    regex = {"structured_outputs": {"regex": HERMES_CALLS}}
    reply = openai_client.chat.completions.create(**common, extra_body=regex)   # auto: default
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Sure.", "tool_calls")
    add, now = choice.message.tool_calls
    assert add.id.startswith("call_") and (add.type, now.type) == ("function", "function")
    assert (add.function.name, now.function.name) == ("add", "now")
    assert 1 <= json.loads(add.function.arguments)["a"] <= 9
    assert json.loads(now.function.arguments) == {}
    content, calls, finish_reasons = "", {}, []
    for chunk in openai_client.chat.completions.create(**common, tool_choice="auto",
                                                       stream=True, extra_body=regex):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:     # as clients accumulate: by index
            if call.index not in calls:
                assert call.id.startswith("call_") and call.function.arguments == ""
                calls[call.index] = [call.function.name, "", len(finish_reasons)]
            else:
                assert call.id is None and call.function.name is None
            calls[call.index][1] += call.function.arguments
        finish_reasons.append(chunk.choices[0].finish_reason)
    assert content == "Sure." and finish_reasons[-1] == "tool_calls"
    assert set(finish_reasons[:-1]) == {None}
    assert [name_arguments[:2] for _, name_arguments in sorted(calls.items())] == [
        [add.function.name, add.function.arguments], [now.function.name, now.function.arguments]]
    assert calls[0][2] < calls[1][2] < len(finish_reasons) - 1    # each sent as it was written
    unknown = r'<tool_call>\n\{"name": "sub", "arguments": \{\}\}\n</tool_call>'
    kept = openai_client.chat.completions.create(
        **common, extra_body={"structured_outputs": {"regex": unknown}}).choices[0]
    assert kept.message.tool_calls is None and kept.finish_reason == "stop"
    assert kept.message.content == '<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>'


def test_chat_templates_get_the_tools_and_calls_as_transformers_gives_them():
    template = chat.ChatTemplate(
        "{% if tools %}{{ tools | map(attribute='function.name') | join(',') }};{% endif %}"
        "{% for m in messages %}{{ m.role }}={% if m.tool_calls %}"
        "{{ m.tool_calls[0].function.arguments.a }}{% else %}{{ m.content }}{% endif %};"
        "{% endfor %}")
    body = {"messages": [{"role": "user", "content": "Add?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "add", "arguments": '{"a": 7}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "8"}]}
    messages = chat.chat_messages(body)
    assert messages[2] == {"role": "tool", "content": "8", "tool_call_id": "c1"}
    assert template.render(messages, tools=TOOLS) == "add,now;user=Add?;assistant=7;tool=8;"
    assert template.render(messages) == "user=Add?;assistant=7;tool=8;"
    assert chat.ChatTemplate().render(messages, tools=TOOLS[1:]) == (
        'tools: [{"name":"now"}]\nuser: Add?\n'
        'assistant: [{"name":"add","arguments":{"a":7}}]\ntool: 8\nassistant:')


def test_a_bad_schema_is_a_400_and_a_concurrent_request_is_unharmed(openai_client,
                                                                   offline_greedy):
    openai = pytest.importorskip("openai")
    replies = []
    thread = threading.Thread(target=lambda: replies.append(openai_client.completions.create(
        model=serve.DEFAULT_MODEL_NAME, prompt=PROMPTS[0], **GREEDY)))
    thread.start()
    for body in ({"response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "schema": {"type": "object", "properties": 5}}}},
                 {"guided_grammar": "start: missing"}):
        with pytest.raises(openai.BadRequestError) as error:
            openai_client.completions.create(model=serve.DEFAULT_MODEL_NAME, prompt="x",
                                             max_tokens=4, extra_body=body)
        assert error.value.body["param"] in ("response_format", "guided_grammar")
    thread.join(GUARD_SECONDS)
    assert replies and replies[0].choices[0].text == offline_greedy[0]


def test_64_concurrent_streams_with_random_disconnects(url):
    rng = random.Random(0)
    plans = [(rng.choice(PROMPTS), rng.randint(4, 12), rng.random() < 0.3 and rng.randint(1, 3))
             for _ in range(64)]

    async def client(http, prompt, max_tokens, disconnect_after):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        events = []
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if disconnect_after and len(events) >= disconnect_after:
                        return None
        return events

    async def run_all():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            return await asyncio.wait_for(
                asyncio.gather(*(client(http, *plan) for plan in plans)), GUARD_SECONDS)

    results = asyncio.run(run_all())
    stayed = [(plan, events) for plan, events in zip(plans, results) if events is not None]
    assert len(stayed) >= 40
    for (_, max_tokens, _), events in stayed:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    values = _wait_idle(lambda: httpx.get(f"{url}/metrics").text)
    assert values["jpaged:num_kv_blocks_used"] == 0
    assert values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
    assert values["vllm:time_to_first_token_seconds_count"] >= 64
    assert values["vllm:time_per_output_token_seconds_count"] > 0


# ---- the in-process app -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app_client(offline_llm, offline_greedy, offline_banned):
    """A TestClient over an app driving the offline LLM's engine (after the greedy outputs were
    taken, so only the app's engine thread uses it from then on)."""
    engine = offline_llm.engine
    async_engine = AsyncEngine(engine, "tiny")
    model = serve.model_info(engine, default_model_dir(), "tiny")
    app = serve.build_app(async_engine, model)
    with TestClient(app) as client:
        client.engine, client.async_engine, client.model = engine, async_engine, model
        yield client


GOOD = {"prompt": "x = ", "max_tokens": 2}
BAD_INPUTS = [
    ("completions", "{not json", 400, None),
    ("completions", "[1, 2]", 400, None),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": 3}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, 9999]}, 400, "prompt"),
    ("completions", {"prompt": "a", "max_tokens": "10"}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "n": True}, 400, "n"),
    ("completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "a", "top_k": 0}, 400, "top_k"),
    ("completions", {"prompt": "a", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "a", "seed": "s"}, 400, "seed"),
    ("completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "a", "echo": True, "stream": True}, 400, "echo"),
    ("completions", {"prompt": "a", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("completions", {"prompt": "a", "logit_bias": [5]}, 400, "logit_bias"),
    ("completions", {"prompt": "a", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "a", "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "a", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "a", "logit_bias": {"5": 1, "05": 2}}, 400, "logit_bias"),
    ("completions", {"prompt": "a", "logit_bias": {"5": 100.5}}, 400, "logit_bias"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "logit_bias": {"5": "up"}}, 400, "logit_bias"),
    ("completions", {"prompt": "a", "skip_special_tokens": 1}, 400, "skip_special_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("completions", {"prompt": "a", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("completions", {"prompt": "a", "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format"),
    ("completions", {"prompt": "a", "structured_outputs": {"regex": "(a"}}, 400,
     "structured_outputs"),
    ("completions", {"prompt": "a", "structured_outputs": {"jsonschema": {}}}, 400,
     "structured_outputs"),
    ("completions", {"prompt": "a", "structured_outputs": "json"}, 400, "structured_outputs"),
    ("completions", {"prompt": "a", "guided_choice": []}, 400, "guided_choice"),
    ("completions", {"prompt": "a", "guided_grammar": "root ::= ("}, 400, "guided_grammar"),
    ("completions", {"prompt": "a", "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "guided_choice"),
    ("chat/completions", {**ASK, "tools": TOOLS}, 400, "tool_choice"),   # auto: no parser here
    ("chat/completions", {**ASK, "tools": TOOLS, "tool_choice": "auto"}, 400, "tool_choice"),
    ("chat/completions", {**ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "sub"}}}, 400, "tool_choice"),
    ("chat/completions", {**ASK, "tool_choice": "required"}, 400, "tool_choice"),
    ("chat/completions", {**ASK, "tools": TOOLS, "tool_choice": "any"}, 400,
     "tool_choice"),
    ("chat/completions", {**ASK, "tools": [{"type": "function"}],
                          "tool_choice": "none"}, 400, "tools[0]"),
    ("chat/completions", {**ASK, "tools": [{"type": "function", "function": {
        "name": "a b"}}], "tool_choice": "none"}, 400, "tools[0].function.name"),
    ("chat/completions", {**ASK, "tools": TOOLS + TOOLS[:1], "tool_choice": "none"},
     400, "tools[2]"),
    ("chat/completions", {**ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": 5}}}],
        "tool_choice": "required"}, 400, "tools"),
    ("chat/completions", {**ASK, "tools": TOOLS, "tool_choice": "required",
                          "guided_regex": "a"}, 400, "tools"),
    ("chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{
        "type": "function", "function": {"name": "add", "arguments": "{a"}}]}]}, 400,
     "messages[0].tool_calls[0].function.arguments"),
    ("completions", {"prompt": "a", "tools": TOOLS}, 400, "tools"),
    ("completions", {"prompt": "a" * 300}, 400, "prompt"),
    ("completions", {"prompt": "a", "max_tokens": 300}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": "a", "n": 9}, 400, None),  # the engine's own check
    ("chat/completions", {"model": "tiny"}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, 400,
     "messages"),
]


@pytest.mark.parametrize("route,body,status,param", BAD_INPUTS,
                         ids=[f"{i}-{case[2]}-{case[3]}" for i, case in enumerate(BAD_INPUTS)])
def test_bad_input_gets_openai_error_and_server_carries_on(app_client, route, body, status,
                                                            param):
    content = body if isinstance(body, str) else json.dumps(body)
    reply = app_client.post(f"/v1/{route}", content=content,
                            headers={"Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if param is not None and "[" not in param:
        assert param.split(".")[0] in error["message"]
    good = app_client.post("/v1/completions", json=GOOD)
    assert good.status_code == 200 and len(good.json()["choices"]) == 1


def _error(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("route,raw,param", [
    ("completions", '{"prompt": "ab\\ud800"}', "prompt"),
    ("completions", '{"prompt": ["ok", "\\udc00"]}', "prompt[1]"),
    ("chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
    ("completions", '{"prompt": "a", "stop": ["\\ud800"]}', "stop[0]")])
def test_lone_surrogate_is_a_400_naming_the_field(app_client, route, raw, param):
    error = _error(app_client.post(f"/v1/{route}", content=raw,
                                   headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param and "surrogate" in error["message"]
    assert app_client.post("/v1/completions", json=GOOD).status_code == 200


@pytest.mark.parametrize("opener,closer", [("[", "]"), ('{"a":', "}")])
def test_deeply_nested_json_is_a_400(app_client, opener, closer):
    for depth in (100, 1_000, 100_000):
        raw = '{"prompt": ' + opener * depth + "1" + closer * depth + "}"
        error = _error(app_client.post("/v1/completions", content=raw), 400)
        assert "nested" in error["message"]


@pytest.mark.parametrize("raw", ['{"prompt": "a", "temperature": NaN}',
                                 '{"prompt": "a", "temperature": 1e999}',
                                 '{"prompt": 1' + "0" * 5000 + "}"])
def test_numbers_json_cannot_hold_are_a_400(app_client, raw):
    _error(app_client.post("/v1/completions", content=raw), 400)


class _CountingTokenizer:
    """A tokenizer that counts the calls that tokenise text (everything else passes through)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.num_calls = 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, *args, **kwargs):
        self.num_calls += 1
        return self._tokenizer.encode(*args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        self.num_calls += 1
        return self._tokenizer.encode_batch(*args, **kwargs)


def test_a_prompt_surely_too_long_is_refused_before_tokenising(app_client):
    bound = app_client.model.max_token_chars
    assert bound == max(map(len, app_client.engine.tokenizer.get_vocab()))   # byte-level BPE
    texts = [PROMPTS[1] * 20, " " * 500, "é🙂\n" * 90, "".join(map(chr, range(32, 400)))]
    for text in texts:   # the bound holds: no token covers more than `bound` characters
        assert len(app_client.engine.tokenizer.encode(text).ids) * bound >= len(text)
    error = _error(app_client.post("/v1/completions", json={"prompt": "a" * 1_000_000}), 400)
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    counting = _CountingTokenizer(app_client.model.tokenizer)   # refused by its length alone:
    model = dataclasses.replace(app_client.model, tokenizer=counting)   # nothing is tokenised
    with pytest.raises(api.APIError, match="characters") as refused:
        api.encode(model, "a" * 1_000_000, "prompt")
    assert refused.value.code == "context_length_exceeded" and counting.num_calls == 0
    assert api.encode(model, "a" * 100, "prompt") and counting.num_calls == 1
    error = _error(app_client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "b" * 256 * bound}]}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


def test_head_health_and_models_retrieve(app_client):
    assert app_client.head("/health").status_code == 200
    assert app_client.get("/v1/models/tiny").json()["id"] == "tiny"
    error = _error(app_client.get("/v1/models/gpt-4"), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_unexpected_exceptions_are_openai_500s(app_client, monkeypatch):
    def broken(body, model):
        raise KeyError("injected")
    monkeypatch.setattr(api, "parse_completion", broken)
    client = TestClient(app_client.app, raise_server_exceptions=False)   # no second lifespan
    error = _error(client.post("/v1/completions", json=GOOD), 500)
    assert error["type"] == "internal_server_error" and "injected" in error["message"]


def test_context_length_error_has_openai_code(app_client):
    reply = app_client.post("/v1/completions", json={"prompt": "a" * 300})
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert "256" in reply.json()["error"]["message"]


def test_unknown_route_is_openai_error(app_client):
    reply = app_client.get("/v1/nothing")
    assert reply.status_code == 404 and "error" in reply.json()


def test_stream_equals_full_reply_with_stop_strings_and_seed(app_client):
    body = {"prompt": "def main(", "max_tokens": 40, "temperature": 0.9, "seed": 3,
            "stop": ["\n\n", "return"]}
    full = app_client.post("/v1/completions", json=body).json()
    with app_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert "\n\n" not in full["choices"][0]["text"]


def _stream_chunks(client, route: str, body: dict) -> list[dict]:
    """The chunks of a streamed reply to body, checked to end with [DONE]."""
    with client.stream("POST", f"/v1/{route}", json={**body, "stream": True}) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert reply.status_code == 200 and lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def _streamed_lengths(chunks: list[dict]) -> list[int]:
    """Characters streamed after each chunk (one choice)."""
    return list(itertools.accumulate(len(c["choices"][0]["text"]) for c in chunks))


def _stop_with_an_earlier_prefix(text: str, chunk_ends: list[int]) -> tuple[str, int, int]:
    """(stop, prefix_at, stop_at): a 4-character stop string that first occurs in text at stop_at
    and whose first two characters occur earlier, at prefix_at, not followed by the rest, where
    a stream without stop strings ended a chunk."""
    for stop_at in range(len(text) - 4, 0, -1):
        stop = text[stop_at:stop_at + 4]
        prefix_at = text.find(stop[:2])
        if (text.find(stop) == stop_at and prefix_at + 4 <= stop_at
                and prefix_at + 2 in chunk_ends):
            return stop, prefix_at, stop_at
    raise AssertionError(f"no stop string with an earlier prefix in {text!r}")


def test_stream_holds_back_a_stop_string_prefix_then_releases_it(app_client):
    body = {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    free = _stream_chunks(app_client, "completions", body)
    text = "".join(c["choices"][0]["text"] for c in free)
    stop, prefix_at, stop_at = _stop_with_an_earlier_prefix(text, _streamed_lengths(free))
    full = app_client.post("/v1/completions", json={**body, "stop": stop}).json()
    chunks = _stream_chunks(app_client, "completions", {**body, "stop": stop})
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == full["choices"][0]["text"] == text[:stop_at]
    assert (chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
            == "stop")
    ends = _streamed_lengths(chunks)
    # Without stop strings a chunk ended right after the prefix; with one it waits until the
    # next character shows it is not the stop string, then comes out in full.
    assert prefix_at + 1 not in ends and prefix_at + 2 not in ends
    assert any(prefix_at + 2 < end < stop_at for end in ends)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_stream_with_n_and_logprobs_equals_full_reply(app_client, route):
    is_chat = route == "chat/completions"
    body = ({"messages": [{"role": "user", "content": "def add(a, b):"}], "logprobs": True,
             "top_logprobs": 2} if is_chat else {"prompt": PROMPTS[0], "logprobs": 2})
    body.update(n=2, max_tokens=16, temperature=1.0, seed=5, stop=["\n\n"])
    # Two requests (the second may hit the first's cached prompt blocks): their tokens are equal,
    # their float32 logprobs only to a tolerance (tests/logprob_compare.py says why).
    full = app_client.post(f"/v1/{route}", json=body).json()
    chunks = _stream_chunks(app_client, route, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    texts = []
    for choice in full["choices"]:
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        finishes = [c["finish_reason"] for c in mine]
        assert finishes == [None] * (len(mine) - 1) + [choice["finish_reason"]]
        streamed_logprobs = [c["logprobs"] for c in mine if c["logprobs"] is not None]
        if is_chat:
            texts.append(choice["message"]["content"])
            assert "".join(c["delta"].get("content", "") for c in mine) == texts[-1]
            assert_equal_but_floats_close(
                [item for lp in streamed_logprobs for item in lp["content"]],
                choice["logprobs"]["content"])
        else:
            texts.append(choice["text"])
            assert "".join(c["text"] for c in mine) == texts[-1]
            assert_equal_but_floats_close({key: [v for lp in streamed_logprobs for v in lp[key]]
                                           for key in choice["logprobs"]}, choice["logprobs"])
    assert len(set(texts)) == 2 and all(texts)


def test_several_prompts_and_n_give_prompt_major_choices(app_client):
    reply = app_client.post("/v1/completions", json={
        "prompt": ["a = ", "b = "], "n": 2, "max_tokens": 3, "temperature": 1, "seed": 1}).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
    assert reply["usage"]["prompt_tokens"] == 8
    assert reply["usage"]["completion_tokens"] == 12


def test_stream_with_n_ends_every_choice(app_client):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 5,
            "temperature": 1, "stream": True}
    with app_client.stream("POST", "/v1/chat/completions", json=body) as reply:
        lines = [line for line in reply.iter_lines() if line]
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    finished = {c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]}
    assert finished == {0, 1, 2}
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1, 2]


@pytest.mark.parametrize("method", ["step", "add_request"])
def test_engine_error_fails_that_request_and_the_next_one_works(app_client, method):
    """A transient failure: its request gets a 500, the error is counted, /health stays 200
    (one failed step is not a dead engine: tests/test_serve_health.py)."""
    engine = app_client.engine
    before = _metrics(app_client.get("/metrics").text)["jpaged:engine_errors_total"]

    def fail_once(*args, **kwargs):
        del engine.__dict__[method]  # the class's method is back for the next call
        raise RuntimeError("injected failure")

    setattr(engine, method, fail_once)
    try:
        reply = app_client.post("/v1/completions", json=GOOD)
    finally:
        engine.__dict__.pop(method, None)
    assert reply.status_code == 500 and "injected failure" in reply.json()["error"]["message"]
    values = _metrics(app_client.get("/metrics").text)
    assert values["jpaged:num_kv_blocks_used"] == 0
    assert values["jpaged:engine_errors_total"] == before + 1
    assert app_client.get("/health").status_code == 200
    assert app_client.post("/v1/completions", json=GOOD).status_code == 200
    assert app_client.get("/health").status_code == 200


def test_metrics_health_and_models(app_client):
    assert app_client.get("/health").status_code == 200
    assert app_client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    text = app_client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_requests_swapped", "vllm:gpu_cache_usage_perc",
                 "vllm:gpu_prefix_cache_hit_rate", "vllm:num_preemptions_total",
                 "vllm:generation_tokens_total", "jpaged:num_kv_blocks_used",
                 "jpaged:num_kv_blocks_free", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "jpaged:engine_errors_total"):
        assert name in text, name
    values = _metrics(text)
    assert values["vllm:num_requests_swapped"] == 0
    assert values["jpaged:num_kv_blocks_free"] == values["jpaged:num_kv_blocks_total"]


def _metric_changes(app_client, send):
    """`send()`'s result and a function giving how much a metric moved during it."""
    before = _metrics(app_client.get("/metrics").text)
    result = send()
    after = _metrics(app_client.get("/metrics").text)
    return result, lambda name: after[name] - before[name]


def test_latency_histograms_count_first_and_later_tokens(app_client):
    reply, delta = _metric_changes(app_client, lambda: app_client.post(
        "/v1/completions", json={"prompt": "x = ", "max_tokens": 6, "ignore_eos": True}))
    assert reply.json()["usage"]["completion_tokens"] == 6
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:time_per_output_token_seconds_count") == 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:request_success_total") == 1


def test_latency_histograms_count_streamed_tokens(app_client):
    chunks, delta = _metric_changes(app_client, lambda: _stream_chunks(app_client, "completions", {
        "prompt": "x = ", "max_tokens": 6, "ignore_eos": True,
        "stream_options": {"include_usage": True}}))
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:time_per_output_token_seconds_count") == 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 1


# ---- flags and templates (no engine) ------------------------------------------------------------
def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--host", "--port", "--block-size", "--num-kv-blocks",
                 "--gpu-memory-utilization", "--max-num-seqs", "--max-model-len",
                 "--preemption-mode", "--swap-space", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--load-format", "--dtype", "--seed",
                 "--attention-backend", "--dead-engine-exit-delay", "--tool-call-parser"):
        assert flag in text, flag
    assert "127.0.0.1" in text


@pytest.mark.parametrize("argv,flag", [(["--preemption-mode", "evict"], "--preemption-mode"),
                                       (["--preemption-mode", "swap", "--swap-space", "0"],
                                        "--preemption-mode"),
                                       (["--swap-space", "-1"], "--swap-space"),
                                       (["--dead-engine-exit-delay", "-1"],
                                        "--dead-engine-exit-delay"),
                                       (["--dead-engine-exit-delay", "nan"],
                                        "--dead-engine-exit-delay"),
                                       (["--tool-call-parser", "xml"], "--tool-call-parser")])
def test_bad_flag_values_fail_at_startup_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_flags_reach_the_engine_options():
    args = serve.parse_args(["--block-size", "8", "--num-kv-blocks", "99", "--max-num-seqs", "3",
                             "--max-model-len", "100", "--dtype", "bfloat16", "--seed", "5",
                             "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                             "--num-scheduler-steps", "4", "--async-scheduling",
                             "--load-format", "dummy", "--preemption-mode", "swap",
                             "--swap-space", "2.5"])
    options = serve.engine_options(args)
    assert (options["preemption_mode"], options["swap_space"],
            options["enable_prefix_caching"]) == ("swap", 2.5, False)
    defaults = serve.engine_options(serve.parse_args([]))
    assert (defaults["preemption_mode"], defaults["swap_space"],
            defaults["enable_prefix_caching"]) == ("auto", 4.0, True)
    assert (options["block_size"], options["num_kv_blocks"], options["max_num_seqs"],
            options["max_model_len"], options["dtype"], options["seed"],
            options["gpu_memory_utilization"]) == (8, 99, 3, 100, "bfloat16", 5, 0.5)
    assert (options["num_scheduler_steps"], options["async_scheduling"]) == (4, True)
    assert options["load_format"] == "dummy" and serve.parse_args([]).load_format == "auto"
    assert (args.host, args.model) == ("127.0.0.1", None)


def test_every_option_of_the_table_is_a_flag_with_its_default():
    from jpaged.options import OPTIONS

    args = serve.parse_args([])
    flags = [o for o in OPTIONS if o.is_flag]
    assert {o.name for o in OPTIONS} - {o.name for o in flags} == {"devices"}   # Python only
    assert {o.name: getattr(args, o.name) for o in flags} == {o.name: o.default for o in flags}
    assert set(serve.engine_options(args)) == {o.name for o in flags} - {"data_parallel_size"}
    options = serve.engine_options(serve.parse_args(
        ["--warmup", "--strict-compilation", "--compilation-cache-dir", "/tmp/xla"]))
    assert (options["warmup"], options["strict_compilation"],
            options["compilation_cache_dir"]) == (True, True, "/tmp/xla")


@pytest.mark.parametrize("argv,flag", [
    (["--block-size", "0"], "--block-size"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
    (["--data-parallel-size", "0"], "--data-parallel-size"),
    (["--strict-compilation", "--no-warmup"], "--strict-compilation"),
    (["--preemption-mode", "swap", "--tensor-parallel-size", "2"], "--preemption-mode")])
def test_the_tables_checks_name_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_chat_template_from_tokenizer_config_and_default(tmp_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert chat.ChatTemplate().render(messages) == "user: hi\nassistant: yo\nassistant:"
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = chat.ChatTemplate.from_model_dir(tmp_path)
    assert template.render(messages) == "<s>[user]hi</s>[assistant]yo</s>[assistant]"
    strict = chat.ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="alternate"):
        strict.render(messages)


# ---- the in-process app over real HTTP (uvicorn on a thread) -----------------------------------
# These servers drive app_client's engine thread, which a test may hold at a step
# (tests/engine_hold.py) to act while its request is surely in flight.
API_KEY = "test-key"


@contextlib.contextmanager
def _served_on_a_thread(app):
    """`app` served by uvicorn on a thread on a free 127.0.0.1 port (lifespan off: the engine
    thread is app_client's, already started): its URL. The server stops on the way out."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + GUARD_SECONDS
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(GUARD_SECONDS)


@pytest.fixture(scope="module")
def live_url(app_client):
    """app_client's app over real HTTP, so that a client can disconnect."""
    with _served_on_a_thread(serve.build_app(app_client.async_engine, app_client.model)) as url:
        yield url


class _HeldTokenizer:
    """The model's tokenizer; while `gate` is an Event, tokenising waits for it to be set."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.gate: threading.Event | None = None
        self.is_waiting = threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode_batch(self, *args, **kwargs):
        if self.gate is not None:
            self.is_waiting.set()
            if not self.gate.wait(GUARD_SECONDS):
                raise RuntimeError(f"tokenising was held for over {GUARD_SECONDS} s")
        return self._tokenizer.encode_batch(*args, **kwargs)


@pytest.fixture(scope="module")
def keyed_url(app_client):
    """A second app over app_client's engine thread with an API key and the default 4 MiB body
    limit. It tokenises every prompt (no early length check), as it must for tokenizers without
    a sound bound, with a tokenizer a test may hold (`keyed_url.tokenizer`)."""
    tokenizer = _HeldTokenizer(app_client.model.tokenizer)
    model = dataclasses.replace(app_client.model, max_token_chars=None, tokenizer=tokenizer)
    with _served_on_a_thread(serve.build_app(app_client.async_engine, model,
                                             api_key=API_KEY)) as url:
        yield _KeyedURL(url, tokenizer)


class _KeyedURL(str):
    """The keyed server's URL, carrying its tokenizer."""

    def __new__(cls, url: str, tokenizer: _HeldTokenizer):
        self = super().__new__(cls, url)
        self.tokenizer = tokenizer
        return self


def test_stream_disconnect_aborts_and_frees_blocks(live_url, app_client):
    """The client reads the first token and leaves while the engine is held at its next step:
    the server aborts the request before it generates more."""
    metrics = lambda: httpx.get(f"{live_url}/metrics").text  # noqa: E731
    before = _metrics(metrics())
    body = {"prompt": "def main(", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with held_steps(app_client.engine, after_outputs=1), \
            watched_aborts(app_client.async_engine) as aborts:
        with httpx.stream("POST", f"{live_url}/v1/completions", json=body,
                          timeout=GUARD_SECONDS) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        assert len(aborts.wait_for_any()) == 1
    after = _wait_idle(metrics)
    assert after["jpaged:num_kv_blocks_used"] == 0
    assert after["vllm:num_requests_running"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 0 < generated < 200  # aborted, not run to max_tokens


def test_non_streaming_disconnect_aborts(live_url, app_client):
    """A client that leaves while its request waits at the engine's first step (here, a
    connection closed once the request is in) gets its request aborted, its blocks freed."""
    metrics = lambda: httpx.get(f"{live_url}/metrics").text  # noqa: E731
    before = _metrics(metrics())
    body = {"prompt": "import ", "max_tokens": 230, "temperature": 0, "ignore_eos": True}
    payload = json.dumps(body).encode()
    with held_steps(app_client.engine) as hold, \
            watched_aborts(app_client.async_engine) as aborts:
        host, port = live_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=GUARD_SECONDS) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                               b"Content-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            assert hold.is_holding.wait(GUARD_SECONDS), "the request never reached a step"
        assert len(aborts.wait_for_any()) == 1   # the connection closed, the request held
    after = _wait_idle(metrics)
    assert after["jpaged:num_kv_blocks_used"] == 0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < 230


def test_api_key_guards_v1_with_the_openai_client(keyed_url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=60)
    assert client.models.retrieve("tiny").id == "tiny"
    reply = client.completions.create(model="tiny", prompt="x = ", max_tokens=2)
    assert reply.usage.completion_tokens <= 2
    wrong = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="wrong", max_retries=0,
                          timeout=GUARD_SECONDS)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.retrieve("tiny")
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="x = ", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    missing = httpx.post(f"{keyed_url}/v1/completions", json=GOOD)
    assert _error(missing, 401)["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed_url}/health").status_code == 200        # open without the key
    assert httpx.head(f"{keyed_url}/health").status_code == 200
    assert httpx.get(f"{keyed_url}/metrics").status_code == 200


def _health_while(url: str, post: dict, in_flight, release, *, polls: int = 5):
    """POST /v1/completions (httpx keyword arguments `post`); once `in_flight()` (awaited) says
    the request is held under way, GET /health `polls` times, each of which must answer 200;
    then `release()` the request and return its reply."""
    async def run():
        async with httpx.AsyncClient(timeout=GUARD_SECONDS) as http:
            reply = asyncio.ensure_future(http.post(f"{url}/v1/completions", **post))
            try:
                await in_flight()
                assert not reply.done(), reply.result()
                for _ in range(polls):
                    assert (await http.get(f"{url}/health")).status_code == 200
            finally:
                release()
            return await reply

    return asyncio.run(run())


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_10mb_body_is_a_413_and_health_answers_while_it_streams_in(keyed_url, declared):
    """Content-Length over the limit is refused before the body is read; a chunked body is read
    only up to the limit. Meanwhile /health answers: with the chunked body stopped halfway to
    the limit, the server (a request's body still coming) answers /health."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    body = b'{"prompt": "' + b"a" * 10_000_000 + b'"}'

    async def run():
        async with httpx.AsyncClient(timeout=GUARD_SECONDS) as http:
            healthy = asyncio.Event()

            async def chunks():   # no Content-Length: the limit holds while the body streams
                for start in range(0, len(body), 1 << 16):
                    if start == 2 << 20:   # 2 MiB in, under the limit: wait for /health
                        await healthy.wait()
                    yield body[start:start + (1 << 16)]

            reply = asyncio.ensure_future(http.post(
                f"{keyed_url}/v1/completions", headers=headers,
                content=body if declared else chunks()))
            assert (await http.get(f"{keyed_url}/health")).status_code == 200
            healthy.set()
            return await reply

    assert _error(asyncio.run(run()), 413)["code"] == "request_too_large"


def test_health_answers_while_a_request_with_the_most_stop_strings_runs(keyed_url, app_client):
    """The largest stop set a request may carry (MAX_STOP_STRINGS strings of MAX_STOP_LENGTH
    characters, none of which occurs) runs to the end, and /health answers while it is in
    flight (held at a step after its first output). What such a set costs per character is
    counted in tests/test_detokenizer.py."""
    from jpaged.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS

    headers = {"Authorization": f"Bearer {API_KEY}"}
    stops = [chr(0x4E00 + i) * MAX_STOP_LENGTH for i in range(MAX_STOP_STRINGS)]
    body = dict(model="tiny", prompt="x = ", max_tokens=200, ignore_eos=True, stop=stops,
                temperature=0)
    with held_steps(app_client.engine, after_outputs=1) as hold:
        async def in_flight():
            assert await asyncio.to_thread(hold.is_holding.wait, GUARD_SECONDS)

        reply = _health_while(keyed_url, dict(headers=headers, json=body), in_flight,
                              hold.release)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 200


def test_a_long_prompt_is_tokenised_off_the_event_loop(keyed_url):
    """A prompt is tokenised on a worker thread: with tokenising held, /health answers (on the
    event loop it would wait for the hold, and the test would fail at its guard)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokenizer = keyed_url.tokenizer
    gate = tokenizer.gate = threading.Event()
    tokenizer.is_waiting.clear()

    async def in_flight():
        assert await asyncio.to_thread(tokenizer.is_waiting.wait, GUARD_SECONDS)

    try:
        reply = _health_while(keyed_url, dict(headers=headers, json={
            "prompt": "def f(x):\n    return x\n" * 100}), in_flight, gate.set)
    finally:
        gate.set()
        tokenizer.gate = None
    assert _error(reply, 400)["code"] == "context_length_exceeded"


def test_api_key_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("JPAGED_API_KEY", "from-env")
    assert serve.parse_args([]).api_key == "from-env"
    assert serve.parse_args(["--api-key", "from-flag"]).api_key == "from-flag"
    monkeypatch.delenv("JPAGED_API_KEY")
    args = serve.parse_args(["--max-request-bytes", "1000"])
    assert (args.api_key, args.max_request_bytes) == (None, 1000)
    assert args.dead_engine_exit_delay == 2.0
    assert serve.parse_args(["--dead-engine-exit-delay", "0"]).dead_engine_exit_delay == 0.0
