"""Tool calls read from a reply's text while it is still being written: each call's name once
its string is whole and its arguments' raw text so far, for a named function, "required" and
every parser's "auto" replies; and the small JSON scanner that finds them in text that stops
anywhere.

A stream sends a call's arguments as the model wrote them, and the full reply's `arguments` is
that same raw text (the arguments value's exact span): a canonical form (`json.dumps` of the
parsed value) cannot be streamed as a prefix of itself, since a later key of the same name
replaces an earlier one, and numbers and escapes change form (`1e2` -> `100.0`, `\\u00e9` ->
`é`) only once they are whole. The raw text is JSON, and parses to the same value.
"""

import dataclasses
import json
import re
from collections.abc import Collection

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(r'[^\s,:\]}\[{"]+')        # a number, true, false or null
_KEY = re.compile(r'("(?:[^"\\]|\\.)*")[ \t\n\r]*:[ \t\n\r]*', re.DOTALL)
_SPACE = re.compile(r"[ \t\n\r]*")               # JSON's whitespace
ARGUMENT_KEYS = ("arguments", "parameters")      # a written call's arguments, first found wins


@dataclasses.dataclass(frozen=True)
class CallText:
    """One call as far as the text has written it."""
    name: str | None        # None until its string is whole
    arguments: str          # the arguments value's raw text so far ("" before it begins)
    is_closed: bool         # the arguments value is whole
    is_complete: bool       # the call is whole and is a call: its arguments are final

    def sendable(self) -> str:
        """The arguments' text a stream may send now: all of it once the call is complete;
        before, all but the value's closing character, so that no client sees arguments end
        that may yet not be a call's."""
        return self.arguments[:-1] if self.is_closed and not self.is_complete else self.arguments


def call_of(value, functions: Collection[str]) -> tuple[str, dict] | None:
    """(name, arguments) of one call's JSON value, or None where it is not a call to one of
    `functions` with an object of arguments (none given: {})."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(name, str) or name not in functions or not isinstance(arguments, dict):
        return None
    return name, arguments


def named_calls(text: str, name: str) -> list[CallText]:
    """A named function's reply: the text is the arguments object."""
    at = skip_space(text, 0)
    if at == len(text):
        return []
    if text[at] != "{":
        raise ValueError("a named function's arguments must be an object")
    end = value_end(text, at)
    is_complete = end is not None and isinstance(_loads_or_none(text), dict)
    return [CallText(name, text[at:end], end is not None, is_complete)]


def required_calls(text: str, functions: Collection[str]) -> list[CallText]:
    """A "required" reply: a list of {"name", "parameters"} objects."""
    at = skip_space(text, 0)
    if at == len(text):
        return []
    if text[at] != "[":
        raise ValueError("a required reply must be a list of calls")
    calls, (items, _) = [], list_items(text, at)
    for start, _ in items:
        call = object_call(text, start, ("parameters",), functions)
        if call is None:
            raise ValueError("a required reply's item is not a call")
        calls.append(call)
    return calls


def object_call(text: str, at: int, keys: tuple[str, ...],
                functions: Collection[str]) -> CallText | None:
    """The call written as the JSON object that opens at text[at]; None where it cannot be a
    call (a name not in `functions`, arguments not an object, or whole but not a call)."""
    if not text.startswith("{", at):
        return None
    members, end = object_members(text, at)
    name = None
    if "name" in members and members["name"][1] is not None:
        name = json.loads(text[slice(*members["name"])])
        if not isinstance(name, str) or name not in functions:
            return None
    key = next((key for key in keys if key in members), None)
    if key is not None:
        start, stop = members[key]
        if text[start] != "{":
            return None
        arguments, is_closed = text[start:stop], stop is not None
    else:
        arguments, is_closed = ("{}", True) if end is not None else ("", False)
    is_complete = end is not None and call_of(json.loads(text[at:end]), functions) is not None
    if end is not None and not is_complete:
        return None
    return CallText(name, arguments, is_closed, is_complete)


# ---- scanning JSON that may stop anywhere ---------------------------------------------------
def skip_space(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


def value_end(text: str, at: int) -> int | None:
    """Where the JSON value that starts at text[at] ends; None while the text stops inside it.
    ValueError where the text cannot be JSON. Brackets and strings are checked; the rest is left
    to the JSON parser once the value is whole."""
    closers = []
    while at < len(text):
        char = text[at]
        if char == '"':
            match = _STRING.match(text, at)
            if match is None:
                return None
            at = match.end()
        elif char in "{[":
            closers.append("}" if char == "{" else "]")
            at += 1
        elif char in "}]":
            if not closers or closers.pop() != char:
                raise ValueError(f"unexpected {char!r}")
            at += 1
        elif closers:
            at += 1
        else:
            match = _SCALAR.match(text, at)
            if match is None:
                raise ValueError(f"unexpected {char!r}")
            return match.end() if match.end() < len(text) else None
        if not closers:
            return at
    return None


def object_members(text: str, at: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """({key: (value start, value end or None)} of the members begun, the object's end or None)
    of the JSON object that opens at text[at]. A repeated key keeps its last value, as
    json.loads does."""
    members, at = {}, skip_space(text, at + 1)
    if text.startswith("}", at):
        return members, at + 1
    while at < len(text):
        if text[at] != '"':
            raise ValueError(f"expected a key, got {text[at]!r}")
        match = _KEY.match(text, at)
        if match is None or match.end() == len(text):
            return members, None
        key, start = json.loads(match.group(1)), match.end()
        end = value_end(text, start)
        members[key] = (start, end)
        if end is None:
            return members, None
        at = skip_space(text, end)
        if text.startswith("}", at):
            return members, at + 1
        if at < len(text) and text[at] != ",":
            raise ValueError(f"expected ',' or '}}', got {text[at]!r}")
        at = skip_space(text, at + 1)
    return members, None


def list_items(text: str, at: int) -> tuple[list[tuple[int, int | None]], int | None]:
    """([(item start, item end or None)] of the items begun, the list's end or None) of the
    JSON list that opens at text[at]."""
    items, at = [], skip_space(text, at + 1)
    if text.startswith("]", at):
        return items, at + 1
    while at < len(text):
        end = value_end(text, at)
        items.append((at, end))
        if end is None:
            return items, None
        at = skip_space(text, end)
        if text.startswith("]", at):
            return items, at + 1
        if at < len(text) and text[at] != ",":
            raise ValueError(f"expected ',' or ']', got {text[at]!r}")
        at = skip_space(text, at + 1)
    return items, None


def _loads_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
