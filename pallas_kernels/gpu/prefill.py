"""GPU ragged prefill/chunk attention (Pallas Triton): query chunks attend causally to the paged cache.

Each sequence's query rows are cut into tiles of `block_q` tokens (tiles never span sequences; the
tile list is built by `_ragged.sequence_tiles` outside the kernel, so a decode row costs one small
tile, not a share of someone else's). The grid is (tile, kv head): a program takes the tile's tokens
for all query heads of the GQA group as one [block_q * G', D] matrix (G' = G rounded up to a power
of two; the extra heads are masked), so every K/V tile is read once per group, and walks the
sequence's keys up to the tile's last position, `tokens_per_step` tokens per step through the block
table, with an online softmax in float32. A cached prefix (prefix caching, chunked prefill) is
just keys before the chunk's first position. Padding rows (past query_start_loc[B]) get zeros.
With a sliding window of W the walk starts at the key W - 1 before the tile's first position, so
older pages are never read; rows mask the keys that left their own window.

Any head dim D that is a multiple of 8 (up to 256): tiles are D' = max(16, next power of two) wide
(Triton needs power-of-two blocks), loads past column D are masked; D' == D adds no mask at all.
The plain-jnp reference is `pallas_kernels.reference.paged_attention_prefill`.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _online_softmax as softmax
from pallas_kernels._compat import dot_f32, float32_precision, pl, plgpu, triton_params
from pallas_kernels._ragged import sequence_tiles
from pallas_kernels._validate import (check_head_dim, check_options, check_power_of_two,
                                      check_prefill_args)


def _prefill_kernel(context_lens_ref, block_tables_ref, query_start_loc_ref, tiles_ref,
                    q_ref, k_pages_ref, v_pages_ref, o_ref, *, group, padded_group, block_q,
                    padded_dim, tokens_per_step, scale, sliding_window, logits_soft_cap,
                    precision):
    """One (tile, kv head) program.

    Refs: context_lens [B], block_tables [B, M], query_start_loc [B+1], tiles [3, num_tiles]
    (sequence or -1 for padding rows, first row, end row); q, o [T, H, D] (whole arrays: rows
    are gathered and stored masked); k_pages, v_pages [N, S, D] (this kv head). Row r of the
    program's [R, D] matrix is token first + r // padded_group, query head
    kv_head * group + r % padded_group, R = block_q * padded_group; columns >= D of its
    D' = padded_dim wide tiles are masked.
    """
    tile, kv_head = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[2]
    block_size = k_pages_ref.shape[1]
    seq, first_row, end_row = tiles_ref[0, tile], tiles_ref[1, tile], tiles_ref[2, tile]
    r = jnp.arange(block_q * padded_group)
    token = first_row + r // padded_group                                  # [R]
    head_in_group = r % padded_group
    is_row = (token < end_row) & (head_in_group < group)
    dims = jnp.arange(padded_dim)
    q_index = (token[:, None], (kv_head * group + head_in_group)[:, None], dims[None, :])
    if padded_dim == head_dim:
        row_mask = jnp.broadcast_to(is_row[:, None], (r.shape[0], head_dim))
    else:
        row_mask = is_row[:, None] & (dims < head_dim)[None, :]
    q = plgpu.load(q_ref.at[q_index], mask=row_mask, other=0)              # [R, D']

    seq = jnp.maximum(seq, 0)  # padding tiles (-1) read sequence 0's scalars but no keys
    q_begin, q_end = query_start_loc_ref[seq], query_start_loc_ref[seq + 1]
    first_position = context_lens_ref[seq] - (q_end - q_begin)  # cached prefix length
    position = first_position + token - q_begin                             # [R]
    is_padding = tiles_ref[0, tile] < 0
    kv_end = jnp.where(is_padding, 0, first_position + end_row - q_begin)  # last row's keys
    if sliding_window is not None:  # the first row's window starts the walk
        kv_begin = jnp.maximum(first_position + first_row - q_begin - sliding_window + 1, 0)

    def step(i, state):
        key = i * tokens_per_step + jnp.arange(tokens_per_step)           # [C] positions
        if sliding_window is not None:
            key += kv_begin
        is_cached = key < kv_end
        page = plgpu.load(block_tables_ref.at[seq, key // block_size], mask=is_cached, other=0)
        index = (page[:, None], (key % block_size)[:, None], dims[None, :])
        if padded_dim == head_dim:
            kv_mask = jnp.broadcast_to(is_cached[:, None], (tokens_per_step, head_dim))
        else:
            kv_mask = is_cached[:, None] & (dims < head_dim)[None, :]
        keys = plgpu.load(k_pages_ref.at[index], mask=kv_mask, other=0)   # [C, D']
        values = plgpu.load(v_pages_ref.at[index], mask=kv_mask, other=0)
        scores = dot_f32(q, keys, transpose_b=True, precision=precision) * scale  # [R, C]
        scores = softmax.soft_cap(scores, logits_soft_cap)
        visible = is_cached[None, :] & (key[None, :] <= position[:, None])
        if sliding_window is not None:
            visible &= key[None, :] > position[:, None] - sliding_window
        return softmax.update(state, scores, values, visible, precision=precision)

    num_keys = kv_end if sliding_window is None else kv_end - kv_begin
    num_steps = pl.cdiv(jnp.maximum(num_keys, 0), tokens_per_step)
    state = jax.lax.fori_loop(0, num_steps, step,
                              softmax.initial_state(r.shape[0], padded_dim))
    out = softmax.finalize(state).astype(o_ref.dtype)  # padding tiles saw no keys: zeros
    plgpu.store(o_ref.at[q_index], out, mask=row_mask)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "precision", "interpret", "block_q",
    "tokens_per_step", "num_warps", "num_stages"))
def paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                            scale=None, sliding_window=None, logits_soft_cap=None,
                            precision=None, interpret=False, block_q=None, tokens_per_step=None,
                            num_warps=4, num_stages=2):
    """Ragged causal prefill/chunk attention on a GPU (Pallas Triton); same contract as the reference.

    q: [T, H, D], all sequences' query rows back to back; sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1] (query_start_loc: [B+1] int32, non-decreasing; rows
    past query_start_loc[B] are padding and come back as zeros). k_pages, v_pages: [K, N, S, D]
    (kv-head-major pages, block 0 a never-read sink); block_tables: [B, M] int32;
    context_lens: [B] int32, cached tokens of b including this chunk, so the chunk's i-th row sits at
    position context_lens[b] - q_len[b] + i and sees keys at positions <= its own. A q_len of 1 is a
    decode row; mixed batches work. Returns [T, H, D] in q's dtype; softmax in float32.
    D: a multiple of 8 up to 256. sliding_window, logits_soft_cap: see `pallas_kernels.reference`
    (None: off, and the kernel is the one without them). precision: of the dots when q is
    float32 (`_compat.float32_precision`; None: HIGHEST, full float32 rather than Triton's TF32).

    Static tiling: block_q (query tokens per tile, power of two; a program's matrix has
    block_q * G' >= 16 rows, G' = G rounded up to a power of two; None: 64 rows), tokens_per_step
    (keys per inner step, power of two >= 16, may span pages; None: 64, or 32 once a padded key
    row D' x itemsize passes 256 bytes),
    num_warps/num_stages (Triton). The grid has cdiv(T, block_q) + B tiles per kv head.
    interpret=True runs in the Pallas interpreter (CPU tests).
    """
    check_prefill_args(q, k_pages, v_pages, block_tables, context_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    check_head_dim(head_dim)
    check_options(sliding_window, logits_soft_cap)
    check_power_of_two("block size (k_pages.shape[2])", block_size, 1)
    padded_dim = max(16, pl.next_power_of_2(head_dim))  # Triton: power-of-two tiles, dots >= 16
    group = num_heads // num_kv_heads
    padded_group = pl.next_power_of_2(group)
    block_q = block_q or max(1, 64 // padded_group)
    check_power_of_two("block_q", block_q, 1)
    check_power_of_two("block_q * padded group size", block_q * padded_group, 16)
    if tokens_per_step is None:
        tokens_per_step = 32 if padded_dim * q.dtype.itemsize > 256 else 64
    check_power_of_two("tokens_per_step", tokens_per_step, 16)
    scale = head_dim ** -0.5 if scale is None else scale
    tiles = sequence_tiles(query_start_loc, num_tokens, block_q)
    kernel = functools.partial(_prefill_kernel, group=group, padded_group=padded_group,
                               block_q=block_q, padded_dim=padded_dim,
                               tokens_per_step=tokens_per_step, scale=scale,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               precision=float32_precision(precision))
    whole = lambda shape: pl.BlockSpec(shape, lambda t, h: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(tiles.shape[1], num_kv_heads),
        in_specs=[
            whole(context_lens.shape),
            whole(block_tables.shape),
            whole(query_start_loc.shape),
            whole(tiles.shape),
            whole(q.shape),  # rows gathered masked inside: ragged tiles need no padding of q
            pl.BlockSpec((None, *k_pages.shape[1:]), lambda t, h: (h, 0, 0, 0)),  # kv head h
            pl.BlockSpec((None, *v_pages.shape[1:]), lambda t, h: (h, 0, 0, 0)),
        ],
        out_specs=whole(q.shape),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="jpaged_prefill_triton",
    )(context_lens, block_tables, query_start_loc, tiles, q, k_pages, v_pages)
