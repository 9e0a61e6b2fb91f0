"""tool_choice "auto": each family's parser on written replies (calls found, anything else kept
as content) and the parser a model gets. Streams of these replies: tests/test_tool_stream.py."""

import json

import pytest
import tokenizers

from jpaged.engine.builder import default_model_dir
from jpaged.request import CompletionOutput, RequestOutput
from jpaged.sampling_params import SamplingParams
from jpaged.serve import tools_api
from jpaged.serve.errors import APIError
from jpaged.serve.chat import ChatTemplate
from jpaged.serve.openai_api import ModelInfo, ParsedRequest, parse_chat
from jpaged.serve.replies import ReplyBuilder
from jpaged.serve.tool_parsers import PARSERS, markers_are_special, tool_call_parser

FUNCTIONS = ("add", "now")
ADD_7, NOW = ("add", {"a": 7}), ("now", {})


def hermes_call(name: str, arguments: dict | None = None) -> str:
    body = {"name": name} if arguments is None else {"name": name, "arguments": arguments}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


HERMES = [   # (reply text, content, calls)
    (hermes_call("add", {"a": 7}), None, [ADD_7]),
    (f"Let me add.\n{hermes_call('add', {'a': 7})}\n{hermes_call('now', {})}\n",
     "Let me add.", [ADD_7, NOW]),
    (f"{hermes_call('now')} Done.", " Done.", [NOW]),                 # no arguments: {}
    ('<tool_call>\n{"name": "add", "arguments": {"a": 7}}', None, [ADD_7]),   # unclosed, at the end
    ("No call here.", "No call here.", []),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 7}\n</tool_call>',        # malformed JSON
     '<tool_call>\n{"name": "add", "arguments": {"a": 7}\n</tool_call>', []),
    (hermes_call("sub", {"a": 1}), hermes_call("sub", {"a": 1}), []),           # unknown function
    (hermes_call("add", {"a": 1}).replace('{"a": 1}', '"a=1"'),                 # arguments not {}
     hermes_call("add", {"a": 1}).replace('{"a": 1}', '"a=1"'), []),
    (f"{hermes_call('sub')}\n{hermes_call('add', {'a': 7})}", hermes_call("sub"), [ADD_7]),
    ('<tool_call>{"arguments": {"a":7}, "name": "add"}</tool_call>', None, [ADD_7]),   # any order
]
LLAMA3_JSON = [
    ('{"name": "add", "parameters": {"a": 7}}', None, [ADD_7]),
    ('<|python_tag|>{"name": "add", "arguments": {"a": 7}}', None, [ADD_7]),
    ('  {"name": "add", "parameters": {"a": 7}}; {"name": "now", "parameters": {}}', None,
     [ADD_7, NOW]),
    ('Calling. <|python_tag|>{"name": "now", "parameters": {}}', "Calling.", [NOW]),
    ('{"name": "add", "parameters": {"a": 7}}; {"name": "sub", "parameters": {}}',
     '{"name": "sub", "parameters": {}}', [ADD_7]),
    ('{"name": "add", "parameters": {"a": 7}', '{"name": "add", "parameters": {"a": 7}', []),
    ('{"answer": 42}', '{"answer": 42}', []),                 # JSON, not a call
    ('The answer: {"name": "now"}', 'The answer: {"name": "now"}', []),   # not at the start
]
MISTRAL = [
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7}}, {"name": "now", "arguments": {}}]',
     None, [ADD_7, NOW]),
    ('Sure. [TOOL_CALLS]{"name": "now", "arguments": {}}', "Sure.", [NOW]),
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7}}', '[TOOL_CALLS] [{"name": "add", '
     '"arguments": {"a": 7}}', []),
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7}}, {"name": "sub", "arguments": {}}]',
     '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7}}, {"name": "sub", "arguments": {}}]',
     []),                                                      # one unknown: the list stays
    ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    (' [{"name": "now", "arguments": {}}]', None, [NOW]),     # [TOOL_CALLS] left out (special)
    ("[1, 2] and [TOOL_CALLS]", "[1, 2] and [TOOL_CALLS]", []),
    ('See [the docs](x). [TOOL_CALLS][{"name": "now"}]', "See [the docs](x).", [NOW]),
    ('[TOOL_CALLS]add[ARGS]{"a": 7}', None, [ADD_7]),          # newer models: name[ARGS]{...}
    ('Sure.[TOOL_CALLS]add[ARGS]{"a": 7}[TOOL_CALLS]now[ARGS] {}', "Sure.", [ADD_7, NOW]),
    ('[TOOL_CALLS]sub[ARGS]{"a": 1}', '[TOOL_CALLS]sub[ARGS]{"a": 1}', []),   # unknown function
    ('[TOOL_CALLS]add[ARGS]"a=1"', '[TOOL_CALLS]add[ARGS]"a=1"', []),         # not an object
]
CASES = ([("hermes", *case) for case in HERMES] + [("llama3_json", *case) for case in LLAMA3_JSON]
         + [("mistral", *case) for case in MISTRAL])


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parsers_find_calls_and_keep_the_rest_as_content(parser, text, content, calls):
    found_content, found = PARSERS[parser].parse(text, FUNCTIONS)
    assert (found_content, [(name, json.loads(arguments)) for name, arguments in found]) == (
        (content, calls) if calls else (text, []))


def test_arguments_are_the_text_the_model_wrote():
    """Every parser's calls carry their arguments as written (what a stream sends), which
    parse to the value json.loads gives (a repeated key: the last one counts)."""
    written = '{"a":7, "s": "\\u00e9",  "a": 8}'
    replies = {"hermes": f'<tool_call>{{"name": "add", "arguments": {written}}}</tool_call>',
               "llama3_json": f'{{"name": "add", "parameters": {written}}}; {{"name": "now"}}',
               "mistral": f'[TOOL_CALLS][{{"arguments": {written}, "name": "add"}}, '
                          f'{{"name": "now", "arguments": {{ }}}}]'}
    for parser, reply in replies.items():
        _, calls = PARSERS[parser].parse(reply, FUNCTIONS)
        assert calls[0] == ("add", written), parser
        assert json.loads(calls[0][1]) == {"a": 8, "s": "é"}
    assert PARSERS["llama3_json"].parse(replies["llama3_json"], FUNCTIONS)[1][1] == ("now", "{}")
    assert PARSERS["mistral"].parse(replies["mistral"], FUNCTIONS)[1][1] == ("now", "{ }")


@pytest.mark.parametrize("name,model_type,template,expected", [
    (None, "qwen2", None, "hermes"), (None, "qwen3", None, "hermes"),
    (None, "mistral", None, "mistral"), (None, "mixtral", None, "mistral"),
    (None, "llama", "{{ '<|start_header_id|>' + m.role }}", "llama3_json"),
    (None, "llama", None, None),          # the built-in model: Llama, the default template
    (None, "gemma2", None, None),
    ("hermes", "llama", None, "hermes"), ("mistral", "gemma2", None, "mistral"),
    ("none", "qwen3", None, None)])      # the family's parser turned off
def test_the_parser_comes_from_its_name_or_the_model_family(name, model_type, template,
                                                             expected):
    parser = tool_call_parser(name, model_type, template)
    assert (parser and parser.name) == expected


def test_an_unknown_parser_name_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="'xml'.*hermes, llama3_json, mistral"):
        tool_call_parser("xml", "qwen2", None)


def test_auto_needs_a_parser_and_is_the_default_with_tools():
    body = {"tools": [{"type": "function", "function": {"name": name}} for name in FUNCTIONS]}
    for choice in ({}, {"tool_choice": "auto"}):
        with pytest.raises(APIError, match="--tool-call-parser") as error:
            tools_api.tool_calling({**body, **choice})
        assert error.value.param == "tool_choice"
        tools = tools_api.tool_calling({**body, **choice}, PARSERS["hermes"])
        assert (tools.choice, tools.schema, tools.functions) == ("auto", None, FUNCTIONS)
    one = tools_api.tool_calling({**body, "parallel_tool_calls": False}, PARSERS["hermes"])
    content, calls, finish_reason = one.reply(hermes_call("now") + hermes_call("add"), "stop")
    assert [call["function"]["name"] for call in calls] == ["now"]   # the first only


# ---- special-token markers --------------------------------------------------------------------
def _tokenizer(special: list[str], plain: list[str]) -> tokenizers.Tokenizer:
    """The built-in model's byte-level tokenizer plus added tokens, special or not."""
    tokenizer = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def test_markers_are_special_only_where_the_tokenizer_marks_them_special():
    llama = _tokenizer(["<|python_tag|>"], [])
    qwen = _tokenizer(["<|im_end|>"], ["<tool_call>"])  # Qwen's markers are added, not special
    mistral = _tokenizer(["[TOOL_CALLS]"], [])
    assert markers_are_special(PARSERS["llama3_json"], llama)
    assert markers_are_special(PARSERS["mistral"], mistral)
    assert not markers_are_special(PARSERS["hermes"], qwen)
    assert not markers_are_special(PARSERS["mistral"], llama)
    assert not markers_are_special(PARSERS["llama3_json"], qwen)
    assert not markers_are_special(None, llama) and not markers_are_special(
        PARSERS["llama3_json"], None)
    # What the flag is for: decoding with skip_special_tokens drops the marker.
    tag = llama.token_to_id("<|python_tag|>")
    assert llama.decode([tag], skip_special_tokens=True) == ""
    assert llama.decode([tag], skip_special_tokens=False) == "<|python_tag|>"


@pytest.mark.parametrize("extra,is_special,skips", [
    ({}, True, False),                                    # auto: markers reach the parser
    ({"tool_choice": "auto"}, True, False),
    ({"skip_special_tokens": None}, True, False),         # null: not set
    ({"skip_special_tokens": True}, True, True),          # set by the request: kept
    ({"tool_choice": "auto", "skip_special_tokens": False}, True, False),
    ({}, False, True),                                    # the markers are plain text
    ({"tool_choice": "none"}, True, True),                # no parsing, no change
    ({"tools": None}, True, True),
    ({"tools": None, "skip_special_tokens": False}, False, False),
])
def test_auto_decodes_with_special_tokens_where_the_markers_are_special(extra, is_special,
                                                                          skips):
    tokenizer = _tokenizer(["<|python_tag|>"], [])
    model = ModelInfo("tiny", tokenizer, tokenizer.get_vocab_size(), 256, ChatTemplate(),
                      tool_parser=PARSERS["llama3_json"], tool_markers_are_special=is_special)
    body = {"messages": [{"role": "user", "content": "Now?"}], "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": name}} for name in FUNCTIONS],
            **extra}
    assert parse_chat(body, model).params.skip_special_tokens is skips
