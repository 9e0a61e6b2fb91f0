"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a softmax router picks each token's top-k
experts, and the experts run as grouped matmuls over the tokens routed to each.

Grouped, never dense: the T x k (token, expert) pairs are sorted by expert, and one grouped
matmul per projection multiplies each expert's contiguous run of rows by that expert's weights,
so the work is T x k rows whatever the number of experts. Every shape is static (T x k rows, X
groups whose sizes are data), so a step never recompiles for a routing. The grouped matmul is
the step's kernel choice (`AttentionMetadata.backend`): with the GPU Pallas backends the Pallas
grouped matmul (`pallas_kernels.gpu.grouped_matmul`: XLA's GPU ragged_dot multiplies every row
by every expert, benchmarks/results/moe_h100.md), elsewhere `jax.lax.ragged_dot` (the reference,
a TPU's own lowering of it, and the training forward, which differentiates it).

Numerics follow transformers: router logits in the model dtype, softmax in float32, top-k,
renormalised where the config says; each expert's output scaled by its weight (in float32
for Mixtral, in the model dtype for Qwen3-MoE), cast to the model dtype, and a token's experts
summed in ascending expert order, as transformers' index_add over experts does.
On a mesh (`jpaged.parallel`) the routing is replicated and the experts run per device under
shard_map: with tensor parallelism each device holds every expert's slice of F (its gate/up
columns and down rows) and sums a partial output; with expert parallelism each holds X/P whole
experts and computes the rows routed to them (a contiguous run of the sorted rows), zero
elsewhere; either way one all-reduce (psum) gives every device the layer's output.
Axis names: T tokens, E hidden size, X experts, k experts per token, F an expert's intermediate
size, P devices. Weights [X, E, 2F] and [X, F, E]: each expert's [in, out], like the projections
(`packing.is_transposed`); gate and up packed as in `packing.gate_up_packing`.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec

from jpaged import parallel
from jpaged.config import ModelConfig
from jpaged.models import row_tiles
from jpaged.models.attention import GPU_BACKENDS, grouped_matmul, row_ops
from jpaged.models.layers import DOT_PRECISIONS, normal


class Router(nnx.Module):
    """The router's weight [X, E] (a torch Linear's layout: one row per expert)."""

    def __init__(self, hidden_size: int, num_experts: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal(rngs, (num_experts, hidden_size), dtype))


class Experts(nnx.Module):
    """Every expert's gated MLP: gate_up_proj [X, E, 2F] (gate's F columns, then up's),
    down_proj [X, F, E]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype,
                 rngs: nnx.Rngs):
        self.gate_up_proj = nnx.Param(normal(
            rngs, (num_experts, hidden_size, 2 * intermediate_size), dtype))
        self.down_proj = nnx.Param(normal(rngs, (num_experts, intermediate_size, hidden_size),
                                          dtype))


class SparseMoE(nnx.Module):
    """x [T, E] -> the sum of each token's top-k experts' outputs, weighted by the router."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh=None):
        experts = config.experts
        self.mesh = mesh
        self.expert_parallel = experts.expert_parallel
        self.top_k = experts.num_experts_per_tok
        self.num_experts = experts.num_local_experts
        self.norm_topk_prob = experts.norm_topk_prob
        self.float32_weights = experts.float32_weights
        self.activation = config.hidden_act
        self.gate = Router(config.hidden_size, self.num_experts, dtype=dtype, rngs=rngs)
        self.experts = Experts(self.num_experts, config.hidden_size,
                               experts.moe_intermediate_size, dtype=dtype, rngs=rngs)

    def route(self, x, precision: str = "default"):
        """x [T, E] -> (expert ids [T, k] int32 in ascending order, their weights [T, k]:
        float32, or the model dtype where the architecture casts them)."""
        logits = jnp.einsum("te,xe->tx", x, self.gate.weight[...],
                            precision=DOT_PRECISIONS[precision])
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, expert_ids = jax.lax.top_k(probs, self.top_k)            # [T, k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if not self.float32_weights:
            weights = weights.astype(x.dtype)
        order = jnp.argsort(expert_ids, axis=-1)
        return (jnp.take_along_axis(expert_ids, order, axis=-1).astype(jnp.int32),
                jnp.take_along_axis(weights, order, axis=-1))

    def __call__(self, x, precision: str = "default", rows=row_tiles.WHOLE, *,
                 backend: str = "reference", interpret: bool = False):
        """x [T, E] -> [T, E]; precision: the matmuls' (a `DOT_PRECISIONS` name). rows: the
        layers' runner (`row_tiles.runner`); only `WHOLE`, as the batch-invariant mode refuses
        mixtures of experts (their grouped matmuls group tokens by expert). backend, interpret:
        the step's kernels (`AttentionMetadata`'s fields), which pick the grouped matmul."""
        if rows.is_tiled:
            raise ValueError("a mixture of experts cannot run in the batch-invariant mode")
        num_tokens, k = x.shape[0], self.top_k
        expert_ids, weights = self.route(x, precision)
        flat = expert_ids.reshape(-1)                                      # [T*k]
        by_expert = jnp.argsort(flat, stable=True)                         # rows grouped
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)   # [X]
        rows = jnp.take(x, by_expert // k, axis=0)                         # [T*k, E]
        operands = (rows, self.experts.gate_up_proj[...], self.experts.down_proj[...],
                    group_sizes)
        matmul = _grouped_matmul(backend, interpret, precision)
        if self.mesh is None:
            out = self._grouped_mlp(*operands, matmul=matmul)
        else:
            out = self._sharded_grouped_mlp(matmul)(*operands)
        out = jnp.zeros_like(out).at[by_expert].set(out)                   # token order again
        out = out.reshape(num_tokens, k, -1)                               # [T, k, E]
        scaled = (out * weights[..., None]).astype(x.dtype)
        total = scaled[:, 0]
        for j in range(1, k):   # ascending expert order, as transformers adds them
            total = total + scaled[:, j]
        return total

    def _grouped_mlp(self, rows, gate_up_proj, down_proj, group_sizes, *, matmul):
        """rows [R, E] sorted by expert, group_sizes [X'] (rows per expert, in order) -> each
        row through its expert's gated MLP [R, E] (rows past the sizes' sum: not defined).
        matmul: the grouped matmul (`_grouped_matmul`)."""
        gate_up = matmul(rows, gate_up_proj, group_sizes)                          # [R, 2F]
        gate, up = jnp.split(gate_up, 2, axis=-1)
        hidden = row_ops.ACTIVATIONS[self.activation](gate) * up                   # [R, F]
        return matmul(hidden, down_proj, group_sizes)                               # [R, E]

    def _sharded_grouped_mlp(self, matmul):
        """`_grouped_mlp` per device on the mesh, then summed over the devices."""
        axis = parallel.AXIS
        if self.expert_parallel:
            def local(rows, gate_up_proj, down_proj, group_sizes):
                num_local = gate_up_proj.shape[0]                          # X/P experts
                first = jax.lax.axis_index(axis) * num_local
                ends = jnp.cumsum(group_sizes)
                begin = jnp.where(first > 0, ends[first - 1], 0)           # first local row
                sizes = jax.lax.dynamic_slice(group_sizes, (first,), (num_local,))
                mine = jnp.roll(rows, -begin, axis=0)                      # local rows first
                out = self._grouped_mlp(mine, gate_up_proj, down_proj, sizes, matmul=matmul)
                is_mine = jnp.arange(rows.shape[0]) < jnp.sum(sizes)
                out = jnp.roll(jnp.where(is_mine[:, None], out, 0), begin, axis=0)
                return jax.lax.psum(out, axis)
        else:
            def local(rows, gate_up_proj, down_proj, group_sizes):
                out = self._grouped_mlp(rows, gate_up_proj, down_proj, group_sizes,
                                        matmul=matmul)
                return jax.lax.psum(out, axis)
        replicated = PartitionSpec()
        weight_specs = (parallel.expert_spec("gate_up_proj", self.expert_parallel),
                        parallel.expert_spec("down_proj", self.expert_parallel))
        return parallel.per_shard(local, self.mesh,
                                  in_specs=(replicated, *weight_specs, replicated),
                                  out_specs=replicated)


def _grouped_matmul(backend: str, interpret: bool, precision: str):
    """(rows [R, I] sorted by group, weights [X, I, O], group_sizes [X]) -> [R, O]: the Pallas
    grouped matmul with the GPU Pallas backends, `jax.lax.ragged_dot` with every other."""
    dot = DOT_PRECISIONS[precision]
    if backend in GPU_BACKENDS:
        return functools.partial(grouped_matmul, interpret=interpret,
                                 precision=jax.lax.Precision.DEFAULT if dot is None else dot)
    return functools.partial(jax.lax.ragged_dot, precision=dot)
