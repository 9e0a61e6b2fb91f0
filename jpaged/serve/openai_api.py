"""The OpenAI wire format's requests: validation into a `ParsedRequest` (token ids, sampling
parameters, how to reply). Pure functions with no web framework in them: `app.py` calls them
on the body `request_body.py` read; `chat.py` renders chat prompts and `replies.py` builds the
replies.

Requests are checked field by field; anything wrong raises `APIError` naming the parameter, which
the server turns into a 4xx with OpenAI's `{"error": {"message", "type", "param", "code"}}` body.
Parameters that would change the result but are not implemented (suffix, best_of > n,
presence/frequency penalties; echo on chat and on streamed completions) are rejected rather than
ignored. `logit_bias` maps token ids (JSON object keys, so decimal strings) to biases in
[-100, 100] added to the logits before sampling. `prompt_logprobs` (vLLM's extra field) puts each
prompt token's logprob on the choice; `skip_special_tokens` (vLLM's extra field, default true)
leaves special tokens out of the text. `echo` with `logprobs` on /v1/completions puts the
prompt's tokens before the completion's, as OpenAI does (the first prompt token's logprob null).
`tools` and `tool_choice` on chat: `tools_api.py` (tool_choice "auto" keeps special tokens in
the text unless the request sets skip_special_tokens, where the parser's markers are special).
"""
import dataclasses
import json

from jpaged.serve import structured_api, tools_api
from jpaged.serve.chat import ChatTemplate, chat_messages
from jpaged.serve.errors import APIError
from jpaged.serve.fields import body_field
from jpaged.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop",
                    "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logit_bias",
                    "skip_special_tokens")
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
    tool_parser: object = None  # tool_parsers.ToolCallParser for tool_choice "auto" (None: none)
    tool_markers_are_special: bool = False   # its markers are special tokens of the tokenizer


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


# ---- field checks -------------------------------------------------------------------------------
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
                     prompt_logprobs=None, tool_schema=None,
                     skip_special_tokens: bool = True) -> SamplingParams:
    """A stream is built from the engine's DELTA outputs (text past any possible stop-string
    prefix, tokens and logprobs new since the last output). A full reply asks for CUMULATIVE
    outputs, not FINAL_ONLY: the latency histograms (TTFT, TPOT) are observed on every output,
    and FINAL_ONLY would give them one, at the end. skip_special_tokens: the default where the
    body does not set it."""
    values = dict(n=body_field(body, "n", (int,), 1),
                  temperature=body_field(body, "temperature", (float,), 1.0),
                  top_p=body_field(body, "top_p", (float,), 1.0),
                  top_k=body_field(body, "top_k", (int,), -1),
                  min_p=body_field(body, "min_p", (float,), 0.0),
                  seed=body_field(body, "seed", (int,)),
                  stop=body_field(body, "stop", (str, list)),
                  stop_token_ids=body_field(body, "stop_token_ids", (list,)),
                  ignore_eos=body_field(body, "ignore_eos", (bool,), False),
                  skip_special_tokens=body_field(body, "skip_special_tokens", (bool,),
                                                 skip_special_tokens),
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
    tools = tools_api.tool_calling(body, model.tool_parser)
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
    # As vLLM's parsers' adjust_request: "auto" keeps special tokens in the text when the
    # parser's markers are special tokens, or they would never reach it.
    keeps_markers = tools is not None and tools.choice == "auto" and model.tool_markers_are_special
    params = _sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, stream=stream,
                              model=model, prompt_logprobs=prompt_logprobs,
                              tool_schema=tools and tools.schema,
                              skip_special_tokens=not keeps_markers)
    return ParsedRequest(True, prompts, params, stream, _stream_options(body, stream), logprobs,
                         prompt_logprobs, tools=tools)
