"""GPU ragged prefill/chunk attention (Pallas Triton): query chunks attend causally to the paged cache.

The flattened queries [T, H, D] are cut into tiles of `block_q` rows regardless of sequence
boundaries, so a mixed batch (long prompt chunks, decode rows of one token) packs densely. The grid
is (query tile, query head); a program loops over the sequences that own rows of its tile (found
once per tile by a jnp searchsorted outside the kernel) and, for each, over that sequence's keys up
to the tile's last visible position, `tokens_per_step` tokens per step through the block table. Rows
of other sequences are masked, so every row ends with exactly its own sequence's attention. A
cached prefix (prefix caching, chunked prefill) is just keys before the chunk's first position.

Each program serves one query head, so a GQA kv page is read once per query head of its group
(from L2 for the later ones); prefill is compute-bound, unlike decode.
The plain-jnp reference is `pallas_kernels.reference.paged_attention_prefill`.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _online_softmax as softmax
from pallas_kernels._compat import dot_f32, pl, plgpu, triton_params
from pallas_kernels._ragged import tile_sequences
from pallas_kernels._validate import check_power_of_two, check_prefill_args


def _prefill_kernel(context_lens_ref, block_tables_ref, query_start_loc_ref, tile_seqs_ref,
                    q_ref, k_pages_ref, v_pages_ref, o_ref, *, block_q,
                    tokens_per_step, scale):
    """One (query tile, query head) program.

    Refs: context_lens [B], block_tables [B, M], query_start_loc [B+1], tile_seqs [2, tiles]
    (first and last sequence owning a row of each tile); q, o [T, H, D] (whole arrays: rows are
    loaded and stored masked, so T needs no padding); k_pages, v_pages [N, S, D] (this head's kv head).
    """
    tile, head = pl.program_id(0), pl.program_id(1)
    num_tokens, _, head_dim = q_ref.shape
    block_size = k_pages_ref.shape[1]
    row = tile * block_q + jnp.arange(block_q)                               # token index [R]
    row_mask = jnp.broadcast_to((row < num_tokens)[:, None], (block_q, head_dim))
    rows = pl.ds(tile * block_q, block_q)
    q = plgpu.load(q_ref.at[rows, head, :], mask=row_mask, other=0)          # [R, D]
    dims = jnp.arange(head_dim)

    def attend_sequence(seq, state):
        q_begin, q_end = query_start_loc_ref[seq], query_start_loc_ref[seq + 1]
        first_position = context_lens_ref[seq] - (q_end - q_begin)  # cached prefix length
        is_own_row = (row >= q_begin) & (row < q_end)
        position = first_position + row - q_begin                            # [R]
        # Keys up to the last own row of this tile: never past the sequence's cached blocks.
        kv_end = first_position + jnp.minimum(tile * block_q + block_q, q_end) - q_begin

        def step(i, state):
            token = i * tokens_per_step + jnp.arange(tokens_per_step)       # [C]
            is_cached = token < kv_end
            page = plgpu.load(block_tables_ref.at[seq, token // block_size], mask=is_cached,
                              other=0)
            index = (page[:, None], (token % block_size)[:, None], dims[None, :])
            kv_mask = jnp.broadcast_to(is_cached[:, None], (tokens_per_step, head_dim))
            keys = plgpu.load(k_pages_ref.at[index], mask=kv_mask, other=0)
            values = plgpu.load(v_pages_ref.at[index], mask=kv_mask, other=0)
            scores = dot_f32(q, keys, transpose_b=True) * scale              # [R, C]
            visible = (is_own_row[:, None] & is_cached[None, :]
                       & (token[None, :] <= position[:, None]))
            return softmax.update(state, scores, values, visible)

        num_steps = pl.cdiv(jnp.maximum(kv_end, 0), tokens_per_step)
        return jax.lax.fori_loop(0, num_steps, step, state)

    state = jax.lax.fori_loop(tile_seqs_ref[0, tile], tile_seqs_ref[1, tile] + 1,
                              attend_sequence, softmax.initial_state(block_q, head_dim))
    out = softmax.finalize(state).astype(o_ref.dtype)  # rows of no sequence (padding): zeros
    plgpu.store(o_ref.at[rows, head, :], out, mask=row_mask)


@functools.partial(jax.jit, static_argnames=(
    "scale", "interpret", "block_q", "tokens_per_step", "num_warps", "num_stages"))
def paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                            scale=None, interpret=False, block_q=64, tokens_per_step=None,
                            num_warps=4, num_stages=2):
    """Ragged causal prefill/chunk attention on a GPU (Pallas Triton); same contract as the reference.

    q: [T, H, D], all sequences' query rows back to back; sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1] (query_start_loc: [B+1] int32, non-decreasing; rows
    past query_start_loc[B] are padding and come back as zeros). k_pages, v_pages: [K, N, S, D]
    (kv-head-major pages, block 0 a never-read sink); block_tables: [B, M] int32;
    context_lens: [B] int32, cached tokens of b including this chunk, so the chunk's i-th row sits at
    position context_lens[b] - q_len[b] + i and sees keys at positions <= its own. A q_len of 1 is a
    decode row; mixed batches work. Returns [T, H, D] in q's dtype; softmax in float32.

    Static tiling: block_q (query rows per program, power of two >= 16), tokens_per_step (keys per
    inner step, power of two >= 16, may span pages; None: 64, or 32 at D=256 or float32),
    num_warps/num_stages (Triton). interpret=True runs in the Pallas interpreter (CPU tests).
    """
    check_prefill_args(q, k_pages, v_pages, block_tables, context_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    check_power_of_two("head dim", head_dim, 16)
    check_power_of_two("block size (k_pages.shape[2])", block_size, 1)
    check_power_of_two("block_q", block_q, 16)
    if tokens_per_step is None:
        tokens_per_step = 32 if head_dim * q.dtype.itemsize > 256 else 64
    check_power_of_two("tokens_per_step", tokens_per_step, 16)
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    tile_seqs = tile_sequences(query_start_loc, num_tokens, block_q)
    kernel = functools.partial(_prefill_kernel, block_q=block_q,
                               tokens_per_step=tokens_per_step, scale=scale)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, h: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(tile_seqs.shape[1], num_heads),
        in_specs=[
            whole(context_lens.shape),
            whole(block_tables.shape),
            whole(query_start_loc.shape),
            whole(tile_seqs.shape),
            whole(q.shape),  # rows loaded masked inside: T need not be a multiple of block_q
            pl.BlockSpec((None, *k_pages.shape[1:]), lambda t, h: (h // group, 0, 0, 0)),
            pl.BlockSpec((None, *v_pages.shape[1:]), lambda t, h: (h // group, 0, 0, 0)),
        ],
        out_specs=whole(q.shape),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="jpaged_prefill_triton",
    )(context_lens, block_tables, query_start_loc, tile_seqs, q, k_pages, v_pages)
