"""Paged attention as the model sees it: per-step metadata and the one call into pallas_kernels.

This is the only model module that imports `pallas_kernels`. The kernel is picked by
`AttentionMetadata.backend` (the plain-jnp reference, or the Pallas GPU/TPU kernels, which run in
interpret mode when `interpret` is set, e.g. on a CPU). Per layer, a model may ask for a
sliding window and a score soft cap; until pallas_kernels takes those, the reference backend
runs `masked_reference_attention` here instead and the Pallas backends refuse the model.
"""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp

import pallas_kernels
from jpaged import parallel

BACKENDS = pallas_kernels.BACKENDS
_EXACT = jax.lax.Precision.HIGHEST  # float32 matmuls in the stand-in reference, as the kernels'


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
      backend:   "reference" | "pallas_gpu" | "pallas_tpu".
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
                    *, sliding_window: int | None = None, logits_soft_cap: float | None = None):
    """q [T, H, D] attends causally to its sequences' cached keys/values -> [T, H, D] in q.dtype.

    k_pages, v_pages: one layer's pages [K, N, S, D], already holding this step's K/V.
    Padded query rows come back as zeros. Softmax runs in float32.
    sliding_window W: a query at position p sees only keys k with p - W < k <= p.
    logits_soft_cap c: each scaled score s becomes c * tanh(s / c) before masking.
    Both are static per layer and reach the kernels only when set, so a model without them
    calls the kernels exactly as before they existed.
    mesh: tensor parallelism (`jpaged.parallel`): the kernel runs on each device with its local
    query heads and kv heads (q split along H, pages along K, metadata replicated).
    """
    options = {name: value for name, value in (("sliding_window", sliding_window),
                                               ("logits_soft_cap", logits_soft_cap))
               if value is not None}
    attend = functools.partial(_attend, scale=scale, **options)
    if mesh is None:
        return attend(q, k_pages, v_pages, metadata)
    local = parallel.per_shard(
        attend, mesh,
        in_specs=(parallel.HEADS, parallel.PAGES, parallel.PAGES, parallel.REPLICATED),
        out_specs=parallel.HEADS)
    return local(q, k_pages, v_pages, metadata)


def kernels_support(backend: str, option: str) -> bool:
    """Whether pallas_kernels' `backend` takes the attention option `option` ('sliding_window',
    'logits_soft_cap'): its decode and prefill kernels name it, and for the reference so does
    the dispatcher (which refuses unnamed options for the reference)."""
    kernels = _KERNELS[backend]
    if backend == "reference":
        kernels += (pallas_kernels.paged_attention_decode, pallas_kernels.paged_attention_prefill)
    return all(option in inspect.signature(kernel).parameters for kernel in kernels)


_KERNELS = {
    "reference": (pallas_kernels.reference.paged_attention_decode,
                  pallas_kernels.reference.paged_attention_prefill),
    "pallas_gpu": (pallas_kernels.paged_attention_decode_gpu,
                   pallas_kernels.paged_attention_prefill_gpu),
    "pallas_tpu": (pallas_kernels.paged_attention_decode_tpu,
                   pallas_kernels.paged_attention_prefill_tpu),
}


def _attend(q, k_pages, v_pages, metadata: AttentionMetadata, scale: float, **options):
    """The single place that binds a kernel implementation."""
    missing = [name for name in options if not kernels_support(metadata.backend, name)]
    if missing and metadata.backend != "reference":
        raise NotImplementedError(
            f"attention backend {metadata.backend!r} does not take {missing} yet (pallas_kernels "
            "lacks the argument); this model needs it: use attention_backend='reference'")
    if missing:
        return masked_reference_attention(q, k_pages, v_pages, metadata, scale=scale, **options)
    options = dict(options, scale=scale, backend=metadata.backend, interpret=metadata.interpret)
    if metadata.is_decode:
        return pallas_kernels.paged_attention_decode(
            q, k_pages, v_pages, metadata.block_tables, metadata.context_lens, **options)
    return pallas_kernels.paged_attention_prefill(
        q, k_pages, v_pages, metadata.block_tables, metadata.context_lens,
        metadata.query_start_loc, **options)


def masked_reference_attention(q, k_pages, v_pages, metadata: AttentionMetadata, *,
                               scale: float, sliding_window: int | None = None,
                               logits_soft_cap: float | None = None):
    """Plain-jnp paged attention with a sliding window and a score soft cap: the stand-in for
    `pallas_kernels.reference` until that takes both options (`kernels_support`), after which
    nothing calls it (tests compare the two then). Same contract as `paged_attention`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    seq_of_token, positions, is_real = _token_positions(metadata, num_tokens)
    tables = metadata.block_tables[seq_of_token]                            # [T, M]
    keys = k_pages[:, tables].reshape(num_kv_heads, num_tokens, -1, head_dim)  # [K, T, M*S, D]
    values = v_pages[:, tables].reshape(num_kv_heads, num_tokens, -1, head_dim)
    key_pos = jnp.arange(keys.shape[2], dtype=jnp.int32)[None]
    visible = ((key_pos < metadata.context_lens[seq_of_token][:, None])
               & (key_pos <= positions[:, None]))                          # [T, M*S]
    if sliding_window is not None:
        visible &= key_pos > positions[:, None] - sliding_window
    queries = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, -1, head_dim)
    scores = jnp.einsum("tkgd,ktcd->tkgc", queries, keys.astype(jnp.float32),
                        precision=_EXACT) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    mask = visible[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0)), 0)
    values = jnp.where(visible[None, :, :, None], values.astype(jnp.float32), 0)  # NaN-safe
    out = jnp.einsum("tkgc,ktcd->tkgd", weights, values, precision=_EXACT)
    out = out / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = out.reshape(num_tokens, num_heads, head_dim)
    return jnp.where(is_real[:, None, None], out, 0).astype(q.dtype)


def _token_positions(metadata: AttentionMetadata, num_tokens: int):
    """(sequence [T], position [T], is_real [T]) of each query row."""
    if metadata.is_decode:
        return (jnp.arange(num_tokens, dtype=jnp.int32), metadata.context_lens - 1,
                metadata.context_lens > 0)
    starts = metadata.query_start_loc
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(starts[1:], token, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, metadata.block_tables.shape[0] - 1)
    query_lens = starts[1:] - starts[:-1]
    positions = metadata.context_lens[seq] - query_lens[seq] + token - starts[seq]
    return seq, positions, token < starts[-1]
