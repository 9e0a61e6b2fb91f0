"""skip_special_tokens end to end, on a tiny Llama whose tokenizer has <|python_tag|> and
[TOOL_CALLS] as special tokens: the text keeps them only when asked (token ids the same both
ways), the token that ends a request is never text, stop strings match across special tokens,
and the server's field and tool_choice "auto" bring the markers to the tool-call parsers."""

import json

import pytest
import tokenizers
from fastapi.testclient import TestClient

from jpaged import LLM, SamplingParams
from jpaged.serve import build_app, model_info
from jpaged.serve.async_engine import AsyncEngine
from jpaged.structured_outputs import StructuredOutputsParams
from jpaged.serve.tool_syntax import PYTHON_TAG, TOOL_CALLS
from tests import hf_fixtures

EOS, TAG, CALLS = 1, 2, 3   # token ids: write_tokenizer puts the extra specials at 2, 3
SETTINGS = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
GREEDY = dict(temperature=0, max_tokens=4)
# The grammar writes some text, the special token, then the call (llguidance names a special
# token <|...|>, or <[id]> by id).
LLAMA_REPLY = 'start: "Sure." <|python_tag|> "{\\"name\\": \\"now\\", \\"parameters\\": {}}"'
MISTRAL_REPLY = 'start: "Sure." <[3]> "[{\\"name\\": \\"now\\", \\"arguments\\": {}}]"'
TOOLS = [{"type": "function", "function": {"name": "now"}}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    out_dir = tmp_path_factory.mktemp("special_tokens")
    hf_fixtures.build_llama_mha(out_dir)    # eos_token_id 1 only
    hf_fixtures.write_tokenizer(out_dir, (PYTHON_TAG, TOOL_CALLS))
    tokenizer = tokenizers.Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    assert [tokenizer.token_to_id(token) for token in (PYTHON_TAG, TOOL_CALLS)] == [TAG, CALLS]
    return str(out_dir)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, **SETTINGS)


def _both_ways(llm, **params):
    """The completion with skip_special_tokens True, then False."""
    return [llm.generate("Hello", SamplingParams(**params, skip_special_tokens=skip),
                         use_tqdm=False)[0].outputs[0] for skip in (True, False)]


def test_special_tokens_are_text_only_when_not_skipped(llm):
    grammar = StructuredOutputsParams(grammar='start: "Sure." <|python_tag|> "{}"')
    skipped, kept = _both_ways(llm, temperature=0, max_tokens=20,
                                structured_outputs=grammar)
    assert kept.text == "Sure.<|python_tag|>{}" and skipped.text == "Sure.{}"
    assert kept.token_ids == skipped.token_ids and TAG in kept.token_ids
    forced_skipped, forced_kept = _both_ways(llm, **GREEDY, logit_bias={TAG: 100})
    assert forced_kept.token_ids == forced_skipped.token_ids == [TAG] * 4
    assert (forced_kept.text, forced_skipped.text) == (PYTHON_TAG * 4, "")


@pytest.mark.parametrize("stop", [{"logit_bias": {EOS: 100}},
                                  {"logit_bias": {TAG: 100}, "stop_token_ids": [TAG]},
                                  {"logit_bias": {70: 100}, "stop_token_ids": [70]}],
                         ids=["eos", "special-stop-id", "plain-stop-id"])
def test_the_token_that_ends_a_request_is_a_token_but_not_text(llm, stop):
    for output in _both_ways(llm, **GREEDY, **stop):
        assert output.token_ids == [next(iter(stop["logit_bias"]))]
        assert (output.text, output.finish_reason) == ("", "stop")


def test_ignore_eos_makes_eos_text_like_any_special_token(llm):
    skipped, kept = _both_ways(llm, **GREEDY, logit_bias={EOS: 100}, ignore_eos=True)
    assert kept.token_ids == skipped.token_ids == [EOS] * 4
    assert (kept.text, skipped.text) == ("</s>" * 4, "")


def test_stop_strings_match_across_special_tokens(llm):
    skipped, kept = _both_ways(llm, **GREEDY, logit_bias={TAG: 100}, stop=["|><|"])
    assert (kept.text, kept.token_ids, kept.finish_reason) == ("<|python_tag", [TAG] * 2, "stop")
    assert (skipped.text, skipped.token_ids, skipped.finish_reason) == ("", [TAG] * 4, "length")


# ---- the server -------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama3_json", "mistral"])
def client(request, checkpoint, llm):
    """An app over the module's engine with one tool-call parser (one app at a time drives it)."""
    app = build_app(AsyncEngine(llm.engine, "tiny"),
                    model_info(llm.engine, checkpoint, "tiny", tool_call_parser=request.param))
    with TestClient(app) as test_client:
        test_client.parser = request.param
        yield test_client


def test_the_field_reaches_the_engine_through_the_openai_client(client):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    common = dict(model="tiny", **GREEDY, logit_bias={str(TAG): 100})
    for skip, text in ((None, ""), (True, ""), (False, PYTHON_TAG * 4)):
        extra = {} if skip is None else {"extra_body": {"skip_special_tokens": skip}}
        completion = api.completions.create(prompt="Hello", **common, **extra)
        assert completion.choices[0].text == text
        chat = api.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                           **common, **extra)
        assert chat.choices[0].message.content == text
    stream = api.completions.create(prompt="Hello", **common, stream=True,
                                    extra_body={"skip_special_tokens": False})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == PYTHON_TAG * 4


@pytest.mark.parametrize("route,body", [
    ("completions", {"prompt": "Hello"}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
@pytest.mark.parametrize("value", [0, "false", [True]])
def test_a_skip_special_tokens_not_a_bool_is_a_400_naming_it(client, route, body, value):
    reply = client.post(f"/v1/{route}", json={**body, "skip_special_tokens": value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "skip_special_tokens"
    assert "skip_special_tokens" in reply.json()["error"]["message"]


def _auto(client, stream=False, **extra) -> tuple[str | None, list, str]:
    """(content, [(name, arguments)], finish_reason) of a tool_choice "auto" reply the grammar
    writes: text, then the parser's special marker, then a call."""
    grammar = LLAMA_REPLY if client.parser == "llama3_json" else MISTRAL_REPLY
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS,
            "temperature": 0, "max_tokens": 40, "structured_outputs": {"grammar": grammar},
            "stream": stream, **extra}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if not stream:
        choice = reply.json()["choices"][0]
        message = choice["message"]
        return message["content"], [(call["function"]["name"], call["function"]["arguments"])
                                     for call in message.get("tool_calls") or ()], \
            choice["finish_reason"]
    deltas = [json.loads(line[6:])["choices"] for line in reply.text.splitlines()
              if line.startswith("data: {")]
    deltas = [choices[0] for choices in deltas if choices]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = {}      # by index: a call's header names it, its fragments join
    for d in deltas:
        for call in d["delta"].get("tool_calls", []):
            name, arguments = calls.get(call["index"], (None, ""))
            calls[call["index"]] = (call["function"].get("name", name),
                                    arguments + call["function"]["arguments"])
    return content, [calls[index] for index in sorted(calls)], deltas[-1]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_auto_finds_a_call_after_text_behind_a_special_marker(client, stream):
    assert _auto(client, stream) == ("Sure.", [("now", "{}")], "tool_calls")


def test_a_request_that_skips_special_tokens_itself_keeps_them_out(client):
    content, calls, finish_reason = _auto(client, skip_special_tokens=True)
    assert calls == [] and finish_reason == "stop"
    assert content.startswith("Sure.") and "Sure.<" not in content and "Sure.[T" not in content
