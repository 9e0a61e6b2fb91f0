"""Chat prompts: the request's messages checked into the shape chat templates take, and the
model's chat template (jinja2, from tokenizer_config.json) or the default one.

    default template: {role}: {content}\\n for every message, then "assistant:" (the
    generation prompt); with tools, a first line "tools: [functions as JSON]", and an
    assistant's calls as JSON after its content
"""

import json
from pathlib import Path

from jpaged.serve import tools_api
from jpaged.serve.errors import APIError
from jpaged.serve.fields import body_field


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
