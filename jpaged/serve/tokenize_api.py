"""The tokenizer endpoints, in vLLM's request and response shapes, so that clients (an evaluation
harness counting and cutting contexts, say) need no local copy of the tokenizer:

    POST /tokenize        {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
                       or {"messages": [...], "add_generation_prompt": true,
                           "add_special_tokens": false}
                          -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [int, ...]} -> {"prompt": str}
    GET  /tokenizer_info  -> tokenizer_config.json's fields, "tokenizer_class" and the chat
                             template

A prompt is tokenised exactly as /v1/completions and /v1/chat/completions tokenise it (the same
template, the same special tokens), but a prompt longer than the context is counted, not
refused: counting long documents is what clients ask this for. Pure functions; `app.py` runs
them on a worker thread.
"""

import json
from pathlib import Path

from jpaged.serve import tools_api
from jpaged.serve.chat import chat_messages
from jpaged.serve.fields import body_field
from jpaged.serve.openai_api import APIError, ModelInfo, check_model

# Chat options of vLLM's that would change the tokens and that this server does not implement:
# refused by name rather than ignored.
_UNSUPPORTED_CHAT = {"continue_final_message": (False,), "chat_template": (None,),
                     "mm_processor_kwargs": (None, {})}


def tokenize(body: dict, model: ModelInfo) -> dict:
    check_model(body, model.name)
    tokenizer = _tokenizer(model, "messages" if "messages" in body else "prompt")
    if "messages" in body:
        text, add_special_tokens = _chat_text(body, model)
    else:
        text = body_field(body, "prompt", (str,), required=True)
        add_special_tokens = body_field(body, "add_special_tokens", (bool,), True)
    return_token_strs = body_field(body, "return_token_strs", (bool,), False)
    encoding = tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    return {"count": len(encoding.ids), "max_model_len": model.max_model_len,
            "tokens": list(encoding.ids),
            "token_strs": list(encoding.tokens) if return_token_strs else None}


def _chat_text(body: dict, model: ModelInfo) -> tuple[str, bool]:
    """The chat prompt as /v1/chat/completions renders it, and whether to add special tokens
    (vLLM's default for chat: no, the template writes them)."""
    for name, off_values in _UNSUPPORTED_CHAT.items():
        if name in body and body[name] not in off_values:
            raise APIError(f"'{name}' is not supported by this server", param=name,
                           code="unsupported_parameter")
    messages = chat_messages(body)
    tools, _ = tools_api.checked_tools(body)    # written into the prompt, as chat does
    add_generation_prompt = body_field(body, "add_generation_prompt", (bool,), True)
    try:
        text = model.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                          tools=tools)
    except Exception as err:  # a template may raise on, e.g., roles out of order
        raise APIError(f"the chat template failed on these messages: {err}",
                       param="messages") from err
    return text, body_field(body, "add_special_tokens", (bool,), False)


def detokenize(body: dict, model: ModelInfo) -> dict:
    """The text of `tokens`, special tokens included (as a Hugging Face tokenizer's decode)."""
    check_model(body, model.name)
    tokenizer = _tokenizer(model, "tokens")
    tokens = body_field(body, "tokens", (list,), required=True)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError("'tokens' must be an array of token ids (integers)", param="tokens")
    bad = [t for t in tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise APIError(f"'tokens' has token ids outside [0, {model.vocab_size}): {bad[:5]}",
                       param="tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}


def _tokenizer(model: ModelInfo, param: str):
    if model.tokenizer is None:
        raise APIError("this model has no tokenizer", param=param)
    return model.tokenizer


def tokenizer_info(model_dir, chat_template_source: str | None, tokenizer=None,
                   eos_token_ids=()) -> dict:
    """GET /tokenizer_info's reply: the fields of the model's tokenizer_config.json (none if it
    has no such file), "tokenizer_class" (a tokenizer.json alone is what transformers loads as
    PreTrainedTokenizerFast), "eos_token" where the file names none (the text of the model's
    first EOS id: clients such as lm-eval's remote tokenizer need it) and "chat_template" where
    the model has one."""
    path = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    info = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if "eos_token" not in info and tokenizer is not None and eos_token_ids:
        eos = tokenizer.id_to_token(eos_token_ids[0])
        if eos is not None:
            info["eos_token"] = eos
    if chat_template_source is not None:
        info["chat_template"] = chat_template_source
    return info
