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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """The host's part of a multi-step decode (padded to a batch bucket B).

    token_ids: [B] int32, each row's newest token (not yet in the cache).
    seq_ids: [B] int32 block-manager rows (-1: padded row).
    sampling: SamplingTensors with [B] leaves; positions are those of the first sampled token.
    remaining: [B] int32, tokens each row may still generate (max_tokens minus those it has).
    stop_ids: [B, W] int32 token ids that end each row (EOS unless ignored, stop_token_ids); -1 pads.
    num_steps: [] int32, iterations wanted (<= the static cap).
    """
    token_ids: jax.Array
    seq_ids: jax.Array
    sampling: SamplingTensors
    remaining: jax.Array
    stop_ids: jax.Array
    num_steps: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """What a multi-step decode hands back in one transfer.

    token_ids, logprobs: [K, B]; top_ids, top_logprobs: [K, B, L]: iteration i's samples.
    done_at: [B] int32, the iteration at which a row finished on the device (its blocks are
    already free), -1 if it did not. num_done: [] int32 iterations run. out_of_blocks: [] bool,
    the loop stopped early because the pool could not serve the next iteration.
    """
    token_ids: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    done_at: jax.Array
    num_done: jax.Array
    out_of_blocks: jax.Array


@dataclasses.dataclass
class LaunchedLoop:
    """A dispatched decode loop: its device inputs and (not yet fetched) results."""
    inputs: DecodeInputs
    result: DecodeResult
    static: dict
    num_rows: int
    start: float


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
        self.strict_compilation = False   # set after warm-up to make any new shape an error
        self.last_device_seconds = 0.0    # last step: inputs to device, compiled call, results back

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
        if is_new and self.strict_compilation:
            raise RuntimeError(f"shape {key} was not compiled at warm-up and strict compilation "
                               "is on")
        if key[0] in ("step", "decode"):
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
        start = time.perf_counter()
        device_inputs = jax.device_put(inputs)
        self.manager, self.cache, out, ok = self._timed(
            key, _step, self.params, self.manager, self.cache, device_inputs,
            graphdef=self.graphdef, is_decode=is_decode, num_logprobs=logprob_bucket,
            backend=self.attention_backend, interpret=self.interpret)
        out, ok = jax.device_get((out, ok))
        self.last_device_seconds = time.perf_counter() - start
        if not ok:
            raise RuntimeError("device block manager ran out of blocks the host mirror predicted; "
                               "the two have diverged")
        count = len(sampling_rows)
        return (out.token_ids[:count], out.logprobs[:count], out.top_ids[:count],
                out.top_logprobs[:count])

    def execute_decode(self, rows, sampling_rows, remaining, stop_ids, num_steps: int,
                       max_steps: int, max_model_len: int, num_logprobs: int):
        """Run up to num_steps decode iterations in one device loop and wait for the result
        (launch_decode then fetch_decode)."""
        launched = self.launch_decode(rows, sampling_rows, remaining, stop_ids, num_steps,
                                      max_steps, max_model_len, num_logprobs)
        return self.fetch_decode(launched, len(rows))

    def launch_decode(self, rows, sampling_rows, remaining, stop_ids, num_steps: int,
                      max_steps: int, max_model_len: int, num_logprobs: int) -> "LaunchedLoop":
        """Dispatch a decode loop (see `_decode_loop_impl`) without waiting for it.

        rows: [(seq_id, last_token)], one sampled row each, in order; remaining: [int];
        stop_ids: [[int]] per row.
        """
        batch = bucket(len(rows), 4, self.max_num_seqs)
        width = bucket(max((len(ids) for ids in stop_ids), default=1), 16, 1 << 16)
        token_ids = np.zeros(batch, np.int32)
        seq_ids = np.full(batch, -1, np.int32)
        remaining_arr = np.zeros(batch, np.int32)
        stop_arr = np.full((batch, width), -1, np.int32)
        for index, ((seq_id, token), left, ids) in enumerate(zip(rows, remaining, stop_ids)):
            token_ids[index], seq_ids[index], remaining_arr[index] = token, seq_id, left
            stop_arr[index, :len(ids)] = ids
        sampling = SamplingTensors.from_rows([r for r in sampling_rows], batch)
        inputs = DecodeInputs(token_ids, seq_ids, sampling, remaining_arr, stop_arr,
                              np.int32(num_steps))
        static = dict(max_steps=max_steps, max_model_len=max_model_len,
                      num_logprobs=MAX_LOGPROBS if num_logprobs else 0)
        return self._launch(jax.device_put(inputs), static, len(rows))

    def continue_decode(self, previous: "LaunchedLoop", keep, num_steps: int) -> "LaunchedLoop":
        """Dispatch the next loop straight from the previous one's device results (its last
        tokens, its live rows), without waiting for them: rows finished on the device stay out,
        and so do rows whose `keep` [rows] flag is False (finished on the host)."""
        keep_arr = np.zeros(previous.inputs.seq_ids.shape[0], bool)
        keep_arr[:len(keep)] = keep
        inputs = self._timed(("next", keep_arr.shape[0], previous.inputs.stop_ids.shape[1]),
                             _next_inputs, previous.inputs, previous.result,
                             jax.device_put(keep_arr), np.int32(num_steps))
        return self._launch(inputs, previous.static, previous.num_rows)

    def _launch(self, device_inputs, static, num_rows) -> "LaunchedLoop":
        batch = device_inputs.seq_ids.shape[0]
        key = ("decode", batch, device_inputs.stop_ids.shape[1], static["max_steps"],
               static["num_logprobs"])
        start = time.perf_counter()
        self.manager, self.cache, result = self._timed(
            key, _decode_loop, self.params, self.manager, self.cache, device_inputs,
            graphdef=self.graphdef, backend=self.attention_backend, interpret=self.interpret,
            **static)
        return LaunchedLoop(device_inputs, result, static, num_rows, start)

    def fetch_decode(self, launched: "LaunchedLoop", count: int) -> DecodeResult:
        """Wait for a launched loop; its results on the host, cut to the real rows."""
        result = jax.device_get(launched.result)
        self.last_device_seconds = time.perf_counter() - launched.start
        steps = int(result.num_done)
        self.num_padded_tokens += result.done_at.shape[0] * steps
        self.num_real_tokens += count * steps
        return dataclasses.replace(
            result, token_ids=result.token_ids[:, :count], logprobs=result.logprobs[:, :count],
            top_ids=result.top_ids[:, :count], top_logprobs=result.top_logprobs[:, :count],
            done_at=result.done_at[:count])

    def bucket_sizes(self, floor: int, cap: int) -> list[int]:
        """Every bucket `bucket(n, floor, cap)` can return, smallest first."""
        return sorted({bucket(n, floor, cap) for n in range(1, cap + 1)})

    def warmup(self, *, max_steps: int, max_model_len: int, progress: bool = True):
        """Compile every bucket shape now, with all-padding inputs that change no state.

        Decode loops for each batch bucket, mixed steps for each token bucket (each with and
        without top logprobs), and the block-manager free/fork sizes.
        """
        from jpaged.sampling import SamplingParams, SamplingRow
        from tqdm.auto import tqdm

        jobs = []
        for logprobs in (0, 1):
            for batch in self.bucket_sizes(4, self.max_num_seqs):
                jobs.append(("decode", batch, logprobs))
            for tokens in self.bucket_sizes(min(128, self.max_num_batched_tokens),
                                            self.max_num_batched_tokens):
                jobs.append(("step", tokens, logprobs))
        for kind in ("free", "fork"):
            jobs += [(kind, size, 0) for size in self.bucket_sizes(4, max(4, self.max_num_seqs))]
        pad_row = SamplingRow(SamplingParams(temperature=0.0), 0, 0, 0)
        for kind, size, logprobs in tqdm(jobs, desc="compiling", disable=not progress):
            if kind == "decode":
                launched = self.launch_decode([(-1, 0)] * size, [pad_row] * size, [0] * size,
                                              [[]] * size, 1, max_steps, max_model_len, logprobs)
                self.fetch_decode(self.continue_decode(launched, [False] * size, 1), size)
            elif kind == "step":
                # One padded row per token bucket: seq -1 appends nothing, writes are dropped.
                self.execute([(-1, [0] * size)], [(0, pad_row)], logprobs)
            else:  # padded ids: frees and forks of nothing
                self.apply_ops([(kind, [-1] * size if kind == "free" else [(-1, -1)] * size)])
        self.num_padded_tokens = self.num_real_tokens = 0

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


def _decode_loop_impl(params, manager, cache, inputs: DecodeInputs, *, graphdef, max_steps,
                      max_model_len, num_logprobs, backend, interpret):
    """Up to inputs.num_steps decode iterations for the whole batch in one `lax.while_loop`.

    Each iteration appends every live row's newest token on the device block manager (a fresh
    block when a row crosses a block boundary, copy-on-write when its last block is shared), runs
    the model, samples, and retires rows that produced a stop id or used up their `remaining`
    tokens or max_model_len: their blocks are freed inside the loop. The loop stops when the
    iterations are done, every row has finished, or the pool cannot serve the next iteration
    (`out_of_blocks`, reported, never silent). Iteration i of the host's replay is exactly
    (append live rows, free rows done at i), which `HostBlockMirror` repeats.
    """
    model = nnx.merge(graphdef, params)
    batch = inputs.seq_ids.shape[0]
    top_width = num_logprobs
    ones = jnp.ones(batch, jnp.int32)

    def live_ids(active):
        return jnp.where(active, inputs.seq_ids, -1)

    def cond(carry):
        step, manager, _, active = carry[0], carry[1], carry[2], carry[4]
        return ((step < jnp.minimum(inputs.num_steps, max_steps)) & jnp.any(active)
                & memory.can_append(manager, live_ids(active), ones))

    def body(carry):
        step, manager, cache, tokens, active, outputs, done_at = carry
        seq_ids = live_ids(active)
        manager, appended = memory.append_tokens(manager, seq_ids, ones, max_tokens=1)
        seq_rows = jnp.maximum(seq_ids, 0)
        context_lens = jnp.where(active, manager.seq_lens[seq_rows], 0)
        metadata = AttentionMetadata(
            slot_mapping=appended.slot_mapping[:, 0], block_tables=manager.block_tables[seq_rows],
            context_lens=context_lens,
            query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32), is_decode=True,
            backend=backend, interpret=interpret)
        cache = jax.lax.cond(jnp.any(appended.copies[:, 1] >= 0), kv_cache.copy_blocks,
                             lambda unchanged, _: unchanged, cache, appended.copies)
        hidden, cache = model(tokens, jnp.maximum(context_lens - 1, 0), cache, metadata)
        sampling = dataclasses.replace(inputs.sampling,
                                       positions=inputs.sampling.positions + step)
        out = sample(model.compute_logits(hidden), sampling, num_logprobs=num_logprobs)
        is_stop = jnp.any(out.token_ids[:, None] == inputs.stop_ids, axis=1)
        finished = active & (is_stop | (step + 1 >= inputs.remaining)
                             | (context_lens + 1 >= max_model_len))
        manager = jax.lax.cond(jnp.any(finished), memory.free_seqs,
                               lambda unchanged, _: unchanged, manager,
                               jnp.where(finished, inputs.seq_ids, -1))
        outputs = tuple(buffer.at[step].set(value) for buffer, value in zip(
            outputs, (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)))
        return (step + 1, manager, cache, out.token_ids, active & ~finished, outputs,
                jnp.where(finished, step, done_at))

    outputs = (jnp.zeros((max_steps, batch), jnp.int32), jnp.zeros((max_steps, batch)),
               jnp.zeros((max_steps, batch, top_width), jnp.int32),
               jnp.zeros((max_steps, batch, top_width)))
    carry = (jnp.int32(0), manager, cache, inputs.token_ids, inputs.seq_ids >= 0, outputs,
             jnp.full(batch, -1, jnp.int32))
    step, manager, cache, _, active, outputs, done_at = jax.lax.while_loop(cond, body, carry)
    out_of_blocks = ((step < jnp.minimum(inputs.num_steps, max_steps)) & jnp.any(active)
                     & ~memory.can_append(manager, live_ids(active), ones))
    result = DecodeResult(*outputs, done_at=done_at, num_done=step, out_of_blocks=out_of_blocks)
    return manager, cache, result


def _next_inputs_impl(inputs: DecodeInputs, result: DecodeResult, keep, num_steps):
    """The inputs of the loop that continues `result`: each live row's last sampled token, its
    positions and remaining budget advanced by the iterations run."""
    ran = result.num_done
    last = result.token_ids[jnp.maximum(ran - 1, 0)]
    alive = (inputs.seq_ids >= 0) & (result.done_at < 0) & keep
    return DecodeInputs(
        token_ids=jnp.where(ran > 0, last, inputs.token_ids),
        seq_ids=jnp.where(alive, inputs.seq_ids, -1),
        sampling=dataclasses.replace(inputs.sampling, positions=inputs.sampling.positions + ran),
        remaining=inputs.remaining - ran, stop_ids=inputs.stop_ids, num_steps=num_steps)


# Module-level, so engines with the same model and shapes share compiled executables.
# Donated: argument 1 (block-manager state) and 2 (KV cache) are updated in place.
_step = jax.jit(_step_impl, static_argnames=("graphdef", "is_decode", "num_logprobs", "backend",
                                             "interpret"), donate_argnums=(1, 2))
_decode_loop = jax.jit(_decode_loop_impl, static_argnames=(
    "graphdef", "max_steps", "max_model_len", "num_logprobs", "backend", "interpret"),
    donate_argnums=(1, 2))
_next_inputs = jax.jit(_next_inputs_impl)
_free = jax.jit(memory.free_seqs, donate_argnums=0)
_fork = jax.jit(memory.fork_seqs, donate_argnums=0)
