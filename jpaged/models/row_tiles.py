"""Row tiles: the batch-invariant mode's way of running a row-wise function.

XLA picks a matmul's or a reduction's algorithm from its shape, so row 0 of `x @ w` changes in
the last bits when x has 3 rows rather than 1 (a CPU's gemv against its gemm), and a row's
log-softmax over a small vocabulary when the batch grows past 16. Mapping the function over
fixed tiles of `TILE_ROWS` rows (`lax.map`, never merged back into one op, each tile fenced by
optimization barriers so that no compiler fuses it with what the program does around it) gives
every row the computation of one shape, whatever the number of rows: a row's result then depends
on the row alone. The batch-invariant engine (`batch_invariant=True`) runs every row-wise part of
the model and the sampler so (the rotary tables too); attention, which mixes a token with its
keys, has its own kernel (`pallas_kernels.batch_invariant`).
"""

from jpaged.models.attention import TILE_ROWS, map_tiles

# The mode's compiler options (GPU options; other backends ignore them), for the engine's programs
# and a trainer's jit of the training forward alike: every matmul on cuBLAS (XLA would pick its
# Triton GEMMs for some shapes: another order of sums), its algorithm chosen by cuBLAS's heuristic
# from the shape alone (autotuning picks the fastest by timing, which may differ from one
# compilation, or one process, to the next).
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}


def map_rows(fn, *rows, tile_rows: int = TILE_ROWS):
    """fn(*rows) for a row-wise fn, computed tile by tile (`pallas_kernels.batch_invariant.
    map_tiles`: fixed tiles padded with copies of row 0, each fenced by optimization barriers):
    every leaf of `rows` (pytrees) has the same leading axis T (a leaf of several leading axes:
    flatten them first); the result's leaves have T leading rows."""
    return map_tiles(fn, *rows, tile_rows=tile_rows)


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
