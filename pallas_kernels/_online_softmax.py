"""Backend-neutral flash-attention math: the online-softmax update and the merge of partials.

The update runs inside kernels (Triton, Mosaic TPU and the interpreters all lower it), so it uses
only jnp elementwise ops, keepdims reductions (2-D shapes suit both backends) and `dot_f32`.
Masked scores are -inf and never produce NaN: a row with nothing visible yet keeps m = -inf,
l = 0, acc = 0 because the exponent is taken against 0 instead of -inf.
"""

import jax.numpy as jnp

from pallas_kernels._compat import dot_f32


def initial_state(num_rows, head_dim):
    """(m [R, 1], l [R, 1], acc [R, D]), float32: running max, running sum, unnormalized output."""
    return (jnp.full((num_rows, 1), -jnp.inf, jnp.float32),
            jnp.zeros((num_rows, 1), jnp.float32),
            jnp.zeros((num_rows, head_dim), jnp.float32))


def soft_cap(scores, logits_soft_cap):
    """cap * tanh(scores / cap), Gemma 2's logit soft-capping; None: scores unchanged, no op."""
    if logits_soft_cap is None:
        return scores
    return logits_soft_cap * jnp.tanh(scores / logits_soft_cap)


def update(state, scores, values, is_visible, *, precision=None):
    """Fold one tile of keys into the state.

    scores: [R, C] float32 (already scaled); values: [C, D] in the cache dtype (masked rows must
    hold finite numbers, e.g. zeros from a masked load); is_visible: [R, C] bool.
    precision: of the probabilities-values dot when values are float32 (`dot_f32`).
    """
    m_prev, l_prev, acc_prev = state
    scores = jnp.where(is_visible, scores, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    correction = jnp.exp(m_prev - m_safe)
    probs = jnp.exp(scores - m_safe)
    l_new = correction * l_prev + jnp.sum(probs, axis=1, keepdims=True)
    acc_new = correction * acc_prev + dot_f32(probs.astype(values.dtype), values,
                                              precision=precision)
    return m_new, l_new, acc_new


def finalize(state):
    """acc / l, with rows that saw no key (l == 0) coming out as zeros."""
    _, l_sum, acc = state
    return acc / jnp.where(l_sum > 0, l_sum, 1.0)


def merge(state, other):
    """Fold another partial state (m, l, acc) over a disjoint set of keys into `state`.

    Either side may be empty (m = -inf, l = 0, acc = 0); merging two empty states stays empty.
    """
    m_a, l_a, acc_a = state
    m_b, l_b, acc_b = other
    m_new = jnp.maximum(m_a, m_b)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    weight_a, weight_b = jnp.exp(m_a - m_safe), jnp.exp(m_b - m_safe)
    return m_new, weight_a * l_a + weight_b * l_b, weight_a * acc_a + weight_b * acc_b
