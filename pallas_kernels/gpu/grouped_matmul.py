"""GPU grouped matmul (Pallas Triton): rows sorted by group, each run of rows times its group's
weight, reading only the weights of groups that have rows.

The experts of a mixture-of-experts layer: rows [R, I] are the (token, expert) pairs sorted by
expert, group_sizes [X] how many rows each expert got, weights [X, I, O] every expert's
projection. `jax.lax.ragged_dot` computes the same product, but XLA's GPU lowering of it
multiplies every row by every expert and keeps the matching rows (benchmarks/results/
moe_h100.md: its rate is the matmul rate over the number of experts), so a decode step of
Qwen3-30B-A3B's 128 experts reads all of them for the handful its tokens chose.

Here the work is a list of tiles: each group's rows split into tiles of `BLOCK_ROWS` (a group of
no rows has none), and the grid runs (tile, column block) programs. A program reads its tile's
rows and its group's weight columns, walks I in steps of `BLOCK_K` into one float32
accumulator, and writes its rows of the output. The tile list is computed on the device from
group_sizes (cumulative sums and one comparison of tiles against groups, no device loop), so
its length is a bound set by the shapes, cdiv(R, BLOCK_ROWS) + min(X, R), and programs past
the routing's own count of tiles end at once. Tiles vary fastest: the programs of one group's tiles and one column block run side by
side and read that weight tile from memory once between them. A group's weights are read once
per tile of its rows, the least a tiled product can read; an empty group's never.

Few rows make few tiles, and then few programs each walking all of I would leave most of the
GPU idle (a decode token of Qwen3-30B-A3B: 8 rows, 96 programs): the reduction is then split
into parts, a third grid axis, each part's programs summing a contiguous range of I's steps into
a float32 partial output, and the parts are added afterwards in a fixed order. The number of
parts is set by the shapes alone (`num_splits`), never by the routing.

Rows past the sum of group_sizes are not written (their values are not defined), as in
`_grouped_mlp`'s contract. The plain-jnp oracle is `jax.lax.ragged_dot` with float32
accumulation (the tests' reference).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._compat import dot_f32, float32_precision, pl, plgpu, triton_params

BLOCK_ROWS = 64    # rows per tile (Hopper's warp-group MMA is 64 rows tall)
BLOCK_COLS = 128   # output columns per program
BLOCK_K = 64       # the reduction's step along I
NUM_WARPS = 4
NUM_STAGES = 4
# Splitting the reduction: enough programs to fill the GPU several times over (an H100 or H200
# has 132 multiprocessors), and each part at least this many steps of BLOCK_K.
TARGET_PROGRAMS = 1024
MIN_SPLIT_STEPS = 2


def max_tiles(num_rows: int, num_groups: int, block_rows: int = BLOCK_ROWS) -> int:
    """The most tiles R rows in X groups can need: each group's last tile may be partial."""
    return pl.cdiv(num_rows, block_rows) + min(num_groups, num_rows)


def tile_list(group_sizes, num_rows: int, block_rows: int = BLOCK_ROWS):
    """int32 [3, max_tiles]: per tile its group, its first row and the end of its group's rows
    (tiles past the routing's count: group 0 and end 0, so they cover no row). group_sizes [X]
    (rows per group, in order, summing to at most num_rows)."""
    num_groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    tiles = (sizes + block_rows - 1) // block_rows                       # [X]
    tile_ends = jnp.cumsum(tiles)
    tile = jnp.arange(max_tiles(num_rows, num_groups, block_rows), dtype=jnp.int32)
    # A tile's group: how many groups' tiles end at or before it. Compared all against all
    # (tiles x groups, one fused pass) rather than searched: jnp.searchsorted's default is a
    # device loop of log2(X) dependent iterations, run twice per layer.
    group = jnp.searchsorted(tile_ends, tile, side="right", method="compare_all")
    group = group.astype(jnp.int32)
    valid = group < num_groups
    group = jnp.where(valid, group, 0)
    first_tile = tile_ends[group] - tiles[group]
    start = ends[group] - sizes[group] + (tile - first_tile) * block_rows
    end = jnp.where(valid, ends[group], 0)
    return jnp.stack([group, jnp.where(valid, start, 0), end])


def num_splits(num_rows: int, num_groups: int, num_in: int, num_out: int,
               block_rows: int = BLOCK_ROWS) -> int:
    """How many parts the reduction over I runs in: as many as bring the grid to
    TARGET_PROGRAMS, each at least MIN_SPLIT_STEPS steps (1: no split). Shapes only."""
    programs = max_tiles(num_rows, num_groups, block_rows) * pl.cdiv(num_out, BLOCK_COLS)
    num_steps = pl.cdiv(num_in, BLOCK_K)
    wanted = max(1, min(TARGET_PROGRAMS // programs, num_steps // MIN_SPLIT_STEPS))
    return pl.cdiv(num_steps, pl.cdiv(num_steps, wanted))    # no part left without steps


def _grouped_kernel(tiles_ref, x_ref, w_ref, out_ref, *, precision, block_rows, split_steps):
    """One (tile, column block, part) program. tiles_ref [3, T] (`tile_list`), x_ref [R, I],
    w_ref [X, I, O], out_ref [R, O], or [parts, R, O] float32 when the reduction is split
    (split_steps: the BLOCK_K steps of I in each part; None: all of them, no split)."""
    tile, col_block, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group, start, end = tiles_ref[0, tile], tiles_ref[1, tile], tiles_ref[2, tile]
    num_in = x_ref.shape[1]
    num_cols = w_ref.shape[2]
    num_steps = pl.cdiv(num_in, BLOCK_K) if split_steps is None else split_steps

    @pl.when(start < end)
    def _():
        rows = start + jnp.arange(block_rows)
        cols = col_block * BLOCK_COLS + jnp.arange(BLOCK_COLS)
        is_row, is_col = rows < end, cols < num_cols

        def step(i, acc):
            ks = (part * num_steps + i) * BLOCK_K + jnp.arange(BLOCK_K)
            is_k = ks < num_in
            x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]],
                           mask=is_row[:, None] & is_k[None, :], other=0)        # [bm, k]
            w = plgpu.load(w_ref.at[group, ks[:, None], cols[None, :]],
                           mask=is_k[:, None] & is_col[None, :], other=0)        # [k, bn]
            return acc + dot_f32(x, w, precision=precision)

        acc = jax.lax.fori_loop(0, num_steps, step,
                                jnp.zeros((block_rows, BLOCK_COLS), jnp.float32))
        where = (rows[:, None], cols[None, :])
        if split_steps is not None:    # this part's own slice of the partial sums
            where = (part, *where)
        plgpu.store(out_ref.at[where], acc.astype(out_ref.dtype),
                    mask=is_row[:, None] & is_col[None, :])


@functools.partial(jax.jit, static_argnames=("precision", "out_dtype", "interpret",
                                             "block_rows", "splits"))
def grouped_matmul(x, w, group_sizes, *, precision=None, out_dtype=None, interpret=False,
                   block_rows=BLOCK_ROWS, splits=None):
    """x [R, I] sorted by group, w [X, I, O], group_sizes [X] int -> [R, O] in out_dtype (None:
    x's): rows of group g times w[g], accumulated in float32; rows past sum(group_sizes) not
    defined. The product `jax.lax.ragged_dot(x, w, group_sizes)` computes.

    x and w of one dtype; precision: of float32 dots (`_compat.float32_precision`; None:
    HIGHEST), 16-bit dots ignore it. interpret: run in the Pallas interpreter (CPU tests).
    block_rows: rows per tile (a power of two, at least 16; tests use small tiles to make many).
    splits: parts the reduction over I runs in (None: `num_splits` of the shapes).
    """
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"x [R, I], w [X, I, O] and group_sizes [X] expected, got shapes "
                         f"{x.shape}, {w.shape} and {group_sizes.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, w's input axis {w.shape[1]}")
    if group_sizes.shape[0] != w.shape[0]:
        raise ValueError(f"{group_sizes.shape[0]} group sizes for {w.shape[0]} groups")
    if x.dtype != w.dtype:
        raise ValueError(f"x in {x.dtype}, w in {w.dtype}: one dtype for both")
    if block_rows < 16 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits must be a positive int or None, got {splits!r}")
    num_rows, num_in, num_cols = x.shape[0], x.shape[1], w.shape[2]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if num_rows == 0:
        return jnp.zeros((0, num_cols), out_dtype)
    tiles = tile_list(group_sizes, num_rows, block_rows)
    if splits is None:
        splits = num_splits(num_rows, w.shape[0], num_in, num_cols, block_rows)
    split_steps = None if splits == 1 else pl.cdiv(pl.cdiv(num_in, BLOCK_K), splits)
    kernel = functools.partial(_grouped_kernel, precision=float32_precision(precision),
                               block_rows=block_rows, split_steps=split_steps)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, n, p: (0,) * len(shape))  # noqa: E731
    out_shape = ((num_rows, num_cols), out_dtype) if splits == 1 else \
        ((splits, num_rows, num_cols), jnp.float32)      # the parts, added below
    out = pl.pallas_call(
        kernel,
        grid=(tiles.shape[1], pl.cdiv(num_cols, BLOCK_COLS), splits),   # tiles fastest
        in_specs=[whole(tiles.shape), whole(x.shape), whole(w.shape)],
        out_specs=whole(out_shape[0]),
        out_shape=jax.ShapeDtypeStruct(*out_shape),
        compiler_params=triton_params(NUM_WARPS, NUM_STAGES),
        interpret=interpret,
        name="jpaged_grouped_matmul",
    )(tiles, x, w)
    if splits == 1:
        return out
    total = out[0]
    for part in range(1, splits):      # a fixed order: the same sum whatever the routing
        total = total + out[part]
    return total.astype(out_dtype)
