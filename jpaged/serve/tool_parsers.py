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
from collections.abc import Callable, Collection

from jpaged.serve import tool_syntax as syntax
from jpaged.serve.tool_stream import ARGUMENT_KEYS, CallText, call_of, object_call, skip_space
from jpaged.serve.tool_syntax import Span


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
        if opens_reply and self.opens_with and text.lstrip().startswith(self.opens_with):
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


PARSERS = {parser.name: parser for parser in (
    ToolCallParser("hermes", ("<tool_call>",), syntax.hermes, syntax.hermes_so_far),
    ToolCallParser("llama3_json", (syntax.PYTHON_TAG,), syntax.llama3_json,
                   syntax.llama3_json_so_far, "{"),
    ToolCallParser("mistral", (syntax.TOOL_CALLS,), syntax.mistral, syntax.mistral_so_far, "["),
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

