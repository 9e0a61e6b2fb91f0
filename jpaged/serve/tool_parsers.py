"""Tool calls a model writes in its own syntax, found in the reply's free text (tool_choice
"auto"): one parser per model family, chosen by name (`--tool-call-parser`) or from the model.

    hermes       Qwen2, Qwen2.5, Qwen3, Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}
                 \\n</tool_call>, any number of them, anywhere in the reply
    llama3_json  Llama 3.1+: {"name": ..., "parameters": {...}} ("arguments" too) as the whole
                 reply, or after <|python_tag|>; several separated by ";"
    mistral      [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}}; or that
                 list as the whole reply; or, as newer Mistral models write them,
                 [TOOL_CALLS]name[ARGS]{...} for each call

<|python_tag|> and [TOOL_CALLS] are special tokens in Llama 3.1's and Mistral's tokenizers, which
the engine leaves out of the text by default: where a parser's markers are special tokens
(`markers_are_special`), a tool_choice "auto" request is decoded with skip_special_tokens false,
unless it sets that field itself (as vLLM's parsers' `adjust_request`), so the markers reach the
parser and calls after some text are found. A reply that opens with the calls' JSON is read as
calls too (a Llama 3 model also writes bare JSON calls; vLLM's llama3_json parser reads a reply
opening with "{" the same way).

A call becomes one of `message.tool_calls` only if its JSON parses, it names a function of the
request's `tools` and its arguments are an object; anything else stays in the content as the
model wrote it. The content is the text outside the calls (None when only whitespace is left).
A call's arguments are the text the model wrote (the arguments value's exact span; see
tool_stream.py). A stream sends the text before the first call marker as it comes
(`streamable`), so the streamed content is always a prefix of the full reply's, and the rest of
the content when the reply ends; each parser's `calls_so_far` has its calls streamed as they are
written (`tools_api.py`): a call's header once its name is whole, then its arguments as they
come. A call streamed that the full reply then has not (a mistral list whose later item is not a
call, JSON the reply leaves unclosed) ends the stream with what it sent.
"""

import dataclasses
import json
import re
from collections.abc import Callable, Collection

from jpaged.serve.tool_stream import (ARGUMENT_KEYS, CallText, call_of, list_items,
                                      object_call, skip_space, value_end)

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # before [ARGS]
HERMES_CLOSE = "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)  # unclosed at the end
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


@dataclasses.dataclass(frozen=True)
class Span:
    """Where a possible call is written, text[start:end], the JSON objects it holds (None: its
    JSON did not parse), and their raw texts (the calls' arguments are the model's own text;
    json.dumps of the parsed value where a raw text is missing)."""
    start: int
    end: int
    objects: list | None
    texts: list[str] | None = None


@dataclasses.dataclass(frozen=True)
class ToolCallParser:
    """One family's syntax: where its calls may be written, and how a stream holds them back."""
    name: str
    markers: tuple[str, ...]          # text that opens a call: a stream holds back from there
    find: Callable[[str], list[Span]]  # the possible calls, in order, not overlapping
    # the calls written so far, for a stream, the last maybe still being written
    calls_so_far: Callable[[str, Collection[str]], list[CallText]]
    opens_with: str = ""              # a reply that starts with this ("{", "[") is a call too

    def parse(self, text: str,
              functions: Collection[str]) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(function name, arguments JSON text)]): the calls written in `text` to
        `functions`, and the text outside them; no calls: (text, [])."""
        calls, outside, at = [], [], 0
        for span in self.find(text):
            found = [call_of(value, functions) for value in span.objects or ()]
            if not found or None in found:
                continue                 # not a call: it stays in the content
            outside.append(text[at:span.start])
            texts = span.texts or [None] * len(found)
            calls.extend((name, _arguments_text(arguments, raw, functions))
                         for (name, arguments), raw in zip(found, texts))
            at = span.end
        if not calls:
            return text, []
        outside.append(text[at:])
        content = "".join(piece for piece in outside if piece.strip()).rstrip()
        return content or None, calls

    def streamable(self, text: str, opens_reply: bool = True) -> int:
        """How many characters of a reply's text not sent yet can be sent as content: those
        before a call marker, or a marker's possible start at the end, less trailing whitespace
        (it may come before a call, and a reply's content does not end in it). opens_reply:
        nothing was sent before `text` (a stream never sends part of a marker, so one cannot
        start before `text`)."""
        return len(text[:self._marker_start(text, opens_reply)].rstrip())

    def _marker_start(self, text: str, opens_reply: bool) -> int:
        if opens_reply and self.opens_with and text.startswith(self.opens_with,
                                                               _skip_space(text, 0)):
            return 0
        found = [text.find(marker) for marker in self.markers if marker in text]
        if found:
            return min(found)
        longest = max(map(len, self.markers))
        for start in range(max(0, len(text) - longest + 1), len(text)):
            if any(marker.startswith(text[start:]) for marker in self.markers):
                return start
        return len(text)


def _arguments_text(arguments: dict, raw: str | None, functions: Collection[str]) -> str:
    """A call's arguments as the model wrote them in `raw` (its JSON object's text), as a stream
    sends them; json.dumps of the parsed value where the parser keeps no raw text."""
    try:
        call = raw and object_call(raw, skip_space(raw, 0), ARGUMENT_KEYS, functions)
    except ValueError:   # JSON the parser read but the scanner did not: the parsed value
        call = None
    if call and call.is_complete:
        return call.arguments
    return json.dumps(arguments, ensure_ascii=False)


def _hermes(text: str) -> list[Span]:
    spans = []
    for match in _HERMES_CALL.finditer(text):
        try:
            value = json.loads(match.group(1))
        except ValueError:
            value = None
        spans.append(Span(match.start(), match.end(), None if value is None else [value],
                          [match.group(1)]))
    return spans


def _hermes_so_far(text: str, functions: Collection[str]) -> list[CallText]:
    """The Hermes calls written so far: those `parse` finds, then the one still being written,
    if it may yet be a call (its name, when whole, one of `functions`; its arguments an
    object). A call is complete once its </tool_call> has come."""
    calls = []
    for match in _HERMES_CALL.finditer(text):
        inner, is_closed = match.group(1), match.group(0).endswith(HERMES_CLOSE)
        at = skip_space(inner, 0)
        try:
            call = object_call(inner, at, ARGUMENT_KEYS, functions)
            if is_closed and call is not None and not (
                    call.is_complete and call_of(json.loads(inner), functions)):
                call = None
        except ValueError:
            call = None
        if call is None and is_closed:
            continue                     # not a call: it stays in the content
        if call is None or not is_closed:   # never a call, or still being written
            calls += [] if call is None else [dataclasses.replace(call, is_complete=False)]
            break
        calls.append(call)
    return calls


def _llama3_json(text: str) -> list[Span]:
    """JSON objects from <|python_tag|> or the reply's first "{" on, each span taking the ";"
    and whitespace after it; spans end where the text stops being JSON."""
    start = text.find(PYTHON_TAG)
    at = start + len(PYTHON_TAG) if start >= 0 else _skip_space(text, 0)
    if start < 0:
        if not text.startswith("{", at):
            return []
        start = at
    spans = []
    while True:
        try:
            value, end = _DECODER.raw_decode(text, at := _skip_space(text, at))
        except ValueError:
            return spans
        raw, end = text[at:end], _skip_space(text, end)
        has_more = text.startswith(";", end)
        if has_more:
            end = _skip_space(text, end + 1)
        spans.append(Span(start, end, [value], [raw]))
        if not has_more:
            return spans
        start = at = end


def _mistral(text: str) -> list[Span]:
    """A list right at the start, then a list (or one object) after each [TOOL_CALLS]."""
    at = _skip_space(text, 0)
    opens_with_list = text.startswith("[", at) and not text.startswith(TOOL_CALLS, at)
    spans = [_json_span(text, at, at)] if opens_with_list else []
    at = spans[-1].end if spans else 0
    while (start := text.find(TOOL_CALLS, at)) >= 0:
        spans.append(_json_span(text, start, start + len(TOOL_CALLS)))
        at = spans[-1].end
    return spans


def _json_span(text: str, start: int, at: int) -> Span:
    """The JSON value from `at` on: a list's items, or a value as a list of one; or a call
    written as name[ARGS]{...}."""
    name, args_at = _named_args(text, at)
    if name is not None:
        try:
            value, end = _DECODER.raw_decode(text, args_at)
        except ValueError:
            return Span(start, at, None)
        # the raw text as a call object, so its arguments are read back exactly as written
        raw = f'{{"name": {json.dumps(name)}, "arguments": {text[args_at:end]}}}'
        return Span(start, end, [{"name": name, "arguments": value}], [raw])
    try:
        value, end = _DECODER.raw_decode(text, at := _skip_space(text, at))
    except ValueError:
        return Span(start, at, None)
    if not isinstance(value, list):
        return Span(start, end, [value], [text[at:end]])
    items, _ = list_items(text, at)
    return Span(start, end, value, [text[first:last] for first, last in items])


def _llama3_json_so_far(text: str, functions: Collection[str]) -> list[CallText]:
    """The llama3_json calls written so far: the objects from <|python_tag|> (or a reply's
    opening "{") on, separated by ";", up to the first that cannot be a call; the last maybe
    still being written."""
    start = text.find(PYTHON_TAG)
    at = start + len(PYTHON_TAG) if start >= 0 else skip_space(text, 0)
    if start < 0 and not text.startswith("{", at):
        return []
    calls = []
    while (at := skip_space(text, at)) < len(text):
        call = object_call(text, at, ARGUMENT_KEYS, functions)
        if call is None or not call.is_complete:
            return calls + ([] if call is None else [call])
        calls.append(call)
        at = skip_space(text, value_end(text, at))
        if not text.startswith(";", at):
            break
        at += 1
    return calls


def _named_args(text: str, at: int) -> tuple[str | None, int]:
    """(name, where its arguments start) of a call written name[ARGS]{...} at text[at]; (None,
    at) where the text there is not (or not yet) one."""
    at = _skip_space(text, at)
    match = _FUNCTION_NAME.match(text, at)
    if match is None or not text.startswith(ARGS, match.end()):
        return None, at
    return match.group(), _skip_space(text, match.end() + len(ARGS))


def _mistral_so_far(text: str, functions: Collection[str]) -> list[CallText]:
    """The mistral calls written so far: the items of a list opening the reply or following
    [TOOL_CALLS] (or the one object after it), up to the first that cannot be a call; the last
    maybe still being written."""
    calls, at, search = [], skip_space(text, 0), 0
    if not text.startswith("[", at) or text.startswith(TOOL_CALLS, at):
        at = None
    while True:
        if at is None:
            marker = text.find(TOOL_CALLS, search)
            if marker < 0:
                return calls
            at = skip_space(text, marker + len(TOOL_CALLS))
        if at == len(text):
            return calls
        name, args_at = _named_args(text, at)
        if name is not None:
            if name not in functions:
                return calls
            if args_at == len(text):
                return calls + [CallText(name, "", False, False)]
            if text[args_at] != "{":
                return calls
            end = value_end(text, args_at)
            is_complete = end is not None and isinstance(json.loads(text[args_at:end]), dict)
            call = CallText(name, text[args_at:end], end is not None, is_complete)
            if not is_complete:
                return calls + [call]
            calls.append(call)
            search, at = end, None
            continue
        if text[at] == "[":
            items, end = list_items(text, at)
        else:
            end = value_end(text, at)
            items = [(at, end)]
        for first, _ in items:
            call = object_call(text, first, ARGUMENT_KEYS, functions)
            if call is None or not call.is_complete:
                return calls + ([] if call is None else [call])
            calls.append(call)
        if end is None:
            return calls
        search, at = end, None


def _skip_space(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


PARSERS = {parser.name: parser for parser in (
    ToolCallParser("hermes", ("<tool_call>",), _hermes, _hermes_so_far),
    ToolCallParser("llama3_json", (PYTHON_TAG,), _llama3_json, _llama3_json_so_far, "{"),
    ToolCallParser("mistral", (TOOL_CALLS,), _mistral, _mistral_so_far, "["),
)}


_BY_MODEL_TYPE = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                  "mistral": "mistral", "mixtral": "mistral"}
_LLAMA3_HEADER = "<|start_header_id|>"   # in Llama 3's chat templates, not Llama 2's


def tool_call_parser(name: str | None, model_type: str,
                     chat_template: str | None) -> ToolCallParser | None:
    """The parser called `name`, or (None) the one for the model's family: Qwen -> hermes,
    Mistral and Mixtral -> mistral, Llama with a Llama 3 chat template -> llama3_json; None where
    the family has none, or for the name "none" (the family's parser off). An unknown name is a
    ValueError listing the known ones."""
    if name == "none":
        return None
    if name is None:
        name = _BY_MODEL_TYPE.get(model_type)
        if model_type == "llama" and _LLAMA3_HEADER in (chat_template or ""):
            name = "llama3_json"
        return PARSERS.get(name)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]


def markers_are_special(parser: ToolCallParser | None, tokenizer) -> bool:
    """Whether one of the parser's markers is a special token of `tokenizer` (a
    `tokenizers.Tokenizer`; None: no), which decoding with skip_special_tokens would drop."""
    if parser is None or tokenizer is None:
        return False
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values()
               if token.special}
    return any(marker in special for marker in parser.markers)

