"""Tool calls streamed as they are written (named, required, and "auto" with each parser): a
reply split into chunks at every position, and one character at a time, must join to the full
reply: its content, and calls accumulated by index (ids aside) equal to the full reply's, each
call's header before its arguments, and Hermes and forced calls sent before the reply ends. A
call that turns out not to be one (a reply cut short, JSON broken after the header) ends the
stream with what it has sent: pinned here."""

import json

import pytest

from jpaged.request import CompletionOutput, RequestOutput
from jpaged.sampling_params import SamplingParams
from jpaged.serve import tool_stream, tools_api
from jpaged.serve.openai_api import ModelInfo, ParsedRequest
from jpaged.serve.replies import ReplyBuilder
from jpaged.serve.tool_parsers import PARSERS
from tests.test_tool_parsers import CASES, FUNCTIONS, hermes_call

NAMED = tools_api.ToolCalling([], "named", name="add", schema={}, functions=("add",))
REQUIRED = tools_api.ToolCalling([], "required", schema={}, functions=FUNCTIONS)


def auto(parser: str) -> tools_api.ToolCalling:
    return tools_api.ToolCalling([], "auto", parser=PARSERS[parser], functions=FUNCTIONS)


FORCED = [   # (tools, reply text): the constrained output
    (NAMED, '{"a": 7, "s": "x\\u00e9y"}'),
    (NAMED, '  { "a" :7 ,"a": 8}  '),                  # spaces kept, the repeated key too
    (REQUIRED, '[{"name": "add", "parameters": {"a": 7, "b": [1, {"c": "]}"}]}}, '
               '{"name": "now", "parameters": {}}]'),
    (REQUIRED, '[ {"parameters": {"a": 1}, "name": "add"} ]'),   # name after the arguments
]
# Replies whose stream sends a call that the full reply then has not: Hermes JSON that broke after
# the arguments had opened, JSON a reply leaves unclosed, a mistral list whose later item is not
# a call (the whole list stays content).
BROKEN = [   # (parser, reply text, the calls its one-character stream sends)
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 7}\n</tool_call>',
     [{"name": "add", "arguments": '{"a": 7'}]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 7}',
     [{"name": "add", "arguments": '{"a": 7'}]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7}}',
     [{"name": "add", "arguments": '{"a": 7}'}]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 7}}, '
                '{"name": "sub", "arguments": {}}]', [{"name": "add", "arguments": '{"a": 7}'}]),
]


def _builder(tools: tools_api.ToolCalling, stream: bool) -> ReplyBuilder:
    parsed = ParsedRequest(True, [[1]], SamplingParams(), stream, False, None, tools=tools)
    return ReplyBuilder(parsed, ModelInfo("tiny", None, 257, 256, None))


def _output(text: str, finish_reason: str | None) -> RequestOutput:
    completion = CompletionOutput(0, text, [], None, None, finish_reason)
    return RequestOutput("r", None, [1], [completion], finish_reason is not None)


def _full(tools, text: str, finish_reason: str = "stop") -> dict:
    return _builder(tools, stream=False).full([_output(text, finish_reason)])["choices"][0]


def _streamed(tools, pieces: list[str], finish_reason: str = "stop"):
    """(joined content, calls [{"name", "arguments"}] accumulated by index, last finish_reason,
    the chunk number of each call's header and of each of its argument fragments, the number of
    chunks before those of the last piece)."""
    builder, deltas = _builder(tools, stream=True), []
    for number, piece in enumerate(pieces, 1):
        output = _output(piece, finish_reason if number == len(pieces) else None)
        before_last = len(deltas)
        deltas += [chunk["choices"][0] for chunk in builder.chunks(0, output)]
    assert all(d["finish_reason"] is None for d in deltas[:-1])
    contents = [d["delta"]["content"] for d in deltas if "content" in d["delta"]]
    calls, timeline = [], []
    for number, delta in enumerate(deltas):
        for call in delta["delta"].get("tool_calls", []):
            if "id" in call:        # a header: the next index, an id, the name
                assert call["index"] == len(calls) and call["id"].startswith("call_")
                assert call["type"] == "function"
                calls.append(dict(call["function"]))
                timeline.append({"header": number, "fragments": []})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {
                    "arguments"} and call["index"] < len(calls)
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
                timeline[call["index"]]["fragments"].append(number)
    return ("".join(contents) if contents else None), calls, deltas[-1]["finish_reason"], \
        timeline, before_last


def _splits(text: str):
    """The text in two pieces at every position, and one character at a time (last)."""
    yield from ([text[:cut], text[cut:]] for cut in range(len(text) + 1))
    yield list(text)


def _check_joins(tools, text: str) -> list[dict]:
    """Every split's stream joins to the full reply; the one-character stream's timeline."""
    full = _full(tools, text)
    expected = [c["function"] for c in full["message"].get("tool_calls", [])]
    for pieces in _splits(text):
        content, calls, finish_reason, timeline, _ = _streamed(tools, pieces)
        assert (content, calls, finish_reason) == (
            full["message"]["content"], expected, full["finish_reason"]), pieces
    return _streamed(tools, list(text))


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_an_auto_stream_split_anywhere_joins_to_the_full_reply(parser, text, content, calls):
    full = _full(auto(parser), text)
    assert (full["message"]["content"], full["finish_reason"]) == (
        content if calls else text, "tool_calls" if calls else "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in full["message"].get("tool_calls", [])] == calls
    if text in {broken for _, broken, _ in BROKEN}:
        return
    _, _, _, timeline, before_last = _check_joins(auto(parser), text)
    assert len(timeline) == len(calls)
    # each call streams: its header and arguments come before the reply ends
    assert all(t["header"] < t["fragments"][0] < before_last for t in timeline)


@pytest.mark.parametrize("tools,text", FORCED)
def test_a_forced_stream_split_anywhere_joins_to_the_full_reply(tools, text):
    full = _full(tools, text)
    assert full["message"]["content"] is None
    assert full["finish_reason"] == ("stop" if tools.choice == "named" else "tool_calls")
    value = json.loads(text)
    written = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
               for c in full["message"]["tool_calls"]]
    assert written == ([("add", value)] if tools.choice == "named"
                       else [(item["name"], item["parameters"]) for item in value])
    _, calls, _, timeline, before_last = _check_joins(tools, text)
    assert len(timeline) == len(written)
    for call, times in zip(calls, timeline):   # header first, arguments as they come
        assert times["header"] < times["fragments"][0] < before_last
        if '{"parameters"' not in text:   # one character at a time, once the name is known
            assert len(times["fragments"]) >= len(call["arguments"]) - 1


def test_forced_arguments_are_the_text_the_model_wrote():
    assert _full(NAMED, ' {"a":7,"a": 8} ')["message"]["tool_calls"][0]["function"] == {
        "name": "add", "arguments": '{"a":7,"a": 8}'}


def test_a_call_header_waits_for_a_known_name_and_arguments_that_open_an_object():
    builder = _builder(auto("hermes"), stream=True)
    pieces = ['<tool_call>{"name": "su', 'b", "arguments": {"a": ', '1}}</tool_call>',
              '<tool_call>{"name": "add", "arguments": "', 'x"}</tool_call>',
              '<tool_call>{"name": "add"', ', "arguments": {', '"a": 7}}</tool_call>']
    sent = [[c["choices"][0]["delta"] for c in builder.chunks(0, _output(piece, None))]
            for piece in pieces]
    assert sent[:6] == [[]] * 6      # "sub" is not a function; "x" is not an object
    assert sent[6][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert sent[6][1]["tool_calls"][0] == {"index": 0, "function": {"arguments": "{"}}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in sent[7]] == ['"a": 7}']


def test_the_closing_brace_waits_for_the_call_to_be_whole():
    builder = _builder(auto("hermes"), stream=True)
    sent = builder.chunks(0, _output('<tool_call>{"name": "add", "arguments": {"a": 7}}', None))
    assert "".join(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                   for c in sent) == '{"a": 7'
    last = builder.chunks(0, _output("</tool_call>", "stop"))
    assert [c["choices"][0]["delta"] for c in last] == [
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}]
    assert last[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parser,text,streamed", BROKEN)
def test_a_call_that_breaks_after_its_header_ends_the_stream_with_what_it_sent(parser, text,
                                                                               streamed):
    full = _full(auto(parser), text)
    assert full["message"] == {"role": "assistant", "content": text}
    assert _streamed(auto(parser), list(text))[:3] == (None, streamed, "stop")
    assert _streamed(auto(parser), [text])[:3] == (text, [], "stop")   # one chunk: as full


@pytest.mark.parametrize("tools,text,content,arguments", [
    (NAMED, '{"a": 7, "s": "x', None, '{"a": 7, "s": "x'),
    (auto("hermes"), 'Hi.<tool_call>{"name": "add", "arguments": {"a": 7}}', "Hi.",
     '{"a": 7'),                       # the closing brace waits for the whole call
])
def test_a_reply_cut_short_streams_what_it_has_and_the_full_reply_keeps_it_as_content(
        tools, text, content, arguments):
    full = _full(tools, text, "length")
    assert (full["message"], full["finish_reason"]) == (
        {"role": "assistant", "content": text}, "length")
    assert _streamed(tools, list(text), "length")[:3] == (
        content, [{"name": "add", "arguments": arguments}], "length")
    assert _streamed(tools, [text], "length")[:3] == (text, [], "length")   # one chunk: as full


def test_text_before_a_call_streams_as_it_comes_and_a_half_marker_waits():
    builder = _builder(auto("hermes"), stream=True)
    sent = [builder.chunks(0, _output(piece, None)) for piece in ("Sure", ". <tool", "_ca")]
    assert [[c["choices"][0]["delta"] for c in chunks] for chunks in sent] == [
        [{"content": "Sure"}], [{"content": "."}], []]
    last = builder.chunks(0, _output('ll>{"name": "now"}</tool_call>', "stop"))
    assert [c["choices"][0]["delta"]["tool_calls"][0]["function"] for c in last] == [
        {"name": "now", "arguments": ""}, {"arguments": "{}"}]
    assert last[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_a_long_call_streams_in_fragments_at_a_cost_linear_in_its_length(parser, monkeypatch):
    """A call whose arguments run to 40,000 characters, streamed 4 characters a chunk: the text
    is scanned for calls again only after it grew by a 64th, so all the scans together read
    O(length) characters (each scan reads the whole text), while the arguments still go out in
    hundreds of fragments before the reply ends, joining to the full reply's."""
    arguments = {"code": "x = 1\n" * 6000 + "\u00e9"}
    body = json.dumps({"name": "add", "arguments": arguments})
    text = {"hermes": f"<tool_call>{body}</tool_call>", "llama3_json": body,
            "mistral": f"[TOOL_CALLS][{body}]"}[parser]
    tools, scanned = auto(parser), []
    scan = tools_api.ToolCalling.calls_so_far
    monkeypatch.setattr(tools_api.ToolCalling, "calls_so_far", lambda self, so_far: (
        scanned.append(len(so_far)), scan(self, so_far))[1])
    pieces = [text[at:at + 4] for at in range(0, len(text), 4)]
    content, calls, finish_reason, timeline, before_last = _streamed(tools, pieces)
    full = _full(auto(parser), text)["message"]
    assert (content, calls, finish_reason) == (
        None, [c["function"] for c in full["tool_calls"]], "tool_calls")
    assert json.loads(calls[0]["arguments"]) == arguments
    assert sum(scanned) < 100 * len(text)          # every chunk scanned: ~len(pieces) / 2 times
    assert len([f for f in timeline[0]["fragments"] if f < before_last]) > 200


def test_parallel_tool_calls_false_streams_the_first_call_only():
    one = tools_api.ToolCalling([], "auto", parser=PARSERS["hermes"], functions=FUNCTIONS,
                                is_parallel=False)
    text = hermes_call("now") + hermes_call("add", {"a": 7})
    assert _check_joins(one, text)[1] == [{"name": "now", "arguments": "{}"}]


@pytest.mark.parametrize("text,end", [('{"a": [1, "]"], "b": {}} x', 24), ('7 ', 1), ('7', None),
                                      ('"a\\"', None), ('{"a": 1', None)])
def test_value_end_finds_where_a_value_ends_or_that_it_has_not(text, end):
    assert tool_stream.value_end(text, 0) == end


@pytest.mark.parametrize("text", ['{"a": 1]', '}', '[1}'])
def test_value_end_refuses_what_cannot_be_json(text):
    with pytest.raises(ValueError):
        tool_stream.value_end(text, 0)
