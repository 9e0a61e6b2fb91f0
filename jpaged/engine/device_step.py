"""The jitted device programs: one step of any mix, and the multi-step decode loop, which can
continue from the previous loop's results on the device. Everything here runs on the device;
`executor.py` builds the inputs, picks the shapes and dispatches.

Both programs DONATE the block-manager state (argument 1) and the KV cache (argument 2): XLA
updates them in place, and callers must replace their references with the returned ones.

Inputs travel packed: the host flattens a `StepInputs`/`DecodeInputs` pytree into ONE int32
buffer (`pack`), sends it with one transfer, and the program unpacks it (`unpack`, static
`layout`), so a step costs one host-to-device copy however many fields the inputs have.
"""

import dataclasses
import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from jpaged import kv_cache
from jpaged.blocks import allocator
from jpaged.logprobs import PositionRows, given_token_logprobs
from jpaged.models import row_tiles
from jpaged.models.attention import AttentionMetadata
from jpaged.sampling import SamplingTensors, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything the host sends for one step (padded to buckets).

    token_ids: [T] int32, the tokens of all rows back to back (padding: 0).
    seq_ids: [B] int32 block-manager rows (-1: padded row); query_lens: [B] int32 tokens per row.
    logits_indices: [R] int32 token index whose logits each sampled row uses.
    sampling: SamplingTensors with [R] leaves.
    scored: the positions whose given tokens' logprobs are wanted (prompt logprobs, scoring),
        or None: a separate program variant, compiled only when some request asks.
    """
    token_ids: jax.Array
    seq_ids: jax.Array
    query_lens: jax.Array
    logits_indices: jax.Array
    sampling: SamplingTensors
    scored: PositionRows | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """The host's part of a multi-step decode (padded to a batch bucket B).

    token_ids: [B] int32, each row's newest token (not yet in the cache).
    seq_ids: [B] int32 block-manager rows (-1: padded row).
    sampling: SamplingTensors with [B] leaves; positions are those of the first sampled token.
    remaining: [B] int32, tokens each row may still generate (max_tokens minus those it has).
    stop_ids: [B, W] int32 token ids that end each row (EOS unless ignored, stop_token_ids);
        -1 pads.
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
    done_at: [B] int32, the iteration at which a row finished on the device (it still holds its
    blocks: the host frees them), -1 if it did not. num_done: [] int32 iterations run.
    out_of_blocks: [] int32, 1 if the loop stopped early because the pool could not serve the
    next iteration.
    missed_copies: [] int32, copies-on-write the host did not plan: programs copy no block
    contents (the scheduler queues a "copy" operation for the copies it plans, which only a
    launch's first iteration can need: after a row's first append its last block is its own);
    anything but 0 means the host and device diverged.
    The loop returns it packed (`pack_traced`, layout `result_layout`): one buffer, one copy.
    """
    token_ids: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    done_at: jax.Array
    num_done: jax.Array
    out_of_blocks: jax.Array
    missed_copies: jax.Array


def pack(tree):
    """(int32 buffer, layout): every leaf of a pytree of 4-byte host arrays, back to back.

    The layout (treedef, leaf shapes and dtypes) is hashable: programs take it as a static
    argument, and it only changes with the shape buckets.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    if any(a.dtype.itemsize != 4 for a in arrays):
        raise TypeError(f"pack takes 4-byte leaves, got {[a.dtype.name for a in arrays]}")
    layout = (treedef, tuple((a.shape, a.dtype.name) for a in arrays))
    return np.concatenate([a.reshape(-1).view(np.int32) for a in arrays]), layout


def unpack_host(buffer: np.ndarray, layout):
    """`unpack` on the host: numpy views into a fetched buffer."""
    treedef, specs = layout
    leaves, offset = [], 0
    for shape, dtype in specs:
        size = math.prod(shape)
        leaves.append(buffer[offset:offset + size].view(dtype).reshape(shape))
        offset += size
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.cache
def result_layout(max_steps: int, batch: int, num_logprobs: int):
    """The packed layout of a decode loop's `DecodeResult` (built once per shape: every launch
    asks for it)."""
    def zeros(shape, dtype=np.int32):
        return np.zeros(shape, dtype)
    return pack(DecodeResult(
        zeros((max_steps, batch)), zeros((max_steps, batch), np.float32),
        zeros((max_steps, batch, num_logprobs)), zeros((max_steps, batch, num_logprobs),
                                                       np.float32),
        zeros(batch), zeros(()), zeros(()), zeros(())))[1]


def pack_traced(tree):
    """`pack` for traced values (a program building the next program's inputs on the device)."""
    return jnp.concatenate([jax.lax.bitcast_convert_type(leaf, jnp.int32).reshape(-1)
                            for leaf in jax.tree_util.tree_leaves(tree)])


def unpack(buffer, layout):
    """The pytree `pack` flattened into buffer, as traced arrays."""
    treedef, specs = layout
    leaves, offset = [], 0
    for shape, dtype in specs:
        size = math.prod(shape)
        part = buffer[offset:offset + size].reshape(shape)
        leaves.append(part if dtype == "int32" else jax.lax.bitcast_convert_type(part, dtype))
        offset += size
    return jax.tree_util.tree_unflatten(treedef, leaves)


class ModelDef:
    """A model's structure as a static jit argument: its NNX graphdef and the treedef of its
    parameters, which travel as a flat list of arrays.

    Every dispatch hashes its static arguments and flattens its array arguments. Hashing an NNX
    graphdef walks the whole module graph and flattening an `nnx.State` runs Python per leaf:
    together about 3 ms per call for a 16-layer model on the H200 machine's host, more than a
    1B model's decode step. So the hash is computed once, and the parameters are a plain list.
    """

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    @functools.cached_property
    def fingerprint(self) -> str:
        """The structure as a digest that is the same in every process (stored programs' keys)."""
        return hashlib.sha256(repr((self.graphdef, self.treedef)).encode()).hexdigest()

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, ModelDef) and self._hash == other._hash
                                 and self.graphdef == other.graphdef
                                 and self.treedef == other.treedef)

    def merge(self, param_leaves):
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, param_leaves))


def split_model(model) -> tuple[ModelDef, list[jax.Array]]:
    """(static structure, parameter arrays) of an NNX model, for the programs below."""
    graphdef, params = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return ModelDef(graphdef, treedef), leaves


def step_impl(param_leaves, manager, cache, packed, *, layout, model_def, is_decode,
              num_logprobs, backend, interpret, logprobs_mode="raw_logprobs",
              num_scored_logprobs=0):
    """The step body (see the module docstring). packed: `pack(StepInputs)`'s buffer. Static:
    layout, model_def, is_decode, num_logprobs, backend, interpret, logprobs_mode,
    num_scored_logprobs (top logprobs per scored position); everything else is traced. Returns
    (manager, cache, sampler output, ok, scored output or None)."""
    inputs: StepInputs = unpack(packed, layout)
    model = model_def.merge(param_leaves)
    num_tokens, batch = inputs.token_ids.shape[0], inputs.seq_ids.shape[0]
    active = inputs.seq_ids >= 0
    seq_rows = jnp.maximum(inputs.seq_ids, 0)
    old_lens = jnp.where(active, manager.seq_lens[seq_rows], 0)
    max_tokens = 1 if is_decode else num_tokens
    manager, appended = allocator.append_tokens(manager, inputs.seq_ids, inputs.query_lens,
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
    hidden, cache = model(inputs.token_ids, positions, cache, metadata)
    rows = row_tiles.runner(model.batch_invariant)
    logits = model.compute_logits(hidden[inputs.logits_indices])
    out = rows(functools.partial(sample, num_logprobs=num_logprobs, logprobs_mode=logprobs_mode),
               logits, inputs.sampling)
    scored = None
    if inputs.scored is not None:
        scored = rows(functools.partial(given_token_logprobs, num_logprobs=num_scored_logprobs),
                      model.compute_logits(hidden[inputs.scored.token_indices]), inputs.scored)
    return manager, cache, out, appended.ok, scored


def continue_inputs(inputs: DecodeInputs, result: DecodeResult, control) -> DecodeInputs:
    """The inputs of the loop that continues the loop `inputs` ran and `result` reports: each live
    row's last sampled token, its positions and remaining budget advanced by the iterations run.
    control: [B + 1] int32, a keep flag per row (0: finished on the host) then the iterations
    wanted (-1: inputs.num_steps). A fresh launch passes `fresh_result` (nothing ran) and all
    keep flags with -1, which leave its inputs as they are."""
    keep, num_steps = control[:-1] != 0, control[-1]
    ran = result.num_done
    last = result.token_ids[jnp.maximum(ran - 1, 0)]
    alive = (inputs.seq_ids >= 0) & (result.done_at < 0) & keep
    return DecodeInputs(
        token_ids=jnp.where(ran > 0, last, inputs.token_ids),
        seq_ids=jnp.where(alive, inputs.seq_ids, -1),
        sampling=dataclasses.replace(inputs.sampling, positions=inputs.sampling.positions + ran),
        remaining=inputs.remaining - ran, stop_ids=inputs.stop_ids,
        num_steps=jnp.where(num_steps >= 0, num_steps, inputs.num_steps))


def fresh_result(max_steps: int, batch: int, num_logprobs: int) -> np.ndarray:
    """The packed `DecodeResult` of a loop that ran nothing: continuing from it (`continue_inputs`)
    leaves a freshly sent loop's inputs unchanged."""
    buffer = np.zeros(sum(math.prod(shape) for shape, _ in
                          result_layout(max_steps, batch, num_logprobs)[1]), np.int32)
    result = unpack_host(buffer, result_layout(max_steps, batch, num_logprobs))
    result.done_at[:] = -1
    return buffer


def decode_loop_impl(param_leaves, manager, cache, packed, previous_result, control, *, layout,
                     model_def, max_steps, max_model_len, num_logprobs, sampler, backend,
                     interpret, logprobs_mode="raw_logprobs", matchers=None):
    """Up to inputs.num_steps decode iterations for the whole batch in one device loop. The
    inputs are `continue_inputs` of packed (`pack(DecodeInputs)`'s buffer), the packed result of
    the loop that ran them (`fresh_result` for a loop the host just sent) and control, so a
    chained loop continues from its predecessor on the device in the same dispatch. Returns the
    new manager and cache, this loop's packed `DecodeResult` and its packed inputs (which the
    next chained loop continues from).

    Each iteration appends every live row's newest token on the device block manager (a fresh
    block when a row crosses a block boundary; a shared last block is replaced by the
    already-copied one, see `missed_copies`), runs
    the model, samples, and retires rows that produced a stop id or used up their `remaining`
    tokens or max_model_len. A retired row keeps its blocks: the host frees them after it has
    offered their full blocks to the prefix cache (a block freed inside the loop could be taken
    by another row before the cache's reference lands, and with async scheduling that reference
    lands only after the loops in flight).

    matchers (static): a `structured_outputs.LoopMatchers` when rows are constrained by a
    structured output, else None. Then each iteration samples under the masks in its carry
    (the inputs' for the first) and ends with a host callback: the matchers take the tokens
    sampled and return the next iteration's masks and the rows their constraint completed,
    which are retired like rows that sampled a stop id. The last masks go back with the packed
    inputs, so a chained loop starts from them. The callback makes the device wait for the
    host once per iteration, only in loops with constrained rows: 0.2-0.35 ms an iteration on
    an H100. A program holding a host callback also runs inside the call that dispatches it,
    so the executor dispatches constrained loops from a thread of its own (`launcher.py`) and
    the host's work between loops overlaps them (benchmarks/results/structured_h200.md).
    Iterations stop counting
    when inputs.num_steps are done, every row has finished, or the pool cannot serve the next
    iteration (`out_of_blocks`, reported, never silent). Iteration i of the host's replay is
    exactly (append the rows live at i), which `HostBlockMirror` repeats.

    The loop has a static trip count (max_steps) and no data-dependent branch: an iteration past
    the stop appends and writes nothing, and the sampler's path (`sampler`, one
    of SAMPLER_MODES) is chosen on the host. On a GPU a `while_loop` predicate or a
    `cond` copies a flag to the host and waits for the device, once per iteration; without them
    the dispatching thread enqueues the whole loop and returns (async scheduling overlaps it).
    """
    sent: DecodeInputs = unpack(packed, layout)
    fresh = control[-1] < 0   # a launch (its first iteration was planned by the scheduler)
    batch = sent.seq_ids.shape[0]
    inputs = continue_inputs(sent, unpack(previous_result, result_layout(
        max_steps, batch, num_logprobs)), control)
    model = model_def.merge(param_leaves)
    ones = jnp.ones(batch, jnp.int32)
    wanted = jnp.minimum(inputs.num_steps, max_steps)

    def live_ids(active):
        return jnp.where(active, inputs.seq_ids, -1)

    def body(step, carry):
        manager, cache, tokens, active, outputs, done_at, num_done, missed, allowed = carry
        runs = ((step < wanted) & jnp.any(active)
                & allocator.can_append(manager, live_ids(active), ones))  # monotone: a prefix runs
        live = active & runs
        seq_ids = live_ids(live)
        manager, appended = allocator.append_tokens(manager, seq_ids, ones, max_tokens=1)
        seq_rows = jnp.maximum(seq_ids, 0)
        context_lens = jnp.where(live, manager.seq_lens[seq_rows], 0)
        metadata = AttentionMetadata(
            slot_mapping=appended.slot_mapping[:, 0], block_tables=manager.block_tables[seq_rows],
            context_lens=context_lens,
            query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32), is_decode=True,
            backend=backend, interpret=interpret)
        # Block contents are copied by the host's "copy" operation, planned with the mirror,
        # before the program: a copy per row in here (to the sink when there is nothing to
        # copy) cost 1.4 ms of a 15 ms step at batch 256 (8B shape, H200). Only a fresh
        # launch's first iteration can meet a shared partial block; any other is counted.
        missed = missed + jnp.sum(live & (appended.copies[:, 1] >= 0) & ~(fresh & (step == 0)))
        hidden, cache = model(tokens, jnp.maximum(context_lens - 1, 0), cache, metadata)
        sampling = dataclasses.replace(inputs.sampling, allowed=allowed,
                                       positions=inputs.sampling.positions + step)
        out = row_tiles.runner(model.batch_invariant)(
            functools.partial(sample, num_logprobs=num_logprobs, mode=sampler,
                              logprobs_mode=logprobs_mode),
            model.compute_logits(hidden), sampling)
        is_stop = jnp.any(out.token_ids[:, None] == inputs.stop_ids, axis=1)
        if matchers is not None:
            allowed, is_complete = io_callback(
                matchers.advance, (jax.ShapeDtypeStruct(allowed.shape, jnp.int32),
                                   jax.ShapeDtypeStruct((batch,), jnp.int32)),
                live_ids(active), live, out.token_ids, ordered=False)
            is_stop = is_stop | (is_complete != 0)
        finished = live & (is_stop | (step + 1 >= inputs.remaining)
                           | (context_lens + 1 >= max_model_len))
        outputs = tuple(buffer.at[step].set(value) for buffer, value in zip(
            outputs, (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)))
        return (manager, cache, jnp.where(live, out.token_ids, tokens), active & ~finished,
                outputs, jnp.where(finished, step, done_at), num_done + runs, missed, allowed)

    outputs = (jnp.zeros((max_steps, batch), jnp.int32), jnp.zeros((max_steps, batch)),
               jnp.zeros((max_steps, batch, num_logprobs), jnp.int32),
               jnp.zeros((max_steps, batch, num_logprobs)))
    carry = (manager, cache, inputs.token_ids, inputs.seq_ids >= 0, outputs,
             jnp.full(batch, -1, jnp.int32), jnp.int32(0), jnp.int32(0), inputs.sampling.allowed)
    manager, cache, _, active, outputs, done_at, num_done, missed, allowed = jax.lax.fori_loop(
        0, max_steps, body, carry)
    out_of_blocks = ((num_done < wanted) & jnp.any(active)
                     & ~allocator.can_append(manager, live_ids(active), ones))
    result = DecodeResult(*outputs, done_at=done_at, num_done=num_done,
                          out_of_blocks=out_of_blocks.astype(jnp.int32),
                          missed_copies=missed)
    inputs = dataclasses.replace(inputs, sampling=dataclasses.replace(inputs.sampling,
                                                                      allowed=allowed))
    return manager, cache, pack_traced(result), pack_traced(inputs)




# Which GEMMs the model's matmuls get, by the program's token count (decode: batch rows). XLA's
# own Triton GEMMs win on skinny products, cuBLAS on wider ones. Decode step of the 8B shape on
# the H200 (benchmarks/results/roofline_8b_h200.md), Triton / cuBLAS: 4.62 / 5.20 ms at batch 1,
# 4.92 / 5.23 at 8, 5.26 / 5.49 at 16, 6.11 / 6.13 at 32, 7.60 / 7.27 at 64 (there Triton read
# the packed q/k/v weight at 2.4 TB/s against cuBLAS's 3.0). GPU options; other backends ignore
# them.
TRITON_GEMM_MAX_TOKENS = 32


def _programs(fn, static_argnames) -> dict:
    """fn jitted three times, {True: with XLA's Triton GEMMs, False: cuBLAS only,
    "batch_invariant": the batch-invariant mode's options (`row_tiles.COMPILER_OPTIONS`)}.
    Module-level, so engines with the same model and shapes share compiled executables. Donated:
    argument 1 (block-manager state) and 2 (KV cache) are updated in place."""
    programs = {}
    for key, options in ((True, {"xla_gpu_enable_triton_gemm": True}),
                         (False, {"xla_gpu_enable_triton_gemm": False}),
                         ("batch_invariant", row_tiles.COMPILER_OPTIONS)):
        programs[key] = jax.jit(fn, donate_argnums=(1, 2), static_argnames=static_argnames,
                                compiler_options=options)
        programs[key].compiler_options = options   # for the program store's key
    return programs


_STEP_PROGRAMS = _programs(step_impl, (
    "layout", "model_def", "is_decode", "num_logprobs", "backend", "interpret", "logprobs_mode",
    "num_scored_logprobs"))
_DECODE_LOOPS = _programs(decode_loop_impl, (
    "layout", "model_def", "max_steps", "max_model_len", "num_logprobs", "sampler", "backend",
    "interpret", "logprobs_mode", "matchers"))


def step_program(num_tokens: int, batch_invariant: bool = False):
    """The jitted `step_impl` for a step of num_tokens (padded) tokens. batch_invariant: every
    program compiles with the mode's options (cuBLAS, its algorithm by heuristic rather than by
    timing: one GEMM per shape whatever the program or the process), so a row tile's matmul is
    the same in a decode step, a prefill and a loop."""
    if batch_invariant:
        return _STEP_PROGRAMS["batch_invariant"]
    return _STEP_PROGRAMS[num_tokens <= TRITON_GEMM_MAX_TOKENS]


def decode_loop(batch: int, batch_invariant: bool = False):
    """The jitted `decode_loop_impl` for a loop of batch (padded) rows (batch_invariant: as in
    `step_program`)."""
    if batch_invariant:
        return _DECODE_LOOPS["batch_invariant"]
    return _DECODE_LOOPS[batch <= TRITON_GEMM_MAX_TOKENS]
