"""Building blocks of a Llama-family decoder: Linear, RMSNorm, rotary embedding, gated MLP.

Weights keep Hugging Face's layout ([out, in] for a Linear) so checkpoints load without a
transpose; the matmul contracts the `in` axis directly, which XLA lowers to the same GEMM.
Axis names: T tokens, E hidden size, F intermediate size, H query heads, K kv heads, D head dim.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _normal(rngs: nnx.Rngs, shape, dtype, stddev=0.02):
    return _scaled_normal(rngs.params(), tuple(shape), jnp.dtype(dtype), stddev)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _scaled_normal(key, shape, dtype, stddev):
    """One compiled op per shape (eager init would compile draw, scale and cast separately)."""
    return (stddev * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ weight.T (+ bias); weight: [out, in] as in torch.nn.Linear."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x):
        y = jnp.einsum("...i,oi->...o", x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embedding(nnx.Module):
    """Token embedding table weight: [V, E]."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (vocab_size, hidden_size), dtype))

    def __call__(self, token_ids):
        return jnp.take(self.weight[...], token_ids, axis=0)


class RMSNorm(nnx.Module):
    """Normalise in float32, cast back, then scale in the input dtype (as transformers does)."""

    def __init__(self, hidden_size: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.weight[...] * normed


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)): E -> F -> E."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs):
        kwargs = dict(use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(hidden_size, intermediate_size, **kwargs)
        self.up_proj = Linear(hidden_size, intermediate_size, **kwargs)
        self.down_proj = Linear(intermediate_size, hidden_size, **kwargs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rotary_cos_sin(positions, inv_frequencies: np.ndarray):
    """positions [T] int32, inv_frequencies [D/2] -> (cos, sin), each [T, D] float32.

    Angles are computed in float32 from the integer positions, like transformers' rotary module.
    """
    inv_freq = jnp.asarray(inv_frequencies, jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)                   # [T, D]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x, cos, sin):
    """Rotate x [T, heads, D] by per-token angles (half-split layout, `rotate_half` in HF).

    cos and sin are cast to x's dtype first, as transformers does, so bf16 matches it.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin
