"""The tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info): the tokens the generation
endpoints count, round trips, special tokens and chat templates as a Hugging Face tokenizer has
them, bad input as 400s naming the field, and the API key."""

import json

import pytest
import tokenizers
from fastapi.testclient import TestClient

from jpaged import LLM
from jpaged.engine.builder import default_model_dir
from jpaged.serve import chat
from jpaged.serve import openai_api as api
from jpaged.serve import build_app, model_info, tokenize_api
from jpaged.serve.async_engine import AsyncEngine
from tests.test_serve import ENGINE_FLAGS, PROMPTS, _error

CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def client():
    """The built-in model's app (its engine compiles on demand: few requests generate)."""
    engine = LLM(None, warmup=False, **ENGINE_FLAGS).engine
    async_engine = AsyncEngine(engine, "tiny")
    app = build_app(async_engine, model_info(engine, default_model_dir(), "tiny"))
    with TestClient(app) as client:
        client.engine, client.async_engine = engine, async_engine
        yield client


def _ok(reply) -> dict:
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_tokenize_counts_a_prompt_as_completions_does(client):
    tokenizer = client.engine.tokenizer
    for prompt in PROMPTS:
        reply = _ok(client.post("/tokenize", json={"model": "tiny", "prompt": prompt}))
        assert reply == {"count": len(tokenizer.encode(prompt).ids), "max_model_len": 256,
                         "tokens": tokenizer.encode(prompt).ids, "token_strs": None}
    reply = _ok(client.post("/tokenize", json={"prompt": PROMPTS[1], "return_token_strs": True}))
    assert reply["token_strs"] == tokenizer.encode(PROMPTS[1]).tokens
    completion = _ok(client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 1}))
    assert completion["usage"]["prompt_tokens"] == reply["count"]


def test_a_prompt_longer_than_the_context_is_counted_not_refused(client):
    long = "import os\n" * 100
    reply = _ok(client.post("/tokenize", json={"prompt": long}))
    assert reply["count"] > reply["max_model_len"] == 256
    error = _error(client.post("/v1/completions", json={"prompt": long}), 400)
    assert error["code"] == "context_length_exceeded"


def test_chat_messages_are_counted_as_the_chat_endpoint_renders_them(client):
    reply = _ok(client.post("/tokenize", json={"messages": CHAT}))
    served = _ok(client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}))
    assert reply["count"] == served["usage"]["prompt_tokens"]
    bare = _ok(client.post("/tokenize", json={"messages": CHAT,
                                              "add_generation_prompt": False}))
    template = chat.ChatTemplate()   # the built-in model has no template of its own
    assert bare["tokens"] == client.engine.tokenizer.encode(
        template.render(CHAT, add_generation_prompt=False)).ids
    assert bare["count"] < reply["count"]
    tools = [{"type": "function", "function": {"name": "now"}}]
    with_tools = _ok(client.post("/tokenize", json={"messages": CHAT, "tools": tools}))
    served = _ok(client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 1, "tools": tools, "tool_choice": "none"}))
    assert with_tools["count"] == served["usage"]["prompt_tokens"] > reply["count"]


@pytest.mark.parametrize("text", ["def main(", "é🙂\n日本語", " leading  spaces\tand\ttabs "])
def test_detokenize_inverts_tokenize(client, text):
    tokens = _ok(client.post("/tokenize", json={"prompt": text}))["tokens"]
    assert _ok(client.post("/detokenize", json={"model": "tiny", "tokens": tokens})) == {
        "prompt": text}


BAD = [("/tokenize", {}, 400, "prompt"),
       ("/tokenize", {"prompt": 3}, 400, "prompt"),
       ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
       ("/tokenize", {"prompt": "a", "return_token_strs": 1}, 400, "return_token_strs"),
       ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
       ("/tokenize", {"messages": []}, 400, "messages"),
       ("/tokenize", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
       ("/tokenize", {"messages": CHAT, "add_generation_prompt": "no"}, 400,
        "add_generation_prompt"),
       ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400,
        "continue_final_message"),
       ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
       ("/tokenize", {"messages": CHAT, "tools": [{"type": "tool"}]}, 400, "tools[0]"),
       ("/detokenize", {}, 400, "tokens"),
       ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
       ("/detokenize", {"tokens": [1, True]}, 400, "tokens"),
       ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
       ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
       ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model")]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests_are_errors_naming_the_field(client, path, body, status, param):
    assert _error(client.post(path, json=body), status)["param"] == param
    assert _ok(client.post("/tokenize", json={"prompt": "x"}))["count"] >= 1


def test_a_body_that_is_not_json_is_a_400(client):
    for path in ("/tokenize", "/detokenize"):
        assert "not valid JSON" in _error(client.post(path, content=b"{nope"), 400)["message"]


def test_the_api_key_guards_the_tokenizer_endpoints(client):
    keyed = TestClient(build_app(client.async_engine, model_info(
        client.engine, default_model_dir(), "tiny"), api_key="secret"))   # no lifespan: the
    for method, path, body in (("post", "/tokenize", {"prompt": "a"}),    # engine is client's
                               ("post", "/detokenize", {"tokens": [65]}),
                               ("get", "/tokenizer_info", None)):
        extra = {} if body is None else {"json": body}
        assert _error(getattr(keyed, method)(path, **extra), 401)["code"] == "invalid_api_key"
        reply = getattr(keyed, method)(path, headers={"Authorization": "Bearer secret"}, **extra)
        assert reply.status_code == 200, reply.text
    assert keyed.get("/health").status_code == 200


# ---- a Hugging Face tokenizer: special tokens, a chat template, tokenizer_config.json ----------
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> api.ModelInfo:
    """The parity checkpoints' tokenizer (encoding prepends <s>) with a chat template added."""
    from tests import hf_fixtures

    directory = tmp_path_factory.mktemp("tokenizer")
    hf_fixtures.write_tokenizer(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE,
                                       "model_max_length": 2048}))
    template = chat.ChatTemplate.from_model_dir(directory)
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    return api.ModelInfo(name="hf", vocab_size=hf_fixtures.VOCAB_SIZE, max_model_len=64,
                         tokenizer=tokenizer, chat_template=template,
                         tokenizer_info=tokenize_api.tokenizer_info(directory, template.source))


def test_special_tokens_are_added_as_asked(hf_model):
    bos = hf_model.tokenizer.token_to_id("<s>")
    plain = tokenize_api.tokenize({"prompt": "hello world"}, hf_model)
    bare = tokenize_api.tokenize({"prompt": "hello world", "add_special_tokens": False,
                                  "return_token_strs": True}, hf_model)
    assert plain["tokens"] == [bos] + bare["tokens"] and plain["count"] == bare["count"] + 1
    assert bare["token_strs"] == hf_model.tokenizer.encode("hello world",
                                                           add_special_tokens=False).tokens
    assert tokenize_api.detokenize({"tokens": plain["tokens"]}, hf_model) == {
        "prompt": "<s>hello world"}   # special tokens included, as transformers' decode


def test_chat_counts_the_templates_special_tokens_once(hf_model):
    bos = hf_model.tokenizer.token_to_id("<s>")
    reply = tokenize_api.tokenize({"messages": CHAT}, hf_model)
    text = "<s>[system]You write Python.</s>[user]def add(a, b):</s>[assistant]"
    assert reply["tokens"] == hf_model.tokenizer.encode(text, add_special_tokens=False).ids
    assert reply["tokens"].count(bos) == 1   # the template's, not one more from encoding
    doubled = tokenize_api.tokenize({"messages": CHAT, "add_special_tokens": True}, hf_model)
    assert doubled["tokens"] == [bos] + reply["tokens"]


def test_tokenizer_info_is_the_tokenizer_config(hf_model):
    info = hf_model.tokenizer_info
    assert info == {"bos_token": "<s>", "eos_token": "</s>",
                    "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE,
                    "model_max_length": 2048}


def test_the_built_in_models_tokenizer_info(client):
    """No tokenizer_config.json: the EOS token's text comes from the model's EOS id, and it
    tokenizes back to that id alone (how lm-eval's remote tokenizer finds the EOS id)."""
    info = _ok(client.get("/tokenizer_info"))
    assert info == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    reply = _ok(client.post("/tokenize", json={"prompt": info["eos_token"],
                                                "add_special_tokens": False}))
    assert reply["tokens"] == [256]


def test_a_model_without_a_tokenizer_says_so(hf_model):
    import dataclasses

    bare = dataclasses.replace(hf_model, tokenizer=None)
    for parse, body, param in ((tokenize_api.tokenize, {"prompt": "a"}, "prompt"),
                               (tokenize_api.tokenize, {"messages": CHAT}, "messages"),
                               (tokenize_api.detokenize, {"tokens": [1]}, "tokens")):
        with pytest.raises(api.APIError, match="no tokenizer") as refused:
            parse(body, bare)
        assert refused.value.param == param
