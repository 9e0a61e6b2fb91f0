"""Building blocks of a Llama-family decoder: Linear, RMSNorm (and Gemma's), rotary tables,
gated MLP, and the precisions their matmuls run at.

Projection weights are stored [in, out], the transpose of Hugging Face's (why: `packing`).
A packed Linear (`jpaged.models.packing`) holds several Hugging Face projections' rows.
Matmuls take the model's precision by name (`DOT_PRECISIONS`) as a call argument.
Axis names: T tokens, E hidden size, F intermediate size, H query heads, K kv heads, D head dim,
P tensor-parallel shards.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.models import packing, row_tiles
from jpaged.models.attention import row_ops


# A model's matmul precisions by name (the `matmul_precision` option's values, less "auto"), as
# jnp's `precision=` takes them. XLA on a GPU runs float32 matmuls at TF32 unless asked for
# HIGHEST; "default" is None, so a default-precision model (bf16, fp16) traces as it always did.
DOT_PRECISIONS = {"highest": jax.lax.Precision.HIGHEST, "high": jax.lax.Precision.HIGH,
                  "default": None}


def default_matmul_precision(dtype) -> str:
    """A model's precision unless asked otherwise: full float32 for float32 parameters (as
    torch computes them), the platform's default for 16-bit ones."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else "default"


def check_matmul_precision(name) -> str:
    if not isinstance(name, str) or name not in DOT_PRECISIONS:
        raise ValueError(f"matmul_precision must be one of {tuple(DOT_PRECISIONS)}, got {name!r}")
    return name


def normal(rngs: nnx.Rngs, shape, dtype, stddev=0.02):
    """A parameter drawn normal with std `stddev` (the random init of every matrix)."""
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
            weight = normal(rngs, (out_features, in_features), dtype)
        else:
            weight = packing.pack([normal(rngs, (rows, in_features), dtype)
                                   for rows in packing.part_rows])
            if weight.shape[0] != out_features:
                raise ValueError(f"packing gives {weight.shape[0]} rows, not {out_features}")
        self.weight = nnx.Param(weight.T)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

    def __call__(self, x, precision: str = "default", rows=row_tiles.WHOLE):
        """x [..., in] -> [..., out]; precision: a `DOT_PRECISIONS` name; rows: how the matmul
        runs over the rows (`row_tiles.runner`)."""
        y = rows.matmul(x, self.weight[...], DOT_PRECISIONS[precision])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class LMHead(nnx.Module):
    """The output projection's weight [V, E] (Hugging Face's `lm_head.weight`, the embedding's
    layout); `LlamaForCausalLM.compute_logits` applies it."""

    def __init__(self, hidden_size: int, vocab_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal(rngs, (vocab_size, hidden_size), dtype))


class Embedding(nnx.Module):
    """Token embedding table weight: [V, E]."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal(rngs, (vocab_size, hidden_size), dtype))

    def __call__(self, token_ids):
        return jnp.take(self.weight[...], token_ids, axis=0)


class RMSNorm(nnx.Module):
    """Normalise in float32, cast back, then scale in the input dtype (as transformers does)."""

    unit_offset = False   # scaled by weight (Gemma's: by 1 + weight)

    def __init__(self, hidden_size: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((hidden_size,), dtype))
        self.eps = eps

    def __call__(self, x):
        return row_ops.rms_norm(x, self.weight[...], eps=self.eps)


class GemmaRMSNorm(nnx.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32, then cast back; the weight
    starts at zero (as transformers' Gemma2RMSNorm / Gemma3RMSNorm)."""

    unit_offset = True

    def __init__(self, hidden_size: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((hidden_size,), dtype))
        self.eps = eps

    def __call__(self, x):
        return row_ops.rms_norm(x, self.weight[...], eps=self.eps, unit_offset=True)


def rms_norm(size: int, config, dtype):
    """The RMSNorm the config's architecture uses, over the last axis of `size`."""
    norm = GemmaRMSNorm if config.is_gemma else RMSNorm
    return norm(size, eps=config.rms_norm_eps, dtype=dtype)


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): E -> F -> E, gate and up packed in one `gate_up_proj`
    (rows in `packing.gate_up_packing(F, shards)` order). act: silu (SwiGLU) or tanh-approximated
    gelu (Gemma's GeGLU). gate_up_packing: how the checkpoint's tensors pack (default: separate
    gate and up)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs, shards: int = 1, activation: str = "silu",
                 gate_up_packing=None):
        kwargs = dict(use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.blocks = packing.gate_up_shards(intermediate_size, shards)
        self.activation = activation
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, **kwargs,
            packing=gate_up_packing or packing.gate_up_packing(intermediate_size, shards))
        self.down_proj = Linear(intermediate_size, hidden_size, **kwargs)

    def __call__(self, x, precision: str = "default", rows=row_tiles.WHOLE):
        """x [..., E] -> [..., E]; precision: the projections' (a `DOT_PRECISIONS` name); rows:
        how the matmuls and the gating run over the rows (`row_tiles.runner`)."""
        gate_up = self.gate_up_proj(x, precision, rows)
        return self.down_proj(rows.gated(gate_up, blocks=self.blocks, activation=self.activation),
                              precision, rows)


def rotary_cos_sin(positions, inv_frequencies: np.ndarray):
    """positions [T] int32, inv_frequencies [D/2] -> (cos, sin), each [T, D] float32. (The
    rotation itself runs with the cache write: `pallas_kernels.rotate_and_write`.)

    Angles are computed in float32 from the integer positions, like transformers' rotary module.
    """
    inv_freq = jnp.asarray(inv_frequencies, jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]   # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)                   # [T, D]
    return jnp.cos(angles), jnp.sin(angles)


@dataclasses.dataclass(frozen=True)
class Rotary:
    """One rotary embedding's tables, static (a model holds it as a plain, hashable attribute).

    inv_frequencies [R/2] for the R rotated dims of a D-dim head. With R < D (partial rotation,
    Phi-3) the packed projection puts the rotated dims at [0, R/2) and [D/2, D/2 + R/2) of each
    query and key head (`packing.qkv_packing`), so the half-split rotation over all D dims pairs
    them as transformers does over R, and the others get angle zero (cos 1, sin 0).
    long_inv_frequencies: longrope's set, for positions >= long_from (a token's rotation then
    depends on its position only, so cached keys stay valid under chunking and recompute).
    scaling multiplies the rotated dims' cos and sin (longrope's attention factor).
    """
    inv_frequencies: tuple
    head_dim: int
    long_inv_frequencies: tuple | None = None
    long_from: int = 0
    scaling: float = 1.0

    @classmethod
    def from_config(cls, rope, head_dim: int) -> "Rotary":
        """From a `rope_config.RopeConfig`."""
        long = rope.long_inv_frequencies(head_dim)
        return cls(tuple(rope.inv_frequencies(head_dim).tolist()), head_dim,
                   None if long is None else tuple(long.tolist()),
                   rope.original_max_position_embeddings, rope.attention_scaling)

    def cos_sin(self, positions):
        """positions [T] int32 -> (cos, sin), each [T, D] float32."""
        cos, sin = rotary_cos_sin(positions, self.inv_frequencies)            # [T, R]
        if self.long_inv_frequencies is not None:
            long_cos, long_sin = rotary_cos_sin(positions, self.long_inv_frequencies)
            is_long = (positions >= self.long_from)[:, None]
            cos, sin = jnp.where(is_long, long_cos, cos), jnp.where(is_long, long_sin, sin)
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        half, rest = len(self.inv_frequencies), self.head_dim // 2 - len(self.inv_frequencies)
        if rest:
            def spread(table, fill):
                pad = jnp.full((table.shape[0], rest), fill, table.dtype)
                return jnp.concatenate([table[:, :half], pad, table[:, half:], pad], axis=-1)
            cos, sin = spread(cos, 1.0), spread(sin, 0.0)
        return cos, sin
