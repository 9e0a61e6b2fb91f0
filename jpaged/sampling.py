"""Sampling parameters (validated on the host) and the batched, batch-invariant on-device sampler.

Axes: B batch rows (one per sequence), V vocabulary, L number of top logprobs (static), W logit
bias entries per row (0 when no row of the batch has a bias, else MAX_LOGIT_BIAS), A words of a
packed token mask per row (0 when no row is constrained, else ceil(V / 32)).

Randomness: row b draws its Gumbel noise from
    fold_in(fold_in(PRNGKey(seed[b]), sample_index[b]), position[b])
so a seeded request's tokens depend only on its seed, which of its n samples the row is, and the
position being sampled: not on the batch size, the row index, the other rows, how many decode
steps run per host call, or whether the sequence was preempted and recomputed. (Checked bit for
bit on an H200 for batches of 5 to 512 rows, logprobs included.)

Cost of `sample` on an H200, V = 128256, in ms (B = 64 / 512): greedy 0.13 / 0.34, temperature or
min-p 0.27 / 0.93, top-p or top-k 1.1-1.3 / 3.7 (an int32 radix sort of every row dominates).
"""

import dataclasses
import enum
import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpaged.options import LOGPROBS_MODES
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
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
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


class SamplingRow(NamedTuple):
    """One sequence's entry in a batch, as the executor knows it on the host."""
    params: SamplingParams
    seed: int          # the request's seed (`request_seed`); any int, reduced modulo 2**32
    sample_index: int  # which of the request's n samples this sequence is, in [0, n)
    position: int      # absolute position of the token being sampled (tokens before it)
    allowed: np.ndarray | None = None   # [A] int32 packed mask of the tokens it may sample
                                        # (a structured output's); None: any token


_PAD_ROW = dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0, sample_index=0,
                position=0)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["temperature", "top_k", "top_p", "min_p", "seeds",
                                "sample_indices", "positions", "bias_ids", "bias_values",
                                "allowed"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings for one batch; leaves are [B], the logit bias [B, W].

    Rows with temperature < GREEDY_TEMPERATURE are greedy and ignore the other settings but the
    logit bias. A row's bias entries past its own are (token 0, bias 0.0): adding 0.0 changes no
    logit. A batch with no biased row has W = 0 and adds nothing; any biased row makes it
    MAX_LOGIT_BIAS, so there are two program variants, not one per bias count. Likewise the
    token masks: A = 0 when no row is constrained, else A = ceil(V / 32) words per row (bit
    t % 32 of word t // 32: token t allowed), all ones for the unconstrained rows.
    `top_k` of -1 (or >= V) and `top_p` of 1 turn those filters off. In a multi-step loop, advance
    with `dataclasses.replace(t, positions=t.positions + 1)`.
    """
    temperature: jax.Array     # [B] float32
    top_k: jax.Array           # [B] int32; -1 or >= V: off
    top_p: jax.Array           # [B] float32 in (0, 1]; 1: off
    min_p: jax.Array           # [B] float32 in [0, 1]; 0: off
    seeds: jax.Array           # [B] uint32
    sample_indices: jax.Array  # [B] int32
    positions: jax.Array       # [B] int32
    bias_ids: jax.Array        # [B, W] int32 token ids whose logits get a bias
    bias_values: jax.Array     # [B, W] float32 the biases
    allowed: jax.Array         # [B, A] int32 packed masks of the tokens each row may sample

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], batch_size: int | None = None
                  ) -> "SamplingTensors":
        """Numpy-backed tensors for `rows`, padded with greedy rows up to `batch_size`.

        Move them to the device with one `jax.device_put(tensors)`. `batch_size` defaults to
        len(rows); a batch_size below len(rows) raises ValueError.
        """
        batch_size = len(rows) if batch_size is None else batch_size
        if batch_size < len(rows):
            raise ValueError(f"batch_size must be at least len(rows)={len(rows)}, "
                             f"got {batch_size}")
        columns = {name: [value] * batch_size for name, value in _PAD_ROW.items()}
        for i, row in enumerate(rows):
            greedy = row.params.is_greedy  # greedy rows: filters off, so no sort is triggered
            columns["temperature"][i] = 0.0 if greedy else row.params.temperature
            columns["top_k"][i] = -1 if greedy else row.params.top_k
            columns["top_p"][i] = 1.0 if greedy else row.params.top_p
            columns["min_p"][i] = 0.0 if greedy else row.params.min_p
            columns["seed"][i] = row.seed % SEED_MODULUS
            columns["sample_index"][i] = row.sample_index
            columns["position"][i] = row.position
        width = MAX_LOGIT_BIAS if any(row.params.logit_bias for row in rows) else 0
        bias_ids = np.zeros((batch_size, width), np.int32)
        bias_values = np.zeros((batch_size, width), np.float32)
        for i, row in enumerate(rows):
            if row.params.logit_bias:
                ids, values = zip(*row.params.logit_bias)
                bias_ids[i, :len(ids)], bias_values[i, :len(ids)] = ids, values
        masks = [row.allowed for row in rows if row.allowed is not None]
        allowed = np.full((batch_size, len(masks[0]) if masks else 0), -1, np.int32)
        for i, row in enumerate(rows):
            if row.allowed is not None:
                allowed[i] = row.allowed
        return cls(
            temperature=np.asarray(columns["temperature"], np.float32),
            top_k=np.asarray(columns["top_k"], np.int32),
            top_p=np.asarray(columns["top_p"], np.float32),
            min_p=np.asarray(columns["min_p"], np.float32),
            seeds=np.asarray(columns["seed"], np.uint32),
            sample_indices=np.asarray(columns["sample_index"], np.int32),
            positions=np.asarray(columns["position"], np.int32),
            bias_ids=bias_ids, bias_values=bias_values, allowed=allowed,
        )


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["token_ids", "logprobs", "top_ids", "top_logprobs"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What the sampler returns for a batch. Logprobs are log_softmax of the raw logits."""
    token_ids: jax.Array     # [B] int32 chosen tokens
    logprobs: jax.Array      # [B] float32 logprob of each chosen token
    top_ids: jax.Array       # [B, L] int32 the L most likely tokens, most likely first
    top_logprobs: jax.Array  # [B, L] float32 their logprobs, descending


SAMPLER_MODES = ("greedy", "random", "sort")


def sampler_mode(rows: Sequence[SamplingRow]) -> str:
    """The static sampler path for these rows, decided on the host: "greedy" when every row is
    greedy (argmax only), "sort" when some sampled row filters with top_k/top_p, else "random"
    (noise drawn, no sort; greedy rows ignore the noise). Drawing the noise for an all-greedy
    batch cost 50 us of an 8B decode step at B = 64 on the H200 (of 7.2 ms), and grows with B."""
    sampled = [row.params for row in rows if row.params.temperature >= GREEDY_TEMPERATURE]
    if not sampled:
        return "greedy"
    return "sort" if any(params.top_k > 0 or params.top_p < 1.0 for params in sampled) \
        else "random"


def sample(logits: jax.Array, tensors: SamplingTensors, *, num_logprobs: int = 0,
           mode: str | None = None, logprobs_mode: str = "raw_logprobs") -> SamplerOutput:
    """Pick one token per row of `logits: [B, V]`; jit-friendly with `num_logprobs` (L) static.

    Greedy rows take the argmax. Other rows divide by temperature, keep the top_k tokens, then
    the nucleus (the fewest most-likely tokens whose probability, renormalised over the top-k
    set, reaches top_p; the top token always stays), then drop tokens with probability below
    min_p times the top token's, and draw from what is left with the Gumbel-max trick. Tokens
    tied with a threshold value are kept. A batch of only greedy rows draws no noise, and a batch
    where no sampled row uses top_k or top_p skips the sort.

    mode (static): None decides both shortcuts on the device with `lax.cond`; one of
    SAMPLER_MODES (the host's `sampler_mode` of these rows) fixes the path at trace time. On a
    GPU each cond makes the dispatching thread wait for the device, so loops that must not block
    (the decode loop) pass a mode. A mode cheaper than the rows need is the caller's error.

    Every row's logit bias is added first and its token mask applied (disallowed tokens at
    -inf), greedy rows too: they decide the tokens.

    logprobs_mode (static, one of LOGPROBS_MODES): "raw_logprobs" reports log_softmax of the raw
    logits (no bias); "processed_logprobs" that of the distribution actually sampled from (bias
    and temperature applied, filtered tokens at -inf; greedy rows keep their biased logits).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    if tensors.temperature.shape != logits.shape[:1]:
        raise ValueError(f"tensors must have one row per logits row ({logits.shape[0]}), "
                         f"got temperature shape {tensors.temperature.shape}")
    if tensors.bias_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"tensors must have one bias row per logits row ({logits.shape[0]}), "
                         f"got bias_ids shape {tensors.bias_ids.shape}")
    if tensors.allowed.shape[1] not in (0, -(-logits.shape[1] // 32)):
        raise ValueError(f"tensors.allowed must have ceil(V / 32) = {-(-logits.shape[1] // 32)} "
                         f"words per row (or none), got shape {tensors.allowed.shape}")
    if not 0 <= num_logprobs <= logits.shape[1]:
        raise ValueError(f"num_logprobs must be in [0, V={logits.shape[1]}], got {num_logprobs}")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    raw = logits.astype(jnp.float32)
    logits = with_token_mask(with_logit_bias(raw, tensors), tensors)
    is_greedy = tensors.temperature < GREEDY_TEMPERATURE                     # [B]
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)               # [B]
    if logprobs_mode == "processed_logprobs":
        return _sample_processed(logits, tensors, is_greedy, greedy_ids, num_logprobs, mode)
    if mode is None:
        token_ids = lax.cond(
            jnp.all(is_greedy),
            lambda: greedy_ids,
            lambda: jnp.where(is_greedy, greedy_ids, _sample_random(logits, tensors, is_greedy)))
    elif mode == "greedy":
        token_ids = greedy_ids
    elif mode in SAMPLER_MODES:
        token_ids = jnp.where(is_greedy, greedy_ids,
                              _sample_random(logits, tensors, is_greedy, sort=mode == "sort"))
    else:
        raise ValueError(f"mode must be None or one of {SAMPLER_MODES}, got {mode!r}")
    return _with_logprobs(raw, token_ids, num_logprobs)


def with_token_mask(logits: jax.Array, tensors: SamplingTensors) -> jax.Array:
    """[B, V] logits with the tokens each row's mask forbids at -inf (no mask when A = 0)."""
    if tensors.allowed.shape[1] == 0:
        return logits
    token = jnp.arange(logits.shape[1], dtype=jnp.int32)
    bits = (tensors.allowed[:, token // 32] >> (token % 32)) & 1             # [B, V]
    return jnp.where(bits != 0, logits, -jnp.inf)


def with_logit_bias(logits: jax.Array, tensors: SamplingTensors) -> jax.Array:
    """[B, V] logits plus each row's logit bias (nothing to add when W = 0)."""
    if tensors.bias_ids.shape[1] == 0:
        return logits
    rows = jnp.arange(logits.shape[0])[:, None]                              # [B, 1]
    return logits.at[rows, tensors.bias_ids].add(tensors.bias_values, mode="drop")


def _with_logprobs(logits: jax.Array, token_ids: jax.Array, num_logprobs: int) -> SamplerOutput:
    """The chosen tokens with their logprobs and the top L under log_softmax(logits)."""
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)                       # [B]
    top_logits, top_ids = _top_logits(logits, num_logprobs)                  # [B, L]
    return SamplerOutput(token_ids=token_ids,
                         logprobs=token_logprobs(logits, token_ids, log_normalizer),
                         top_ids=top_ids, top_logprobs=top_logits - log_normalizer[:, None])


def token_logprobs(logits: jax.Array, token_ids: jax.Array,
                   log_normalizer: jax.Array | None = None) -> jax.Array:
    """[B] log_softmax(logits)[b, token_ids[b]] for logits [B, V] float32, as the sampler reports
    a chosen token's (the training forward, `jpaged.models.forward`, computes it so too).
    log_normalizer: [B] logsumexp of the rows, when the caller has it."""
    # logprob = logit - logsumexp(logits): no [B, V] log_softmax is materialised.
    if log_normalizer is None:
        log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    return jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0] - log_normalizer


def _sample_processed(logits, tensors, is_greedy, greedy_ids, num_logprobs, mode):
    """`sample` under "processed_logprobs": the same tokens (the draw takes the argmax of the
    same filtered, scaled logits plus the same noise), logprobs from those processed logits."""
    if mode not in (None, *SAMPLER_MODES):
        raise ValueError(f"mode must be None or one of {SAMPLER_MODES}, got {mode!r}")
    if mode == "greedy":
        return _with_logprobs(logits, greedy_ids, num_logprobs)
    processed = jnp.where(is_greedy[:, None], logits, _processed_logits(
        logits, tensors, is_greedy, None if mode is None else mode == "sort"))
    token_ids = jnp.where(is_greedy, greedy_ids, _draw(processed, tensors))
    return _with_logprobs(processed, token_ids, num_logprobs)


def _top_logits(logits: jax.Array, num_logprobs: int) -> tuple[jax.Array, jax.Array]:
    """([B, L] float32 largest logits, descending; [B, L] int32 their token ids).

    On the GPU XLA's top-k kernel covers k <= 16; a larger L falls back to a full sort (H200,
    [512, 128256]: about 1 ms for L = 5, 5 ms for L = 20).
    """
    if num_logprobs == 0:
        batch_size = logits.shape[0]
        return jnp.zeros((batch_size, 0), jnp.float32), jnp.zeros((batch_size, 0), jnp.int32)
    top_logits, top_ids = lax.top_k(logits, num_logprobs)
    return top_logits, top_ids.astype(jnp.int32)


def row_keys(tensors: SamplingTensors) -> jax.Array:
    """[B] PRNG keys, one per row, from (seed, sample_index, position) alone."""
    def key(seed, sample_index, position):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), sample_index),
                                  position)
    return jax.vmap(key)(tensors.seeds, tensors.sample_indices, tensors.positions)


def _sample_random(logits: jax.Array, tensors: SamplingTensors, is_greedy: jax.Array,
                   sort: bool | None = None) -> jax.Array:
    """[B] int32 tokens drawn from the filtered, temperature-scaled distribution of each row.
    sort: None decides on the device whether any row needs the top-k/top-p sort (see sample)."""
    return _draw(_processed_logits(logits, tensors, is_greedy, sort), tensors)


def _draw(processed: jax.Array, tensors: SamplingTensors) -> jax.Array:
    """[B] int32 Gumbel-max draws from processed: [B, V] logits (-inf: never drawn)."""
    vocab_size = processed.shape[-1]
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (vocab_size,), jnp.float32))(
        row_keys(tensors))                                                   # [B, V]
    return jnp.argmax(processed + gumbel, axis=-1).astype(jnp.int32)


def _processed_logits(logits: jax.Array, tensors: SamplingTensors, is_greedy: jax.Array,
                      sort: bool | None) -> jax.Array:
    """[B, V] the logits each row samples from: divided by temperature, filtered tokens -inf."""
    batch_size, vocab_size = logits.shape
    temperature = jnp.where(is_greedy, 1.0, tensors.temperature)
    scaled = logits / temperature[:, None]                                   # [B, V]
    is_top_k_on = (tensors.top_k > 0) & (tensors.top_k < vocab_size)
    wants_sort = ~is_greedy & (is_top_k_on | (tensors.top_p < 1.0))
    sorted_threshold = functools.partial(  # [B]
        _top_k_top_p_threshold, scaled, jnp.where(is_top_k_on, tensors.top_k, vocab_size),
        tensors.top_p)
    no_threshold = functools.partial(jnp.full, (batch_size,), -jnp.inf, jnp.float32)
    if sort is None:
        threshold = lax.cond(jnp.any(wants_sort), sorted_threshold, no_threshold)
    else:
        threshold = sorted_threshold() if sort else no_threshold()
    # p >= min_p * p_max  <=>  scaled >= max(scaled) + log(min_p); log(0) = -inf keeps all.
    min_p_floor = jnp.max(scaled, axis=-1) + jnp.log(tensors.min_p)          # [B]
    is_kept = (scaled >= threshold[:, None]) & (scaled >= min_p_floor[:, None])
    return jnp.where(is_kept, scaled, -jnp.inf)


def _top_k_top_p_threshold(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B] the smallest scaled logit each row keeps under top-k (k in [1, V]) then top-p."""
    vocab_size = scaled.shape[-1]
    # Sorting int32 keys is about twice as fast as sorting floats on the GPU (radix sort);
    # ~key orders descending without a reversal.
    sorted_desc = _from_sortable(~lax.sort(~_to_sortable(scaled), dimension=1, is_stable=False))
    in_top_k = jnp.arange(vocab_size)[None, :] < top_k[:, None]              # [B, V]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    cumulative = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.pad(cumulative[:, :-1], ((0, 0), (1, 0)))              # exclusive cumsum
    num_kept = jnp.sum(in_top_k & (mass_before < top_p[:, None]), axis=-1)   # >= 1
    # top_p == 1 keeps the whole top-k set even where rounding makes the cumsum reach 1 early.
    num_kept = jnp.where(top_p >= 1.0, top_k, num_kept)
    return jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)[:, 0]


def _to_sortable(x: jax.Array) -> jax.Array:
    """float32 -> int32 with the same order (a bijection on non-NaN values)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _from_sortable(keys: jax.Array) -> jax.Array:
    """Inverse of `_to_sortable`."""
    bits = jnp.where(keys < 0, keys ^ jnp.int32(0x7FFFFFFF), keys)
    return lax.bitcast_convert_type(bits, jnp.float32)
