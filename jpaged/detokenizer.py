"""Incremental detokenization of one output sequence: streamed text deltas and stop strings.

Decoding works on a sliding window, as vLLM's prefix/read offsets do: the text of the new tokens
is decode(window + new) minus decode(window), where the window is the last few already-decoded
tokens (giving tokenizers that strip a leading space the context they need). A call costs
O(new tokens), never a re-decode of the whole output.
"""

import collections
import functools
from collections.abc import Sequence

import tokenizers

# Prompt tokens kept as decoding context before the first output token (vLLM uses 5 too).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decoder yields for an incomplete UTF-8 sequence


class StopMatcher:
    """An Aho-Corasick automaton over a request's stop strings, fed the output text a character
    at a time. Its state is the longest suffix of the text fed so far that is a prefix of some
    stop string, so one transition per character (amortized) answers both questions a token
    asks: did a stop string just end (`feed`), and how much of the text may still begin one
    (`held_back_len`). Cost: linear in the text plus the stop strings' total length, where
    checking every suffix against every stop string costs that length squared per token.
    """

    def __init__(self, stop: tuple[str, ...]):
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._match: list[str | None] = [None]  # the stop string the state's text ends with
        for string in stop:
            state = 0
            for char in string:
                if char not in self._goto[state]:
                    self._goto.append({})
                    self._depth.append(self._depth[state] + 1)
                    self._match.append(None)
                    self._goto[state][char] = len(self._goto) - 1
                state = self._goto[state][char]
            if self._match[state] is None:
                self._match[state] = string
        self._fail = [0] * len(self._goto)
        queue = collections.deque(self._goto[0].values())
        while queue:  # breadth first: a state's fail link is shallower, so already known
            state = queue.popleft()
            for char, child in self._goto[state].items():
                self._fail[child] = self._next(self._fail[state], char)
                if self._match[child] is None:  # a longer match ending here wins: earlier start
                    self._match[child] = self._match[self._fail[child]]
                queue.append(child)

    def _next(self, state: int, char: str) -> int:
        while state and char not in self._goto[state]:
            state = self._fail[state]
        return self._goto[state].get(char, 0)

    def start(self) -> int:
        return 0

    def feed(self, state: int, text: str) -> tuple[int, int, str | None]:
        """Advance over text; stop at the first character that completes a stop string.
        Returns (state, chars of text consumed, the stop string matched or None)."""
        for index, char in enumerate(text):
            state = self._next(state, char)
            if self._match[state] is not None:
                return state, index + 1, self._match[state]
        return state, len(text), None

    def held_back_len(self, state: int) -> int:
        """Length of the longest suffix of the text fed that a stop string may still complete."""
        return self._depth[state]


@functools.lru_cache(maxsize=64)  # the n samples of a request (and repeated requests) share one
def stop_matcher(stop: tuple[str, ...]) -> StopMatcher:
    return StopMatcher(stop)


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text, a delta at a time.

    `append(ids)` returns (delta, is_stopped). Guarantees:
    - A character split across tokens comes out whole: while the decoded window ends in U+FFFD
      (an incomplete UTF-8 sequence) nothing of it is released; the next token resolves it.
    - Stop strings are matched on the full output text, so they may span tokens; the first one
      completed wins (the longest if several end at the same character). On a match,
      `text` is truncated right before the stop string (vLLM's default), `stop_reason` names it,
      and tokens after the one that completed it (in the same call) are ignored.
    - A delta never contains text that could still be the start of a stop string: such a suffix
      is held back until it can no longer match. So concatenated deltas are always a prefix of
      the final `text`.
    When the sequence ends for another reason (length, EOS, stop token), call `flush()` to get the
    held-back text, including any incomplete trailing character as U+FFFD.

    With `tokenizer=None` (a model driven by token ids), text stays "" and stop strings never
    match; `num_tokens` still counts.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer | None, prompt_token_ids: Sequence[int],
                 stop: tuple[str, ...], *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._matcher = stop_matcher(tuple(stop)) if stop else None
        self._match_state = 0
        self._skip_special_tokens = skip_special_tokens
        # The decoding window: [:_read_offset] is context already turned into text (the prompt's
        # tail, later the last tokens read), the rest are output tokens not yet turned into text.
        self._token_ids = [int(i) for i in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]]
        self._read_offset = len(self._token_ids)
        self._text = ""                # decoded output text (complete characters)
        self._num_streamed = 0         # chars of _text already returned as deltas
        self.num_tokens = 0            # output tokens consumed
        self.stop_reason: str | None = None  # the stop string that matched, if any

    @property
    def text(self) -> str:
        """The full output text so far, truncated before a matched stop string.

        It can run ahead of the streamed deltas by a held-back possible stop-string prefix.
        """
        return self._text

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    def append(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Consume new output tokens; return (new text to stream, whether a stop string matched).

        After a match, later calls consume nothing and return ("", True).
        """
        if self._tokenizer is None:   # no text, so no stop string ever matches
            self.num_tokens += len(token_ids)
            return "", False
        for token_id in token_ids:
            if self.is_stopped:
                break
            self.num_tokens += 1
            self._token_ids.append(int(token_id))
            self._extend_text(self._decode_pending(allow_incomplete=False))
        return self._take_delta(), self.is_stopped

    def flush(self) -> str:
        """The rest of the text, held back or incomplete: call once when the sequence ends."""
        if self._tokenizer is not None and not self.is_stopped:
            self._extend_text(self._decode_pending(allow_incomplete=True))
        return self._take_delta(final=True)

    def _decode_pending(self, *, allow_incomplete: bool) -> str:
        """Text of the unread tokens, or "" while it ends mid-character."""
        context_text = self._decode(self._token_ids[:self._read_offset])
        window_text = self._decode(self._token_ids)
        if len(window_text) <= len(context_text):
            return ""  # e.g. a skipped special token: keep it unread
        if window_text.endswith(_REPLACEMENT_CHAR) and not allow_incomplete:
            return ""
        # The tokens just read become the context of the next call; older ones are dropped.
        del self._token_ids[:self._read_offset]
        self._read_offset = len(self._token_ids)
        return window_text[len(context_text):]

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _extend_text(self, new_text: str) -> None:
        """Append decoded text; on a stop string that ends inside it, truncate and stop."""
        if not new_text:
            return
        if self._matcher is None:
            self._text += new_text
            return
        self._match_state, consumed, stop = self._matcher.feed(self._match_state, new_text)
        self._text += new_text[:consumed]
        if stop is not None:
            self.stop_reason = stop
            self._text = self._text[:len(self._text) - len(stop)]

    def _take_delta(self, final: bool = False) -> str:
        """Text not yet streamed, minus a suffix that may begin a stop string (unless final)."""
        end = len(self._text)
        if not (final or self.is_stopped):
            end -= self._held_back_len()
        end = max(end, self._num_streamed)
        delta = self._text[self._num_streamed:end]
        self._num_streamed = end
        return delta

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string
        (not a whole one: that would have matched)."""
        return 0 if self._matcher is None else self._matcher.held_back_len(self._match_state)
