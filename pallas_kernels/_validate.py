"""Argument checks shared by the public kernel wrappers: each failure is a ValueError naming the argument.

The `*_problem` functions return a reason (or None) instead of raising, so that
`pallas_kernels.unsupported_reason` answers with the very checks the wrappers make.
"""

import math
import numbers

import jax.numpy as jnp

from pallas_kernels.reference import check_page_layout

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256  # the largest head dim tested (Gemma); larger K/V tiles would need re-tiling


def head_dim_problem(head_dim):
    """The Pallas kernels take any multiple of 8 up to MAX_HEAD_DIM (tiles are padded inside)."""
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}"
    return None


def dtype_problem(name, dtype):
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"{name} {jnp.dtype(dtype)} not in {[str(d) for d in SUPPORTED_DTYPES]}"
    return None


def options_problem(sliding_window, logits_soft_cap):
    """sliding_window: None or a positive int; logits_soft_cap: None or a positive finite float."""
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, numbers.Integral)
                                       or sliding_window < 1):
        return f"sliding_window must be None or a positive int, got {sliding_window!r}"
    if logits_soft_cap is not None and (isinstance(logits_soft_cap, bool)
                                        or not isinstance(logits_soft_cap, numbers.Real)
                                        or not 0 < logits_soft_cap < math.inf):
        return f"logits_soft_cap must be None or a positive number, got {logits_soft_cap!r}"
    return None


def raise_if(problem):
    if problem is not None:
        raise ValueError(problem)


def check_head_dim(head_dim):
    raise_if(head_dim_problem(head_dim))


def check_options(sliding_window, logits_soft_cap):
    raise_if(options_problem(sliding_window, logits_soft_cap))


def _check_int32(name, array, shape):
    if array.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {array.dtype}")
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(array.shape)}")


def _check_heads_and_pages(q, k_pages, v_pages):
    check_page_layout(k_pages, v_pages, head_dim=q.shape[-1])
    num_heads, num_kv_heads = q.shape[1], k_pages.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of k_pages' {num_kv_heads} kv heads")
    raise_if(dtype_problem("q dtype", q.dtype))
    if k_pages.dtype != q.dtype:
        raise ValueError(f"k_pages dtype {k_pages.dtype} != q dtype {q.dtype}")


def check_decode_args(q, k_pages, v_pages, block_tables, context_lens):
    """q [B, H, D], pages [K, N, S, D], block_tables [B, M] int32, context_lens [B] int32."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, D], got shape {q.shape}")
    _check_heads_and_pages(q, k_pages, v_pages)
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [B, M], got shape {block_tables.shape}")
    _check_int32("block_tables", block_tables, (q.shape[0], block_tables.shape[1]))
    _check_int32("context_lens", context_lens, (q.shape[0],))


def check_prefill_args(q, k_pages, v_pages, block_tables, context_lens, query_start_loc):
    """q [T, H, D], pages [K, N, S, D], block_tables [B, M], context_lens [B], query_start_loc [B+1]."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    _check_heads_and_pages(q, k_pages, v_pages)
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [B, M], got shape {block_tables.shape}")
    batch = block_tables.shape[0]
    _check_int32("block_tables", block_tables, block_tables.shape)
    _check_int32("context_lens", context_lens, (batch,))
    _check_int32("query_start_loc", query_start_loc, (batch + 1,))


def power_of_two_problem(name, value, minimum):
    if value < minimum or value & (value - 1):
        return f"{name} must be a power of two >= {minimum}, got {value}"
    return None


def check_power_of_two(name, value, minimum):
    """Triton tiles need power-of-two sizes; dots need at least 16 along each side."""
    raise_if(power_of_two_problem(name, value, minimum))
