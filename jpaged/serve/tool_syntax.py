"""Each tool-call parser's syntax (`tool_parsers.py` says which models write which): where a
reply's possible calls are written (`hermes`, `llama3_json`, `mistral`: spans of text with their
JSON), and the calls written so far in a reply that stops anywhere (`*_so_far`, for a stream).
"""

import dataclasses
import json
import re
from collections.abc import Collection

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


def hermes(text: str) -> list[Span]:
    spans = []
    for match in _HERMES_CALL.finditer(text):
        try:
            value = json.loads(match.group(1))
        except ValueError:
            value = None
        spans.append(Span(match.start(), match.end(), None if value is None else [value],
                          [match.group(1)]))
    return spans


def hermes_so_far(text: str, functions: Collection[str]) -> list[CallText]:
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


def llama3_json(text: str) -> list[Span]:
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


def mistral(text: str) -> list[Span]:
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


def llama3_json_so_far(text: str, functions: Collection[str]) -> list[CallText]:
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


def mistral_so_far(text: str, functions: Collection[str]) -> list[CallText]:
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
