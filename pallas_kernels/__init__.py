"""Paged-attention kernels: the plain-jnp reference (the oracle), Pallas GPU (Triton; a Mosaic GPU
prefill for Hopper) and TPU kernels.

This package imports only jax and numpy; every setting arrives as an argument. Page layout, shared
by every function here: `k_pages, v_pages: [K, N, S, D]` per layer (kv-head-major, so one head's
S x D tile of a block is contiguous); physical block 0 is a reserved sink that kernels never read.

`paged_attention_decode` / `paged_attention_prefill` dispatch on `backend`, one of `BACKENDS`
("pallas_mosaic_gpu" is "pallas_gpu" with the Hopper prefill kernel written in Mosaic GPU; its
decode and cache writes are the Triton ones);
mapping "auto" to one of these is the engine's job, with `unsupported_reason` saying which
backends can run a model. `interpret=True` runs a Pallas kernel in the interpreter (CPU tests);
the reference ignores it. "batch_invariant" is the plain-jnp attention whose every reduction has a
shape fixed by the mode, never by the batch (`pallas_kernels.batch_invariant`). Both take `sliding_window` and `logits_soft_cap` (semantics in
`pallas_kernels.reference`'s docstring; None: off), and `precision`, the `jax.lax.Precision` of
their dots on float32 inputs (None: HIGHEST, full float32; a GPU's DEFAULT would be TF32); dots
on 16-bit inputs are the same whatever it says.
"""

import jax.numpy as jnp

from pallas_kernels import _compat, _validate, batch_invariant, reference
from pallas_kernels.gpu.decode import paged_attention_decode as paged_attention_decode_gpu
from pallas_kernels.gpu.prefill import paged_attention_prefill as paged_attention_prefill_gpu
from pallas_kernels.gpu import prefill_mgpu
from pallas_kernels.gpu.prefill_mgpu import (
    paged_attention_prefill as paged_attention_prefill_mosaic_gpu)
from pallas_kernels.gpu.cache_write import rotate_and_write as rotate_and_write_gpu
from pallas_kernels.gpu.cache_write import write_to_pages as write_to_pages_gpu
from pallas_kernels.reference import check_page_layout, dense_causal_attention
from pallas_kernels.tpu.decode import paged_attention_decode as paged_attention_decode_tpu
from pallas_kernels.tpu.prefill import paged_attention_prefill as paged_attention_prefill_tpu

BACKENDS = ("reference", "pallas_gpu", "pallas_mosaic_gpu", "pallas_tpu", "batch_invariant")
PLAIN_JNP_BACKENDS = ("reference", "batch_invariant")   # no kernel options, no Pallas
GPU_BACKENDS = ("pallas_gpu", "pallas_mosaic_gpu")  # share the Triton decode and cache writes

_DECODE = {"batch_invariant": batch_invariant.paged_attention_decode,
           "pallas_gpu": paged_attention_decode_gpu,
           "pallas_mosaic_gpu": paged_attention_decode_gpu,
           "pallas_tpu": paged_attention_decode_tpu}
_PREFILL = {"batch_invariant": batch_invariant.paged_attention_prefill,
            "pallas_gpu": paged_attention_prefill_gpu,
            "pallas_mosaic_gpu": paged_attention_prefill_mosaic_gpu,
            "pallas_tpu": paged_attention_prefill_tpu}

__all__ = ["BACKENDS", "GPU_BACKENDS", "check_page_layout", "dense_causal_attention",
           "paged_attention_decode",
           "batch_invariant", "paged_attention_decode_gpu", "paged_attention_decode_tpu", "paged_attention_prefill",
           "paged_attention_prefill_gpu", "paged_attention_prefill_mosaic_gpu",
           "paged_attention_prefill_tpu", "reference",
           "rotate_and_write", "rotate_and_write_gpu", "unsupported_reason", "write_to_pages",
           "write_to_pages_gpu"]


def _check_backend(backend, kernel_options):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend in PLAIN_JNP_BACKENDS and kernel_options:
        raise ValueError(f"kernel options {sorted(kernel_options)} do not apply to {backend!r}")


def unsupported_reason(backend, *, head_dim, dtype=None, kv_cache_dtype=None, block_size=None,
                       sliding_window=None, logits_soft_cap=None):
    """None if `backend`'s kernels can run a model with these properties, else a short reason.

    The reasons are the messages the kernels' own argument checks raise. dtype: the queries' (the
    model's compute dtype); kv_cache_dtype: the pages' (None: the same); block_size: tokens per
    KV block; None skips a check. The plain-jnp backends run anything valid.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    problems = [_validate.options_problem(sliding_window, logits_soft_cap)]
    if backend not in PLAIN_JNP_BACKENDS:
        problems.append(_validate.head_dim_problem(head_dim))
        if dtype is not None:
            problems.append(_validate.dtype_problem("dtype", dtype))
            if kv_cache_dtype is not None and jnp.dtype(kv_cache_dtype) != jnp.dtype(dtype):
                problems.append(f"kv_cache_dtype {jnp.dtype(kv_cache_dtype)} != dtype "
                                f"{jnp.dtype(dtype)}: the kernels read pages in the queries' dtype")
    if backend in GPU_BACKENDS and block_size is not None:
        problems.append(_validate.power_of_two_problem("block_size", block_size, 1))
    if backend == "pallas_mosaic_gpu":
        problems.append(_compat.mosaic_gpu_problem())
        problems.append(prefill_mgpu.unsupported_reason(head_dim=head_dim, dtype=dtype,
                                                        block_size=block_size))
    return next((problem for problem in problems if problem is not None), None)


def paged_attention_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale=None,
                           sliding_window=None, logits_soft_cap=None, precision=None,
                           backend="reference", interpret=False, **kernel_options):
    """Decode attention, one query token per sequence, on the chosen backend.

    q: [B, H, D]; k_pages, v_pages: [K, N, S, D]; block_tables: [B, M] int32; context_lens: [B]
    int32 including the current token (0 = padding row, zeros out). Returns [B, H, D] in q's dtype.
    sliding_window: the query sees only its last sliding_window keys (itself included);
    logits_soft_cap: scores s -> c * tanh(s / c); None: off (see `pallas_kernels.reference`).
    precision: of the dots on float32 inputs (None: HIGHEST).
    kernel_options: static tiling of the chosen kernel (see its docstring).
    """
    _check_backend(backend, kernel_options)
    _validate.check_options(sliding_window, logits_soft_cap)
    options = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                   precision=precision)
    if backend == "reference":
        return reference.paged_attention_decode(q, k_pages, v_pages, block_tables, context_lens,
                                                **options)
    if backend == "batch_invariant":
        return _DECODE[backend](q, k_pages, v_pages, block_tables, context_lens, **options)
    return _DECODE[backend](q, k_pages, v_pages, block_tables, context_lens, **options,
                            interpret=interpret, **kernel_options)


def paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                            scale=None, sliding_window=None, logits_soft_cap=None, precision=None,
                            backend="reference", interpret=False, **kernel_options):
    """Ragged causal prefill/chunk attention (mixed with decode rows) on the chosen backend.

    q: [T, H, D]; sequence b owns rows query_start_loc[b]:query_start_loc[b+1] ([B+1] int32; rows
    past query_start_loc[B] come back as zeros); context_lens: [B] int32 including the chunk;
    block_tables: [B, M] int32. Returns [T, H, D] in q's dtype. sliding_window, logits_soft_cap,
    precision: as in `paged_attention_decode`.
    """
    _check_backend(backend, kernel_options)
    _validate.check_options(sliding_window, logits_soft_cap)
    options = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                   precision=precision)
    if backend == "reference":
        return reference.paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens,
                                                 query_start_loc, **options)
    if backend == "batch_invariant":
        return _PREFILL[backend](q, k_pages, v_pages, block_tables, context_lens,
                                 query_start_loc, **options)
    return _PREFILL[backend](q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                             **options, interpret=interpret, **kernel_options)


def write_to_pages(k_pages, v_pages, k_new, v_new, slot_mapping, *, backend="reference",
                   interpret=False):
    """Write k_new, v_new [T, K, D] into pages [K, N, S, D] at slot_mapping [T] (-1 skips).

    The GPU backends run the Pallas cache-write kernel (faster than XLA's scatter on the H200, see
    benchmarks/results/kernels_h200.md); the reference and "pallas_tpu" use XLA's scatter. Callers
    donate the pages so either writes in place. Returns the updated (k_pages, v_pages).
    """
    _check_backend(backend, {})
    if backend in GPU_BACKENDS:
        return write_to_pages_gpu(k_pages, v_pages, k_new, v_new, slot_mapping,
                                  interpret=interpret)
    return reference.write_to_pages(k_pages, v_pages, k_new, v_new, slot_mapping)


def rotate_and_write(qkv, cos, sin, k_pages, v_pages, slot_mapping, *, num_heads,
                     backend="reference", interpret=False):
    """A layer's projected heads qkv [T, H + 2K, D] (queries, keys, values) -> rotated queries
    [T, H, D], with the rotated keys and the values written into pages [K, N, S, D] at
    slot_mapping [T] (-1 skips); cos, sin [T, D] float32. Returns (q, k_pages, v_pages).

    The GPU backends do it in one Pallas launch; the reference and "pallas_tpu" with XLA's ops
    and scatter; "batch_invariant" rotates in its fixed row tiles. Callers donate the pages so
    either writes in place.
    """
    _check_backend(backend, {})
    if backend == "batch_invariant":
        return batch_invariant.rotate_and_write(qkv, cos, sin, k_pages, v_pages, slot_mapping,
                                                num_heads=num_heads)
    if backend in GPU_BACKENDS:
        return rotate_and_write_gpu(qkv, cos, sin, k_pages, v_pages, slot_mapping,
                                    num_heads=num_heads, interpret=interpret)
    return reference.rotate_and_write(qkv, cos, sin, k_pages, v_pages, slot_mapping,
                                      num_heads=num_heads)
