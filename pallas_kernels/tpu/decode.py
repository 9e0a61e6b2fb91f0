"""TPU paged decode attention (Pallas Mosaic TPU): one query token per sequence, pages fetched by DMA.

The grid is (sequence, kv head). Context lengths and the flattened block tables are scalar-prefetch
operands (in SMEM before the kernel starts). K/V pages stay in HBM (`pl.ANY`); the kernel copies
`pages_per_chunk` pages at a time into a double-buffered VMEM scratch (one DMA per page: a head's
S x D tile is contiguous in the [K, N, S, D] layout) and starts the next chunk's copies before
computing on the current one. All query heads of a GQA group share each chunk. Only blocks
< ceil(context_len / S) are copied, and only their block-table entries are read; with a sliding
window of W, only from the block holding key context_len - W on. Any head dim works here (Mosaic
lays the lane dimension out in 128-wide tiles itself); the wrapper admits multiples of 8 up to 256.

Refs are sliced (`.at[...]`, `pl.ds`), never reshaped or bitcast: that breaks the TPU interpreter.
The plain-jnp reference is `pallas_kernels.reference.paged_attention_decode`.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _online_softmax as softmax
from pallas_kernels._compat import (dot_f32, mosaic_tpu_precision, pl, pltpu, tpu_interpret,
                                    tpu_params)
from pallas_kernels._validate import check_decode_args, check_head_dim, check_options
from pallas_kernels.tpu import _dma


def _decode_kernel(context_lens_ref, block_tables_ref, q_ref, k_pages_hbm, v_pages_hbm, o_ref,
                   k_buffer, v_buffer, k_sems, v_sems, *, pages_per_chunk, max_blocks, scale,
                   sliding_window, logits_soft_cap, precision):
    """One (sequence, kv head) program.

    Scalar prefetch (SMEM): context_lens [B], block_tables [B*M] (flattened). q_ref, o_ref: [G, D]
    (this sequence's GQA group). k/v_pages_hbm: [K, N, S, D] in HBM. k/v_buffer: [2, C, D] VMEM,
    C = pages_per_chunk * S; k/v_sems: two DMA semaphores each (one per buffer slot).
    """
    seq, kv_head = pl.program_id(0), pl.program_id(1)
    block_size = k_pages_hbm.shape[2]
    chunk_tokens = k_buffer.shape[1]
    context_len = context_lens_ref[seq]
    first_page, num_keys = None, context_len  # chunk 0 starts at block 0 ...
    if sliding_window is not None:  # ... or at the block holding the window's first key
        first_key = jnp.maximum(context_len - sliding_window, 0)
        # lax.div truncates (= floor here, first_key >= 0); jnp's // adds a sign() that Mosaic
        # lowers only when it knows the TPU generation (not on a CPU).
        first_page = jax.lax.div(first_key, block_size)
        num_keys = context_len - first_page * block_size
    fetcher = _dma.ChunkFetcher(
        k_pages_hbm.at[kv_head], v_pages_hbm.at[kv_head], k_buffer, v_buffer, k_sems, v_sems,
        block_tables_ref, table_offset=seq * max_blocks, pages_per_chunk=pages_per_chunk,
        num_pages=pl.cdiv(context_len, block_size), first_page=first_page)
    num_chunks = pl.cdiv(num_keys, chunk_tokens)
    q = q_ref[...]
    group, head_dim = q.shape

    def first_token(chunk):
        token = chunk * chunk_tokens
        return token if sliding_window is None else token + first_page * block_size

    def chunk_step(chunk, keys, values, state):                          # [C, D] each
        token = first_token(chunk) + jax.lax.broadcasted_iota(jnp.int32, (1, chunk_tokens), 1)
        is_cached = token < context_len                                   # [1, C]
        if sliding_window is not None:
            is_cached &= token >= first_key
        values = _dma.zero_stale_rows(values, first_token(chunk), context_len)
        scores = dot_f32(q, keys, transpose_b=True, precision=precision) * scale  # [G, C]
        scores = softmax.soft_cap(scores, logits_soft_cap)
        visible = jnp.broadcast_to(is_cached, scores.shape)
        return softmax.update(state, scores, values, visible, precision=precision)

    state = _dma.fold_chunks(fetcher, num_chunks, chunk_step,
                             softmax.initial_state(group, head_dim))
    o_ref[...] = softmax.finalize(state).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap",
                                             "precision", "interpret", "pages_per_chunk"))
def paged_attention_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale=None,
                           sliding_window=None, logits_soft_cap=None, precision=None,
                           interpret=False, pages_per_chunk=None):
    """Paged decode attention on a TPU (Pallas Mosaic TPU); same contract as the reference.

    q: [B, H, D]; k_pages, v_pages: [K, N, S, D] (kv-head-major pages, block 0 a never-read sink);
    block_tables: [B, M] int32 (entries past ceil(context_len/S) are not read);
    context_lens: [B] int32, including the current token; 0 marks a padding row (zeros out).
    Returns [B, H, D] in q's dtype; softmax in float32. H must be a multiple of K; D a multiple
    of 8 up to 256. sliding_window, logits_soft_cap: see `pallas_kernels.reference` (None: off,
    and the kernel is the one without them). precision: of the dots when q is float32
    (`_compat.mosaic_tpu_precision`; None: HIGHEST).

    Static tiling: pages_per_chunk (pages per DMA chunk; None: enough for ~128 tokens).
    interpret=True runs under `pltpu.InterpretParams()` (CPU tests; raises on out-of-range reads).
    """
    check_decode_args(q, k_pages, v_pages, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    check_head_dim(head_dim)
    check_options(sliding_window, logits_soft_cap)
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    pages_per_chunk = pages_per_chunk or max(1, 128 // block_size)
    chunk_tokens = pages_per_chunk * block_size
    scale = head_dim ** -0.5 if scale is None else scale
    q_groups = q.reshape(batch, num_kv_heads, group, head_dim)  # free: heads are kv-major
    group_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, *_: (b, h, 0, 0))
    kernel = functools.partial(_decode_kernel, pages_per_chunk=pages_per_chunk,
                               max_blocks=max_blocks, scale=scale, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap,
                               precision=mosaic_tpu_precision(precision))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # context_lens, flattened block_tables -> SMEM
            grid=(batch, num_kv_heads),
            in_specs=[group_spec,                              # q[b, kv group] -> VMEM
                      pl.BlockSpec(memory_space=pl.ANY),      # k_pages stay in HBM
                      pl.BlockSpec(memory_space=pl.ANY)],     # v_pages stay in HBM
            out_specs=group_spec,
            scratch_shapes=_dma.chunk_scratch(chunk_tokens, head_dim, k_pages.dtype),
        ),
        out_shape=jax.ShapeDtypeStruct(q_groups.shape, q.dtype),
        compiler_params=tpu_params(("parallel", "parallel")),
        interpret=tpu_interpret(interpret),
        name="jpaged_decode_tpu",
    )(context_lens, block_tables.reshape(-1), q_groups, k_pages, v_pages)
    return out.reshape(batch, num_heads, head_dim)
