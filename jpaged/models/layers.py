"""Building blocks of a Llama-family decoder: Linear, RMSNorm, rotary tables, gated MLP.

Weights keep Hugging Face's layout ([out, in] for a Linear) so checkpoints load without a
transpose; the matmul contracts the `in` axis directly, which XLA lowers to the same GEMM.
A packed Linear (`jpaged.models.packing`) holds several Hugging Face projections' rows.
Axis names: T tokens, E hidden size, F intermediate size, H query heads, K kv heads, D head dim,
P tensor-parallel shards.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models import packing


def _normal(rngs: nnx.Rngs, shape, dtype, stddev=0.02):
    return _scaled_normal(rngs.params(), tuple(shape), jnp.dtype(dtype), stddev)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _scaled_normal(key, shape, dtype, stddev):
    """One compiled op per shape (eager init would compile draw, scale and cast separately)."""
    return (stddev * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """y = x @ weight (+ bias); weight: [in, out], the transpose of torch.nn.Linear's (why, and
    the conversion at the checkpoint boundary: `packing`).

    packing (a `packing.Packing`): the weight's output features are its parts' rows, each part
    drawn on its own ([rows, in]) and then packed, so features that appear twice are equal;
    out_features is then the packed count.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs, packing=None):
        if packing is None:
            weight = _normal(rngs, (out_features, in_features), dtype)
        else:
            weight = packing.pack([_normal(rngs, (rows, in_features), dtype)
                                   for rows in packing.part_rows])
            if weight.shape[0] != out_features:
                raise ValueError(f"packing gives {weight.shape[0]} rows, not {out_features}")
        self.weight = nnx.Param(weight.T)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x):
        y = jnp.einsum("...i,io->...o", x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class LMHead(nnx.Module):
    """The output projection's weight [V, E] (Hugging Face's `lm_head.weight`, the embedding's
    layout); `LlamaForCausalLM.compute_logits` applies it."""

    def __init__(self, hidden_size: int, vocab_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_normal(rngs, (vocab_size, hidden_size), dtype))


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
    """down(silu(gate(x)) * up(x)): E -> F -> E, gate and up packed in one `gate_up_proj`
    (rows in `packing.gate_up_packing(F, shards)` order)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs, shards: int = 1):
        kwargs = dict(use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.blocks = packing.gate_up_shards(intermediate_size, shards)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, **kwargs,
                                   packing=packing.gate_up_packing(intermediate_size, shards))
        self.down_proj = Linear(intermediate_size, hidden_size, **kwargs)

    def __call__(self, x):
        """x [..., E] -> [..., E]."""
        lead = x.shape[:-1]
        gate_up = self.gate_up_proj(x).reshape(*lead, self.blocks, 2, -1)   # [..., P, 2, F/P]
        gate = gate_up[..., 0, :].reshape(*lead, -1)                       # [..., F]
        up = gate_up[..., 1, :].reshape(*lead, -1)
        return self.down_proj(jax.nn.silu(gate) * up)


def rotary_cos_sin(positions, inv_frequencies: np.ndarray):
    """positions [T] int32, inv_frequencies [D/2] -> (cos, sin), each [T, D] float32. (The
    rotation itself runs with the cache write: `pallas_kernels.rotate_and_write`.)

    Angles are computed in float32 from the integer positions, like transformers' rotary module.
    """
    inv_freq = jnp.asarray(inv_frequencies, jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)                   # [T, D]
    return jnp.cos(angles), jnp.sin(angles)
