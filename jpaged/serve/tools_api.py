"""Function calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`.

    tools: [{"type": "function", "function": {"name", "description", "parameters", "strict"}}]
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: true (default) | false: at most one call

"auto" (the default when tools are given) lets the model answer in text or call functions in
its own syntax: the reply is generated unconstrained (or under the request's own output
constraint) and a parser for the model's family (`tool_parsers.py`) finds the calls in its text;
without one for the served model (`--tool-call-parser`), "auto" is a 400 naming `tool_choice`.
A named function or "required" becomes a JSON-schema constraint on the reply (the structured
outputs machinery), so every call the reply makes parses and matches its function's
`parameters`: named, the output is the arguments object; required, a list of
`{"name", "parameters"}` objects, one schema branch per tool. The tools reach the chat template
(its `tools` variable) whatever the choice, as transformers passes them.

The reply carries `message.tool_calls` ([{"id", "type": "function", "function": {"name",
"arguments"}}], arguments a JSON string) and `content`: null when forced, the text outside the
calls with "auto"; finish_reason "tool_calls" for "auto" (when it called) and "required", and
"stop" for a named function (OpenAI's and vLLM's). A reply cut short (finish_reason "length")
has no complete call: its text stays in `content`. A call's `arguments` is the arguments' JSON
as the model wrote it (its exact span), so that a
stream can send it as it comes (`tool_stream.py` says why).

A stream sends each call as OpenAI does: a header ({"index", "id", "type": "function",
"function": {"name", "arguments": ""}}) once the name is one of the functions and the arguments
have opened as an object, then {"index", "function": {"arguments": FRAGMENT}} as the model
writes them (named, required, and "auto" with every parser). The joined fragments are the full
reply's `arguments`, and a call's closing brace waits until the call is whole. Where the calls a
stream has sent turn out not to be the full reply's, it keeps what it sent and sends nothing
more but the finish_reason (the full reply's): a reply cut short ("length") after a call's
header has streamed the call as far as it got (vLLM's behaviour), while the full reply has no
calls and its text in `content`; likewise a call whose JSON breaks after its header, JSON left
unclosed, or a mistral list whose later item is not a call (the full reply keeps that text as
content). Every reply whose calls complete streams exactly the full reply.
"""

import dataclasses
import json
import re
import uuid

from jpaged.serve.errors import APIError
from jpaged.serve.tool_parsers import PARSERS, ToolCallParser
from jpaged.serve.tool_stream import CallText, named_calls, required_calls

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")     # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}   # none
CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """A request's tools (OpenAI's shape, as chat templates take them) and what it forces."""
    tools: list[dict]
    choice: str                      # "none", "auto", "required" or "named"
    name: str | None = None          # the named function
    schema: dict | None = None       # the reply's JSON schema (None: unconstrained)
    parser: ToolCallParser | None = None   # auto: finds the calls in the text
    functions: tuple[str, ...] = ()  # the functions a call may name
    is_parallel: bool = True         # auto: more than one call allowed

    def reply(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict],
                                                                    str | None]:
        """(content, tool calls in OpenAI's shape, finish_reason) of a reply's text; only a
        reply that completed (finish_reason "stop") has calls."""
        if finish_reason != "stop" or self.choice == "none":
            return text, [], finish_reason
        content, pairs = self._found(text)
        if not pairs:
            return text, [], finish_reason
        calls = [{"id": new_call_id(), "type": "function",
                  "function": {"name": name, "arguments": arguments}} for name, arguments in pairs]
        return content, calls, "stop" if self.choice == "named" else "tool_calls"

    def streamable(self, text: str, opens_reply: bool) -> int:
        """How many characters of a reply's text not sent yet a stream may send as content:
        all with "none", those before a call with "auto", none of a forced call's JSON.
        opens_reply: nothing of the reply was sent before `text`."""
        if self.choice == "none":
            return len(text)
        return self.parser.streamable(text, opens_reply) if self.choice == "auto" else 0

    def calls_so_far(self, text: str) -> list[CallText]:
        """The calls a reply's text holds so far, in order, the last maybe still being written:
        a stream sends each as it comes. ValueError: the text can hold no more calls."""
        if self.choice == "named":
            return named_calls(text, self.name)
        if self.choice == "required":
            return required_calls(text, self.functions)
        if self.choice == "auto":
            calls = self.parser.calls_so_far(text, self.functions)
            return calls if self.is_parallel else calls[:1]
        return []

    def _found(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments JSON text)]) of a completed reply; the arguments as the
        model wrote them, so that a stream can send them as they come."""
        if self.choice == "auto":
            content, pairs = self.parser.parse(text, self.functions)
            return content, pairs if self.is_parallel else pairs[:1]   # as vLLM does
        try:
            value = json.loads(text)
            calls = self.calls_so_far(text)
        except ValueError:
            return text, []
        if self.choice == "named" and not isinstance(value, dict):
            return text, []
        return None, [(call.name, call.arguments) for call in calls if call.is_complete]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calling(body: dict, parser: ToolCallParser | None = None) -> ToolCalling | None:
    """The request's `tools` and `tool_choice`, checked (APIError naming the field); None when
    it gives no tools. parser: the served model's, for "auto" (None: "auto" is refused)."""
    tools, functions = checked_tools(body)
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise APIError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolCalling(tools, "none")
    if choice == "auto":
        if parser is None:
            raise APIError("tool_choice 'auto' (the default with tools) needs a tool-call parser, "
                           "and this model's family has none: start the server with "
                           f"--tool-call-parser ({', '.join(PARSERS)}), or give tool_choice "
                           "'required', a named function ({\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}) or 'none'", param="tool_choice",
                           code="unsupported_parameter")
        return ToolCalling(tools, "auto", parser=parser, functions=tuple(functions),
                           is_parallel=parallel)
    if choice == "required":
        branches = [{"type": "object", "additionalProperties": False,
                     "required": ["name", "parameters"],
                     "properties": {"name": {"type": "string", "enum": [name]},
                                    "parameters": function["parameters"]}}
                    for name, function in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolCalling(tools, "required", schema=schema, functions=tuple(functions))
    name = _named(choice)
    if name not in functions:
        raise APIError(f"'tool_choice' names the function '{name}', which 'tools' does not "
                       f"have (it has {sorted(functions)})", param="tool_choice")
    return ToolCalling(tools, "named", name=name, schema=functions[name]["parameters"],
                       functions=(name,))


def checked_tools(body: dict) -> tuple[list[dict] | None, dict[str, dict]]:
    """The request's `tools` (None: none) and {name: {"name", "parameters"}} of its functions;
    APIError naming the entry at fault."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None, {}
    if not isinstance(tools, list):
        raise APIError("'tools' must be an array of {\"type\": \"function\", \"function\": "
                       "{...}}", param="tools")
    functions = {}
    for index, tool in enumerate(tools):
        function = _function(tool, f"tools[{index}]")
        if function["name"] in functions:
            raise APIError(f"'tools' has the function '{function['name']}' twice",
                           param=f"tools[{index}]")
        functions[function["name"]] = function
    return tools, functions


def _function(tool, where: str) -> dict:
    """{"name", "parameters"} of one entry of `tools`."""
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise APIError(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                       param=where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise APIError(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', "
                       f"got {json.dumps(name)[:80]}", param=f"{where}.function.name")
    parameters = function.get("parameters", _NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise APIError(f"'{where}.function.parameters' must be a JSON schema object",
                       param=f"{where}.function.parameters")
    return {"name": name, "parameters": parameters}


def _named(choice) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        return choice["function"]["name"]
    raise APIError(f"'tool_choice' must be one of {list(CHOICES)} or {{\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}", param="tool_choice")


def message_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, checked, with each call's `arguments` (a JSON string
    on the wire) parsed into the object chat templates write with `tojson`, as transformers
    expects them."""
    if not isinstance(calls, list):
        raise APIError(f"'{where}.tool_calls' must be an array", param=f"{where}.tool_calls")
    parsed = []
    for index, call in enumerate(calls):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise APIError(f"'{at}' must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"arguments\": \"<JSON>\"}}", param=at)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError as err:
            raise APIError(f"'{at}.function.arguments' is not JSON: {err}",
                           param=f"{at}.function.arguments") from err
        parsed.append({"id": call.get("id"), "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return parsed
