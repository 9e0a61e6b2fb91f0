"""Per-layer attention options (sliding window, score soft cap): what reaches the kernels, and the
jnp stand-in the reference backend runs until pallas_kernels takes both options."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jpaged.models import AttentionMetadata, attention, paged_attention
from pallas_kernels.testing import TOLERANCE, make_problem

OPTIONS = ("sliding_window", "logits_soft_cap")
REFERENCE_TAKES_OPTIONS = all(attention.kernels_support("reference", o) for o in OPTIONS)
SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=jnp.float32)
# jitted: op by op, the CPU spends seconds dispatching the gathers
stand_in = jax.jit(attention.masked_reference_attention,
                   static_argnames=("scale", "sliding_window", "logits_soft_cap"))


def _metadata(problem, is_decode):
    return AttentionMetadata(
        slot_mapping=jnp.zeros(problem.q.shape[0], jnp.int32), block_tables=problem.block_tables,
        context_lens=problem.context_lens, query_start_loc=problem.query_start_loc,
        is_decode=is_decode)


def _problems():
    """A ragged prefill (a cached prefix before two chunks, one padding row) and a decode."""
    prefill = make_problem(0, **SHAPE, context_lens=[13, 7], query_lens=[6, 7], padding_rows=1)
    decode = make_problem(1, **SHAPE, context_lens=[13, 1, 9])
    return [(prefill, False), (decode, True)]


def _rel_err(actual, expected):
    return float(np.max(np.abs(np.asarray(actual) - np.asarray(expected)))
                 / np.max(np.abs(np.asarray(expected))))


@pytest.mark.parametrize("case", [0, 1], ids=["prefill", "decode"])
def test_stand_in_equals_kernel_reference_without_options(case):
    problem, is_decode = _problems()[case]
    metadata = _metadata(problem, is_decode)
    got = stand_in(problem.q, problem.k_pages, problem.v_pages,
                                               metadata, scale=0.3)
    if is_decode:
        expected = jax.jit(functools.partial(pallas_kernels.reference.paged_attention_decode,
                                             scale=0.3))(*problem.decode_args)
    else:
        expected = jax.jit(functools.partial(pallas_kernels.reference.paged_attention_prefill,
                                             scale=0.3))(*problem.prefill_args)
    assert np.isfinite(np.asarray(got)).all()
    assert _rel_err(got, expected) < TOLERANCE[jnp.dtype(jnp.float32)]


def test_stand_in_window_and_soft_cap_hand_worked():
    """One kv head, one block of 8 tokens, a decode query at position 4 (context 5)."""
    values = np.arange(8, dtype=np.float32)[:, None] * np.ones((1, 8), np.float32)  # v_k = k
    keys = np.zeros((8, 8), np.float32)
    keys[3, 0], keys[4, 0] = 1.0, 3.0                      # scores 0, 0, 0, 1, 3 (q = e_0)
    pages = lambda x: jnp.asarray(np.concatenate([np.full((1, 8, 8), np.nan), x[None]])[None])
    metadata = AttentionMetadata(
        slot_mapping=jnp.zeros(1, jnp.int32), block_tables=jnp.array([[1]], jnp.int32),
        context_lens=jnp.array([5], jnp.int32), query_start_loc=jnp.array([0, 1], jnp.int32),
        is_decode=True)
    q = jnp.asarray(np.eye(8, dtype=np.float32)[:1][None])                 # [1, 1, 8]

    def attend(**options):
        out = stand_in(q, pages(keys), pages(values), metadata,
                                                   scale=1.0, **options)
        return float(out[0, 0, 0])

    def expected(scores, positions):
        weights = np.exp(scores)
        return float(np.sum(weights * positions) / np.sum(weights))

    all_scores = np.array([0.0, 0.0, 0.0, 1.0, 3.0])
    assert attend() == pytest.approx(expected(all_scores, np.arange(5)))
    # window 2 at position 4: keys 3 and 4 only
    assert attend(sliding_window=2) == pytest.approx(expected(all_scores[3:], np.arange(3, 5)))
    capped = 1.5 * np.tanh(all_scores / 1.5)
    assert attend(logits_soft_cap=1.5) == pytest.approx(expected(capped, np.arange(5)))
    assert attend(sliding_window=2, logits_soft_cap=1.5) == pytest.approx(
        expected(capped[3:], np.arange(3, 5)))


@pytest.mark.skipif(not REFERENCE_TAKES_OPTIONS,
                    reason="pallas_kernels.reference takes no sliding_window/logits_soft_cap yet")
@pytest.mark.parametrize("case", [0, 1], ids=["prefill", "decode"])
def test_stand_in_equals_kernel_reference_with_options(case):
    problem, is_decode = _problems()[case]
    options = dict(sliding_window=3, logits_soft_cap=2.0)
    got = stand_in(problem.q, problem.k_pages, problem.v_pages,
                                               _metadata(problem, is_decode), scale=0.3,
                                               **options)
    if is_decode:
        expected = pallas_kernels.paged_attention_decode(*problem.decode_args, scale=0.3,
                                                         **options)
    else:
        expected = pallas_kernels.paged_attention_prefill(*problem.prefill_args, scale=0.3,
                                                          **options)
    assert _rel_err(got, expected) < TOLERANCE[jnp.dtype(jnp.float32)]


def test_options_reach_the_kernels_only_when_set(monkeypatch):
    """Without options the kernel call is exactly as before; with them, the kernels get them
    once they take them, and until then the reference backend runs the stand-in and the Pallas
    backends refuse."""
    problem, _ = _problems()[1]
    calls = []
    real_decode = pallas_kernels.paged_attention_decode

    def recording_decode(*args, **kwargs):
        calls.append(sorted(kwargs))
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(pallas_kernels, "paged_attention_decode", recording_decode)
    metadata = _metadata(problem, is_decode=True)
    attend = jax.jit(paged_attention, static_argnames=("scale", "sliding_window",
                                                       "logits_soft_cap"))
    attend(problem.q, problem.k_pages, problem.v_pages, metadata, scale=0.3)
    assert calls == [["backend", "interpret", "scale"]]
    calls.clear()
    attend(problem.q, problem.k_pages, problem.v_pages, metadata, scale=0.3,
                    sliding_window=3, logits_soft_cap=2.0)
    if REFERENCE_TAKES_OPTIONS:
        assert calls == [["backend", "interpret", "logits_soft_cap", "scale", "sliding_window"]]
    else:
        assert calls == []
    for backend in ("pallas_gpu", "pallas_tpu"):
        if not attention.kernels_support(backend, "sliding_window"):
            gpu_metadata = AttentionMetadata(*[getattr(metadata, f) for f in (
                "slot_mapping", "block_tables", "context_lens", "query_start_loc")],
                is_decode=True, backend=backend, interpret=True)
            with pytest.raises(NotImplementedError, match=f"{backend}.*sliding_window"):
                attend(problem.q, problem.k_pages, problem.v_pages, gpu_metadata, scale=0.3,
                       sliding_window=3)
