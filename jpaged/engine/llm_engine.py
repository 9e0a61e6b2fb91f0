"""LLMEngine: the one object that owns the scheduler, the block ledger and the executor.

Research code drives it directly (`add_request`, `step`, `abort`, `has_unfinished`); `LLM` and the
server are thin shells over it. A step enters each part once: the scheduler decides the batch
(admission, chunked prefill, decode, preemption) through the ledger, the executor applies the
ledger's block operations and runs the jitted step or decode loop, and the output processor turns
the sampled tokens into outputs; what finished goes back to the ledger, whose frees reach the
device with the next step's operations. docs/design.md draws the path of one step.
"""

import time
from typing import NamedTuple

import jax

from jpaged.blocks.ledger import BlockLedger
from jpaged.engine.builder import EngineConfig, build_engine_config, resolve_engine_config
from jpaged.engine.executor import Executor
from jpaged.engine.inputs import InputProcessor
from jpaged.engine.output import OutputProcessor
from jpaged.engine.pipeline import DecodePipeline
from jpaged.engine.scheduler import Scheduler


class StepRecord(NamedTuple):
    """One step, for benchmarks: device_seconds spans input transfer, the compiled step (or
    decode loop) and the output transfer; host_seconds is everything else (scheduling, building
    inputs, output processing)."""
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
            num_scheduler_steps=config.num_scheduler_steps)
        self.pipeline = DecodePipeline(self.executor, self.ledger, depth=config.async_depth,
                                       max_model_len=config.max_model_len)
        self.warmup_seconds = 0.0
        if config.warmup:
            self.compile_programs()
        if self.executor.num_swap_blocks and config.preemption_mode == "auto":
            self.scheduler.swap_policy = self.executor.swap_is_cheaper
        self.executor.strict_compilation = config.strict_compilation
        self._requests: dict = {}
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
                            item.get("priority", 0)))
        requests = [self.inputs.build(*args) for args in checked]
        for request in requests:
            self.output.add(request)
            self._requests[request.request_id] = request
            self.scheduler.add(request)
        return requests

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

        An exception while processing one request's outputs fails that request alone: its
        output comes back finished, finish_reason "error", `error` saying why, its blocks freed.
        An exception from the step as a whole (scheduling, the executor) is raised: the block
        mirror has already planned the step's appends, which the device makes only inside the
        step, so no request can be retried or freed soundly (see docs/design.md).
        """
        start = time.perf_counter()
        if self.pipeline.loops:   # decode loops in flight: chain more behind them, fetch one
            rows = self.pipeline.in_flight.rows
            chain = self._loops_to_chain()
            if chain and not self.pipeline.make_room(chain):
                chain = 0
            results, device_freed = self.pipeline.advance(chain=chain)
            is_decode, num_tokens = True, len(rows)
        else:
            schedule = self.scheduler.schedule()
            if not schedule.rows:
                self.executor.apply(schedule.block_ops)
                return []
            rows, is_decode, num_tokens = schedule.rows, schedule.is_decode, schedule.num_tokens
            if schedule.is_loop:
                self.pipeline.launch(rows, self.config.num_scheduler_steps, schedule.block_ops)
                if self._loops_to_chain():
                    return []  # this loop's tokens come back with the next step
                results, device_freed = self.pipeline.advance(chain=0)
            else:
                results, device_freed = self.executor.run_rows(rows, schedule.block_ops), []
        device_seconds = self.executor.last_device_seconds
        outcome = self.output.process(results)
        self.scheduler.update(outcome, device_freed, self.pipeline.hold_back)
        for request in outcome.finished_requests:
            self._requests.pop(request.request_id, None)
        outputs = outcome.outputs + [self._fail(request, err) for request, err in outcome.failed]
        if not self.has_unfinished():
            self.apply_block_ops()  # idle: the device's pool equals the mirror's at once
        self._record(start, device_seconds, rows, is_decode, num_tokens, results)
        return outputs

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
