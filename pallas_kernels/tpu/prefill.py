"""TPU ragged prefill/chunk attention (Pallas Mosaic TPU): query chunks attend causally to the paged cache.

The flattened queries are cut into tiles of `block_q` rows regardless of sequence boundaries (a mixed
batch of prompt chunks and decode rows packs densely). The grid is (query tile, kv head); a program
loops over the sequences owning rows of its tile and, for each, DMAs that sequence's pages chunk by
chunk (double-buffered, `tpu._dma`) up to the tile's last visible position. Every query head of
the GQA group is served from each chunk; their running softmax state lives in VMEM scratch.
Rows of other sequences are masked, so each row ends with exactly its own sequence's attention.
With a sliding window of W, a sequence's chunks start at the block holding key W - 1 before the
tile's first own row: older blocks are never copied. Any head dim works (Mosaic tiles lanes itself).

Scalar prefetch (SMEM): context_lens, flattened block_tables, query_start_loc and the per-tile
sequence range. Refs are sliced, never reshaped or bitcast (that breaks the TPU interpreter).
The plain-jnp reference is `pallas_kernels.reference.paged_attention_prefill`.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _online_softmax as softmax
from pallas_kernels._compat import (dot_f32, mosaic_tpu_precision, pl, pltpu, tpu_interpret,
                                    tpu_params)
from pallas_kernels._ragged import tile_sequences
from pallas_kernels._validate import check_head_dim, check_options, check_prefill_args
from pallas_kernels.tpu import _dma


def _prefill_kernel(context_lens_ref, block_tables_ref, query_start_loc_ref, tile_seqs_ref,
                    q_ref, k_pages_hbm, v_pages_hbm, o_ref, k_buffer, v_buffer, k_sems, v_sems,
                    m_scratch, l_scratch, acc_scratch, *, pages_per_chunk, max_blocks, scale,
                    sliding_window, logits_soft_cap, precision):
    """One (query tile, kv head) program.

    Scalar prefetch: context_lens [B], block_tables [B*M], query_start_loc [B+1], tile_seqs
    [2*tiles] (first sequences, then last sequences). q_ref, o_ref: [G, R, D] (this tile's rows
    for the G query heads of this kv head). k/v_pages_hbm: [K, N, S, D] in HBM. Scratch: K/V
    chunk buffers [2, C, D] with their semaphores; m/l [G, R, 1] and acc [G, R, D] float32.
    """
    tile, kv_head = pl.program_id(0), pl.program_id(1)
    num_tiles = pl.num_programs(0)
    group, block_q, head_dim = q_ref.shape
    block_size = k_pages_hbm.shape[2]
    chunk_tokens = k_buffer.shape[1]
    m_scratch[...] = jnp.full(m_scratch.shape, -jnp.inf, jnp.float32)
    l_scratch[...] = jnp.zeros(l_scratch.shape, jnp.float32)
    acc_scratch[...] = jnp.zeros(acc_scratch.shape, jnp.float32)
    row = tile * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)  # token index

    def attend_sequence(seq, carry):
        q_begin, q_end = query_start_loc_ref[seq], query_start_loc_ref[seq + 1]
        first_position = context_lens_ref[seq] - (q_end - q_begin)  # cached prefix length
        is_own_row = (row >= q_begin) & (row < q_end)                   # [R, 1]
        position = first_position + row - q_begin                      # [R, 1]
        # Keys up to the last own row of this tile: never past the sequence's cached blocks.
        kv_end = first_position + jnp.minimum((tile + 1) * block_q, q_end) - q_begin
        first_page, num_keys = None, kv_end  # chunk 0 starts at block 0 ...
        if sliding_window is not None:  # ... or at the first own row's window's first block
            first_row = jnp.maximum(tile * block_q, q_begin)
            first_key = first_position + first_row - q_begin - sliding_window + 1
            # lax.div, not //: see tpu/decode.py
            first_page = jax.lax.div(jnp.maximum(first_key, 0), block_size)
            num_keys = kv_end - first_page * block_size
        fetcher = _dma.ChunkFetcher(
            k_pages_hbm.at[kv_head], v_pages_hbm.at[kv_head], k_buffer, v_buffer, k_sems, v_sems,
            block_tables_ref, table_offset=seq * max_blocks, pages_per_chunk=pages_per_chunk,
            num_pages=pl.cdiv(kv_end, block_size), first_page=first_page)
        num_chunks = pl.cdiv(jnp.maximum(num_keys, 0), chunk_tokens)

        def chunk_step(chunk, keys, values, carry):
            first_token = chunk * chunk_tokens
            if sliding_window is not None:
                first_token += first_page * block_size
            token = first_token + jax.lax.broadcasted_iota(jnp.int32, (1, chunk_tokens), 1)
            visible = is_own_row & (token < kv_end) & (token <= position)  # [R, C]
            if sliding_window is not None:
                visible &= token > position - sliding_window
            values = _dma.zero_stale_rows(values, first_token, kv_end)
            for head in range(group):
                _update_head(head, q_ref, keys, values, visible, scale, logits_soft_cap,
                             precision, m_scratch, l_scratch, acc_scratch)
            return carry

        return _dma.fold_chunks(fetcher, num_chunks, chunk_step, carry)

    jax.lax.fori_loop(tile_seqs_ref[tile], tile_seqs_ref[num_tiles + tile] + 1,
                      attend_sequence, 0)
    for head in range(group):  # rows of no sequence (padding) saw nothing: zeros
        state = (m_scratch[head], l_scratch[head], acc_scratch[head])
        o_ref[head] = softmax.finalize(state).astype(o_ref.dtype)


def _update_head(head, q_ref, keys, values, visible, scale, logits_soft_cap, precision,
                 m_scratch, l_scratch, acc_scratch):
    """Fold one K/V chunk into query head `head`'s softmax state held in scratch."""
    scores = dot_f32(q_ref[head], keys, transpose_b=True, precision=precision) * scale  # [R, C]
    scores = softmax.soft_cap(scores, logits_soft_cap)
    state = (m_scratch[head], l_scratch[head], acc_scratch[head])
    m_new, l_new, acc_new = softmax.update(state, scores, values, visible, precision=precision)
    m_scratch[head] = m_new
    l_scratch[head] = l_new
    acc_scratch[head] = acc_new


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap",
                                             "precision", "interpret", "block_q",
                                             "pages_per_chunk"))
def paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                            scale=None, sliding_window=None, logits_soft_cap=None,
                            precision=None, interpret=False, block_q=128, pages_per_chunk=None):
    """Ragged causal prefill/chunk attention on a TPU (Pallas Mosaic TPU); same contract as the reference.

    q: [T, H, D], all sequences' query rows back to back; sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1] (query_start_loc: [B+1] int32, non-decreasing; rows
    past query_start_loc[B] are padding and come back as zeros). k_pages, v_pages: [K, N, S, D]
    (kv-head-major pages, block 0 a never-read sink); block_tables: [B, M] int32;
    context_lens: [B] int32, cached tokens of b including this chunk, so the chunk's i-th row sits at
    position context_lens[b] - q_len[b] + i and sees keys at positions <= its own. A q_len of 1 is a
    decode row; mixed batches work. Returns [T, H, D] in q's dtype; softmax in float32.
    D: a multiple of 8 up to 256. sliding_window, logits_soft_cap: see `pallas_kernels.reference`
    (None: off, and the kernel is the one without them). precision: of the dots when q is
    float32 (`_compat.mosaic_tpu_precision`; None: HIGHEST).

    Static tiling: block_q (query rows per program, a multiple of 8; capped at T rounded up to 8;
    q is padded to a multiple of it), pages_per_chunk (pages per DMA chunk; None: ~128 tokens).
    The wrapper moves q to [K, G, T, D] so each program's tile is one contiguous block per head.
    interpret=True runs under `pltpu.InterpretParams()` (CPU tests; raises on out-of-range reads).
    """
    check_prefill_args(q, k_pages, v_pages, block_tables, context_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    check_head_dim(head_dim)
    check_options(sliding_window, logits_soft_cap)
    if block_q % 8:
        raise ValueError(f"block_q must be a multiple of 8, got {block_q}")
    block_q = min(block_q, pl.cdiv(num_tokens, 8) * 8)
    padded_tokens = pl.cdiv(num_tokens, block_q) * block_q
    group = num_heads // num_kv_heads
    pages_per_chunk = pages_per_chunk or max(1, 128 // block_size)
    scale = head_dim ** -0.5 if scale is None else scale
    q_heads = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    q_heads = jnp.pad(q_heads, ((0, 0), (0, 0), (0, padded_tokens - num_tokens), (0, 0)))
    tile_seqs = tile_sequences(query_start_loc, padded_tokens, block_q)
    tile_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda t, h, *_: (h, 0, t, 0))
    kernel = functools.partial(_prefill_kernel, pages_per_chunk=pages_per_chunk,
                               max_blocks=block_tables.shape[1], scale=scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               precision=mosaic_tpu_precision(precision))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # context_lens, block_tables, query_start_loc, tile_seqs
            grid=(tile_seqs.shape[1], num_kv_heads),
            in_specs=[tile_spec,                               # q tile of the G heads -> VMEM
                      pl.BlockSpec(memory_space=pl.ANY),      # k_pages stay in HBM
                      pl.BlockSpec(memory_space=pl.ANY)],     # v_pages stay in HBM
            out_specs=tile_spec,
            scratch_shapes=[
                *_dma.chunk_scratch(pages_per_chunk * block_size, head_dim, k_pages.dtype),
                pltpu.VMEM((group, block_q, 1), jnp.float32),         # running max
                pltpu.VMEM((group, block_q, 1), jnp.float32),         # running sum
                pltpu.VMEM((group, block_q, head_dim), jnp.float32),  # unnormalized output
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_heads.shape, q.dtype),
        compiler_params=tpu_params(("parallel", "parallel")),
        interpret=tpu_interpret(interpret),
        name="jpaged_prefill_tpu",
    )(context_lens, block_tables.reshape(-1), query_start_loc, tile_seqs.reshape(-1),
      q_heads, k_pages, v_pages)
    out = out[:, :, :num_tokens].transpose(2, 0, 1, 3)
    return out.reshape(num_tokens, num_heads, head_dim)
