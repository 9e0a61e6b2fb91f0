"""The batched, batch-invariant on-device sampler, and the per-row tensors it reads
(`SamplingParams`, validated on the host, is `jpaged.sampling_params`).

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
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpaged.options import LOGPROBS_MODES
from jpaged.sampling_params import (GREEDY_TEMPERATURE, MAX_LOGIT_BIAS, SEED_MODULUS,
                                    SamplingParams)


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
