"""Sampling parameters as a request gives them (vLLM's names and defaults), validated on the host:
`SamplingParams`, the caps that keep a request within what the device arrays hold, and the seed a
request samples with. The device sampler that applies them is `jpaged.sampling`.
"""

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from jpaged.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5  # a temperature below this means greedy (argmax), as in vLLM
SEED_MODULUS = 2**32       # device seeds are uint32: seeds equal modulo 2**32 give the same stream
# Caps that keep every request within what the device arrays and the host matcher hold; a value
# past one is rejected with a ValueError naming the field and the cap.
MAX_INT32 = 2**31 - 1      # top_k lives in an int32 on the device (any top_k >= V is "off")
MAX_STOP_STRINGS = 64      # stop strings per request (OpenAI allows 4)
MAX_STOP_LENGTH = 256      # characters per stop string: the matcher's automaton has at most
                           # MAX_STOP_STRINGS * MAX_STOP_LENGTH states per request
MAX_STOP_TOKEN_IDS = 256   # stop_token_ids per request, far under the decode loop's stop-id buffer
MAX_LOGIT_BIAS = 1024      # logit_bias entries per request: every row of a biased batch carries
                           # this many (id, bias) pairs, padding included (8 KiB a row)
MAX_BIAS = 100.0           # |bias| cap, OpenAI's: -100 in effect bans a token, +100 forces one
MAX_TEMPERATURE = 1e4      # float32-exact; logits / temperature stay finite and ordered, and far
                           # below it sampling is already uniform in practice (a gap of 20 -> 2e-3)


def _check_int(name: str, value, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")
    return int(value)


def _check_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_float32_fraction(name: str, value: float, *, zero_allowed: bool):
    """A probability in (0, 1] ([0, 1] if zero_allowed) that stays nonzero as a float32: a tiny
    positive value would round to 0 on the device and silently change what the filter does."""
    low_ok = value >= 0 if zero_allowed else value > 0
    if not (low_ok and value <= 1) or (value > 0 and np.float32(value) == 0):
        interval = "[0, 1]" if zero_allowed else "(0, 1]"
        raise ValueError(f"{name} must be in {interval} and, if nonzero, at least the smallest "
                         f"float32 ({float(np.finfo(np.float32).smallest_subnormal):.1e}), "
                         f"got {value!r}")


def _check_stop(stop) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(strings, (list, tuple)) or not all(
            isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop must be a non-empty str or a list of non-empty str, got {stop!r}")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(strings)} strings; at most MAX_STOP_STRINGS="
                         f"{MAX_STOP_STRINGS} are allowed")
    longest = max(map(len, strings), default=0)
    if longest > MAX_STOP_LENGTH:
        raise ValueError(f"stop has a string of {longest} characters; at most MAX_STOP_LENGTH="
                         f"{MAX_STOP_LENGTH} are allowed")
    return tuple(strings)


def _check_logit_bias(logit_bias) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (or (id, bias) pairs) -> ((id, bias), ...) sorted by id."""
    if logit_bias is None:
        return ()
    pairs = (list(logit_bias.items()) if isinstance(logit_bias, Mapping)
             else logit_bias if isinstance(logit_bias, (list, tuple)) else None)
    if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise ValueError("logit_bias must be a dict of token id -> bias, "
                         f"got {str(logit_bias)[:80]}")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most MAX_LOGIT_BIAS="
                         f"{MAX_LOGIT_BIAS} are allowed")
    checked = {}
    for token_id, bias in pairs:
        token_id = _check_int("logit_bias", token_id, minimum=0)
        bias = _check_float("logit_bias", bias)
        if token_id > MAX_INT32 or abs(bias) > MAX_BIAS:
            raise ValueError(f"logit_bias maps token ids to biases in [-{MAX_BIAS:g}, "
                             f"{MAX_BIAS:g}], got {token_id}: {bias!r}")
        if token_id in checked:
            raise ValueError(f"logit_bias has token id {token_id} twice")
        checked[token_id] = bias
    return tuple(sorted(checked.items()))


def _check_structured_outputs(value) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(
            StructuredOutputsParams)})
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}")
        return StructuredOutputsParams(**value)
    raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its "
                     f"fields, got {type(value).__name__}")


class RequestOutputKind(enum.IntEnum):
    """What a request's outputs carry as it runs (vLLM's names). CUMULATIVE: every output holds
    all tokens and text so far. DELTA: only what is new since the request's previous output.
    FINAL_ONLY: one output, when the request finishes (`LLM.generate` asks for this: building a
    cumulative output every step copies each sequence's tokens, which grows with its length)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _check_output_kind(kind) -> RequestOutputKind:
    """A RequestOutputKind, or its name (any case) or value."""
    try:
        if isinstance(kind, str):
            return RequestOutputKind[kind.upper()]
        if not isinstance(kind, bool) and isinstance(kind, numbers.Integral):
            return RequestOutputKind(kind)
    except (KeyError, ValueError):
        pass
    raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                     f"got {kind!r}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request: vLLM's names and defaults, validated eagerly.

    Every invalid value raises ValueError naming the parameter. After construction `stop` is a
    tuple of str and `stop_token_ids` a tuple of int (both possibly empty), so instances are
    hashable. A temperature below GREEDY_TEMPERATURE (e.g. 0) means greedy decoding. `seed=None`
    means the engine draws one (see `request_seed`). `logprobs=k` asks for the k most likely
    tokens' logprobs at each step (0: only the chosen token's). `prompt_logprobs=k` asks for
    each prompt token's logprob and the k most likely tokens at its position (vLLM's semantics:
    the first prompt token has none).

    Caps (module constants, named in the errors): temperature <= MAX_TEMPERATURE; top_k <=
    MAX_INT32 (an int32 on the device; a top_k >= the vocabulary turns the filter off, as vLLM);
    top_p and a nonzero min_p must stay nonzero as float32; at most MAX_STOP_STRINGS stop strings
    of at most MAX_STOP_LENGTH characters; at most MAX_STOP_TOKEN_IDS stop_token_ids, each <=
    MAX_INT32 (the engine also checks them against its vocabulary); logprobs and prompt_logprobs
    <= MAX_LOGPROBS; logit_bias: at most MAX_LOGIT_BIAS entries, biases in [-MAX_BIAS, MAX_BIAS].

    `logit_bias` (OpenAI's semantics) maps token ids to a bias added to their logits before
    sampling, greedy rows included; it is stored as ((id, bias), ...) sorted by id. The logprobs
    reported under "raw_logprobs" are the model's, unbiased; "processed_logprobs" include it.

    `structured_outputs` (a `StructuredOutputsParams`, or a dict of its fields) constrains the
    output to a JSON schema, any JSON object, a regex, a choice or a grammar: only tokens that
    keep it valid are sampled, and it ends with finish_reason "stop" once complete.

    `skip_special_tokens` (vLLM's, default True) leaves special tokens (the tokenizer's added
    tokens marked special) out of the output text; False keeps them in, e.g. a tool-call marker
    such as Llama 3.1's <|python_tag|>. Either way the token that ended the request (EOS or one
    of `stop_token_ids`) is not part of the text, as in vLLM; token ids are the same both ways.

    `detokenize` (vLLM's, default True): False leaves every output's text empty and turns no
    token into text as it comes, for a caller that reads token ids only (an RL rollout decodes
    its samples itself): the host work of incremental detokenization, most of the output
    processing of a decode loop, is not done. Stop strings are matched on that text, so they
    are refused with detokenize=False; stop ids, EOS, max_tokens and structured outputs work.
    """
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    structured_outputs: StructuredOutputsParams | Mapping | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self):
        fields = {
            "n": _check_int("n", self.n, minimum=1),
            "temperature": _check_float("temperature", self.temperature),
            "top_p": _check_float("top_p", self.top_p),
            "top_k": _check_int("top_k", self.top_k, minimum=-1),
            "min_p": _check_float("min_p", self.min_p),
            "seed": None if self.seed is None else _check_int("seed", self.seed),
            "max_tokens": _check_int("max_tokens", self.max_tokens, minimum=1),
            "stop": _check_stop(self.stop),
            "stop_token_ids": self._checked_stop_token_ids(),
            "logprobs": (None if self.logprobs is None
                         else _check_int("logprobs", self.logprobs, minimum=0)),
            "prompt_logprobs": (None if self.prompt_logprobs is None else _check_int(
                "prompt_logprobs", self.prompt_logprobs, minimum=0)),
            "output_kind": _check_output_kind(self.output_kind),
            "logit_bias": _check_logit_bias(self.logit_bias),
            "structured_outputs": _check_structured_outputs(self.structured_outputs),
        }
        if not 0 <= fields["temperature"] <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, MAX_TEMPERATURE={MAX_TEMPERATURE:g}], "
                             f"got {self.temperature!r}")
        _check_float32_fraction("top_p", fields["top_p"], zero_allowed=False)
        if fields["top_k"] == 0 or fields["top_k"] > MAX_INT32:
            raise ValueError(f"top_k must be -1 (off) or in [1, {MAX_INT32}] (values >= the "
                             f"vocabulary size mean off), got {self.top_k!r}")
        _check_float32_fraction("min_p", fields["min_p"], zero_allowed=True)
        if fields["logprobs"] is not None and fields["logprobs"] > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs!r}")
        if fields["prompt_logprobs"] is not None and fields["prompt_logprobs"] > MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be at most {MAX_LOGPROBS}, "
                             f"got {self.prompt_logprobs!r}")
        for name in ("ignore_eos", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if fields["stop"] and not self.detokenize:
            raise ValueError(f"stop strings are matched on the output text: stop={self.stop!r} "
                             "needs detokenize=True")
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def _checked_stop_token_ids(self) -> tuple[int, ...]:
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of int, got {self.stop_token_ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(ids)} ids; at most MAX_STOP_TOKEN_IDS="
                             f"{MAX_STOP_TOKEN_IDS} are allowed")
        checked = tuple(_check_int("stop_token_ids", i, minimum=0) for i in ids)
        if any(i > MAX_INT32 for i in checked):
            raise ValueError(f"stop_token_ids must be token ids (at most {MAX_INT32}), "
                             f"got {max(checked)}")
        return checked

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def request_seed(params: SamplingParams, rng: np.random.Generator) -> int:
    """The seed a request samples with: `params.seed` if given, else one drawn from `rng`.

    `rng` is the engine's generator (e.g. `np.random.default_rng(LLM(seed=...))`), so unseeded
    requests are still reproducible for the same engine seed and arrival order. It is drawn from
    only for unseeded requests. Returns an int in [0, 2**32).
    """
    if params.seed is not None:
        return params.seed % SEED_MODULUS
    return int(rng.integers(0, SEED_MODULUS, dtype=np.uint64))
