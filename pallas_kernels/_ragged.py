"""Ragged-batch bookkeeping shared by the prefill kernels: which sequences own rows of each query tile."""

import jax.numpy as jnp

from pallas_kernels._compat import pl


def tile_sequences(query_start_loc, num_tokens, block_q):
    """[2, cdiv(T, block_q)] int32: first and last sequence owning a row of each query tile.

    query_start_loc: [B+1] int32; rows past query_start_loc[B] are padding. A tile of padding rows
    only gets last < first, so a kernel's loop over its sequences is empty. Empty sequences
    (q_len 0) inside the range are harmless: no row is theirs.
    """
    num_tiles = pl.cdiv(num_tokens, block_q)
    first_token = jnp.arange(num_tiles, dtype=jnp.int32) * block_q
    total = query_start_loc[-1]
    last_token = jnp.minimum(first_token + block_q, total) - 1
    ends = query_start_loc[1:]
    first_seq = jnp.searchsorted(ends, first_token, side="right").astype(jnp.int32)
    last_seq = jnp.searchsorted(ends, last_token, side="right").astype(jnp.int32)
    last_seq = jnp.where(first_token < total, last_seq, first_seq - 1)
    return jnp.stack([first_seq, last_seq])


def sequence_tiles(query_start_loc, num_tokens, block_q):
    """[3, cdiv(T, block_q) + B] int32: (sequence, first row, end row) of each query tile.

    Tiles never span sequences: sequence b gets cdiv(q_len[b], block_q) tiles of its own rows,
    then the padding rows [query_start_loc[B], T) get tiles with sequence -1 (the kernel writes
    zeros there); leftover tiles are empty (first row == end row). The static count
    cdiv(T, block_q) + B is enough: cdiv rounds up at most once per sequence.
    """
    batch = query_start_loc.shape[0] - 1
    num_tiles = pl.cdiv(num_tokens, block_q) + batch
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tiles_per_seq = (q_lens + block_q - 1) // block_q
    tile_ends = jnp.cumsum(tiles_per_seq)
    num_real = tile_ends[-1]
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tile_ends, tile, side="right"), batch - 1)
    begin = query_start_loc[seq] + (tile - (tile_ends[seq] - tiles_per_seq[seq])) * block_q
    end = jnp.minimum(begin + block_q, query_start_loc[seq + 1])
    total = query_start_loc[-1]
    pad_begin = jnp.minimum(total + (tile - num_real) * block_q, num_tokens)
    pad_end = jnp.minimum(pad_begin + block_q, num_tokens)
    is_real = tile < num_real
    return jnp.stack([jnp.where(is_real, seq, -1), jnp.where(is_real, begin, pad_begin),
                      jnp.where(is_real, end, pad_end)]).astype(jnp.int32)
