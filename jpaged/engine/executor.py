"""The executor: all device state (block-manager pytree, KV cache, swap store, model
parameters), block operations applied in the ledger's order, dispatch of the jitted programs of
`device_step.py` on inputs packed from `batch_arrays.py`'s host arrays, compilation accounting
and warm-up.

One step takes one host-to-device transfer (its `StepInputs` packed into one buffer) and returns
one device-to-host transfer of the sampled tokens; a decode loop likewise, and a chained loop one
small transfer of keep flags. The programs DONATE the block-manager state and the KV cache, so
XLA updates both in place; the executor's references to the old buffers are replaced by the
returned ones on every call. A decode loop holding a host callback (constrained rows) is
dispatched from a thread of its own (`launcher.py`); reading `manager` or `cache` waits for it.

Shapes are padded to buckets (powers of two between a floor and a cap) so the number of
compilations is bounded: tokens T, sequences B and sampled rows R; decode-only steps use T = B.
Every program runs through its ahead-of-time executable (`programs.Programs`), compiled at
warm-up (`warmup.py`, in the background) or on first use.
"""

import contextlib
import dataclasses
import functools
import time
import types
from concurrent.futures import Future

import jax
import numpy as np

from jpaged import kv_cache, parallel
from jpaged.blocks import allocator
from jpaged.blocks.ops import BlockOp, bucket
from jpaged.blocks.swap import SwapStore, transfer_rate_probe
from jpaged.engine.device_step import (DecodeResult, decode_loop, fresh_result, pack,
                                       result_layout, split_model, step_program, unpack_host)
from jpaged.engine import batch_arrays, compile_cache, warmup
from jpaged.engine.executable_store import Store
from jpaged.engine.launcher import Launcher, resolved
from jpaged.engine.programs import Programs
from jpaged.models.weights import checkpoint_weights, new_parameters, parameter_names
from jpaged.request import Samples
from jpaged.sampling import SamplingRow
from jpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from jpaged.structured_outputs import LoopMatchers, allowed_masks


class StepFailed(Exception):
    """A step raised after its block operations were applied and before it changed any device
    state (its inputs could not be built or its program not dispatched): the device allocator
    still stands where the ledger planned the step's appends from. The cause is chained."""


def _token_masks(rows) -> dict:
    """{row index: packed mask} of the rows that sample under a structured output's constraint,
    computed together."""
    constrained = [index for index, row in enumerate(rows)
                   if row.sample_indices and row.seq.constraint is not None]
    if not constrained:
        return {}
    masks = allowed_masks([rows[index].seq.constraint for index in constrained])
    return dict(zip(constrained, masks))


class _HandedOn:
    """An `Executor` attribute kept as `_<name>` and reached only once the loops submitted to
    its launcher thread have run (`Launcher.settle`; at once on that thread)."""

    def __set_name__(self, owner, name):
        self.attribute = "_" + name

    def __get__(self, executor, owner=None):
        if executor is None:
            return self
        executor.launcher.settle()
        return getattr(executor, self.attribute)

    def __set__(self, executor, value):
        executor.launcher.settle()
        setattr(executor, self.attribute, value)


@dataclasses.dataclass
class LaunchedLoop:
    """A dispatched decode loop. `dispatched` resolves to (the packed inputs it ran on the device,
    its not yet fetched packed results: a `DecodeResult` laid out by `result_layout`) once the
    call that dispatched it has returned: at once, unless the loop went to the launcher thread."""
    dispatched: Future
    layout: tuple
    batch: tuple        # (rows, stop-id width, logit-bias width, mask width) buckets
    result_layout: tuple
    static: dict
    num_rows: int
    start: float

    @property
    def packed(self) -> jax.Array:
        return self.dispatched.result()[0]

    @property
    def result(self) -> jax.Array:
        return self.dispatched.result()[1]


class Executor:
    """Device state, block operations and the compiled programs.

    model: an NNX model (its `config`, `mesh`). config: the engine's `EngineConfig`; unless
    preemption is by recompute only, `swap_space` GiB of host memory hold swapped-out blocks.
    """

    # The device state the loops on the launcher thread hand on: read or written after them.
    manager = _HandedOn()   # the block-manager state (`allocator.init_state`'s pytree)
    cache = _HandedOn()     # the paged KV cache (`kv_cache.init_cache`)

    def __init__(self, model, config):
        self.launcher = Launcher()
        model_config = model.config
        self.compilation_cache_dir = compile_cache.configure(config.compilation_cache_dir)
        self.model_def, self.param_leaves = split_model(model)
        self.programs = Programs(None if self.compilation_cache_dir is None else Store(
            self.compilation_cache_dir, repr((model_config, jax.numpy.dtype(model.dtype).name))))
        # Committed to their devices (no copy), as replacements (`replace_params`) will be: jit
        # keys its cache on commitment, so an update would otherwise compile every program again.
        self.param_leaves = [jax.device_put(leaf, leaf.sharding) for leaf in self.param_leaves]
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.attention_backend = config.attention_backend
        self.batch_invariant = config.batch_invariant
        self.logprobs_mode = config.logprobs_mode
        self.interpret = config.interpret
        # Tensor parallelism (model.mesh, `jpaged.parallel`): the block manager and the inputs
        # are replicated on the mesh, the cache split along kv heads. None: one device.
        self.mesh = model.mesh
        self.input_sharding = parallel.replicated(self.mesh)
        self.manager = allocator.init_state(config.num_kv_blocks, config.block_size,
                                            config.max_num_seqs, self.max_blocks_per_seq)
        if self.mesh is not None:
            self.manager = jax.device_put(self.manager, self.input_sharding)
        self.cache = kv_cache.init_cache(
            model_config.num_hidden_layers,
            parallel.num_cache_kv_heads(model_config.num_key_value_heads, self.mesh),
            config.num_kv_blocks, config.block_size, model_config.head_dim, config.kv_dtype,
            sharding=parallel.cache_sharding(self.mesh))
        self.bytes_per_block = kv_cache.bytes_per_block(
            model_config.num_hidden_layers, model_config.num_key_value_heads,
            model_config.head_dim, config.block_size, config.kv_dtype)
        self.num_swap_blocks = (0 if config.preemption_mode == "recompute"
                                else int(config.swap_space * 2**30 // self.bytes_per_block))
        self.swap_store = (SwapStore(config.num_kv_blocks, self.bytes_per_block,
                                     dispatch=self.dispatch)
                           if self.num_swap_blocks else None)
        self.swap_rates = None            # measured by measure_swap_rates
        # Constrained rows loop with their matchers on the host (`LoopMatchers`), on one device
        # or a mesh of this process's devices (the callback runs once, its results replicated).
        # Over several processes they step one token at a time: each process would need the
        # callback's answer, and JAX runs it in one.
        self.loop_matchers = LoopMatchers() if jax.process_count() == 1 else None
        self._fresh: dict = {}            # shape -> (fresh_result, control) on the device
        self._controls: dict = {}         # (batch, rows, num_steps) -> all-kept control vector
        self.num_padded_tokens = 0
        self.num_real_tokens = 0
        self.last_step_compiled = False
        # The last step's device part (inputs to the device, the compiled call or loop, results
        # back): (when it began, when its results were on the host), perf_counter seconds.
        self.last_device_window = (0.0, 0.0)

    # ---- block operations, in the ledger's order --------------------------------------------
    def apply(self, ops: list[BlockOp]):
        """Run the ledger's block operations on the device, in order."""
        for op in ops:
            op.run(self)

    def dispatch(self, key, program, *args, **static):
        """program(*args, **static) through the executable compiled for shape `key`: the first
        call of a key compiles it, counted (and an error once strict compilation is on); a key
        still compiling in the background is waited for, never compiled twice."""
        out, is_new = self.programs.run(key, program, args, static)
        if key[0] in ("step", "decode"):
            self.last_step_compiled = is_new
        return out

    @property
    def strict_compilation(self) -> bool:
        """Any shape not compiled (or compiling) by now is an error; set after warm-up."""
        return self.programs.strict

    @strict_compilation.setter
    def strict_compilation(self, value: bool):
        self.programs.strict = value

    @property
    def compile_seconds(self) -> float:
        return self.programs.compile_seconds

    # ---- swap-or-recompute policy -----------------------------------------------------------
    def measure_swap_rates(self) -> dict:
        """The measurements the "auto" preemption policy compares: a swap round trip (fixed
        seconds + seconds per block) and the prefill rate (seconds per token). Taken at the first
        decision, not at start: the largest prefill step ran four times at every start (most of
        a CPU start: 145 s of 170 on a busy 2-core machine), and most runs never preempt."""
        typical = self.max_blocks_per_seq
        self.cache, fixed, per_block = transfer_rate_probe(
            self.swap_store, self.cache, min(typical, self.manager.num_blocks - 1))
        self.swap_rates = {"swap_fixed_seconds": fixed, "swap_seconds_per_block": per_block,
                           "prefill_seconds_per_token": self.measure_prefill_seconds_per_token()}
        return self.swap_rates

    def swap_is_cheaper(self, num_blocks: int, num_tokens: int) -> bool:
        """Is swapping num_blocks out and back cheaper than prefilling num_tokens again?"""
        rates = self.swap_rates or self.measure_swap_rates()
        swap = rates["swap_fixed_seconds"] + rates["swap_seconds_per_block"] * num_blocks
        return swap < rates["prefill_seconds_per_token"] * num_tokens

    # ---- the step ---------------------------------------------------------------------------
    def execute(self, rows, sampling_rows, num_logprobs: int):
        """Run one step. rows: [(seq_id, token_ids)], sampling_rows: [(row index, SamplingRow)].

        Returns host numpy (token_ids [R], logprobs [R], top_ids [R, L], top_logprobs [R, L])
        for the len(sampling_rows) real sampled rows.
        """
        out, _ = self._execute(rows, sampling_rows, num_logprobs)
        return out.token_ids, out.logprobs, out.top_ids, out.top_logprobs

    def _execute(self, rows, sampling_rows, num_logprobs: int, scored=(),
                 num_scored_logprobs: int = 0):
        """`execute`, also scoring given tokens. scored: [(row index, token offset in the row,
        target token, temperature)]; num_scored_logprobs: the top logprobs each needs.

        Returns (sampled, scored) `SamplerOutput`s on the host, cut to the real rows (scored:
        None when nothing was asked). Steps that score nothing run the very program they ran
        before scoring existed; scoring ones a variant keyed by the bucketed count of scored
        positions (and whether top logprobs are wanted), compiled on first use.
        """
        start = time.perf_counter()
        with self._unchanged_on_failure():
            key, program, args, static = self.step_call(rows, sampling_rows, num_logprobs,
                                                        scored, num_scored_logprobs)
            self.manager, self.cache, out, ok, scored_out = self.dispatch(key, program, *args,
                                                                          **static)
        out, ok, scored_out = jax.device_get((out, ok, scored_out))
        self.last_device_window = (start, time.perf_counter())
        if not ok:
            raise RuntimeError("device block manager ran out of blocks the host mirror predicted; "
                               "the two have diverged")
        return _cut(out, len(sampling_rows)), (None if scored_out is None
                                               else _cut(scored_out, len(scored)))

    @contextlib.contextmanager
    def _unchanged_on_failure(self):
        """Turn an exception raised before a step changed the device state into StepFailed;
        one that left donated buffers consumed propagates as it is (nothing can be retried)."""
        before = self.manager
        try:
            yield
        except Exception as err:
            leaves = jax.tree.leaves((self.manager, self.cache))
            if self.manager is not before or any(leaf.is_deleted() for leaf in leaves):
                raise
            raise StepFailed(f"{type(err).__name__}: {err}") from err

    def step_call(self, rows, sampling_rows, num_logprobs: int, scored=(),
                  num_scored_logprobs: int = 0):
        """(key, program, args, static arguments) of the step `execute` runs."""
        inputs, is_decode = self._build_inputs(rows, sampling_rows, scored)
        logprob_bucket = MAX_LOGPROBS if num_logprobs else 0
        scored_bucket = MAX_LOGPROBS if num_scored_logprobs else 0
        key = ("step", inputs.token_ids.shape[0], inputs.seq_ids.shape[0],
               inputs.logits_indices.shape[0], is_decode, logprob_bucket,
               inputs.sampling.bias_ids.shape[1], inputs.sampling.allowed.shape[1])
        if inputs.scored is not None:
            key += ("scored", inputs.scored.targets.shape[0], scored_bucket)
        packed, layout = pack(inputs)
        static = dict(layout=layout, model_def=self.model_def, is_decode=is_decode,
                      num_logprobs=logprob_bucket, backend=self.attention_backend,
                      interpret=self.interpret, logprobs_mode=self.logprobs_mode,
                      num_scored_logprobs=scored_bucket)
        return (key, step_program(inputs.token_ids.shape[0], self.batch_invariant),
                (self.param_leaves, self.manager, self.cache, self._put(packed)), static)

    def run_rows(self, rows, block_ops: list) -> tuple[list, list]:
        """Apply the step's block operations, then run one compiled step of any mix for the
        scheduled rows (`ScheduledRow`s). Returns ([(row, sample_index, Samples)] for every
        sample drawn, [(row, first token index, Samples)] for the rows whose prompt positions
        were scored: Samples of the prompt's next tokens, in order)."""
        self.apply(block_ops)
        inputs = [(row.seq.slot, row.token_ids) for row in rows]
        sampling_rows, targets = [], []
        masks = _token_masks(rows)
        for index, row in enumerate(rows):
            position = row.start + row.num_tokens
            # Siblings born at the prompt's end share its mask: none has taken a token yet.
            for sample_index in row.sample_indices:
                sampling_rows.append((index, SamplingRow(row.request.params, row.request.seed,
                                                         sample_index, position,
                                                         masks.get(index))))
                targets.append((row, sample_index))
        scored, scored_rows = batch_arrays.scored_positions(rows)
        num_logprobs = max(row.request.params.logprobs or 0 for row in rows)
        out, scored_out = self._execute(
            inputs, sampling_rows, num_logprobs, scored,
            max((row.request.params.prompt_logprobs or 0 for row, _, _ in scored_rows),
                default=0))
        token_ids, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
        results = [(row, sample_index, Samples(token_ids[i:i + 1], logprobs[i:i + 1],
                                               out.top_ids[i:i + 1], out.top_logprobs[i:i + 1]))
                   for i, (row, sample_index) in enumerate(targets)]
        return results, [(row, first, _samples(scored_out, begin, end))
                         for row, first, (begin, end) in scored_rows]

    def launch_decode(self, rows, sampling_rows, remaining, stop_ids, num_steps: int,
                      max_steps: int, max_model_len: int, num_logprobs: int,
                      constraints=None) -> "LaunchedLoop":
        """Dispatch a decode loop (see `decode_loop_impl`) without waiting for it.

        rows: [(seq_id, last_token)], one sampled row each, in order; remaining: [int];
        stop_ids: [[int]] per row; constraints: [structured output `Constraint` or None] per
        row, or None (only with `loop_matchers`: no loop is in flight).
        """
        with self._unchanged_on_failure():
            packed, fresh, control, layout, batch, static = self.decode_inputs(
                rows, sampling_rows, remaining, stop_ids, num_steps, max_steps, max_model_len,
                num_logprobs, constraints)
            return self._launch(resolved((packed, fresh)), control, layout, batch, static,
                                len(rows))

    def decode_inputs(self, rows, sampling_rows, remaining, stop_ids, num_steps: int,
                      max_steps: int, max_model_len: int, num_logprobs: int,
                      constraints=None) -> tuple:
        """A fresh loop's device inputs, as `_launch` and `loop_call` take them (but num_rows)."""
        constrained = [i for i, constraint in enumerate(constraints or ())
                       if constraint is not None]
        if constrained:
            masks = self.loop_matchers.start([rows[i][0] for i in constrained],
                                             [constraints[i] for i in constrained])
            sampling_rows = list(sampling_rows)
            for i, mask in zip(constrained, masks):
                sampling_rows[i] = sampling_rows[i]._replace(allowed=mask)
        inputs, size, width = batch_arrays.loop_arrays(rows, sampling_rows, remaining, stop_ids,
                                                num_steps, max_num_seqs=self.max_num_seqs)
        static = dict(max_steps=max_steps, max_model_len=max_model_len,
                      num_logprobs=MAX_LOGPROBS if num_logprobs else 0,
                      sampler=batch_arrays.loop_sampler(sampling_rows, num_logprobs),
                      logprobs_mode=self.logprobs_mode,
                      matchers=self.loop_matchers if constrained else None)
        packed, layout = pack(inputs)
        fresh = self._fresh_result_and_control(size, static)
        return (self._put(packed), *fresh, layout,
                (size, width, inputs.sampling.bias_ids.shape[1],
                 inputs.sampling.allowed.shape[1]), static)

    def continue_decode(self, previous: "LaunchedLoop", keep, num_steps: int) -> "LaunchedLoop":
        """Dispatch the next loop straight from the previous one's device results (its last
        tokens, its live rows), without waiting for them: rows finished on the device stay out,
        and so do rows whose `keep` [rows] flag is False (finished on the host)."""
        return self._launch(previous.dispatched,
                            self._control(previous.batch[0], keep, num_steps), previous.layout,
                            previous.batch, previous.static, previous.num_rows)

    def _control(self, batch: int, keep, num_steps: int) -> jax.Array:
        """A chained loop's control vector on the device: keep flags [batch], then num_steps.
        The usual one (every row kept) is sent once per shape and reused: a transfer costs 0.16
        ms of host time per loop on the H200, a tenth of a 1B-shaped model's step."""
        key = (batch, len(keep), num_steps) if all(keep) else None
        if key is not None and key in self._controls:
            return self._controls[key]
        control = np.zeros(batch + 1, np.int32)
        control[:len(keep)] = keep
        control[-1] = num_steps
        control = self._put(control)
        if key is not None:
            if len(self._controls) >= 1024:  # row counts x step counts: bounded, rarely reached
                self._controls.clear()
            self._controls[key] = control
        return control

    def _fresh_result_and_control(self, batch: int, static: dict):
        """Device constants a freshly sent loop continues from (nothing ran, every row kept, its
        own step count): made once per shape, so a launch still sends one buffer."""
        key = (batch, static["max_steps"], static["num_logprobs"])
        if key not in self._fresh:
            control = np.ones(batch + 1, np.int32)
            control[-1] = -1
            self._fresh[key] = (self._put(fresh_result(static["max_steps"], batch,
                                                        static["num_logprobs"])),
                                self._put(control))
        return self._fresh[key]

    def _put(self, host_array) -> jax.Array:
        """One host-to-device transfer (replicated over the mesh under tensor parallelism).

        Always committed to its device(s), as the programs' outputs are: jit keys its cache on
        commitment, so an uncommitted input would compile a program a second time when a later
        call passes an output in its place (a chained loop's inputs come from its predecessor)."""
        return jax.device_put(host_array, self.input_sharding
                              or jax.sharding.SingleDeviceSharding(jax.devices()[0]))

    def _launch(self, inputs: Future, control, layout, batch, static,
                num_rows) -> "LaunchedLoop":
        """Dispatch a loop. inputs: resolves to (its packed inputs, the result it continues
        from); batch: (rows, stop-id width, logit-bias width, mask width) buckets.

        A loop advancing constrained rows' matchers (a host callback) goes to the launcher
        thread, behind the loops already there, since the call dispatching it returns only when
        it ends. Its program is compiled here first when its shape is new, so a compilation
        error is this call's; it runs on the parameters of now."""
        start = time.perf_counter()
        self.last_step_compiled = self._loop_key(batch, static) not in self.programs
        if static["matchers"] is None:
            dispatched = resolved(self._dispatch_loop(inputs, control, layout, batch, static,
                                                      self.param_leaves))
        else:
            if self.last_step_compiled:
                self.programs.executable(*self.loop_call(*inputs.result(), control, layout,
                                                         batch, static))
            dispatched = self.launcher.submit(self._dispatch_loop, inputs, control, layout,
                                              batch, static, list(self.param_leaves))
        layout_of_result = result_layout(static["max_steps"], batch[0], static["num_logprobs"])
        return LaunchedLoop(dispatched, layout, batch, layout_of_result, static, num_rows, start)

    def _dispatch_loop(self, inputs: Future, control, layout, batch, static,
                       params) -> tuple:
        """Run a loop's program; (its packed inputs, its result on the device)."""
        call = self.loop_call(*inputs.result(), control, layout, batch, static, params=params)
        (self.manager, self.cache, result, packed), _ = self.programs.run(*call)
        # Start the copy to the host now, queued behind this loop. Requested only at fetch time,
        # after the next loop was dispatched, it waited for that loop too on the H200 (a 55 ms
        # program's result took 140 ms to fetch behind a second one, 54 ms copied early).
        result.copy_to_host_async()
        return packed, result

    @staticmethod
    def _loop_key(batch, static) -> tuple:
        return ("decode", *batch, static["max_steps"], static["num_logprobs"], static["sampler"])

    def loop_call(self, packed, previous_result, control, layout, batch, static, *,
                  params=None) -> tuple:
        """(key, program, args, static arguments) of a decode loop (params: the parameter
        leaves it runs on, the executor's by default)."""
        kwargs = dict(layout=layout, model_def=self.model_def, backend=self.attention_backend,
                      interpret=self.interpret, **static)
        return (self._loop_key(batch, static), decode_loop(batch[0], self.batch_invariant),
                (self.param_leaves if params is None else params, self.manager, self.cache,
                 packed, previous_result, control), kwargs)

    def fetch_decode(self, launched: "LaunchedLoop", count: int) -> DecodeResult:
        """Wait for a launched loop; its results on the host, cut to the real rows."""
        result = unpack_host(np.asarray(launched.result), launched.result_layout)
        self.last_device_window = (launched.start, time.perf_counter())
        steps = int(result.num_done)
        self.num_padded_tokens += result.done_at.shape[0] * steps
        self.num_real_tokens += count * steps
        return dataclasses.replace(
            result, token_ids=result.token_ids[:, :count], logprobs=result.logprobs[:, :count],
            top_ids=result.top_ids[:, :count], top_logprobs=result.top_logprobs[:, :count],
            done_at=result.done_at[:count])

    def measure_prefill_seconds_per_token(self, repeats: int = 3) -> float:
        """Device seconds per token of the largest prefill step (padding only, nothing changes),
        best of `repeats` after one untimed call."""
        size = self.max_num_batched_tokens
        pad_row = SamplingRow(SamplingParams(temperature=0.0), 0, 0, 0)
        best, counts = float("inf"), (self.num_padded_tokens, self.num_real_tokens)
        for _ in range(repeats + 1):
            start = time.perf_counter()
            self.execute([(-1, [0] * size)], [(0, pad_row)], 0)
            best = min(best, time.perf_counter() - start)
        self.num_padded_tokens, self.num_real_tokens = counts   # padding, not the workload's
        return best / bucket(size, min(128, size), size)

    def warmup(self, *, max_steps: int, max_model_len: int, first_only: bool = False,
               progress: bool = True):
        """Compile the bucket shapes (`warmup.compile_programs`): returns once the programs a
        first request needs exist; the rest compile behind it (first_only: not at all)."""
        warmup.compile_programs(self, max_steps=max_steps, max_model_len=max_model_len,
                                first_only=first_only, progress=progress)

    def _build_inputs(self, rows, sampling_rows, scored=()):
        inputs, is_decode, padded, real = batch_arrays.step_arrays(
            rows, sampling_rows, scored, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens)
        self.num_padded_tokens += padded
        self.num_real_tokens += real
        return inputs, is_decode

    # ---- weights ----------------------------------------------------------------------------
    @functools.cached_property
    def param_index(self) -> dict[str, int]:
        """{parameter name: its index in param_leaves}."""
        return {name: i for i, name in enumerate(parameter_names(self.model_def.treedef))}

    @functools.cached_property
    def model_spec(self) -> types.SimpleNamespace:
        """The model's config, dtype and mesh: what `new_parameters` reads of it (merging the
        model for each update would take milliseconds, and keeping one would keep its arrays)."""
        model = self.model_def.merge(self.param_leaves)
        return types.SimpleNamespace(config=model.config, dtype=model.dtype, mesh=model.mesh)

    def new_params(self, weights):
        """`weights.new_parameters` for this executor's model: every tensor checked now, then
        an iterator of (parameter name, new value) for `replace_params`."""
        current = {name: self.param_leaves[i] for name, i in self.param_index.items()}
        return new_parameters(self.model_spec, weights, current)

    def checkpoint_weights(self) -> dict[str, jax.Array]:
        """{Hugging Face tensor name: array in the checkpoint layout} of the parameters."""
        return checkpoint_weights(self.model_def.merge(self.param_leaves))

    def replace_params(self, named_values):
        """Swap parameters, one at a time, for new arrays of the same shape, dtype and sharding:
        the programs take the leaves as an argument, so nothing compiles again. Each old array
        loses the executor's reference before the next new one is made, so its memory is free
        by then unless something else holds it (a program dispatched earlier finishes on it)."""
        for name, value in named_values:
            index = self.param_index[name]
            old = self.param_leaves[index]
            if (value.shape, value.dtype, value.sharding) != (old.shape, old.dtype, old.sharding):
                raise RuntimeError(f"parameter {name}: replacement {value.shape} {value.dtype} "
                                   f"{value.sharding} differs from {old.shape} {old.dtype} "
                                   f"{old.sharding}")
            self.param_leaves[index] = value
            del old

    # ---- stats ------------------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        """Programs compiled or compiling (one per shape key)."""
        return len(self.programs)

    @property
    def graphdef(self):
        return self.model_def.graphdef

    @property
    def params(self):
        """The parameters as an `nnx.State`, for inspection (the programs take param_leaves)."""
        return jax.tree_util.tree_unflatten(self.model_def.treedef, self.param_leaves)

    @functools.cached_property
    def num_blocks(self) -> int:
        return self.manager.num_blocks


def _cut(out, count: int):
    """A host SamplerOutput's first count rows (the rest is padding)."""
    return jax.tree_util.tree_map(lambda leaf: leaf[:count], out)


def _samples(out, begin: int, end: int) -> Samples:
    return Samples(out.token_ids[begin:end].tolist(), out.logprobs[begin:end].tolist(),
                   out.top_ids[begin:end], out.top_logprobs[begin:end],
                   out.ranks[begin:end].tolist())
