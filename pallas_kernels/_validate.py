"""Argument checks shared by the public kernel wrappers: each failure is a ValueError naming the argument."""

import jax.numpy as jnp

from pallas_kernels.reference import check_page_layout

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not in {[str(d) for d in SUPPORTED_DTYPES]}")
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


def check_power_of_two(name, value, minimum):
    """Triton tiles need power-of-two sizes; dots need at least 16 along each side."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
