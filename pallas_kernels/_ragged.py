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
