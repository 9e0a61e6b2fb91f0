"""The model runner: the one jit-compiled step, its shape buckets, and the device-side state.

The runner owns the device state (block-manager pytree, KV cache, model parameters). One step
takes one host-to-device transfer of a `StepInputs` pytree and returns one device-to-host
transfer of the sampled tokens. Inside the jitted step, in order: the block manager appends this
step's tokens (popping blocks, copy-on-write), the cache applies the copies, the model writes and
attends through the block tables, logits are taken at the sampled rows only, and the sampler draws.
The step DONATES the block-manager state and the KV cache, so XLA updates both in place; the
runner's references to the old buffers are replaced by the returned ones on every call.

Shapes are padded to buckets (powers of two between a floor and a cap) so the number of
compilations is bounded: tokens T, sequences B and sampled rows R; decode-only steps use T = B.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged import kv_cache, memory
from jpaged.models.attention import AttentionMetadata
from jpaged.sampling import MAX_LOGPROBS, SamplingTensors, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything the host sends for one step (padded to buckets).

    token_ids: [T] int32, the tokens of all rows back to back (padding: 0).
    seq_ids: [B] int32 block-manager rows (-1: padded row); query_lens: [B] int32 tokens per row.
    logits_indices: [R] int32 token index whose logits each sampled row uses.
    sampling: SamplingTensors with [R] leaves.
    """
    token_ids: jax.Array
    seq_ids: jax.Array
    query_lens: jax.Array
    logits_indices: jax.Array
    sampling: SamplingTensors


def bucket(n: int, floor: int, cap: int) -> int:
    """Smallest power of two >= n (at least floor), capped at cap (which must be >= n)."""
    if n > cap:
        raise ValueError(f"{n} exceeds the largest bucket {cap}")
    size = max(floor, 1 << max(n - 1, 0).bit_length())
    return min(size, cap)


class ModelRunner:
    """Device state and the compiled step."""

    def __init__(self, model, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, max_num_batched_tokens: int, kv_dtype,
                 attention_backend: str = "reference", interpret: bool = False):
        config = model.config
        self.graphdef, self.params = nnx.split(model)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.attention_backend = attention_backend
        self.interpret = interpret
        self.manager = memory.init_state(num_blocks, block_size, max_num_seqs,
                                         self.max_blocks_per_seq)
        self.cache = kv_cache.init_cache(config.num_hidden_layers, config.num_key_value_heads,
                                         num_blocks, block_size, config.head_dim, kv_dtype)
        self.compiled_shapes: set = set()
        self.compile_seconds = 0.0
        self.num_padded_tokens = 0
        self.num_real_tokens = 0
        self.last_step_compiled = False

    # ---- block-manager operations queued by the scheduler ----------------------------------
    def apply_ops(self, ops):
        """Replay the scheduler's frees and forks on the device, in the scheduler's order."""
        for kind, items in ops:
            size = bucket(len(items), 4, max(4, self.max_num_seqs))
            if kind == "free":
                ids = np.full(size, -1, np.int32)
                ids[:len(items)] = items
                self._timed(("free", size), _free, self.manager, ids)
            else:
                pairs = np.full((size, 2), -1, np.int32)
                pairs[:len(items)] = items
                self._timed(("fork", size), _fork, self.manager, pairs[:, 0], pairs[:, 1])

    def _timed(self, key, fn, *args, **kwargs):
        is_new = key not in self.compiled_shapes
        if key[0] == "step":
            self.last_step_compiled = is_new
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        if is_new:
            jax.block_until_ready(result)
            self.compiled_shapes.add(key)
            self.compile_seconds += time.perf_counter() - start
        if key[0] in ("free", "fork"):
            self.manager = result
        return result

    # ---- the step ---------------------------------------------------------------------------
    def execute(self, rows, sampling_rows, num_logprobs: int):
        """Run one step. rows: [(seq_id, token_ids)], sampling_rows: [(row index, SamplingRow)].

        Returns host numpy (token_ids [R], logprobs [R], top_ids [R, L], top_logprobs [R, L])
        for the len(sampling_rows) real sampled rows.
        """
        inputs, is_decode = self._build_inputs(rows, sampling_rows)
        logprob_bucket = MAX_LOGPROBS if num_logprobs else 0
        key = ("step", inputs.token_ids.shape[0], inputs.seq_ids.shape[0],
               inputs.logits_indices.shape[0], is_decode, logprob_bucket)
        device_inputs = jax.device_put(inputs)
        self.manager, self.cache, out, ok = self._timed(
            key, _step, self.params, self.manager, self.cache, device_inputs,
            graphdef=self.graphdef, is_decode=is_decode, num_logprobs=logprob_bucket,
            backend=self.attention_backend, interpret=self.interpret)
        out, ok = jax.device_get((out, ok))
        if not ok:
            raise RuntimeError("device block manager ran out of blocks the host mirror predicted; "
                               "the two have diverged")
        count = len(sampling_rows)
        return (out.token_ids[:count], out.logprobs[:count], out.top_ids[:count],
                out.top_logprobs[:count])

    def _build_inputs(self, rows, sampling_rows):
        num_tokens = sum(len(tokens) for _, tokens in rows)
        is_decode = all(len(tokens) == 1 for _, tokens in rows)
        # Decode steps bucket the batch; mixed steps bucket only the tokens and keep every row
        # (padded rows cost the kernels nothing), so compilations stay few.
        if is_decode:
            batch = size = samples = bucket(len(rows), 4, self.max_num_seqs)
        else:
            batch = samples = self.max_num_seqs
            size = bucket(num_tokens, 128, self.max_num_batched_tokens)
        self.num_padded_tokens += size
        self.num_real_tokens += num_tokens
        token_ids = np.zeros(size, np.int32)
        seq_ids = np.full(batch, -1, np.int32)
        query_lens = np.zeros(batch, np.int32)
        last_token = np.zeros(len(rows), np.int32)
        offset = 0
        for index, (seq_id, tokens) in enumerate(rows):
            token_ids[offset:offset + len(tokens)] = tokens
            seq_ids[index], query_lens[index] = seq_id, len(tokens)
            offset += len(tokens)
            last_token[index] = offset - 1
        logits_indices = np.zeros(samples, np.int32)
        logits_indices[:len(sampling_rows)] = [last_token[row] for row, _ in sampling_rows]
        sampling = SamplingTensors.from_rows([r for _, r in sampling_rows], samples)
        return StepInputs(token_ids, seq_ids, query_lens, logits_indices, sampling), is_decode

    # ---- stats ------------------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        return len(self.compiled_shapes)

    @functools.cached_property
    def num_blocks(self) -> int:
        return self.manager.num_blocks


def _step_impl(params, manager, cache, inputs: StepInputs, *, graphdef, is_decode, num_logprobs,
               backend, interpret):
    """The step body (see the module docstring). Static: graphdef, is_decode, num_logprobs,
    backend, interpret; everything else is traced."""
    model = nnx.merge(graphdef, params)
    num_tokens, batch = inputs.token_ids.shape[0], inputs.seq_ids.shape[0]
    active = inputs.seq_ids >= 0
    seq_rows = jnp.maximum(inputs.seq_ids, 0)
    old_lens = jnp.where(active, manager.seq_lens[seq_rows], 0)
    max_tokens = 1 if is_decode else num_tokens
    manager, appended = memory.append_tokens(manager, inputs.seq_ids, inputs.query_lens,
                                             max_tokens=max_tokens)
    query_start_loc = jnp.concatenate(
        [jnp.zeros(1, jnp.int32), jnp.cumsum(inputs.query_lens, dtype=jnp.int32)])
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(query_start_loc[1:], token, side="right"), 0, batch - 1)
    offset = token - query_start_loc[row]
    is_real = token < query_start_loc[-1]
    positions = jnp.where(is_real, old_lens[row] + offset, 0)
    slot_mapping = jnp.where(
        is_real, appended.slot_mapping[row, jnp.clip(offset, 0, max_tokens - 1)],
        kv_cache.PAD_SLOT)
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=manager.block_tables[seq_rows],
        context_lens=jnp.where(active, manager.seq_lens[seq_rows], 0),
        query_start_loc=query_start_loc, is_decode=is_decode,
        backend=backend, interpret=interpret)
    # Copy-on-write is rare (first write after a fork): skip the gather when nothing copies.
    cache = jax.lax.cond(jnp.any(appended.copies[:, 1] >= 0), kv_cache.copy_blocks,
                         lambda unchanged, _: unchanged, cache, appended.copies)
    hidden, cache = model(inputs.token_ids, positions, cache, metadata)
    logits = model.compute_logits(hidden[inputs.logits_indices])
    out = sample(logits, inputs.sampling, num_logprobs=num_logprobs)
    return manager, cache, out, appended.ok


# Module-level, so engines with the same model and shapes share compiled executables.
# Donated: argument 1 (block-manager state) and 2 (KV cache) are updated in place.
_step = jax.jit(_step_impl, static_argnames=("graphdef", "is_decode", "num_logprobs", "backend",
                                             "interpret"), donate_argnums=(1, 2))
_free = jax.jit(memory.free_seqs, donate_argnums=0)
_fork = jax.jit(memory.fork_seqs, donate_argnums=0)
