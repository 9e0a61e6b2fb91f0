"""Row-wise model ops in plain jnp: RMSNorm (transformers' and Gemma's) and gated activation.

The models' own computation (`jpaged.models.layers` calls these) and the oracle of the GPU row
kernels (`pallas_kernels.gpu.rows`). Axis names: T rows, E row width, F gated features.
"""

import functools

import jax
import jax.numpy as jnp

ACTIVATIONS = {"silu": jax.nn.silu,
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def rms_norm(x, weight, *, eps, unit_offset=False):
    """x [..., E] / rms(x) (+ eps), normalised in float32; then cast to x's dtype and scaled by
    weight [E] in it (transformers' RMSNorm), or with `unit_offset` scaled by 1 + weight in
    float32 and cast once (Gemma 2/3's)."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(variance + eps)
    if unit_offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def gated(gate_up, *, blocks=1, activation="silu"):
    """gate_up [..., 2F], packed in `blocks` blocks of (F / blocks gate features, then as many
    up features) (`jpaged.models.packing.gate_up_packing`) -> act(gate) * up [..., F]."""
    lead = gate_up.shape[:-1]
    gate_up = gate_up.reshape(*lead, blocks, 2, -1)                    # [..., P, 2, F/P]
    gate = gate_up[..., 0, :].reshape(*lead, -1)                       # [..., F]
    up = gate_up[..., 1, :].reshape(*lead, -1)
    return ACTIVATIONS[activation](gate) * up
