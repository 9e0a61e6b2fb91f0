"""Plain-jnp paged attention and page writes: the oracle every Pallas kernel is tested against.

Axis vocabulary (used across jpaged): B sequences, T query tokens (flattened over sequences),
H query heads, K kv heads, D head dim, N physical blocks, S block size (tokens per block),
M max blocks per sequence (block-table width).

Page layout (owned by `jpaged.kv_cache`, asserted here): one array per layer for keys and one for
values, `k_pages: [K, N, S, D]`, so the S x D tile of one kv head in one block is contiguous.
Block-table entries past a sequence's last block are never read by the kernels; the reference reads
them and masks the result, so it is NaN-safe (masked values are zeroed, not just their weights).

Two options shared by every attention function here and every kernel (None = off):
- `sliding_window=W`: a query at position p sees keys at positions k with p - W < k <= p, so exactly
  W keys counting its own. This is transformers' `sliding_window_overlay` (masking_utils.py,
  `kv_idx > q_idx - sliding_window`, checked in transformers 5.24) combined with the causal mask.
- `logits_soft_cap=c`: each scaled score s becomes c * tanh(s / c) before masking and softmax, as
  Gemma 2's `eager_attention_forward` does (`attn_logit_softcapping`).
"""

import jax
import jax.numpy as jnp

from pallas_kernels._compat import float32_precision

# Full float32 matmuls: GPUs default to TF32 (~1e-3 relative error), too loose for an oracle.
_EXACT = jax.lax.Precision.HIGHEST


def _precision(dtype, precision):
    """The precision of this module's float32 dots on inputs of `dtype`: float32 inputs get the
    caller's (`float32_precision`, None: HIGHEST); 16-bit inputs, upcast here, always HIGHEST."""
    precision = float32_precision(precision)   # checked whatever the dtype
    return precision if jnp.dtype(dtype) == jnp.float32 else _EXACT


def check_page_layout(k_pages, v_pages, num_kv_heads=None, head_dim=None):
    """Raise ValueError unless k_pages/v_pages are matching [K, N, S, D] arrays."""
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [K, N, S, D], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} != k_pages dtype {k_pages.dtype}")
    if num_kv_heads is not None and k_pages.shape[0] != num_kv_heads:
        raise ValueError(f"k_pages has {k_pages.shape[0]} kv heads, expected {num_kv_heads}")
    if head_dim is not None and k_pages.shape[3] != head_dim:
        raise ValueError(f"k_pages head dim {k_pages.shape[3]} != query head dim {head_dim}")


def _gather_sequences(pages, block_tables):
    """pages [K, N, S, D], block_tables [B, M] -> [B, K, M*S, D] in logical token order."""
    num_kv_heads, _, block_size, head_dim = pages.shape
    batch, max_blocks = block_tables.shape
    gathered = pages[:, block_tables]  # [K, B, M, S, D]
    gathered = gathered.reshape(num_kv_heads, batch, max_blocks * block_size, head_dim)
    return jnp.swapaxes(gathered, 0, 1)


def paged_attention_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale=None,
                           sliding_window=None, logits_soft_cap=None, precision=None):
    """One query token per sequence attends to its cached context (or its last sliding_window keys).

    q: [B, H, D]; k_pages, v_pages: [K, N, S, D]; block_tables: [B, M] int32;
    context_lens: [B] int32 (tokens in the cache, including the current one; 0 = padding row,
    whose output is zeros). Returns [B, H, D] in q's dtype; softmax in float32.
    precision: of the dots when q is float32 (None: HIGHEST; 16-bit q: always HIGHEST).
    """
    batch = q.shape[0]
    positions = context_lens - 1
    seq_of_token = jnp.arange(batch, dtype=jnp.int32)
    out = _attend_tokens(q, k_pages, v_pages, block_tables, context_lens, seq_of_token,
                         positions, scale, sliding_window, logits_soft_cap, precision)
    return jnp.where((context_lens > 0)[:, None, None], out, 0).astype(q.dtype)


def paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                            *, scale=None, sliding_window=None, logits_soft_cap=None,
                            precision=None):
    """A ragged batch of query chunks attends causally to the paged cache.

    q: [T, H, D], the queries of all sequences back to back; sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1] (query_start_loc: [B+1] int32, non-decreasing;
    rows past query_start_loc[B] are padding and come back as zeros).
    context_lens: [B], tokens in the cache for b *including* this chunk, so the chunk's i-th query
    sits at position context_lens[b] - q_len[b] + i and sees positions <= its own (a cached prefix
    of context_lens[b] - q_len[b] tokens comes first). Returns [T, H, D]. precision: as in
    `paged_attention_decode`.
    """
    num_tokens = q.shape[0]
    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    # Sequence of each token: number of starts <= t, minus one.
    seq_of_token = jnp.searchsorted(query_start_loc[1:], token_idx, side="right").astype(jnp.int32)
    batch = block_tables.shape[0]
    is_real = token_idx < query_start_loc[-1]
    seq_of_token = jnp.minimum(seq_of_token, batch - 1)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    offset_in_chunk = token_idx - query_start_loc[seq_of_token]
    positions = context_lens[seq_of_token] - q_lens[seq_of_token] + offset_in_chunk
    out = _attend_tokens(q, k_pages, v_pages, block_tables, context_lens, seq_of_token,
                         positions, scale, sliding_window, logits_soft_cap, precision)
    return jnp.where(is_real[:, None, None], out, 0).astype(q.dtype)


def _attend_tokens(q, k_pages, v_pages, block_tables, context_lens, seq_of_token, positions,
                   scale, sliding_window, logits_soft_cap, precision):
    """Per-token attention: q [T, H, D]; token t belongs to seq_of_token[t] at positions[t]."""
    check_page_layout(k_pages, v_pages, head_dim=q.shape[-1])
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    precision = _precision(q.dtype, precision)
    keys = _gather_sequences(k_pages, block_tables)    # [B, K, C, D], C = M*S
    values = _gather_sequences(v_pages, block_tables)
    ctx = keys.shape[2]
    key_pos = jnp.arange(ctx, dtype=jnp.int32)
    # visible[t, c]: key c is cached for t's sequence and not in t's future.
    visible = (key_pos[None] < context_lens[seq_of_token][:, None]) & (
        key_pos[None] <= positions[:, None])
    if sliding_window is not None:
        visible &= key_pos[None] > positions[:, None] - sliding_window
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    k_tok = keys[seq_of_token].astype(jnp.float32)     # [T, K, C, D]
    v_tok = values[seq_of_token].astype(jnp.float32)
    v_tok = jnp.where(visible[:, None, :, None], v_tok, 0.0)
    scores = jnp.einsum("tkgd,tkcd->tkgc", qg, k_tok, precision=precision) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    weights = jnp.where(visible[:, None, None, :], weights, 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("tkgc,tkcd->tkgd", weights, v_tok, precision=precision)
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(num_tokens, num_heads, head_dim)


def write_to_pages(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Scatter new keys/values into the pages.

    k_new, v_new: [T, K, D]; slot_mapping: [T] int32, slot = block * S + offset; -1 marks a padded
    token whose write is skipped (this is the one padding destination for writes).
    Returns the updated (k_pages, v_pages); callers donate the old buffers so XLA updates in place.
    """
    check_page_layout(k_pages, v_pages)
    num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape
    total_slots = num_blocks * block_size
    slots = jnp.where(slot_mapping < 0, total_slots, slot_mapping)  # out of range -> dropped

    def scatter(pages, new):
        flat = pages.reshape(num_kv_heads, total_slots, head_dim)
        flat = flat.at[:, slots].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return scatter(k_pages, k_new), scatter(v_pages, v_new)


def apply_rotary(x, cos, sin):
    """Rotate x [T, heads, D] by per-token angles: cos, sin [T, D] float32 (half-split layout,
    transformers' `rotate_half`). cos and sin are cast to x's dtype first, as transformers does."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def check_packed_heads(qkv, k_pages, num_heads: int) -> int:
    """The cache's kv heads K, once qkv is checked to be [T, num_heads + 2K, D]."""
    num_kv_heads = k_pages.shape[0]
    if qkv.ndim != 3 or qkv.shape[1] != num_heads + 2 * num_kv_heads:
        raise ValueError(f"qkv must be [T, {num_heads} + 2 x {num_kv_heads}, D], got "
                         f"{qkv.shape}")
    return num_kv_heads


def rotate_and_write(qkv, cos, sin, k_pages, v_pages, slot_mapping, *, num_heads):
    """A layer's projected heads -> rotated queries, with rotated keys and values written.

    qkv: [T, H + 2K, D]: query heads [0, H), key heads [H, H+K), value heads [H+K, H+2K);
    cos, sin: [T, D] float32 rotary tables; slot_mapping [T] int32 (-1 skips the write).
    Returns (q [T, H, D] rotated, k_pages, v_pages with the rotated keys and the values written).
    """
    num_kv_heads = check_packed_heads(qkv, k_pages, num_heads)
    q = apply_rotary(qkv[:, :num_heads], cos, sin)
    k = apply_rotary(qkv[:, num_heads:num_heads + num_kv_heads], cos, sin)
    k_pages, v_pages = write_to_pages(k_pages, v_pages, k, qkv[:, num_heads + num_kv_heads:],
                                      slot_mapping)
    return q, k_pages, v_pages


def dense_causal_attention(q, k, v, *, scale=None, query_offset=0, sliding_window=None,
                           logits_soft_cap=None):
    """Unpaged oracle for the oracle: q [Q, H, D], k/v [C, K, D]; query i sits at query_offset + i."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    k = jnp.repeat(k, num_heads // num_kv_heads, axis=1).astype(jnp.float32)
    v = jnp.repeat(v, num_heads // num_kv_heads, axis=1).astype(jnp.float32)
    scores = jnp.einsum("qhd,chd->hqc", q.astype(jnp.float32), k, precision=_EXACT) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    key_pos, query_pos = jnp.arange(k.shape[0])[None], (query_offset + jnp.arange(num_q))[:, None]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    scores = jnp.where(mask[None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hqc,chd->qhd", weights, v, precision=_EXACT).astype(q.dtype)
