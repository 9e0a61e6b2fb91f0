"""GPU matmul of one fixed tiling (Pallas Triton): row t of x @ w depends on row t of x alone.

cuBLAS (and XLA's own GEMMs) pick a tiling, and with it a reduction order (split-K or not, the
k step), from the whole problem's shape, so a row's result changes in the last bits with the
number of rows beside it. Here the tiling is fixed by the weight's shape only: each program
computes a `BLOCK_ROWS` x bn tile of the output, walking the inputs' I axis from the first column
in steps of `BLOCK_K`, accumulating `dot(x tile, w tile)` into one float32 accumulator; the dots
have one shape whatever the row count, and a row never meets another row's numbers. So a
row's result is the same in a batch of 1 and of 4,096, and one launch serves every row (the
batch-invariant mode's row tiles of cuBLAS calls read the weights once per 64 rows instead).

A weight of few column blocks (a decode step's o and down projections of the 8B shape: 32 of 128
columns, too few programs for the card when a row block is all there is) splits its I axis into
`num_splits` parts, a number set by the weight's shape alone: each program sums its part, the
parts' float32 sums are added in order (part 0 first) and rounded once. A row's order of sums is
then still the same whatever the rows beside it.

Rows, columns and the I axis are masked at their ends, so any shape runs with no copy around the
launch. The grid is (row block, column block), row blocks varying fastest: the programs that
share a column block of the weight run side by side and read it once from memory between them.
The tile is 64 x 128 (4 warps, 4 stages): the best of a sweep on an H100 over decode rows
(8 and 64) and prompt rows (2,048) together (benchmarks/results/batch_invariant_h200.md). The
plain-jnp oracle is `x @ w` accumulated in float32 (the tests' `reference`).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._compat import dot_f32, float32_precision, pl, plgpu, triton_params

BLOCK_ROWS = 64    # rows per program (Hopper's warp-group MMA is 64 rows tall)
BLOCK_K = 64       # the reduction's step along I: part of the numbers, never chosen by shape
NUM_WARPS = 4
NUM_STAGES = 4
BLOCK_COLS = 128   # columns per program
# Splitting the I axis: into parts until a row block has TARGET_PROGRAMS programs, at most
# MAX_SPLITS parts of at least MIN_SPLIT_STEPS steps of BLOCK_K each.
TARGET_PROGRAMS = 128
MAX_SPLITS = 4
MIN_SPLIT_STEPS = 16


def num_splits(num_in: int, num_cols: int) -> int:
    """Parts of the I axis of a weight [I, O] (O = num_cols): set by its shape alone."""
    col_blocks = pl.cdiv(num_cols, BLOCK_COLS)
    steps = pl.cdiv(num_in, BLOCK_K)
    return max(1, min(MAX_SPLITS, TARGET_PROGRAMS // col_blocks, steps // MIN_SPLIT_STEPS))


def _matmul_kernel(x_ref, w_ref, out_ref, *, transposed, precision, steps_per_split):
    """One (row block, column block, part of I) program. x_ref [R, I], w_ref [I, O] ([O, I] when
    transposed), out_ref [R, O], or [parts, R, O] float32 when I is split (the part's sums)."""
    row_block, col_block, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows, num_in = x_ref.shape
    num_cols = out_ref.shape[-1]
    rows = row_block * BLOCK_ROWS + jnp.arange(BLOCK_ROWS)
    cols = col_block * BLOCK_COLS + jnp.arange(BLOCK_COLS)
    is_row, is_col = rows < num_rows, cols < num_cols

    def step(i, acc):
        ks = i * BLOCK_K + jnp.arange(BLOCK_K)
        is_k = ks < num_in
        x = plgpu.load(x_ref.at[rows[:, None], ks[None, :]],
                       mask=is_row[:, None] & is_k[None, :], other=0)
        if transposed:
            w = plgpu.load(w_ref.at[cols[:, None], ks[None, :]],
                           mask=is_col[:, None] & is_k[None, :], other=0)        # [bn, k]
        else:
            w = plgpu.load(w_ref.at[ks[:, None], cols[None, :]],
                           mask=is_k[:, None] & is_col[None, :], other=0)        # [k, bn]
        return acc + dot_f32(x, w, transpose_b=transposed, precision=precision)

    first = part * steps_per_split
    last = jnp.minimum(first + steps_per_split, pl.cdiv(num_in, BLOCK_K))
    acc = jax.lax.fori_loop(first, last, step, jnp.zeros((BLOCK_ROWS, BLOCK_COLS), jnp.float32))
    index = (rows[:, None], cols[None, :])
    if out_ref.ndim == 3:   # the part's own sums
        index = (jnp.full((BLOCK_ROWS, 1), part), *index)
    plgpu.store(out_ref.at[index], acc.astype(out_ref.dtype),
                mask=is_row[:, None] & is_col[None, :])


@functools.partial(jax.jit, static_argnames=("transposed", "precision", "out_dtype",
                                             "interpret", "splits"))
def matmul(x, w, *, transposed=False, precision=None, out_dtype=None, interpret=False,
           splits=None):
    """x [R, I] @ w [I, O] (w [O, I], the product with its transpose, when `transposed`) ->
    [R, O] in out_dtype (None: x's), accumulated in float32 over I in steps of `BLOCK_K`.

    x and w of one dtype; precision: of float32 dots (`_compat.float32_precision`; None:
    HIGHEST), 16-bit dots ignore it. interpret: run in the Pallas interpreter (CPU tests).
    splits: parts of the I axis (None: `num_splits` of the weight's shape; tests and sweeps
    set it).
    """
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x and w must be 2-D, got shapes {x.shape} and {w.shape}")
    num_in = w.shape[1] if transposed else w.shape[0]
    if x.shape[1] != num_in:
        raise ValueError(f"x has {x.shape[1]} columns, w's input axis {num_in}")
    if x.dtype != w.dtype:
        raise ValueError(f"x in {x.dtype}, w in {w.dtype}: one dtype for both")
    num_rows = x.shape[0]
    num_cols = w.shape[0] if transposed else w.shape[1]
    if num_rows == 0:
        return jnp.zeros((0, num_cols), out_dtype or x.dtype)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    splits = num_splits(num_in, num_cols) if splits is None else splits
    steps = pl.cdiv(num_in, BLOCK_K)
    if not 1 <= splits <= steps:
        raise ValueError(f"splits must be in [1, {steps}] (steps of I), got {splits}")
    kernel = functools.partial(_matmul_kernel, transposed=transposed,
                               precision=float32_precision(precision),
                               steps_per_split=pl.cdiv(steps, splits))
    out_shape = (num_rows, num_cols) if splits == 1 else (splits, num_rows, num_cols)
    whole = lambda shape: pl.BlockSpec(shape, lambda m, n, k: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        # row blocks fastest: the programs of one column block share its weight tile
        grid=(pl.cdiv(num_rows, BLOCK_ROWS), pl.cdiv(num_cols, BLOCK_COLS), splits),
        in_specs=[whole(x.shape), whole(w.shape)],     # the kernel indexes its own tiles
        out_specs=whole(out_shape),
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype if splits == 1 else jnp.float32),
        compiler_params=triton_params(NUM_WARPS, NUM_STAGES),
        interpret=interpret,
        name="jpaged_invariant_matmul",
    )(x, w)
    if splits == 1:
        return out
    total = out[0]
    for part in range(1, splits):   # in order, one add at a time: no compiler reorders them
        total = total + out[part]
    return total.astype(out_dtype)
