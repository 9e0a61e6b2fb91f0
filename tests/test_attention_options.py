"""Per-layer attention options (sliding window, score soft cap) as the model layer passes them to
the kernels, and which backends can run which model."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jpaged.models import AttentionMetadata, attention, paged_attention
from pallas_kernels.testing import make_problem

SHAPE = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=jnp.float32)
attend_jit = jax.jit(paged_attention, static_argnames=("scale", "sliding_window",
                                                       "logits_soft_cap"))


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


def test_window_and_soft_cap_hand_worked():
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
        out = attend_jit(q, pages(keys), pages(values), metadata, scale=1.0, **options)
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


def test_options_reach_the_kernels_only_when_set(monkeypatch):
    """Without options the kernel call is exactly as before they existed; with them, the
    kernels get them."""
    problem, _ = _problems()[1]
    calls = []
    real_decode = pallas_kernels.paged_attention_decode
    this_thread = threading.get_ident()

    def recording_decode(*args, **kwargs):
        if threading.get_ident() == this_thread:   # not another engine's compile thread
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
    assert calls == [["backend", "interpret", "logits_soft_cap", "scale", "sliding_window"]]


def test_unsupported_reason_checks_every_layer():
    """A backend that cannot run a model says why, naming the property; windows are checked for
    every layer kind the model has."""
    from jpaged.config import ModelConfig

    config = ModelConfig.preset("gemma-2-9b")
    for backend in ("reference", "pallas_gpu", "pallas_tpu"):
        assert attention.unsupported_reason(backend, config, dtype="bfloat16",
                                            kv_dtype="bfloat16", block_size=16) is None
    assert "head" in attention.unsupported_reason(
        "pallas_gpu", dataclasses.replace(config, head_dim=264), dtype="bfloat16",
        kv_dtype="bfloat16", block_size=16)
    assert "block_size" in attention.unsupported_reason(
        "pallas_gpu", config, dtype="bfloat16", kv_dtype="bfloat16", block_size=24)
