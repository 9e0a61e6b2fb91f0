"""The OpenAI wire format: request validation, chat templates, and response / stream chunks.

Pure functions and small classes with no web framework in them: `app.py` calls them.

Requests are checked field by field; anything wrong raises `APIError` naming the parameter, which
the server turns into a 4xx with OpenAI's `{"error": {"message", "type", "param", "code"}}` body.
Parameters that would change the result but are not implemented (suffix, best_of > n,
presence/frequency penalties; echo on chat and on streamed completions) are rejected rather than
ignored. `logit_bias` maps token ids (JSON object keys, so decimal strings) to biases in
[-100, 100] added to the logits before sampling. `prompt_logprobs` (vLLM's extra field) puts each prompt token's logprob on
the choice; `echo` with `logprobs` on /v1/completions puts the prompt's tokens before the
completion's, as OpenAI does (the first prompt token's logprob null).

Chat prompts are rendered with the model's `chat_template` from tokenizer_config.json (with
jinja2, as transformers does) or, when the model has none, with the default template:

    {role}: {content}\\n      for every message, then "assistant:" (the generation prompt)
"""

import dataclasses
import json
import math
import time
import uuid
from pathlib import Path

from jpaged.request import RequestOutput
from jpaged.serve import structured_api, tools_api
from jpaged.serve.errors import APIError
from jpaged.sampling import MAX_LOGPROBS, RequestOutputKind, SamplingParams

_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                    "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias")
# Parameters we do not implement, with the value that means "off" (anything else is rejected).
_UNSUPPORTED = {"echo": (False,), "suffix": ("",), "presence_penalty": (0, 0.0),
                "frequency_penalty": (0, 0.0), "tools": ([],)}


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What request parsing needs to know about the served model."""
    name: str
    tokenizer: object           # tokenizers.Tokenizer or None
    vocab_size: int
    max_model_len: int
    chat_template: "ChatTemplate"
    max_token_chars: int | None = None   # see `max_token_chars`; None: no early length check
    tokenizer_info: dict = dataclasses.field(default_factory=dict)   # GET /tokenizer_info
    constraints: object = None  # the engine's ConstraintCompiler (structured outputs)


def max_token_chars(tokenizer) -> int | None:
    """The most characters of text one token can cover, where that bound is sound, so a prompt
    longer than max_model_len times it is refused before it is tokenised: a byte-level BPE (no
    normalizer, a plain ByteLevel pre-tokenizer, no unknown token) turns every byte into part of
    exactly one token, and a token of k byte-characters covers at most k characters. Any other
    tokenizer may drop or merge text (whitespace splitting, normalisation, fused unknowns): None."""
    if (tokenizer is None or tokenizer.normalizer is not None
            or type(tokenizer.pre_tokenizer).__name__ != "ByteLevel"
            or type(tokenizer.model).__name__ != "BPE" or tokenizer.model.unk_token is not None):
        return None
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)))


def encode(model: "ModelInfo", text: str, param: str, **kwargs) -> list[int]:
    """Token ids of `text`, refused early when it is surely too long. `encode_batch` rather than
    `encode`: only the batch call lets go of the GIL, so a long prompt tokenised on a worker
    thread does not stall the event loop."""
    bound = model.max_token_chars
    if bound is not None and len(text) > model.max_model_len * bound:
        raise APIError(f"This model's maximum context length is {model.max_model_len} tokens; "
                       f"the prompt ('{param}') has {len(text)} characters, so more than that "
                       "many tokens", param=param, code="context_length_exceeded")
    return model.tokenizer.encode_batch([text], **kwargs)[0].ids


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """A validated request: token ids per prompt plus how to sample and reply."""
    is_chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    num_top_logprobs: int | None     # None: no logprobs in the reply
    num_prompt_logprobs: int | None = None   # the choices' prompt_logprobs (None: none)
    echo: bool = False               # completions: the prompt comes back before the completion
    tools: "tools_api.ToolCalling | None" = None   # chat: the tools and the call it forces


# ---- the request body ---------------------------------------------------------------------------
MAX_JSON_DEPTH = 64   # far beyond any real request; keeps every later walk of the body shallow


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object; anything a handler cannot take safely is an APIError:
    invalid JSON or UTF-8, NaN / Infinity / numbers out of float range, integers of more than
    Python's 4,300 digits, nesting deeper than MAX_JSON_DEPTH, and strings holding a lone UTF-16
    surrogate (legal as a JSON escape, "\\ud800", but not text: the tokenizer cannot take it)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as err:
        raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels "
                       "deep") from err
    except APIError:
        raise
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise APIError(f"the request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    _check_tree(body)
    return body


def _reject_constant(name: str):
    raise APIError(f"the request body has {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(f"the request body has the number {text[:40]}, out of range")
    return value


def _check_tree(body: dict):
    """Depth and lone surrogates, walked with an explicit stack (no recursion on client input)."""
    stack = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        items = (value.items() if isinstance(value, dict) else enumerate(value)
                 if isinstance(value, list) else ())
        for key, item in items:
            path = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
            path = path.lstrip(".")
            if isinstance(key, str):
                _check_text(key, path)
            if isinstance(item, str):
                _check_text(item, path)
            elif isinstance(item, (dict, list)):
                stack.append((item, path, depth + 1))


def _check_text(text: str, where: str):
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(f"'{where[:200]}' is not valid Unicode: it holds a lone UTF-16 surrogate "
                       f"at character {err.start}", param=where[:200]) from err


# ---- field checks -------------------------------------------------------------------------------
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
               list: "an array", dict: "an object"}


def body_field(body: dict, name: str, kinds: tuple, default=None, *, required: bool = False):
    """body[name] if present and of one of `kinds` (bool is never an int here); None -> default."""
    if name not in body or body[name] is None:
        if required:
            raise APIError(f"'{name}' is a required property", param=name)
        return default
    value = body[name]
    if not any(_is_kind(value, kind) for kind in kinds):
        wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise APIError(f"'{name}' must be {wanted}, got {json.dumps(value)[:80]}", param=name)
    return value


def _is_kind(value, kind) -> bool:
    if isinstance(value, bool):  # JSON true is not the integer 1
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _reject_unsupported(body: dict, allowed=()):
    for name, off_values in _UNSUPPORTED.items():
        if name not in allowed and body.get(name) is not None and body[name] not in off_values:
            raise APIError(f"'{name}' is not supported by this server", param=name,
                           code="unsupported_parameter")
    if body.get("best_of") is not None and body["best_of"] != body.get("n", 1):
        raise APIError("'best_of' other than n is not supported", param="best_of",
                       code="unsupported_parameter")


def check_model(body: dict, model_name: str):
    """An absent model means the served one; another name is a 404 (OpenAI's model_not_found)."""
    name = body_field(body, "model", (str,), model_name)
    if name != model_name:
        raise APIError(f"The model `{name}` does not exist. This server serves `{model_name}`.",
                       param="model", status=404, code="model_not_found")


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """`logit_bias` with its keys as token ids in the vocabulary (the biases SamplingParams
    checks)."""
    bias = body_field(body, "logit_bias", (dict,))
    if not bias:
        return None
    checked = {}
    for key, value in bias.items():
        token_id = int(key) if key.isascii() and key.isdecimal() else -1
        if not 0 <= token_id < vocab_size:
            raise APIError(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got "
                           f"{json.dumps(key)[:40]}", param="logit_bias")
        if token_id in checked:
            raise APIError(f"'logit_bias' has token id {token_id} twice", param="logit_bias")
        checked[token_id] = value
    return checked


def _sampling_params(body: dict, *, max_tokens, logprobs, stream: bool, model: ModelInfo,
                     prompt_logprobs=None, tool_schema=None) -> SamplingParams:
    """A stream is built from the engine's DELTA outputs (text past any possible stop-string
    prefix, tokens and logprobs new since the last output). A full reply asks for CUMULATIVE
    outputs, not FINAL_ONLY: the latency histograms (TTFT, TPOT) are observed on every output,
    and FINAL_ONLY would give them one, at the end."""
    values = dict(n=body_field(body, "n", (int,), 1),
                  temperature=body_field(body, "temperature", (float,), 1.0),
                  top_p=body_field(body, "top_p", (float,), 1.0),
                  top_k=body_field(body, "top_k", (int,), -1),
                  min_p=body_field(body, "min_p", (float,), 0.0),
                  seed=body_field(body, "seed", (int,)),
                  stop=body_field(body, "stop", (str, list)),
                  stop_token_ids=body_field(body, "stop_token_ids", (list,)),
                  ignore_eos=body_field(body, "ignore_eos", (bool,), False),
                  logit_bias=_logit_bias(body, model.vocab_size),
                  structured_outputs=structured_api.structured_outputs(body, model.constraints,
                                                                       tool_schema),
                  max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.CUMULATIVE)
    try:
        return SamplingParams(**values)
    except ValueError as err:  # SamplingParams' messages start with the parameter's name
        name = str(err).split(" ", 1)[0]
        raise APIError(str(err), param=name if name in _SAMPLING_FIELDS else None) from err


def _check_length(prompts: list[list[int]], max_tokens: int | None, max_model_len: int,
                  param: str) -> int:
    """The max_tokens to use (None: what is left of the context); too long -> APIError."""
    longest = max(len(ids) for ids in prompts)
    if longest >= max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens; the "
                       f"prompt ('{param}') has {longest} tokens and at least one must be "
                       "generated",
                       param=param, code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - longest
    if isinstance(max_tokens, int) and max_tokens >= 1 and longest + max_tokens > max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"you requested {longest + max_tokens} tokens ({longest} in the prompt, "
                       f"{max_tokens} in the completion); lower max_tokens", param="max_tokens",
                       code="context_length_exceeded")
    return max_tokens


def _stream_options(body: dict, stream: bool) -> bool:
    options = body_field(body, "stream_options", (dict,), {})
    if options and not stream:
        raise APIError("'stream_options' is only allowed with stream true", param="stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise APIError("'stream_options.include_usage' must be a boolean",
                       param="stream_options.include_usage")
    return include


def _prompt_logprobs(body: dict) -> int | None:
    count = body_field(body, "prompt_logprobs", (int,))
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise APIError(f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got {count}",
                       param="prompt_logprobs")
    return count


# ---- /v1/completions ----------------------------------------------------------------------------
def parse_completion(body: dict, model: ModelInfo) -> ParsedRequest:
    check_model(body, model.name)
    _reject_unsupported(body, allowed=("echo",))
    prompts = _completion_prompts(body, model)
    logprobs = body_field(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise APIError(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}",
                       param="logprobs")
    prompt_logprobs = _prompt_logprobs(body)
    max_tokens = _check_length(prompts, body_field(body, "max_tokens", (int,), 16),
                               model.max_model_len, "prompt")
    stream = body_field(body, "stream", (bool,), False)
    echo = body_field(body, "echo", (bool,), False)
    if echo and stream:
        raise APIError("'echo' is not supported on streamed completions", param="echo",
                       code="unsupported_parameter")
    # echo with logprobs needs the prompt's logprobs (and its top alternatives) too
    computed = (prompt_logprobs if not (echo and logprobs is not None)
                else max(logprobs, prompt_logprobs or 0))
    params = _sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, stream=stream,
                              model=model, prompt_logprobs=computed)
    return ParsedRequest(False, prompts, params, stream, _stream_options(body, stream), logprobs,
                         prompt_logprobs, echo)


def _completion_prompts(body: dict, model: ModelInfo) -> list[list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    prompt = body_field(body, "prompt", (str, list), required=True)
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) and not isinstance(p, bool)
                                                  for p in prompt)):
        prompt = [prompt]
    if not prompt:
        raise APIError("'prompt' must not be empty", param="prompt")
    return [_prompt_ids(item, model) for item in prompt]


def _prompt_ids(item, model: ModelInfo) -> list[int]:
    if isinstance(item, str):
        if model.tokenizer is None:
            raise APIError("this model has no tokenizer: send the prompt as token ids",
                           param="prompt")
        ids = encode(model, item, "prompt")  # as LLMEngine.add_request tokenizes
    elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in item):
        ids = item
    else:
        raise APIError("'prompt' must be a string, an array of strings, an array of token ids "
                       "or an array of arrays of token ids", param="prompt")
    if not ids:
        raise APIError("'prompt' must not be empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < model.vocab_size]
    if bad:
        raise APIError(f"'prompt' has token ids outside [0, {model.vocab_size}): {bad[:5]}",
                       param="prompt")
    return list(ids)


# ---- /v1/chat/completions -----------------------------------------------------------------------
def parse_chat(body: dict, model: ModelInfo) -> ParsedRequest:
    check_model(body, model.name)
    _reject_unsupported(body, allowed=("tools",))
    messages = chat_messages(body)
    tools = tools_api.tool_calling(body)
    if model.tokenizer is None:
        raise APIError("this model has no tokenizer, so chat is not available", param="messages")
    try:
        text = model.chat_template.render(messages, tools=tools and tools.tools)
    except Exception as err:  # a template may raise on, e.g., roles out of order
        raise APIError(f"the chat template failed on these messages: {err}",
                       param="messages") from err
    prompts = [_prompt_ids(encode(model, text, "messages", add_special_tokens=False), model)]
    want_logprobs = body_field(body, "logprobs", (bool,), False)
    top = body_field(body, "top_logprobs", (int,))
    if top is not None and not want_logprobs:
        raise APIError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise APIError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}",
                       param="top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    max_tokens = body_field(body, "max_completion_tokens", (int,))
    max_tokens = body_field(body, "max_tokens", (int,), max_tokens)
    prompt_logprobs = _prompt_logprobs(body)
    max_tokens = _check_length(prompts, max_tokens, model.max_model_len, "messages")
    stream = body_field(body, "stream", (bool,), False)
    params = _sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, stream=stream,
                              model=model, prompt_logprobs=prompt_logprobs,
                              tool_schema=tools and tools.schema)
    return ParsedRequest(True, prompts, params, stream, _stream_options(body, stream), logprobs,
                         prompt_logprobs, tools=tools)


def chat_messages(body: dict) -> list[dict]:
    messages = body_field(body, "messages", (list,), required=True)
    if not messages:
        raise APIError("'messages' must not be empty", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise APIError(f"'{where}' must be an object", param=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise APIError(f"'{where}.role' must be a non-empty string", param=f"{where}.role")
        calls = message.get("tool_calls")
        if role == "assistant" and calls:    # a call the model made: its content may be null
            content = message.get("content")
            parsed.append({"role": role, "content": "" if content is None else
                           _message_text(content, where),
                           "tool_calls": tools_api.message_tool_calls(calls, where)})
            continue
        entry = {"role": role, "content": _message_text(message.get("content"), where)}
        if role == "tool":                   # a call's result, answering its id
            for key in ("tool_call_id", "name"):
                if isinstance(message.get(key), str):
                    entry[key] = message[key]
        parsed.append(entry)
    return parsed


def _message_text(content, where: str) -> str:
    """A string, or a list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str)
                                         for part in content):
        return "".join(part["text"] for part in content)
    raise APIError(f"'{where}.content' must be a string or an array of text parts",
                   param=f"{where}.content")


class ChatTemplate:
    """The model's chat template (jinja2, from tokenizer_config.json) or the default one."""

    def __init__(self, source: str | None = None, *, bos_token: str = "", eos_token: str = ""):
        self.source = source
        self._special = dict(bos_token=bos_token, eos_token=eos_token)
        self._compiled = None
        if source is not None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError as err:
                raise RuntimeError("this model's tokenizer_config.json has a chat_template, "
                                   "which needs jinja2: pip install jinja2") from err
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._compiled = env.from_string(source)

    @classmethod
    def from_model_dir(cls, model_dir) -> "ChatTemplate":
        """From `tokenizer_config.json` in model_dir; the default template if absent."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return cls()
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {item.get("name"): item.get("template") for item in source}
            source = named.get("default")
        if source is not None and not isinstance(source, str):
            raise ValueError(f"{path}: field 'chat_template' must be a string")
        return cls(source, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")))

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """tools: OpenAI's `tools` (the template's `tools` variable; the default template
        writes the functions on a first line, and an assistant's calls as JSON after its
        content)."""
        if self._compiled is None:
            lines = "".join(f"{m['role']}: {m['content']}{_calls_text(m)}\n" for m in messages)
            if tools:
                lines = f"tools: {_compact([t['function'] for t in tools])}\n{lines}"
            return lines + ("assistant:" if add_generation_prompt else "")
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools or None, **self._special)


def _calls_text(message: dict) -> str:
    calls = message.get("tool_calls")
    return _compact([call["function"] for call in calls]) if calls else ""


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _raise_template_error(message):
    raise ValueError(message)


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


# ---- replies ------------------------------------------------------------------------------------
def new_id(is_chat: bool) -> str:
    return ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


class ReplyBuilder:
    """Builds the full reply (from CUMULATIVE outputs), or the stream's chunks (from DELTA
    outputs), of one parsed request. Choice index = prompt index * n + sample index, as OpenAI
    does.
    """

    def __init__(self, parsed: ParsedRequest, model: ModelInfo):
        self.parsed, self.model = parsed, model
        self.id, self.created = new_id(parsed.is_chat), int(time.time())
        self._object = "chat.completion" if parsed.is_chat else "text_completion"
        self._text_offsets: dict[int, int] = {}  # choice index -> text_offset of its next token
        self._finished: set[int] = set()
        self._held: dict[int, str] = {}   # choice index -> text of a stream's tool calls so far

    def _chat_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the choice's finish_reason): tool calls where the request
        forces them and the reply completed them, else the text as content."""
        tools = self.parsed.tools
        calls = tools.calls(text) if tools is not None and finish_reason == "stop" else None
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, tools.finish_reason

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = self._object + (".chunk" if chunk and self.parsed.is_chat else "")
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.model.name, "choices": choices}

    def full(self, outputs: list[RequestOutput]) -> dict:
        """The non-streaming reply for every prompt's final output, in prompt order."""
        choices = []
        for prompt_index, output in enumerate(outputs):
            for completion in output.outputs:
                index = prompt_index * self.parsed.params.n + completion.index
                if self.parsed.is_chat:
                    message, finish_reason = self._chat_message(completion.text,
                                                                completion.finish_reason)
                    choice = {"index": index, "message": message,
                              "logprobs": self._logprobs(completion.token_ids,
                                                         completion.logprobs, 0),
                              "finish_reason": finish_reason}
                else:
                    choice = self._completion_choice(index, output, completion)
                choices.append(self._with_prompt_logprobs(choice, output))
        choices.sort(key=lambda choice: choice["index"])
        num_prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        num_completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
        return {**self._envelope(choices, chunk=False),
                "usage": usage(num_prompt_tokens, num_completion_tokens)}

    def _completion_choice(self, index: int, output: RequestOutput, completion) -> dict:
        """A /v1/completions choice; with echo, the prompt's text (and its tokens' logprobs)
        first."""
        text, logprobs = completion.text, self._logprobs(completion.token_ids,
                                                         completion.logprobs, 0)
        if self.parsed.echo:
            prompt_text = self._prompt_text(output.prompt_token_ids)
            text = prompt_text + text
            if logprobs is not None:
                logprobs = self._echoed_logprobs(output, logprobs, len(prompt_text))
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason}

    def _echoed_logprobs(self, output: RequestOutput, logprobs: dict, prompt_chars: int) -> dict:
        """The prompt tokens' entries before the completion's (OpenAI's echo: the first prompt
        token has no logprob, and no top_logprobs)."""
        top, tokens, offsets, offset = self.parsed.num_top_logprobs, [], [], 0
        for token_id in output.prompt_token_ids:
            offsets.append(offset)
            tokens.append(self._token_text(token_id))
            offset += len(tokens[-1])
        entries = output.prompt_logprobs
        return {"tokens": tokens + logprobs["tokens"],
                "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(
                    output.prompt_token_ids, entries)] + logprobs["token_logprobs"],
                "top_logprobs": [None if e is None else {self._token_text(i): lp.logprob
                                                         for i, lp in list(e.items())[:top]}
                                 for e in entries] + logprobs["top_logprobs"],
                "text_offset": offsets + [prompt_chars + o for o in logprobs["text_offset"]]}

    def _with_prompt_logprobs(self, choice: dict, output: RequestOutput) -> dict:
        """vLLM's `prompt_logprobs` on a choice: per prompt token null (the first) or
        {token id: {"logprob", "rank", "decoded_token"}} for the token and the top k (1-based
        ranks in the whole distribution)."""
        count = self.parsed.num_prompt_logprobs
        if count is None or output.prompt_logprobs is None:
            return choice
        listed = []
        for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
            if entry is None:
                listed.append(None)
                continue
            shown = dict(list(entry.items())[:count]) | {token: entry[token]}
            listed.append({str(i): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": self._token_text(i)}
                           for i, lp in shown.items()})
        return {**choice, "prompt_logprobs": listed}

    def _prompt_text(self, token_ids) -> str:
        if self.model.tokenizer is None:
            return "".join(self._token_text(t) for t in token_ids)
        return self.model.tokenizer.decode(token_ids, skip_special_tokens=False)

    def first_chunks(self) -> list[dict]:
        """Chat streams open with the assistant role for every choice."""
        if not self.parsed.is_chat:
            return []
        count = len(self.parsed.prompts) * self.parsed.params.n
        return [self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}], chunk=True)
                for i in range(count)]

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[dict]:
        """One chunk per choice that a DELTA output moves on: its new text (the engine holds back
        what may still become a stop string), its new tokens' logprobs, its finish_reason.

        A delta with nothing the client sees (a token whose text is held back, and no logprobs
        asked) makes no chunk. A finished sequence keeps appearing in later outputs, empty."""
        chunks = []
        for completion in output.outputs:
            index = prompt_index * self.parsed.params.n + completion.index
            is_done = completion.finish_reason is not None
            has_logprobs = self.parsed.num_top_logprobs is not None and bool(completion.token_ids)
            has_logprobs |= output.prompt_logprobs is not None  # sent once, in the first delta
            text = completion.text
            if self.parsed.tools is not None and self.parsed.tools.schema is not None:
                self._held[index] = self._held.get(index, "") + text   # sent when it ends
                text = ""
            if index in self._finished or not (text or has_logprobs or is_done):
                continue
            offset = self._text_offsets.get(index, 0)
            logprobs = self._logprobs(completion.token_ids, completion.logprobs, offset)
            if logprobs is not None and "tokens" in logprobs:  # completions count text offsets
                self._text_offsets[index] = offset + sum(map(len, logprobs["tokens"]))
            if is_done:
                self._finished.add(index)
            if self.parsed.is_chat:
                delta, finish_reason = self._chat_delta(index, text, completion.finish_reason)
                choice = {"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": completion.text, "logprobs": logprobs,
                          "finish_reason": completion.finish_reason}
            chunks.append(self._envelope([self._with_prompt_logprobs(choice, output)],
                                         chunk=True))
        return chunks

    def _chat_delta(self, index: int, text: str, finish_reason) -> tuple[dict, str | None]:
        """A chat chunk's delta and finish_reason. Where the request forces tool calls, the
        text is held (`chunks`) until the choice ends, then sent as whole calls (or, cut
        short, as content): a client that joins the deltas gets the full reply's message."""
        if index not in self._held:
            return ({"content": text} if text else {}), finish_reason
        if finish_reason is None:
            return {}, None
        message, finish_reason = self._chat_message(self._held.pop(index), finish_reason)
        if message["content"] is not None:
            return ({"content": message["content"]} if message["content"] else {}), finish_reason
        return {"tool_calls": [{"index": i, **call} for i, call in
                               enumerate(message["tool_calls"])]}, finish_reason
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def usage_chunk(self, num_prompt_tokens: int, num_completion_tokens: int) -> dict:
        return {**self._envelope([], chunk=True),
                "usage": usage(num_prompt_tokens, num_completion_tokens)}

    # ---- logprobs ----------------------------------------------------------------------------
    def _logprobs(self, token_ids, entries, text_offset: int):
        """text_offset: where the first token's text starts (the token texts before it, summed)."""
        top = self.parsed.num_top_logprobs
        if top is None:
            return None
        if self.parsed.is_chat:
            return {"content": [self._chat_logprob(t, e, top) for t, e in zip(token_ids, entries)]}
        tokens, offsets = [], []
        for token_id in token_ids:
            offsets.append(text_offset)
            tokens.append(self._token_text(token_id))
            text_offset += len(tokens[-1])
        return {"tokens": tokens,
                "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": [{self._token_text(i): lp for i, lp in list(e.items())[:top]}
                                 for e in entries],
                "text_offset": offsets}

    def _chat_logprob(self, token_id: int, entry: dict, top: int) -> dict:
        def item(i, lp):
            text = self._token_text(i)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {**item(token_id, entry[token_id]),
                "top_logprobs": [item(i, lp) for i, lp in list(entry.items())[:top]]}

    def _token_text(self, token_id: int) -> str:
        if self.model.tokenizer is None:
            return f"token_id:{token_id}"
        return self.model.tokenizer.decode([token_id], skip_special_tokens=False)


def sse(data) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
