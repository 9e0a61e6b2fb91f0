"""Row tiles: the batch-invariant mode's way of running a model's row-wise parts.

XLA picks a matmul's or a reduction's algorithm from its shape, so row 0 of `x @ w` changes in
the last bits when x has 3 rows rather than 1 (a CPU's gemv against its gemm), and a row's
log-softmax over a small vocabulary when the batch grows past 16. A `Rows` runner gives every row
the computation of one shape, whatever the number of rows, so a row's result depends on the row
alone: a row-wise function runs over fixed tiles of `TILE_ROWS` rows (`lax.map`, never merged
back into one op, each tile fenced by optimization barriers so that no compiler fuses it with
what the program does around it), and a matmul is `pallas_kernels.batch_invariant.matmul` (on a
GPU one launch of a GEMM of fixed tiling over every row, so the weights are read once however
many rows there are; elsewhere XLA's dot over the same tiles). The norms and the gating, a
model's row-wise parts of every layer, have GPU kernels of their own (`norm`, `gated`: one launch
whose programs each run one row's fixed computation, not a loop of small kernels per tile); the
rest (once a step: embedding scale, rotary tables, soft cap, sampling) runs in tiles. The
batch-invariant engine
(`batch_invariant=True`) runs every row-wise part of the model and the sampler so (the rotary
tables too); attention, which mixes a token with its keys, has its own kernel
(`pallas_kernels.batch_invariant`). The default mode's runner, `WHOLE`, is the plain ops.
"""

import dataclasses

import jax.numpy as jnp

from jpaged.models.attention import (TILE_ROWS, invariant_gated, invariant_matmul,
                                     invariant_rms_norm, map_tiles, row_ops)

# The mode's compiler options (GPU options; other backends ignore them), for the engine's programs
# and a trainer's jit of the training forward alike: every matmul XLA itself runs (the tiles under
# a mesh, the GEMM's gradient) on cuBLAS (XLA would pick its Triton GEMMs for some shapes: another
# order of sums), its algorithm chosen by cuBLAS's heuristic from the shape alone (autotuning
# picks the fastest by timing, which may differ from one compilation, or one process, to the
# next).
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 0}


def map_rows(fn, *rows, tile_rows: int = TILE_ROWS):
    """fn(*rows) for a row-wise fn, computed tile by tile (`pallas_kernels.batch_invariant.
    map_tiles`: fixed tiles padded with copies of row 0, each fenced by optimization barriers):
    every leaf of `rows` (pytrees) has the same leading axis T (a leaf of several leading axes:
    flatten them first); the result's leaves have T leading rows."""
    return map_tiles(fn, *rows, tile_rows=tile_rows)


@dataclasses.dataclass(frozen=True)
class Rows:
    """How a model runs its row-wise parts over T tokens. `rows(fn, *x)` runs a row-wise fn
    (no matmul inside: matmuls go through `rows.matmul`) whole or in tiles (`map_rows`).

    is_tiled: the batch-invariant mode. kernel: the path of its matmuls, norms and gating (None:
    the Triton kernels on a GPU; False: the jnp ops in tiles, e.g. for weights sharded over a
    mesh, which one kernel launch cannot take)."""
    is_tiled: bool = False
    kernel: bool | None = None

    def __call__(self, fn, *rows):
        return map_rows(fn, *rows) if self.is_tiled else fn(*rows)

    def flat(self, fn, x):
        """fn over x [..., E] row by row (the leading axes flattened into rows when tiled)."""
        if not self.is_tiled:
            return fn(x)
        out = map_rows(fn, x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], *out.shape[1:])

    def norm(self, norm, x):
        """An RMSNorm module `norm` (`layers.RMSNorm`, `layers.GemmaRMSNorm`) over x [..., E]."""
        if not self.is_tiled:
            return norm(x)
        out = invariant_rms_norm(x.reshape(-1, x.shape[-1]), norm.weight[...], eps=norm.eps,
                                 unit_offset=norm.unit_offset, kernel=self.kernel)
        return out.reshape(x.shape)

    def gated(self, gate_up, *, blocks: int, activation: str):
        """act(gate) * up from a packed gate/up projection [..., 2F] (`row_ops.gated`)."""
        if not self.is_tiled:
            return row_ops.gated(gate_up, blocks=blocks, activation=activation)
        out = invariant_gated(gate_up.reshape(-1, gate_up.shape[-1]), blocks=blocks,
                              activation=activation, kernel=self.kernel)
        return out.reshape(*gate_up.shape[:-1], out.shape[-1])

    def matmul(self, x, weight, precision, *, transposed: bool = False, out_dtype=None):
        """x [..., I] @ weight [I, O] (weight [O, I] when transposed) -> [..., O], in out_dtype
        (None: the dot's own); precision: a `jax.lax.Precision` or None."""
        if not self.is_tiled:
            return jnp.einsum("...i,oi->...o" if transposed else "...i,io->...o", x, weight,
                              precision=precision, preferred_element_type=out_dtype)
        out = invariant_matmul(x.reshape(-1, x.shape[-1]), weight, transposed=transposed,
                               precision=precision, out_dtype=out_dtype, kernel=self.kernel)
        return out.reshape(*x.shape[:-1], out.shape[-1])


WHOLE = Rows()  # the default mode: each part one computation over all rows


def runner(batch_invariant: bool, mesh=None) -> Rows:
    """The runner of a model in this mode: `WHOLE`, or tiles (matmuls in tiles of XLA's dot
    where the weights are sharded over a tensor-parallel `mesh`, else the GEMM on a GPU)."""
    if not batch_invariant:
        return WHOLE
    return Rows(is_tiled=True, kernel=None if mesh is None else False)
