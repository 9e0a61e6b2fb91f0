"""Log-probabilities of given tokens at chosen positions (prompt logprobs, scoring), on the device.

Axes: Q positions asked for (a bucketed, static count), V vocabulary, L top logprobs (static).

A step computes these only when some row asks: the step program takes a `PositionRows` (or None,
the variant every other step compiles), so a request without prompt logprobs pays nothing.
Only the asked positions' logits are computed, and each row's chosen-token logprob is
logit - logsumexp: no [Q, V] log-softmax reaches the host.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.sampling import SamplerOutput

# Scored positions one step computes at most: the scheduler cuts prompt chunks that score so
# that a step's [Q, V] logits stay bounded (at 8B's vocabulary, 1,024 rows are 0.5 GB of float32
# logits) whatever max_num_batched_tokens is; the KV pool's sizing reserves this many rows.
SCORED_POSITIONS_PER_STEP = 1024


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PositionRows:
    """The positions a step scores, padded to Q rows.

    token_indices: [Q] int32 index into the step's tokens whose logits predict the target.
    targets: [Q] int32 the token whose logprob is wanted (padding: 0).
    temperature: [Q] float32 logits are divided by it first (1: the raw distribution).
    """
    token_indices: jax.Array
    targets: jax.Array
    temperature: jax.Array

    @classmethod
    def from_lists(cls, token_indices, targets, temperature, size: int) -> "PositionRows":
        """Numpy-backed rows, padded with (index 0, target 0, temperature 1) up to size."""
        def padded(values, dtype, fill):
            out = np.full(size, fill, dtype)
            out[:len(values)] = values
            return out
        return cls(padded(token_indices, np.int32, 0), padded(targets, np.int32, 0),
                   padded(temperature, np.float32, 1.0))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GivenTokenLogprobs(SamplerOutput):
    """A SamplerOutput whose token_ids are the given targets, with ranks: [Q] int32 each
    target's 1-based rank (1 + the tokens strictly more likely)."""
    ranks: jax.Array


def given_token_logprobs(logits: jax.Array, rows: PositionRows, *,
                         num_logprobs: int) -> GivenTokenLogprobs:
    """log_softmax(logits / temperature) at each row's target, its rank, and the row's top L.

    logits: [Q, V].
    """
    scaled = logits.astype(jnp.float32) / rows.temperature[:, None]         # [Q, V]
    log_normalizer = jax.nn.logsumexp(scaled, axis=-1)                       # [Q]
    target = jnp.take_along_axis(scaled, rows.targets[:, None], axis=-1)     # [Q, 1]
    chosen = target[:, 0] - log_normalizer
    ranks = 1 + jnp.sum(scaled > target, axis=-1, dtype=jnp.int32)
    if num_logprobs:
        top_logits, top_ids = jax.lax.top_k(scaled, num_logprobs)            # [Q, L]
    else:
        top_logits = jnp.zeros((scaled.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((scaled.shape[0], 0), jnp.int32)
    return GivenTokenLogprobs(token_ids=rows.targets, logprobs=chosen,
                              top_ids=top_ids.astype(jnp.int32),
                              top_logprobs=top_logits - log_normalizer[:, None], ranks=ranks)
