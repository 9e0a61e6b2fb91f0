"""OpenAI's reply shapes: the full reply of a request and its stream's chunks (server-sent
events), built from the engine's outputs."""

import json
import time
import uuid

from jpaged.request import RequestOutput
from jpaged.serve.openai_api import ModelInfo, ParsedRequest
from jpaged.serve.tools_api import new_call_id

SCAN_GROWTH = 64   # a stream's text is scanned for calls again once it grew by 1/64th


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
        # A chat stream with tools, by choice index: the reply's text so far, how much of it was
        # sent as content, the calls sent ([name, arguments sent]), whether calls stopped, and
        # the text's length when it was last scanned for calls
        self._texts: dict[int, str] = {}
        self._content_sent: dict[int, int] = {}
        self._calls_sent: dict[int, list[list[str]]] = {}
        self._calls_stopped: set[int] = set()
        self._calls_scanned: dict[int, int] = {}

    def _chat_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the choice's finish_reason): the reply's tool calls, where
        the request has tools and the reply completed them, and the text outside them."""
        if self.parsed.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls, finish_reason = self.parsed.tools.reply(text, finish_reason)
        message = {"role": "assistant", "content": content}
        return (message | {"tool_calls": calls} if calls else message), finish_reason

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
        """The chunks of each choice that a DELTA output moves on: its new text (the engine
        holds back what may still become a stop string), its new tokens' logprobs (on its first
        chunk), its finish_reason (on its last). A chat choice with tools may take several
        chunks: a tool call's header and its arguments' fragments each take one.

        A delta with nothing the client sees (a token whose text is held back, and no logprobs
        asked) makes no chunk. A finished sequence keeps appearing in later outputs, empty."""
        chunks = []
        for completion in output.outputs:
            index = prompt_index * self.parsed.params.n + completion.index
            is_done = completion.finish_reason is not None
            has_logprobs = self.parsed.num_top_logprobs is not None and bool(completion.token_ids)
            has_logprobs |= output.prompt_logprobs is not None  # sent once, in the first delta
            if index in self._finished:
                continue
            if self.parsed.is_chat:
                deltas, finish_reason = self._chat_deltas(index, completion.text,
                                                          completion.finish_reason)
            else:
                deltas = [completion.text] if completion.text else []
                finish_reason = completion.finish_reason
            if not (deltas or has_logprobs or is_done):
                continue
            offset = self._text_offsets.get(index, 0)
            logprobs = self._logprobs(completion.token_ids, completion.logprobs, offset)
            if logprobs is not None and "tokens" in logprobs:  # completions count text offsets
                self._text_offsets[index] = offset + sum(map(len, logprobs["tokens"]))
            if is_done:
                self._finished.add(index)
            deltas = deltas or [{} if self.parsed.is_chat else ""]
            for number, delta in enumerate(deltas):
                choice = {"index": index, "delta" if self.parsed.is_chat else "text": delta,
                          "logprobs": logprobs if number == 0 else None,
                          "finish_reason": finish_reason if number == len(deltas) - 1 else None}
                if number == 0:
                    choice = self._with_prompt_logprobs(choice, output)
                chunks.append(self._envelope([choice], chunk=True))
        return chunks

    def _chat_deltas(self, index: int, text: str, finish_reason) -> tuple[list[dict], str | None]:
        """A chat choice's deltas for its new text, and its finish_reason. With tools, content
        streams up to where a call may start (`ToolCalling.streamable`), and each call as it is
        written (`ToolCalling.calls_so_far`): its header once its name is one of the functions
        and its arguments have opened, then its arguments' text as it comes. The last deltas
        send what the full reply has beyond that: a client that joins the deltas gets the full
        reply's message (`_last_deltas` says where it cannot)."""
        tools = self.parsed.tools
        if tools is None or tools.choice == "none":
            return ([{"content": text}] if text else []), finish_reason
        whole = self._texts[index] = self._texts.get(index, "") + text
        if finish_reason is not None:
            return self._last_deltas(index, whole, finish_reason)
        sent = self._content_sent.get(index, 0)
        count = tools.streamable(whole[sent:], opens_reply=not sent)
        self._content_sent[index] = sent + count
        content = [{"content": whole[sent:sent + count]}] if count else []
        return content + self._call_deltas(index, whole, is_last=False), None

    def _call_deltas(self, index: int, text: str, is_last: bool = True) -> list[dict]:
        """The calls' headers and argument fragments that `text` adds to those sent. Calls stop
        streaming for good where the text turns out not to continue them (a call sent turns
        out not to be one): the last chunk then decides.

        A scan reads the whole text, so before the last chunk the text is scanned again only
        once it has grown by 1/SCAN_GROWTH of its length since the last scan (every chunk while
        it is short): a long call's arguments then cost O(length) to stream in all, not
        O(length^2), and go out in fragments of at most that share of the text."""
        sent, deltas = self._calls_sent.setdefault(index, []), []
        if index in self._calls_stopped:
            return deltas
        scanned = self._calls_scanned.get(index, 0)
        if not is_last and (len(text) - scanned) * SCAN_GROWTH < len(text):
            return deltas
        self._calls_scanned[index] = len(text)
        try:
            calls = self.parsed.tools.calls_so_far(text)
        except ValueError:
            calls = []
        if len(calls) < len(sent):
            self._calls_stopped.add(index)
        for number, call in enumerate(calls):
            if number < len(sent) and (call.name != sent[number][0]
                                       or not call.arguments.startswith(sent[number][1])):
                self._calls_stopped.add(index)
                break
            if number == len(sent):
                if call.name is None or not (call.arguments.startswith("{") or call.is_complete):
                    break
                sent.append([call.name, ""])
                deltas.append(_call_delta(number, header=call.name))
            fragment = call.sendable()[len(sent[number][1]):]
            if fragment:
                sent[number][1] += fragment
                deltas.append(_call_delta(number, arguments=fragment))
        return deltas

    def _last_deltas(self, index: int, text: str,
                     finish_reason: str) -> tuple[list[dict], str | None]:
        """A tool-using chat choice's last deltas and its finish_reason (the full reply's):
        the full reply's content beyond what was sent, the rest of each call sent, and the calls
        not sent yet (header, then arguments). Where the calls sent are not the start of the full
        reply's (a reply cut short, finish_reason "length", or a call whose JSON broke after its
        header was sent), the last text streams as any other (the calls' fragments it adds) and
        nothing more is sent: the stream keeps what it has, as vLLM's does, and the full reply
        keeps that text as content."""
        message, finish_reason = self._chat_message(text, finish_reason)
        calls, sent = message.get("tool_calls", []), self._calls_sent.get(index, [])
        if len(calls) < len(sent) or any(
                call["function"]["name"] != name or not call["function"]["arguments"].startswith(
                    arguments) for call, (name, arguments) in zip(calls, sent)):
            return self._call_deltas(index, text), finish_reason
        rest = (message["content"] or "")[self._content_sent.get(index, 0):]
        deltas = [{"content": rest}] if rest else []
        for number, call in enumerate(calls):
            if number >= len(sent):
                sent.append([call["function"]["name"], ""])
                deltas.append(_call_delta(number, header=call["function"]["name"],
                                          call_id=call["id"]))
            if fragment := call["function"]["arguments"][len(sent[number][1]):]:
                deltas.append(_call_delta(number, arguments=fragment))
        return deltas, finish_reason

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


def _call_delta(index: int, header: str | None = None, arguments: str = "",
                call_id: str | None = None) -> dict:
    """A delta of one tool call: its header (id, type, name; arguments "") or a fragment of its
    arguments, as OpenAI streams them."""
    if header is None:
        return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}
    return {"tool_calls": [{"index": index, "id": call_id or new_call_id(), "type": "function",
                            "function": {"name": header, "arguments": ""}}]}


def sse(data) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
