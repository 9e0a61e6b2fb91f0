"""GPU row kernels (Pallas Triton): a model's row-wise parts, one launch each, a row's result
depending on that row alone.

The batch-invariant mode ran its norms and its gating as `lax.map` loops over fixed row tiles
(`pallas_kernels.batch_invariant.map_tiles`): right, but a loop of small XLA kernels per tile (a
prompt of 2,000 tokens of the 8B shape spent about 37 of its 141 ms in them on an H100). Here
each is one launch whose programs run one fixed computation on one row (the gating: on one
block of one row's columns): the grid grows with the rows, the code each row meets never
does, and a kernel launch is a boundary no compiler fuses across. Columns are moved as
power-of-two blocks (Triton's), the columns past the row's end masked.

- `rms_norm`: x / rms(x) * weight over each row [E] (transformers' RMSNorm: normalised in
  float32, cast to x's dtype, then scaled in it), or Gemma's x / rms(x) * (1 + weight), all in
  float32, cast once (`unit_offset`).
- `gated`: act(gate) * up from a packed [T, 2F] gate/up projection (`jpaged.models.packing`: per
  block of F / P features its gate columns, then its up columns), in float32, cast once; act
  silu or tanh-approximated gelu.

The plain-jnp oracles are the model's own modules (`jpaged.models.layers`); these agree with
them to float32 rounding, not bit for bit (a process takes one path).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._compat import pl, plgpu, triton_params

GATED_BLOCK = 1024   # output columns per gating program
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _warps(padded_cols: int) -> int:
    """Warps of a one-row program: set by the row's width alone (they set the sum's order)."""
    return 4 if padded_cols <= 4096 else 8


def _load(ref, index, mask):
    return plgpu.load(ref.at[index]) if mask is None else plgpu.load(ref.at[index], mask=mask,
                                                                      other=0)


def _norm_kernel(x_ref, w_ref, out_ref, *, eps, unit_offset, padded_cols):
    """One row. x_ref, out_ref [T, E]; w_ref [E]."""
    num_cols = x_ref.shape[1]
    row = pl.program_id(0) + jnp.arange(1)
    cols = jnp.arange(padded_cols)
    is_col = None if padded_cols == num_cols else (cols < num_cols)[None, :]
    index = (row[:, None], cols[None, :])
    x = _load(x_ref, index, is_col)                                               # [1, E']
    x32 = x.astype(jnp.float32)
    variance = jnp.sum(x32 * x32, axis=1, keepdims=True) / num_cols
    normed = x32 * jax.lax.rsqrt(variance + eps)
    weight = _load(w_ref, cols[None, :], is_col)
    if unit_offset:
        out = normed * (1.0 + weight.astype(jnp.float32))
    else:
        out = weight * normed.astype(x.dtype)
    plgpu.store(out_ref.at[index], out.astype(out_ref.dtype), mask=is_col)


@functools.partial(jax.jit, static_argnames=("eps", "unit_offset", "interpret"))
def rms_norm(x, weight, *, eps, unit_offset=False, interpret=False):
    """x [T, E], weight [E] -> [T, E] in x's dtype: each row normalised by its root mean square
    (+ eps) and scaled by weight (by 1 + weight when `unit_offset`, Gemma's). interpret: run in
    the Pallas interpreter (CPU tests)."""
    if x.ndim != 2 or weight.shape != x.shape[1:]:
        raise ValueError(f"x must be [T, E] and weight [E], got {x.shape} and {weight.shape}")
    padded_cols = pl.next_power_of_2(x.shape[1])
    kernel = functools.partial(_norm_kernel, eps=float(eps), unit_offset=unit_offset,
                               padded_cols=padded_cols)
    whole = lambda array: pl.BlockSpec(array.shape, lambda t: (0,) * array.ndim)  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(x.shape[0],),                            # one program per row
        in_specs=[whole(x), whole(weight)],            # the kernel indexes its own row
        out_specs=whole(x),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=triton_params(_warps(padded_cols), 1),
        interpret=interpret,
        name="jpaged_rms_norm_rows",
    )(x, weight)


def _activation(name, gate):
    """act(gate) in float32, from exp alone (lowered the same way on every backend)."""
    if name == "silu":
        return gate / (1.0 + jnp.exp(-gate))
    # gelu, tanh-approximated: 0.5 g (1 + tanh(z)), tanh(z) = 1 - 2 / (1 + exp(2z))
    z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return 0.5 * gate * (2.0 - 2.0 / (1.0 + jnp.exp(2.0 * z)))


def _gated_kernel(x_ref, out_ref, *, part, activation):
    """One block of one row's output columns. x_ref [T, 2F] (packed), out_ref [T, F]."""
    num_out = out_ref.shape[1]
    row = pl.program_id(0) + jnp.arange(1)
    out_col = pl.program_id(1) * GATED_BLOCK + jnp.arange(GATED_BLOCK)
    is_col = (out_col < num_out)[None, :]
    gate_col = (out_col // part) * (2 * part) + out_col % part     # its block's gate column
    gate = plgpu.load(x_ref.at[row[:, None], gate_col[None, :]], mask=is_col, other=0)
    up = plgpu.load(x_ref.at[row[:, None], (gate_col + part)[None, :]], mask=is_col, other=0)
    out = _activation(activation, gate.astype(jnp.float32)) * up.astype(jnp.float32)
    plgpu.store(out_ref.at[row[:, None], out_col[None, :]], out.astype(out_ref.dtype),
                mask=is_col)


@functools.partial(jax.jit, static_argnames=("blocks", "activation", "interpret"))
def gated(gate_up, *, blocks=1, activation="silu", interpret=False):
    """gate_up [T, 2F], packed in `blocks` blocks of (F / blocks gate columns, then as many up
    columns) -> act(gate) * up [T, F] in gate_up's dtype. activation: one of `ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_up.ndim != 2 or gate_up.shape[1] % (2 * blocks):
        raise ValueError(f"gate_up must be [T, 2F] in {blocks} blocks, got {gate_up.shape}")
    num_rows, num_out = gate_up.shape[0], gate_up.shape[1] // 2
    kernel = functools.partial(_gated_kernel, part=num_out // blocks, activation=activation)
    whole = lambda shape: pl.BlockSpec(shape, lambda t, f: (0, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(num_rows, pl.cdiv(num_out, GATED_BLOCK)),   # (row, block of its output columns)
        in_specs=[whole(gate_up.shape)],
        out_specs=whole((num_rows, num_out)),
        out_shape=jax.ShapeDtypeStruct((num_rows, num_out), gate_up.dtype),
        compiler_params=triton_params(4, 1),
        interpret=interpret,
        name="jpaged_gated_rows",
    )(gate_up)
