"""LLMEngine: the one object that owns the scheduler, the block ledger and the executor.

Research code drives it directly (`add_request`, `step`, `abort`, `has_unfinished`); `LLM` and the
server are thin shells over it. A step enters each part once: the scheduler decides the batch
(admission, chunked prefill, decode, preemption) through the ledger, the executor applies the
ledger's block operations and runs the jitted step or decode loop, and the output processor turns
the sampled tokens into outputs; what finished goes back to the ledger, whose frees reach the
device with the next step's operations. docs/design.md draws the path of one step.
"""

import itertools
import time
from typing import NamedTuple

import jax
import numpy as np

from jpaged.blocks.ledger import BlockLedger
from jpaged.engine.builder import (EngineConfig, build_engine_config, engine_model,
                                   resolve_engine_config)
from jpaged.engine.executor import Executor, StepFailed
from jpaged.engine.inputs import InputProcessor
from jpaged.engine.output import OutputProcessor
from jpaged.engine.pipeline import DecodePipeline
from jpaged.engine.scheduler import Scheduler


class StepRecord(NamedTuple):
    """One step, for benchmarks: device_seconds spans input transfer, the compiled step (or
    decode loop) and the output transfer, within the step (a loop dispatched in an earlier step,
    under async scheduling: from this step's start until its results are on the host);
    host_seconds is everything else (scheduling, building inputs, output processing). The two
    add up to the step's wall time."""
    is_decode: bool
    num_seqs: int
    num_tokens: int
    context_tokens: int      # tokens attended over, summed over the batch's sequences
    num_generated: int       # tokens sampled this step (K per row for a K-iteration loop)
    device_seconds: float
    host_seconds: float
    compiled: bool           # this step compiled a new shape (its times include the compile)


class LLMEngine:
    """Continuous-batching engine over one model."""

    def __init__(self, model, tokenizer, config: EngineConfig):
        model = engine_model(model, config)
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.config = config
        self.inputs = InputProcessor(tokenizer, model.config, config)
        self.output = OutputProcessor(tokenizer, config.max_model_len)
        self.executor = Executor(model, config)
        self.ledger = BlockLedger(
            config.num_kv_blocks, config.block_size, config.max_num_seqs,
            self.executor.max_blocks_per_seq, enable_prefix_caching=config.enable_prefix_caching,
            num_swap_blocks=self.executor.num_swap_blocks)
        self.scheduler = Scheduler(
            self.ledger, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            preemption_mode=config.preemption_mode,
            num_scheduler_steps=config.num_scheduler_steps,
            sliding_window=model.config.window_of_every_layer,
            loops_take_constraints=self.executor.loop_matchers is not None)
        self.pipeline = DecodePipeline(self.executor, self.ledger, depth=config.async_depth,
                                       max_model_len=config.max_model_len)
        self.warmup_seconds = 0.0
        if config.warmup:
            self.compile_programs()
        if self.executor.num_swap_blocks and config.preemption_mode == "auto":
            self.scheduler.swap_policy = self.executor.swap_is_cheaper
        self.executor.strict_compilation = config.strict_compilation
        self._requests: dict = {}
        self._score_ids = itertools.count()
        self.num_steps = 0
        self.host_seconds = 0.0
        self.device_seconds = 0.0
        self.step_log: list[StepRecord] | None = None  # set to [] to record every step

    @classmethod
    def from_pretrained(cls, model=None, **options) -> "LLMEngine":
        """Load a Hugging Face directory (None: the built-in model) and size the KV pool."""
        model_obj, tokenizer, config = resolve_engine_config(model, **options)
        return cls(model_obj, tokenizer, config)

    @classmethod
    def from_model(cls, model, tokenizer=None, **options) -> "LLMEngine":
        """An engine over a model already built in memory (e.g. random weights for benchmarks)."""
        return cls(model, tokenizer, build_engine_config(model, **options))

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt=None, params=None, *, prompt_token_ids=None,
                    priority: int = 0):
        """Queue a request; bad input raises ValueError naming the problem and queues nothing."""
        return self.add_requests([dict(request_id=request_id, prompt=prompt, params=params,
                                       prompt_token_ids=prompt_token_ids, priority=priority)])[0]

    def add_requests(self, items: list[dict]) -> list:
        """Queue several requests (add_request's keyword arguments each), all or none: every one
        is checked before any is queued, and a bad one raises ValueError naming its index."""
        checked = []
        for index, item in enumerate(items):
            request_id = item["request_id"]
            try:
                if request_id in self._requests or any(request_id == c[0] for c in checked):
                    raise ValueError(f"request_id {request_id!r} is already in flight")
                token_ids, params = self.inputs.check(
                    item.get("prompt"), item.get("params"),
                    prompt_token_ids=item.get("prompt_token_ids"))
            except ValueError as err:
                if len(items) == 1:
                    raise
                raise ValueError(f"prompt {index}: {err}") from err
            checked.append((request_id, item.get("prompt"), token_ids, params,
                            item.get("priority", 0), item.get("score_from", 1),
                            item.get("score_temperature", 1.0)))
        requests = [self.inputs.build(*args) for args in checked]
        for request in requests:
            self.output.add(request)
            self._requests[request.request_id] = request
            self.scheduler.add(request)
        return requests

    def add_score_requests(self, request_ids, prompt_token_ids, completion_token_ids, *,
                           temperature: float = 1.0) -> list:
        """Queue one scoring request per (prompt, completion) pair, all or none (`score`)."""
        if not len(request_ids) == len(prompt_token_ids) == len(completion_token_ids):
            raise ValueError(f"got {len(prompt_token_ids)} prompts and "
                             f"{len(completion_token_ids)} completions")
        return self.add_requests([self.inputs.score_item(*pair, temperature) for pair in zip(
            request_ids, prompt_token_ids, completion_token_ids)])

    def score(self, prompt_token_ids, completion_token_ids, *,
              temperature: float = 1.0) -> list[np.ndarray]:
        """For each pair, float32 [len(completion)] log p(completion[i] | prompt +
        completion[:i]) under log_softmax(logits / temperature); runs the engine until they are
        done (other requests' outputs of those steps are dropped). The pairs are requests
        scored in batched, chunked prefill; prompt blocks come from the prefix cache."""
        request_ids = [f"score-{next(self._score_ids)}" for _ in prompt_token_ids]
        self.add_score_requests(request_ids, prompt_token_ids, completion_token_ids,
                                temperature=temperature)
        finished = {}
        while len(finished) < len(request_ids):
            finished.update((out.request_id, out) for out in self.step() if out.finished)
        return [completion_logprobs(finished[request_id], len(completion))
                for request_id, completion in zip(request_ids, completion_token_ids)]

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its blocks return to the pool at once. False if unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        held = [seq for seq in request.live_sequences if self.pipeline.holds(seq)]
        if held:
            for seq in request.live_sequences:
                seq.finish_reason = "abort"
            self.pipeline.free(held)
            self.scheduler.retire(request)
        else:
            self.scheduler.abort(request_id)
        self.apply_block_ops()
        return True

    def apply_block_ops(self):
        """Run the ledger's queued block operations on the device now."""
        self.executor.apply(self.ledger.take_ops())

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request can get: the free stack plus cached blocks no request holds
        (evicted on demand)."""
        return self.ledger.num_available

    @property
    def num_unfinished_requests(self) -> int:
        """Requests waiting, running or swapped out."""
        return self.scheduler.num_unfinished

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.pipeline.in_flight is not None

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list:
        """Schedule and run one step; return the outputs of requests that made progress.

        A step of pure decodes runs as one device loop of `num_scheduler_steps` iterations when no
        request is waiting, and as a single ordinary step otherwise (so a waiting request joins
        at the next step: TTFT does not grow with K). With `async_scheduling`, while nothing
        waits, the next loop is dispatched before this one's tokens are processed on the host,
        so the host work overlaps the device; outputs then trail the device by one step.

        A failure is confined to the request that causes it: an exception while processing one
        request's outputs fails that request alone (its output comes back finished,
        finish_reason "error", `error` saying why, its blocks freed); a step that raises before
        it changed the device runs again one request at a time, and only a request whose own
        step raises fails. Anything else (scheduling, a failure on the device) is raised.
        """
        start = time.perf_counter()
        retired, failed, scored = [], [], []
        if self.pipeline.loops:   # decode loops in flight: chain more behind them, fetch one
            rows = self.pipeline.in_flight.rows
            chain = self._loops_to_chain()
            if chain and not self.pipeline.make_room(chain):
                chain = 0
            results, retired = self.pipeline.advance(chain=chain)
            is_decode, num_tokens = True, len(rows)
        else:
            schedule = self.scheduler.schedule()
            if not schedule.rows:
                self.executor.apply(schedule.block_ops)
                return []
            rows, is_decode, num_tokens = schedule.rows, schedule.is_decode, schedule.num_tokens
            try:
                if schedule.is_loop:
                    self.pipeline.launch(rows, self.config.num_scheduler_steps,
                                         schedule.block_ops)
                else:
                    results, scored = self.executor.run_rows(rows, schedule.block_ops)
            except StepFailed:
                results, scored, failed = self._run_each_request_alone(rows)
            else:
                if schedule.is_loop:
                    if self._loops_to_chain():
                        return []  # this loop's tokens come back with the next step
                    results, retired = self.pipeline.advance(chain=0)
        # A loop dispatched in an earlier step (async scheduling) ran while that step's host
        # work went on: only the part of its window inside this step is this step's device time.
        launched, fetched = self.executor.last_device_window
        device_seconds = max(0.0, fetched - max(launched, start))
        outcome = self.output.process(results, scored)
        self.scheduler.update(outcome, retired, self.pipeline.hold_back)
        if self.pipeline.loops:
            self.scheduler.tend_behind_loops(self.pipeline.behind_newest)
        for request in outcome.finished_requests:
            self._requests.pop(request.request_id, None)
        outputs = outcome.outputs + [self._fail(request, err)
                                     for request, err in failed + outcome.failed]
        if not self.has_unfinished():
            self.apply_block_ops()  # idle: the device's pool equals the mirror's at once
        self._record(start, device_seconds, rows, is_decode, num_tokens, results)
        return outputs

    def _run_each_request_alone(self, rows) -> tuple[list, list, list]:
        """The step raised before it changed the device (StepFailed): run each request's rows
        as a step of its own, in the step's order, so every block is taken as the ledger
        planned. A request whose own step raises again is the one to fail; its planned appends
        are made without a step so the requests after it still get their planned blocks.
        Returns (results and scored prompt positions of the requests that ran, [(request,
        error)] for those that did not)."""
        results, scored, failed = [], [], []
        for request, group in itertools.groupby(rows, key=lambda row: row.request):
            group = list(group)
            try:
                group_results, group_scored = self.executor.run_rows(group, [])
                results += group_results
                scored += group_scored
            except StepFailed as err:
                self.executor.apply(self.scheduler.step_skipped(group))
                failed.append((request, err.__cause__ or err))
        assert len({id(request) for request, _ in failed}) == len(failed), \
            "a request's rows were not contiguous in its step"
        return results, scored, failed

    def _fail(self, request, err: Exception):
        """End a request with finish_reason "error" (its blocks freed) and return its output."""
        live = request.live_sequences
        self.abort(request.request_id)
        for seq in live:
            seq.finish_reason = "error"
        output = self.output.output(request)
        output.finished, output.error = True, f"{type(err).__name__}: {err}"
        return output

    def _loops_to_chain(self) -> int:
        """Loops to dispatch behind the ones in flight: none unless async scheduling is on and
        no request waits (see `DecodePipeline.loops_to_chain`)."""
        if not self.config.async_scheduling or self.scheduler.has_queued:
            return 0
        return self.pipeline.loops_to_chain(self.scheduler.running)

    def _record(self, start, device_seconds, rows, is_decode, num_tokens, results):
        total_seconds = time.perf_counter() - start
        self.num_steps += 1
        self.device_seconds += device_seconds
        self.host_seconds += total_seconds
        if self.step_log is not None:
            self.step_log.append(StepRecord(
                is_decode, len(rows), num_tokens,
                sum(row.start + row.num_tokens for row in rows),
                sum(len(samples.token_ids) for _, _, samples in results), device_seconds,
                total_seconds - device_seconds, self.executor.last_step_compiled))

    # ---- weights ----------------------------------------------------------------------------
    def update_weights(self, weights) -> None:
        """Replace the model's weights in place, between steps, without compiling anything.

        weights: a Mapping {Hugging Face tensor name: numpy or jax array in the checkpoint's
        layout and shape} holding every tensor the model needs, or a checkpoint directory.
        Every tensor is checked first: a missing, extra, mis-shaped or non-floating one raises
        ValueError naming it, and the old weights stay. Jax arrays already on the engine's
        devices are converted there; parameters are replaced one at a time.

        Every cached prefix block is dropped (its KV came from the old weights), and what
        requests in flight computed so far is never cached. Requests in flight continue with
        the new weights from their next step, attending over the KV the old weights wrote;
        decode loops already dispatched (async scheduling) finish with the old weights.
        """
        values = self.executor.new_params(weights)   # every tensor checked here
        live = [seq for request in self._requests.values() for seq in request.sequences]
        if self.pipeline.loops:
            self.pipeline.behind_newest(self.ledger.invalidate_prefix_cache(live, behind_loop=True))
        else:
            self.ledger.invalidate_prefix_cache(live, behind_loop=False)
            self.apply_block_ops()
        self.executor.replace_params(values)

    def get_weights(self) -> dict:
        """{Hugging Face tensor name: jax array in the checkpoint's layout}: what
        `update_weights` takes, and what a checkpoint of the model would hold."""
        return self.executor.checkpoint_weights()

    # ---- introspection ----------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple:
        return self.inputs.eos_token_ids

    @property
    def num_generated_tokens(self) -> int:
        return self.output.num_generated_tokens

    def compile_programs(self, *, first_only: bool = False, progress: bool = True):
        """Compile the programs of every bucket shape (first_only: those a first request needs,
        the smallest buckets). Returns once a first request's programs exist; the others
        compile in the background (`wait_for_compilation`). Adds to warmup_seconds."""
        start = time.perf_counter()
        self.executor.warmup(max_steps=self.config.num_scheduler_steps,
                             max_model_len=self.config.max_model_len, first_only=first_only,
                             progress=progress)
        self.warmup_seconds += time.perf_counter() - start

    def wait_for_compilation(self):
        """Block until every program queued by warm-up is compiled."""
        self.executor.programs.wait()

    def stats(self) -> dict:
        executor, scheduler, ledger = self.executor, self.scheduler, self.ledger
        store, cache = executor.swap_store, ledger.prefix_cache
        return {
            "num_kv_blocks": self.config.num_kv_blocks,
            "num_free_blocks": self.num_free_blocks,
            "block_size": self.config.block_size,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_compilations": executor.num_compilations,
            "compile_seconds": executor.compile_seconds,
            "num_compiling": len(executor.programs.pending()),
            "num_compilation_cache_hits": executor.programs.num_cache_hits,
            "warmup_seconds": self.warmup_seconds,
            "num_swapped": len(scheduler.swapped),
            "num_preemptions": scheduler.num_preemptions,
            "num_recomputed_tokens": scheduler.num_recomputed_tokens,
            "num_swapped_out_blocks": ledger.num_swapped_out_blocks,
            "num_swapped_in_blocks": ledger.num_swapped_in_blocks,
            "num_window_freed_blocks": ledger.num_trimmed_blocks,
            "num_free_swap_blocks": len(ledger.free_host_blocks),
            "swap_bytes_out": store.bytes_out if store else 0,
            "swap_bytes_in": store.bytes_in if store else 0,
            "prefix_cache_hit_rate": cache.hit_rate if cache else 0.0,
            "num_cached_blocks": len(cache) if cache else 0,
            "num_loops_out_of_blocks": self.pipeline.num_ran_dry,
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "padding_waste": (executor.num_padded_tokens / executor.num_real_tokens
                              if executor.num_real_tokens else 0.0),
            "host_seconds_per_step": ((self.host_seconds - self.device_seconds) / self.num_steps
                                      if self.num_steps else 0.0),
            "device_seconds_per_step": (self.device_seconds / self.num_steps
                                        if self.num_steps else 0.0),
            "backend": jax.default_backend(),
            "attention_backend": self.config.attention_backend,
        }


def completion_logprobs(output, num_tokens: int) -> np.ndarray:
    """float32 [num_tokens]: a scoring request's logprobs of its last num_tokens prompt tokens
    (`LLMEngine.add_score_requests`)."""
    start = len(output.prompt_token_ids) - num_tokens
    tokens, entries = output.prompt_token_ids[start:], output.prompt_logprobs[start:]
    return np.array([entry[token].logprob for token, entry in zip(tokens, entries)], np.float32)
