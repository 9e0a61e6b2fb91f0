"""Structured outputs: the constraints a request can put on its output (vLLM's names: a JSON
schema, any JSON object, a regex, a choice of strings, a grammar), compiled with llguidance into
token matchers, one per sequence, cached per constraint.

A matcher gives each step the packed mask of the tokens that keep the output valid (bit t % 32
of word t // 32 set: token t allowed), which the device sampler applies to the logits, and
consumes the tokens sampled; once the constraint is complete (nothing but the end could follow)
the sequence ends with finish_reason "stop". JSON is compact: no whitespace between tokens of
the JSON text, so a weak model cannot pad an object with whitespace until max_tokens.

Compiling a constraint builds llguidance's lexer and parser tables (milliseconds for a small
schema, longer for a large grammar, with the GIL released). Each distinct constraint is compiled
once per engine and kept (least recently used first out past MAX_CACHED): a request copies the
compiled matcher. The server compiles while it validates a request, on its worker threads, so
the engine's thread finds the constraint compiled.
"""

import collections
import dataclasses
import json
import threading
from collections.abc import Sequence

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CACHED = 256             # compiled constraints kept per engine
MAX_CONSTRAINT_CHARS = 1 << 20   # a schema, regex or grammar's text (1 MiB)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema: a dict or its JSON text), `regex`,
    `choice` (the output is one of these strings), `grammar` (Lark as llguidance takes it, or
    GBNF with `::=` rules), or `json_object=True` (any JSON object). After construction `json`
    is the schema as compact JSON text and `choice` a tuple, so instances are hashable; a
    malformed value raises ValueError naming the field (the schema itself is checked when it is
    compiled, see `ConstraintCompiler`)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            value = _schema_text(value)
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(item, str) and item for item in value)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {str(value)[:80]}")
            value = tuple(value)
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be a bool, got {value!r}")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, "
                             f"got {str(value)[:80]}")
        if len(value if isinstance(value, str) else json.dumps(value)) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.{kind} has more than "
                             f"MAX_CONSTRAINT_CHARS={MAX_CONSTRAINT_CHARS} characters")
        object.__setattr__(self, kind, value)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint as one string (its cache key with `kind`)."""
        value = getattr(self, self.kind)
        return json.dumps(value) if self.kind in ("choice", "json_object") else value


def _schema_text(schema) -> str:
    """A JSON schema (dict, bool or JSON text) as canonical JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as err:
            raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from err
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                         f"got {str(schema)[:80]}")
    return json.dumps(schema, separators=(",", ":"))   # key order kept: it orders the output


class Constraint:
    """One sequence's matcher: the mask of its next token, and the tokens it has taken."""

    def __init__(self, matcher, num_words: int, matcher_words: int):
        self._matcher = matcher
        self.num_words = num_words            # ceil(V / 32): the logits' width in words
        self._matcher_words = matcher_words   # the matcher's vocabulary in words (>= num_words)

    def fork(self) -> "Constraint":
        """An independent copy in the same state (a sibling sequence, a new request)."""
        return Constraint(self._matcher.deep_copy(), self.num_words, self._matcher_words)

    def allowed(self) -> np.ndarray:
        """[ceil(V / 32)] int32 packed mask of the tokens allowed next."""
        return allowed_masks([self])[0]

    def consume(self, tokens: list[int]) -> tuple[int, bool]:
        """Take tokens in order until the constraint is complete: (how many it took, whether it
        is complete). A token the constraint rejects raises ValueError (the mask forbade it)."""
        for count, token in enumerate(tokens, 1):
            if not self._matcher.consume_token(token):
                raise ValueError(f"the output constraint rejected token {token}: "
                                 f"{self._matcher.get_error()}")
            if self._matcher.is_stopped():
                return count, True
        return len(tokens), False


class LoopMatchers:
    """The matchers of a decode loop's constrained rows, advanced by the loop itself, so a
    constrained request keeps the device loop (and the rows beside it keep their K tokens per
    launch): after each iteration the loop hands the host the tokens it sampled (a host
    callback, `advance`), each live constrained row's matcher takes its token, and the loop gets
    back the masks of its next iteration and the rows whose constraint is now complete, which it
    retires as it retires a row that sampled a stop id.

    The matchers are copies (`Constraint.fork`) of the sequences' own, taken when a loop is
    launched (`start`); the sequences' own take the same tokens when the host processes the
    loop's results, as after a single step, and end the sequence at the same token. One object
    per engine, a static argument of its constrained loops (their executables call it). `start`
    runs only while no loop is in flight; `advance` only from the loops, one call at a time."""

    def __init__(self):
        self._matchers: dict[int, Constraint] = {}   # sequence slot -> its loop's matcher
        self._masks: dict[int, np.ndarray] = {}      # sequence slot -> its matcher's mask now
        self._num_words = 0

    def start(self, slots: list[int], constraints: list[Constraint]) -> np.ndarray:
        """Copy the matchers of the constrained rows of a loop about to launch (slots: their
        sequences' block-manager rows); [R, ceil(V / 32)] int32: their first iteration's masks."""
        forks = [constraint.fork() for constraint in constraints]
        masks = allowed_masks(forks)
        self._matchers = dict(zip(slots, forks))
        self._masks = dict(zip(slots, masks))
        self._num_words = forks[0].num_words
        return masks

    def advance(self, seq_ids: np.ndarray, sampled: np.ndarray, tokens: np.ndarray):
        """One loop iteration's host side. seq_ids: [B] int32 the loop's rows still running
        (-1: padding or finished); sampled: [B] bool, the rows that sampled this iteration;
        tokens: [B] int32 what they sampled. Returns ([B, A] int32 the masks of the next
        iteration, all ones for unconstrained rows; [B] int32, 1 where the token completed the
        row's constraint). A token the mask should have forbidden also retires the row: the
        sequence's own matcher then rejects it and its request fails with the reason."""
        masks = np.full((len(seq_ids), self._num_words), -1, np.int32)
        complete = np.zeros(len(seq_ids), np.int32)
        stale = []
        for row, (slot, has_sampled, token) in enumerate(zip(seq_ids.tolist(), sampled.tolist(),
                                                             tokens.tolist())):
            matcher = self._matchers.get(slot)
            if matcher is None:
                continue
            if has_sampled:
                try:
                    _, is_complete = matcher.consume([token])
                except ValueError:
                    is_complete = True
                if is_complete:
                    complete[row] = 1
                    del self._matchers[slot], self._masks[slot]
                    continue
                stale.append((row, slot))
            else:
                masks[row] = self._masks[slot]
        if stale:
            fresh = allowed_masks([self._matchers[slot] for _, slot in stale])
            for (row, slot), mask in zip(stale, fresh):
                masks[row] = self._masks[slot] = mask
        return masks, complete


_executor = None
_executor_lock = threading.Lock()


def allowed_masks(constraints: list[Constraint]) -> np.ndarray:
    """[R, ceil(V / 32)] int32: each constraint's next-token mask, computed in parallel on
    llguidance's thread pool (a mask over a 128k vocabulary takes tens of microseconds to a
    millisecond, and a step may hold hundreds of constrained rows)."""
    global _executor
    import llguidance

    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    width = max(c._matcher_words for c in constraints)
    masks = np.zeros((len(constraints), width), np.int32)
    _executor.unsafe_compute_mask_ptr([(c._matcher, i) for i, c in enumerate(constraints)],
                                      masks.ctypes.data, width * 4, len(constraints))
    return masks[:, :constraints[0].num_words]


class ConstraintCompiler:
    """Compiles `StructuredOutputsParams` for one model's tokenizer; thread-safe.

    tokenizer: a `tokenizers.Tokenizer`; vocab_size: the model's logits width V (masks have
    ceil(V / 32) words); eos_token_ids: the ids that end a sequence (allowed once a constraint
    is complete)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def constraint(self, params: StructuredOutputsParams) -> Constraint:
        """A fresh matcher for params (compiled, or copied from the cache); ValueError naming
        the field when the schema, regex or grammar is malformed."""
        key = (params.kind, params.text)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.fork()
        template = self._compile(params)
        with self._lock:
            self._cache[key] = template
            self.num_compiled += 1
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return template.fork()

    def _compile(self, params: StructuredOutputsParams) -> Constraint:
        import llguidance

        tokenizer = self._llguidance_tokenizer()
        kind = params.kind
        try:
            grammar = _grammar(llguidance, params)
        except Exception as err:   # the converters' own errors (GBNF's is no ValueError)
            raise ValueError(f"structured_outputs.{kind} is not valid: {err}") from err
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} is not valid: "
                             f"{matcher.get_error()[:400]}")
        return Constraint(matcher, -(-self.vocab_size // 32), -(-tokenizer.vocab_size // 32))

    def _llguidance_tokenizer(self):
        """llguidance's view of the tokenizer, built once (about a second for 128k tokens)."""
        import llguidance

        with self._lock:
            if self._ll_tokenizer is None:
                if self._tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer.json")
                n_vocab = max(self.vocab_size, self._tokenizer.get_vocab_size(True))
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.to_str(), n_vocab=n_vocab, eos_token=self._eos or None)
            return self._ll_tokenizer


def _grammar(llguidance, params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for params."""
    kind, value = params.kind, getattr(params, params.kind)
    compact = {"whitespace_flexible": False}
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=compact)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(item, ensure_ascii=False) for item in value))
    from llguidance.gbnf_to_lark import any_to_lark
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(value))
