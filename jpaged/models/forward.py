"""The training forward: a model over whole sequences, as a trainer runs and differentiates it.

`sequence_logits(model, token_ids)` is the model's own step over a [B, L] batch of sequences,
each prefilled at once into a scratch KV cache of its own (no engine, no pool, nothing kept), so
it runs exactly the layers the engine runs. For a model in the batch-invariant mode
(`batch_invariant=True`, the engine option of that name) every token's numbers are those the
engine computed for it, bit for bit, however the engine batched, chunked, cached or preempted the
request: `sequence_logprobs` then returns exactly the logprobs the engine reported for the same
tokens (its default "raw_logprobs" mode), so a policy-gradient loss over them is exactly
on-policy. Both are pure functions of the parameters, so `jax.grad` and `nnx.grad` go through
them.
"""

import jax
import jax.numpy as jnp

from jpaged import kv_cache, parallel
from jpaged.models import row_tiles
from jpaged.models.attention import AttentionMetadata
from jpaged.models.row_tiles import COMPILER_OPTIONS
from jpaged.sampling import token_logprobs

# jit the training forward with COMPILER_OPTIONS (`jax.jit(..., compiler_options=...)`) to agree
# with the batch-invariant engine on a GPU: its programs compile with them.
__all__ = ["COMPILER_OPTIONS", "sequence_logits", "sequence_logprobs"]


def sequence_logits(model, token_ids, *, block_size: int = 16, backend: str | None = None):
    """token_ids [B, L] int32 -> logits [B, L, V] float32: position i's logits predict token
    i + 1. Sequences of different lengths are right-padded (any id): causal attention keeps a
    padding token out of every earlier position's numbers.

    block_size: the KV block size of the engine to agree with (its keys are reduced a block at
    a time); backend: the attention backend (None: "batch_invariant" for a batch-invariant model,
    else the plain-jnp "reference").
    """
    if token_ids.ndim != 2:
        raise ValueError(f"token_ids must be [B, L], got shape {token_ids.shape}")
    if backend is None:
        backend = "batch_invariant" if model.batch_invariant else "reference"
    batch, length = token_ids.shape
    blocks_per_seq = -(-length // block_size)
    # Sequence b owns blocks 1 + b * M ... (block 0 is the sink, as in the engine's pool).
    block_tables = (1 + jnp.arange(batch, dtype=jnp.int32)[:, None] * blocks_per_seq
                    + jnp.arange(blocks_per_seq, dtype=jnp.int32)[None, :])      # [B, M]
    positions = jnp.arange(length, dtype=jnp.int32)
    slots = (block_tables[:, positions // block_size] * block_size
             + positions % block_size)                                            # [B, L]
    metadata = AttentionMetadata(
        slot_mapping=slots.reshape(-1), block_tables=block_tables,
        context_lens=jnp.full((batch,), length, jnp.int32),
        query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32) * length,
        backend=backend)
    config = model.config
    cache = kv_cache.init_cache(
        config.num_hidden_layers, parallel.num_cache_kv_heads(config.num_key_value_heads,
                                                              model.mesh),
        1 + batch * blocks_per_seq, block_size, config.head_dim, model.dtype)
    hidden, _ = model(token_ids.reshape(-1), jnp.tile(positions, batch), cache, metadata)
    return model.compute_logits(hidden).reshape(batch, length, -1)


def sequence_logprobs(model, token_ids, *, block_size: int = 16, backend: str | None = None):
    """token_ids [B, L] -> [B, L - 1] float32: log p(token i + 1 | tokens <= i), under
    log_softmax of the raw logits (computed as the engine's sampler computes a sampled token's
    logprob, row tiles included in the batch-invariant mode). Arguments as `sequence_logits`."""
    logits = sequence_logits(model, token_ids, block_size=block_size, backend=backend)
    batch, length, vocab = logits.shape
    rows = logits[:, :-1].reshape(-1, vocab)
    targets = token_ids[:, 1:].reshape(-1)
    out = row_tiles.runner(model.batch_invariant)(token_logprobs, rows, targets)
    return out.reshape(batch, length - 1)
