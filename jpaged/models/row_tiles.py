"""Row tiles: the batch-invariant mode's way of running a row-wise function.

XLA picks a matmul's or a reduction's algorithm from its shape, so row 0 of `x @ w` changes in
the last bits when x has 3 rows rather than 1 (a CPU's gemv against its gemm), and a row's
log-softmax over a small vocabulary when the batch grows past 16. Mapping the function over
fixed tiles of `TILE_ROWS` rows (`lax.map`, never merged back into one op) gives every row the
computation of one shape, whatever the number of rows: a row's result then depends on the row
alone. The batch-invariant engine (`batch_invariant=True`) runs every row-wise part of the model
and the sampler so; attention, which mixes a token with its keys, has its own kernel
(`pallas_kernels.batch_invariant`).
"""

import jax
import jax.numpy as jnp

TILE_ROWS = 8


def map_rows(fn, *rows, tile_rows: int = TILE_ROWS):
    """fn(*rows) for a row-wise fn, computed tile by tile: every leaf of `rows` (pytrees) has the
    same leading axis T (a leaf of several leading axes: flatten them first); the result's leaves
    have T leading rows. The last tile is padded with copies of row 0, so a tile holds only real
    rows' values (no NaN or inf that padding could bring)."""
    leaves = jax.tree.leaves(rows)
    num_rows = leaves[0].shape[0]
    if any(leaf.shape[0] != num_rows for leaf in leaves):
        raise ValueError(f"every row input needs {num_rows} leading rows, got shapes "
                         f"{[leaf.shape for leaf in leaves]}")
    num_tiles = -(-num_rows // tile_rows)
    pad = num_tiles * tile_rows - num_rows

    def tiles(leaf):
        padded = jnp.concatenate([leaf, jnp.broadcast_to(leaf[:1], (pad, *leaf.shape[1:]))])
        return padded.reshape(num_tiles, tile_rows, *leaf.shape[1:])

    out = jax.lax.map(lambda tile: fn(*tile), jax.tree.map(tiles, rows))
    return jax.tree.map(
        lambda leaf: leaf.reshape(num_tiles * tile_rows, *leaf.shape[2:])[:num_rows], out)


def whole(fn, *rows):
    """fn(*rows) as one computation over all rows (the default mode)."""
    return fn(*rows)


def runner(batch_invariant: bool):
    """How a model in this mode runs its row-wise functions: `map_rows` or `whole`."""
    return map_rows if batch_invariant else whole


def map_flat_rows(fn, x, batch_invariant: bool):
    """fn over x [..., E] row by row (the leading axes flattened into rows when tiled)."""
    if not batch_invariant:
        return fn(x)
    out = map_rows(fn, x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], *out.shape[1:])
