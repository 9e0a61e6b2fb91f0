"""Sampling: parameter validation, filters on hand-worked distributions, empirical frequencies,
batch invariance of seeded rows, and logprobs against log_softmax."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.sampling import SamplingRow, SamplingTensors, row_keys, sample
from jpaged.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_LENGTH,
                                    MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                                    SamplingParams, request_seed)

sample_jit = jax.jit(sample, static_argnames=("num_logprobs", "mode", "logprobs_mode"))

# A hand-worked distribution over 8 tokens (sums to 1).
PROBS = np.array([0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01], np.float64)
NUM_DRAWS = 8192


def run(rows, logits, batch_size=None, num_logprobs=0, **static):
    tensors = SamplingTensors.from_rows(rows, batch_size)
    logits = np.asarray(logits, np.float32)
    if batch_size is not None and batch_size > logits.shape[0]:
        logits = np.concatenate([logits, np.zeros((batch_size - len(logits), logits.shape[1]),
                                                  np.float32)])
    return jax.tree.map(np.asarray, sample_jit(logits, tensors, num_logprobs=num_logprobs,
                                               **static))


def draws(params, probs=PROBS, seed=0):
    """NUM_DRAWS tokens for the same distribution, one per position (so one key each)."""
    rows = [SamplingRow(params, seed, 0, position) for position in range(NUM_DRAWS)]
    logits = np.tile(np.log(probs), (NUM_DRAWS, 1))
    return run(rows, logits).token_ids


# ---------------------------------------------------------------------------- SamplingParams

INVALID = [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "1"), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", math.nan),
    ("n", 0), ("n", 1.5), ("n", True), ("max_tokens", 0), ("max_tokens", -3),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.0), ("min_p", -0.1), ("min_p", 1.5),
    ("min_p", math.inf), ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 1.0),
    ("seed", 1.5), ("seed", "7"), ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]),
    ("stop", 5), ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 7),
    ("ignore_eos", "yes"), ("skip_special_tokens", 0), ("skip_special_tokens", "false"),
    ("skip_special_tokens", None), ("detokenize", 1), ("detokenize", None),
    ("logit_bias", {3: 100.5}), ("logit_bias", {3: -101}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"3": 1.0}), ("logit_bias", {3: math.nan}),
    ("logit_bias", {3: True}), ("logit_bias", [3, 4]), ("logit_bias", 3),
    ("logit_bias", [(3, 1.0), (3, 2.0)]), ("logit_bias", {2**31: 1.0}),
    # past what the device holds: int32 overflow, or float32 rounding that changes the meaning
    ("top_k", 2**31), ("top_p", 1e-46), ("min_p", 1e-46), ("temperature", 1e308),
    ("temperature", MAX_TEMPERATURE * 1.01),
]


@pytest.mark.parametrize("name,value,cap", [
    ("stop_token_ids", [2**31], "2147483647"),
    ("stop_token_ids", list(range(65_536)), "MAX_STOP_TOKEN_IDS"),
    ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1), "MAX_STOP_TOKEN_IDS"),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1), "MAX_STOP_STRINGS"),
    ("stop", ["x" * (MAX_STOP_LENGTH + 1)], "MAX_STOP_LENGTH"),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "MAX_LOGIT_BIAS"),
])
def test_counts_and_ids_past_the_caps_raise_naming_the_field_and_cap(name, value, cap):
    with pytest.raises(ValueError, match=name) as error:
        SamplingParams(**{name: value})
    assert cap in str(error.value)


def test_values_at_the_caps_are_accepted():
    params = SamplingParams(top_k=2**31 - 1, temperature=MAX_TEMPERATURE, top_p=1e-45,
                            min_p=1e-45, stop_token_ids=[2**31 - 1] * MAX_STOP_TOKEN_IDS,
                            stop=["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS,
                            logit_bias={i: (-1) ** i * 100 for i in range(MAX_LOGIT_BIAS)})
    assert len(params.logit_bias) == MAX_LOGIT_BIAS
    assert np.float32(params.top_p) > 0 and np.isfinite(np.float32(params.temperature))


@pytest.mark.parametrize("name,value", INVALID)
def test_invalid_params_raise_value_error_naming_the_parameter(name, value):
    with pytest.raises(ValueError, match=name) as error:
        SamplingParams(**{name: value})
    if not isinstance(value, (list, dict)):
        assert repr(value) in str(error.value)


def test_params_are_normalised_hashable_and_revalidated_on_replace():
    params = SamplingParams(stop="###", stop_token_ids=[2, 3], temperature=0)
    assert params.stop == ("###",) and params.stop_token_ids == (2, 3)
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().skip_special_tokens is True   # vLLM's default
    assert SamplingParams(skip_special_tokens=False) != SamplingParams()
    assert hash(params) == hash(SamplingParams(stop=("###",), stop_token_ids=(2, 3),
                                               temperature=0.0))
    assert params.is_greedy and SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert dataclasses.replace(params, n=3).stop == ("###",)
    biased = SamplingParams(logit_bias={9: -1, 2: 0.5})
    assert biased.logit_bias == ((2, 0.5), (9, -1.0)) and SamplingParams().logit_bias == ()
    assert hash(biased) == hash(SamplingParams(logit_bias=[(9, -1.0), (2, 0.5)]))
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(params, top_k=0)


@given(n=st.integers(1, 8), temperature=st.floats(0, 5), top_p=st.floats(1e-6, 1),
       top_k=st.one_of(st.just(-1), st.integers(1, 1000)),
       min_p=st.one_of(st.just(0.0), st.floats(1e-6, 1)),
       seed=st.one_of(st.none(), st.integers(-2**63, 2**63)), max_tokens=st.integers(1, 4096),
       logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)))
def test_valid_params_construct(**kwargs):
    assert SamplingParams(**kwargs).n == kwargs["n"]


def test_request_seed_uses_the_given_seed_else_draws_reproducibly():
    rng = np.random.default_rng(0)
    assert request_seed(SamplingParams(seed=5), rng) == 5
    assert request_seed(SamplingParams(seed=-1), rng) == 2**32 - 1
    drawn = [request_seed(SamplingParams(), rng) for _ in range(3)]
    assert drawn[0] == request_seed(SamplingParams(), np.random.default_rng(0))  # rng untouched
    assert len(set(drawn)) == 3 and all(0 <= seed < 2**32 for seed in drawn)


def test_from_rows_pads_with_greedy_rows_and_rejects_overflow():
    rows = [SamplingRow(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1),
                        2**32 + 3, 1, 40)]
    tensors = SamplingTensors.from_rows(rows, batch_size=4)
    assert tensors.temperature.dtype == np.float32 and tensors.seeds.dtype == np.uint32
    np.testing.assert_allclose(tensors.temperature, [0.7, 0, 0, 0])
    assert list(tensors.top_k) == [5, -1, -1, -1] and list(tensors.seeds) == [3, 0, 0, 0]
    assert list(tensors.sample_indices) == [1, 0, 0, 0] and list(tensors.positions) == [40, 0, 0, 0]
    greedy = SamplingTensors.from_rows([SamplingRow(SamplingParams(temperature=0, top_k=3), 1,
                                                    0, 0)])
    assert list(greedy.top_k) == [-1]  # a greedy row never triggers the sort
    assert tensors.bias_ids.shape == tensors.bias_values.shape == (4, 0)  # nothing to add
    biased = SamplingTensors.from_rows(
        rows + [SamplingRow(SamplingParams(logit_bias={7: -2.5, 3: 1}), 0, 0, 0)], batch_size=4)
    assert biased.bias_ids.shape == (4, MAX_LOGIT_BIAS) and biased.bias_ids.dtype == np.int32
    assert list(biased.bias_ids[1, :3]) == [3, 7, 0] and not biased.bias_ids[[0, 2, 3]].any()
    assert list(biased.bias_values[1, :3]) == [1.0, -2.5, 0.0]
    assert not biased.bias_values[[0, 2, 3]].any()
    with pytest.raises(ValueError, match="batch_size"):
        SamplingTensors.from_rows(rows * 3, batch_size=2)


# ---------------------------------------------------------------------------- filters

def test_greedy_and_top_k_1_take_the_argmax():
    logits = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32) * 3
    greedy = [SamplingRow(SamplingParams(temperature=0), i, 0, i) for i in range(16)]
    top1 = [SamplingRow(SamplingParams(temperature=1.5, top_k=1), i, 0, i) for i in range(16)]
    np.testing.assert_array_equal(run(greedy, logits).token_ids, logits.argmax(-1))
    np.testing.assert_array_equal(run(top1, logits).token_ids, logits.argmax(-1))
    mixed = [greedy[i] if i % 2 else top1[i] for i in range(16)]
    np.testing.assert_array_equal(run(mixed, logits).token_ids, logits.argmax(-1))


@pytest.mark.parametrize("params,kept", [
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_p=0.65), {0, 1, 2}),          # mass before token 2 is 0.6 < 0.65
    (SamplingParams(top_p=0.8), {0, 1, 2, 3}),
    (SamplingParams(temperature=0.5, top_p=0.8), {0, 1}),  # p^2 renormalised: .66, .17, .09
    (SamplingParams(top_k=2, top_p=0.5), {0}),        # renormalised over top-2: 2/3 >= 0.5
    (SamplingParams(min_p=0.3), {0, 1, 2}),           # p >= 0.12
    (SamplingParams(min_p=0.6), {0}),                 # p >= 0.24
    (SamplingParams(temperature=2.0, min_p=0.6), {0, 1, 2}),  # sqrt(p / 0.4) >= 0.6
    (SamplingParams(top_k=4, top_p=0.99, min_p=0.3), {0, 1, 2}),
    (SamplingParams(top_p=1e-6), {0}),
])
def test_filters_keep_exactly_the_hand_worked_set(params, kept):
    assert set(draws(params).tolist()) == kept


def chi_square(tokens, expected_probs):
    counts = np.bincount(tokens, minlength=len(expected_probs))
    expected = expected_probs * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def test_empirical_frequencies_match_the_tempered_softmax():
    tempered = PROBS ** (1 / 0.7)
    # 7 degrees of freedom: P(chi2 > 35) ~ 1e-5; a wrong temperature gives hundreds.
    assert chi_square(draws(SamplingParams(temperature=0.7)), tempered / tempered.sum()) < 35
    wrong = PROBS ** (1 / 1.0)
    assert chi_square(draws(SamplingParams(temperature=0.7)), wrong / wrong.sum()) > 100


def test_empirical_frequencies_are_renormalised_over_the_kept_set():
    expected = np.where(np.arange(8) < 3, PROBS, 0)
    assert chi_square(draws(SamplingParams(top_k=3), seed=1), expected / expected.sum()) < 25


def test_sort_is_skipped_unless_a_row_needs_it():
    """The sort sits inside a lax.cond branch, and greedy-only batches draw no noise."""
    tensors = SamplingTensors.from_rows([SamplingRow(SamplingParams(), 0, 0, 0)])
    jaxpr = jax.make_jaxpr(sample)(jnp.zeros((1, 8)), tensors)
    top_level = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert "cond" in top_level and "sort" not in top_level and "random_bits" not in top_level
    assert "sort" in str(jaxpr) and "random_bits" in str(jaxpr)


# ---------------------------------------------------------------------------- batch invariance

random_params = st.builds(
    SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([-1, 1, 5, 40]), top_p=st.sampled_from([1.0, 0.9, 0.3]),
    min_p=st.sampled_from([0.0, 0.05]))


@settings(max_examples=25, deadline=None)
@given(target=random_params, others=st.lists(random_params, min_size=7, max_size=7),
       seed=st.integers(0, 2**32 - 1), sample_index=st.integers(0, 3),
       position=st.integers(0, 10_000), row=st.integers(0, 7), data_seed=st.integers(0, 2**16))
def test_a_seeded_row_gives_the_same_token_in_any_batch(target, others, seed, sample_index,
                                                        position, row, data_seed):
    rng = np.random.default_rng(data_seed)
    logits = rng.normal(size=(8, 128)).astype(np.float32)
    target_row = SamplingRow(target, seed, sample_index, position)
    alone = run([target_row], logits[row:row + 1])
    rows = [SamplingRow(p, int(rng.integers(2**32)), 0, int(rng.integers(1000))) for p in others]
    rows.insert(row, target_row)
    batched = run(rows, logits)
    padded = run([target_row], logits[row:row + 1], batch_size=16)
    for out, index in ((batched, row), (padded, 0)):
        assert out.token_ids[index] == alone.token_ids[0]
        np.testing.assert_allclose(out.logprobs[index], alone.logprobs[0], rtol=1e-6)


def stream(seed, sample_index, num_positions=64, params=SamplingParams()):
    rows = [SamplingRow(params, seed, sample_index, p) for p in range(num_positions)]
    logits = np.random.default_rng(0).normal(size=(1, 128)).astype(np.float32)
    return run(rows, np.repeat(logits, num_positions, axis=0)).token_ids


def test_seeded_streams_are_reproducible_and_distinct_per_sample_and_seed():
    np.testing.assert_array_equal(stream(7, 0), stream(7, 0))
    assert np.mean(stream(7, 0) == stream(7, 1)) < 0.5
    assert np.mean(stream(7, 0) == stream(8, 0)) < 0.5
    keys = np.asarray(jax.random.key_data(row_keys(
        SamplingTensors.from_rows([SamplingRow(SamplingParams(), 7, i, 3) for i in range(2)]))))
    assert not np.array_equal(keys[0], keys[1])


# ---------------------------------------------------------------------------- logprobs

def log_softmax(logits):
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("num_logprobs", [0, 3, MAX_LOGPROBS])
def test_logprobs_are_log_softmax_of_the_raw_logits(num_logprobs):
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=(6, 100)) * 4).astype(np.float32)
    rows = [SamplingRow(SamplingParams(temperature=t, top_k=k, top_p=p), i, 0, i)
            for i, (t, k, p) in enumerate([(0, -1, 1), (0.5, -1, 1), (2.0, 10, 1),
                                           (1.0, -1, 0.5), (1.0, 3, 0.9), (0.8, -1, 1)])]
    out = run(rows, logits, num_logprobs=num_logprobs)
    reference = log_softmax(logits)
    np.testing.assert_allclose(out.logprobs,
                               reference[np.arange(6), out.token_ids], rtol=1e-5, atol=1e-5)
    assert out.top_ids.shape == out.top_logprobs.shape == (6, num_logprobs)
    assert out.top_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32
    np.testing.assert_array_equal(out.top_ids, np.argsort(-reference, axis=-1)[:, :num_logprobs])
    np.testing.assert_allclose(out.top_logprobs,
                               np.sort(reference, axis=-1)[:, ::-1][:, :num_logprobs],
                               rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(out.top_logprobs, axis=-1) <= 0)


def test_hand_worked_logprob():
    logits = np.log(np.array([[0.5, 0.25, 0.25]], np.float32)) + 3.0  # a shift changes nothing
    out = run([SamplingRow(SamplingParams(temperature=0), 0, 0, 0)], logits, num_logprobs=2)
    assert out.token_ids[0] == 0
    np.testing.assert_allclose(out.logprobs, [math.log(0.5)], rtol=1e-6)
    np.testing.assert_allclose(out.top_logprobs, [[math.log(0.5), math.log(0.25)]], rtol=1e-6)


def test_bad_shapes_raise_value_error_naming_the_argument():
    tensors = SamplingTensors.from_rows([SamplingRow(SamplingParams(), 0, 0, 0)])
    with pytest.raises(ValueError, match="logits"):
        sample(jnp.zeros((8,)), tensors)
    with pytest.raises(ValueError, match="tensors"):
        sample(jnp.zeros((2, 8)), tensors)
    with pytest.raises(ValueError, match="num_logprobs"):
        sample(jnp.zeros((1, 8)), tensors, num_logprobs=9)


@pytest.mark.parametrize("rows_params,mode", [
    ([SamplingParams(temperature=0.0)] * 3, "greedy"),
    ([SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 2, "greedy"),
    ([SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, min_p=0.05),
      SamplingParams(temperature=1.3, seed=4)], "random"),
    ([SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
      SamplingParams(temperature=1.0, top_k=3)], "sort"),
])
def test_host_chosen_sampler_mode_equals_the_device_decision(rows_params, mode):
    """sampler_mode picks the cheapest path, and that static path samples exactly what the
    cond-based path does (same keys, same filters), over many positions."""
    from jpaged.sampling import sampler_mode
    rows = [SamplingRow(p, 7, 0, position) for position in range(64) for p in rows_params]
    assert sampler_mode(rows) == mode
    logits = np.random.default_rng(0).normal(size=(len(rows), 50)).astype(np.float32) * 3
    tensors = SamplingTensors.from_rows(rows)
    static = jax.jit(sample, static_argnames=("num_logprobs", "mode"))
    expected = static(logits, tensors, num_logprobs=2)
    got = static(logits, tensors, num_logprobs=2, mode=mode)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="mode"):
        sample(logits, tensors, mode="fast")


# ---------------------------------------------------------------------------- logit bias


def test_logit_bias_decides_greedy_and_sampled_tokens_but_not_raw_logprobs():
    logits = np.log(PROBS)[None].repeat(4, 0).astype(np.float32)
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={0: -100}), 0, 0, 0),
            SamplingRow(SamplingParams(temperature=0, logit_bias={7: 100, 0: 3}), 0, 0, 0),
            SamplingRow(SamplingParams(temperature=0), 0, 0, 0),
            SamplingRow(SamplingParams(temperature=0, logit_bias={1: math.log(2) + 1e-3}), 0,
                        0, 0)]
    out = run(rows, logits, num_logprobs=2)
    assert list(out.token_ids) == [1, 7, 0, 1]   # banned, forced, untouched, 0.2 * 2 > 0.4
    reference = log_softmax(logits)              # raw: the model's, whatever the bias
    np.testing.assert_allclose(out.logprobs, reference[0, [1, 7, 0, 1]], rtol=1e-6)
    np.testing.assert_allclose(out.top_logprobs, reference[:, :2], rtol=1e-6)
    processed = run(rows, logits, num_logprobs=2, logprobs_mode="processed_logprobs")
    assert list(processed.token_ids) == [1, 7, 0, 1]
    biased = logits.copy()
    biased[0, 0] -= 100
    biased[1, [7, 0]] += [100, 3]
    biased[3, 1] += math.log(2) + 1e-3
    np.testing.assert_allclose(processed.logprobs, log_softmax(biased)[range(4), [1, 7, 0, 1]],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(processed.top_ids[:2], [[1, 2], [7, 0]])


def test_sampled_rows_never_draw_a_banned_token_and_follow_the_biased_softmax():
    bias = {0: -100, 1: math.log(3)}             # 0 gone; 1 three times as likely
    tokens = draws(SamplingParams(temperature=1.0, logit_bias=bias, seed=5))
    assert not np.any(tokens == 0)
    expected = PROBS * np.exp([0, math.log(3), 0, 0, 0, 0, 0, 0])
    expected[0] = 0
    expected /= expected.sum()
    frequencies = np.bincount(tokens, minlength=len(PROBS)) / NUM_DRAWS
    np.testing.assert_allclose(frequencies, expected, atol=4 * np.sqrt(0.25 / NUM_DRAWS))
    filtered = draws(SamplingParams(temperature=0.7, top_k=2, logit_bias={0: -100}, seed=6))
    assert set(np.unique(filtered)) == {1, 2}    # top-2 of the biased logits


@pytest.mark.parametrize("target", [SamplingParams(temperature=0),
                                    SamplingParams(temperature=0.9, top_p=0.8, seed=3)])
def test_a_row_without_bias_samples_the_same_in_a_biased_batch(target):
    """A biased row puts the whole batch on the W = MAX_LOGIT_BIAS variant; the other rows'
    tokens and logprobs are bit for bit what they were without it."""
    logits = np.random.default_rng(1).normal(size=(3, 64)).astype(np.float32) * 3
    plain = [SamplingRow(target, 3, 0, 9), SamplingRow(SamplingParams(temperature=0), 0, 0, 0)]
    biased = [plain[0], SamplingRow(SamplingParams(
        temperature=0, logit_bias={int(np.argmax(logits[1])): -100}), 0, 0, 0)]
    for mode in (None, "sort"):
        a = run(plain, logits[:2], num_logprobs=3, mode=mode)
        b = run(biased, logits[:2], num_logprobs=3, mode=mode)
        assert a.token_ids[1] != b.token_ids[1]
        for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(leaf_a[0], leaf_b[0])
