"""Paged attention as the model sees it: per-step metadata and the one call into pallas_kernels.

This is the only model module that imports `pallas_kernels`. The kernel is picked by
`AttentionMetadata.backend` (the plain-jnp reference, or the Pallas GPU/TPU kernels, which run in
interpret mode when `interpret` is set, e.g. on a CPU). Per layer, a model may ask for a
sliding window and a score soft cap, which every kernel takes; `unsupported_reason` says before
anything is built whether a backend's kernels can run a model at all.
"""

import dataclasses
import functools

import jax

import pallas_kernels
from jpaged import parallel
from pallas_kernels import row_ops  # noqa: F401  (the models' norms and gating)
# The batch-invariant attention's row tiles, matmul, norms and gating, which the mode's row-wise
# parts share (`row_tiles`).
from pallas_kernels.batch_invariant import TILE_ROWS, map_tiles  # noqa: F401
from pallas_kernels.batch_invariant import gated as invariant_gated  # noqa: F401
from pallas_kernels.batch_invariant import matmul as invariant_matmul  # noqa: F401
from pallas_kernels.batch_invariant import rms_norm as invariant_rms_norm  # noqa: F401
# The experts' grouped matmul of a mixture of experts on the GPU backends (`moe`).
from pallas_kernels.gpu.grouped_matmul import grouped_matmul  # noqa: F401

BACKENDS = pallas_kernels.BACKENDS
GPU_BACKENDS = pallas_kernels.GPU_BACKENDS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged cache (shared by every layer).

    Data fields (traced):
      slot_mapping:    [T] int32, cache slot (block * S + offset) each token's K/V is written to;
                       -1 marks a padded token whose write is dropped.
      block_tables:    [B, M] int32, physical block of each sequence's logical blocks; unused
                       entries are 0 (the sink block).
      context_lens:    [B] int32, tokens in the cache for each sequence including this step's.
      query_start_loc: [B+1] int32, sequence b owns query rows query_start_loc[b]:[b+1]; rows past
                       query_start_loc[B] are padding.
    Static fields (part of the compiled step's cache key):
      is_decode: every sequence has exactly one query and row b of q is sequence b (T == B), so
                 the decode kernel runs; query_start_loc is then unused.
      backend:   "reference" | "pallas_gpu" | "pallas_mosaic_gpu" | "pallas_tpu".
      interpret: run Pallas kernels in interpret mode (CPU tests).
    """
    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    is_decode: bool = dataclasses.field(default=False, metadata=dict(static=True))
    backend: str = dataclasses.field(default="reference", metadata=dict(static=True))
    interpret: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


def paged_attention(q, k_pages, v_pages, metadata: AttentionMetadata, scale: float, mesh=None,
                    *, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    precision: str | None = None):
    """q [T, H, D] attends causally to its sequences' cached keys/values -> [T, H, D] in q.dtype.

    k_pages, v_pages: one layer's pages [K, N, S, D], already holding this step's K/V.
    Padded query rows come back as zeros. Softmax runs in float32.
    sliding_window W: a query at position p sees only keys k with p - W < k <= p.
    logits_soft_cap c: each scaled score s becomes c * tanh(s / c) before masking.
    Both are static per layer and reach the kernels only when set, so a model without them
    calls the kernels exactly as before they existed.
    precision: the model's matmul precision ("highest", "high", "default"), which the kernels
    apply to float32 inputs only (None: theirs, HIGHEST); 16-bit inputs' dots never change.
    mesh: tensor parallelism (`jpaged.parallel`): the kernel runs on each device with its local
    query heads and kv heads (q split along H, pages along K, metadata replicated).
    """
    options = {name: value for name, value in (("sliding_window", sliding_window),
                                               ("logits_soft_cap", logits_soft_cap),
                                               ("precision", precision))
               if value is not None}
    attend = functools.partial(_attend, scale=scale, **options)
    if mesh is None:
        return attend(q, k_pages, v_pages, metadata)
    local = parallel.per_shard(
        attend, mesh,
        in_specs=(parallel.HEADS, parallel.PAGES, parallel.PAGES, parallel.REPLICATED),
        out_specs=parallel.HEADS)
    return local(q, k_pages, v_pages, metadata)


def unsupported_reason(backend: str, model_config, *, dtype, kv_dtype, block_size: int):
    """None if `backend`'s kernels can run this model (head size, dtypes, block size, every
    layer's window and soft cap), else the reason, as the kernels' own checks word it."""
    windows = {model_config.layer_window(i) for i in range(model_config.num_hidden_layers)}
    for window in sorted(windows, key=lambda w: -1 if w is None else w):
        reason = pallas_kernels.unsupported_reason(
            backend, head_dim=model_config.head_dim, dtype=dtype, kv_cache_dtype=kv_dtype,
            block_size=block_size, sliding_window=window,
            logits_soft_cap=model_config.attn_logit_softcapping)
        if reason is not None:
            return reason
    return None


def _attend(q, k_pages, v_pages, metadata: AttentionMetadata, scale: float, **options):
    """The single place that binds a kernel implementation."""
    options = dict(options, scale=scale, backend=metadata.backend, interpret=metadata.interpret)
    if metadata.is_decode:
        return pallas_kernels.paged_attention_decode(
            q, k_pages, v_pages, metadata.block_tables, metadata.context_lens, **options)
    return pallas_kernels.paged_attention_prefill(
        q, k_pages, v_pages, metadata.block_tables, metadata.context_lens,
        metadata.query_start_loc, **options)
