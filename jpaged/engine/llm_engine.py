"""LLMEngine: the one object that owns both the scheduler and the runner.

Research code drives it directly (`add_request`, `step`, `abort`, `has_unfinished`); `LLM` and the
server are thin shells over it. A step: replay the scheduler's block operations on the device,
schedule (admission, chunked prefill, decode, preemption), run the jitted step, then process the
sampled tokens on the host (forks for n > 1, stop checks, detokenization, freeing finished
sequences at once).
"""

import itertools
import time
from typing import NamedTuple

import jax
import numpy as np

from jpaged import kv_cache
from jpaged.blocks.mirror import HostBlockMirror
from jpaged.engine.pipeline import DecodePipeline
from jpaged.detokenizer import IncrementalDetokenizer
from jpaged.engine.builder import EngineConfig, build_engine_config, resolve_engine_config
from jpaged.request import CompletionOutput, Request, RequestOutput, Samples, Sequence
from jpaged.engine.executor import ModelRunner
from jpaged.sampling import (MAX_LOGPROBS, RequestOutputKind, SamplingParams, SamplingRow,
                             request_seed)
from jpaged.blocks.prefix_cache import PrefixCache
from jpaged.engine.scheduler import Scheduler
from jpaged.blocks.swap import SwapStore, transfer_rate_probe


def enable_compilation_cache(directory: str):
    """Persist compiled executables under `directory`, so a second start skips compiling.
    This is a process-wide JAX setting (every engine in the process shares the cache)."""
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


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
        if config.compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        self.mirror = HostBlockMirror(config.num_kv_blocks, config.block_size, config.max_num_seqs,
                                      -(-config.max_model_len // config.block_size))
        model_config = model.config
        self.bytes_per_block = kv_cache.bytes_per_block(
            model_config.num_hidden_layers, model_config.num_key_value_heads,
            model_config.head_dim, config.block_size, config.kv_dtype)
        num_swap_blocks = (0 if config.preemption_mode == "recompute"
                           else int(config.swap_space * 2**30 // self.bytes_per_block))
        self.scheduler = Scheduler(
            self.mirror, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            prefix_cache=PrefixCache(config.block_size) if config.enable_prefix_caching else None,
            preemption_mode=config.preemption_mode, num_swap_blocks=num_swap_blocks)
        self.pipeline = DecodePipeline(self)
        self.runner = ModelRunner(
            model, num_blocks=config.num_kv_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens, kv_dtype=config.kv_dtype,
            attention_backend=config.attention_backend, interpret=config.interpret)
        if num_swap_blocks:
            self.runner.swap_store = SwapStore(config.num_kv_blocks, self.bytes_per_block)
        self.warmup_seconds = 0.0
        if config.warmup:
            start = time.perf_counter()
            self.runner.warmup(max_steps=config.num_scheduler_steps,
                               max_model_len=config.max_model_len)
            self.warmup_seconds = time.perf_counter() - start
        self.swap_rates = None
        if num_swap_blocks and config.preemption_mode == "auto":
            self.swap_rates = self._measure_swap_rates()
            self.scheduler.swap_policy = self._swap_is_cheaper
        self.runner.strict_compilation = config.strict_compilation
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._rng = np.random.default_rng(config.seed)
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        self.num_generated_tokens = 0
        self.num_loops_out_of_blocks = 0   # device loops that stopped early for lack of blocks
        self.num_steps = 0
        self.host_seconds = 0.0
        self.device_seconds = 0.0
        self.step_log: list[StepRecord] | None = None  # set to [] to record every step

    def _measure_swap_rates(self) -> dict:
        """The start-up measurements the "auto" preemption policy compares: a swap round trip
        (fixed seconds + seconds per block) and the prefill rate (seconds per token)."""
        runner = self.runner
        typical = -(-self.config.max_model_len // self.config.block_size)
        runner.cache, fixed, per_block = transfer_rate_probe(
            runner.swap_store, runner.cache, min(typical, self.config.num_kv_blocks - 1))
        return {"swap_fixed_seconds": fixed, "swap_seconds_per_block": per_block,
                "prefill_seconds_per_token": runner.measure_prefill_seconds_per_token()}

    def _swap_is_cheaper(self, num_blocks: int, num_tokens: int) -> bool:
        rates = self.swap_rates
        swap = rates["swap_fixed_seconds"] + rates["swap_seconds_per_block"] * num_blocks
        return swap < rates["prefill_seconds_per_token"] * num_tokens

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
    def add_request(self, request_id: str, prompt=None, params: SamplingParams | None = None, *,
                    prompt_token_ids=None, priority: int = 0) -> Request:
        """Queue a request; bad input raises ValueError naming the problem and queues nothing."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params)}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        token_ids = self._prompt_tokens(prompt, prompt_token_ids)
        self._check_fits(token_ids, params)
        request = Request(request_id=request_id, prompt=prompt, prompt_token_ids=token_ids,
                          params=params, seed=request_seed(params, self._rng),
                          arrival_index=next(self._arrivals), priority=priority,
                          stop_id_set=frozenset(self.stop_ids(params)))
        request.sequences[0].detokenizer = self._detokenizer(token_ids, params)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request

    def _prompt_tokens(self, prompt, prompt_token_ids) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass prompt_token_ids")
            token_ids = self.tokenizer.encode(prompt).ids
        else:
            token_ids = [int(t) for t in prompt_token_ids]
        if not token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside [0, {vocab}): {bad[:5]}")
        return token_ids

    def _check_fits(self, token_ids, params: SamplingParams):
        config = self.config
        if len(token_ids) >= config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; max_model_len is "
                             f"{config.max_model_len} (the prompt plus at least one generated "
                             "token must fit)")
        if params.n > config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={config.max_num_seqs}")
        total = min(len(token_ids) + params.max_tokens, config.max_model_len)
        blocks = params.n * -(-total // config.block_size)
        usable = config.num_kv_blocks - 1
        if blocks > usable:
            raise ValueError(f"request needs up to {blocks} KV blocks ({params.n} x {total} "
                             f"tokens) but the pool has only {usable}: it could never run")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs={params.logprobs} exceeds {MAX_LOGPROBS}")

    def _detokenizer(self, prompt_token_ids, params):
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; its blocks return to the pool at once. False if unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        held = [seq for seq in request.live_sequences if self.pipeline.holds(seq)]
        if held:
            for seq in request.live_sequences:
                seq.finish_reason = "abort"
            self._defer_free(held)
            self.scheduler.retire(request)
        else:
            self.scheduler.abort(request_id)
        self._flush_block_ops()
        return True

    def _defer_free(self, sequences: list[Sequence]):
        """Free sequences still live in loops in flight: on the device after the newest of them
        (it is dispatched now), in the mirror after that loop's replay."""
        if sequences:
            self.scheduler.queue_device_free(sequences)
            self.pipeline.defer_frees(sequences)

    def _flush_block_ops(self):
        """Replay the scheduler's queued frees and forks on the device block manager."""
        self.runner.apply_ops(self.scheduler.pending_ops)
        self.scheduler.pending_ops = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request can get: the free stack plus cached blocks no request holds
        (evicted on demand)."""
        cache = self.scheduler.prefix_cache
        return self.mirror.num_free + (cache.num_evictable() if cache else 0)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.pipeline.in_flight is not None

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the outputs of requests that made progress.

        A step of pure decodes runs as one device loop of `num_scheduler_steps` iterations when no
        request is waiting, and as a single ordinary step otherwise (so a waiting request joins
        at the next step: TTFT does not grow with K). With `async_scheduling`, while nothing
        waits, the next loop is dispatched before this one's tokens are processed on the host,
        so the host work overlaps the device; outputs then trail the device by one step.
        """
        start = time.perf_counter()
        if self.pipeline.in_flight is not None:
            rows = self.pipeline.in_flight.rows
            chain = self._loops_to_chain()
            if chain and not self._room_to_chain(chain):
                chain = 0
            self._flush_block_ops()  # evictions that made room land before the next loops
            results, device_freed = self.pipeline.advance(chain=chain)
            is_decode, num_tokens = True, len(rows)
        else:
            schedule = self.scheduler.schedule()
            queued = self.scheduler.waiting or self.scheduler.swapped
            is_loop = bool(schedule.rows) and self._is_pure_decode(schedule) and not queued
            if is_loop:  # iteration 0 is planned; room for the rest
                self.scheduler.make_room_for_loop([row.seq for row in schedule.rows],
                                                  self.config.num_scheduler_steps - 1)
            self._flush_block_ops()
            if not schedule.rows:
                return []
            rows, is_decode, num_tokens = schedule.rows, schedule.is_decode, schedule.num_tokens
            if is_loop:
                self.pipeline.launch(schedule.rows, self.config.num_scheduler_steps)
                if self._loops_to_chain():
                    return []  # this loop's tokens come back with the next step
                results, device_freed = self.pipeline.advance(chain=0)
            else:
                results, device_freed = self._run_step(schedule), []
        device_seconds = self.runner.last_device_seconds
        outputs = self._process(results, device_freed)
        self._flush_block_ops()  # finished sequences' blocks return now, not at the next step
        total_seconds = time.perf_counter() - start
        self.num_steps += 1
        self.device_seconds += device_seconds
        self.host_seconds += total_seconds
        if self.step_log is not None:
            self.step_log.append(StepRecord(
                is_decode, len(rows), num_tokens,
                sum(row.start + row.num_tokens for row in rows),
                sum(len(samples.token_ids) for _, _, samples in results), device_seconds,
                total_seconds - device_seconds, self.runner.last_step_compiled))
        return outputs

    @staticmethod
    def _is_pure_decode(schedule) -> bool:
        return all(row.num_tokens == 1 and row.sample_indices == (row.seq.index,)
                   for row in schedule.rows)

    def _loops_to_chain(self) -> int:
        """How many loops to dispatch now behind the ones in flight, continuing the newest: up to
        `async_depth` left in flight once the oldest is fetched, none unless async scheduling is
        on, nothing waits, the pool did not run dry (preemption needs the scheduler) and the
        newest loop covers every running sequence (a request left out by the token budget must
        not starve), and no more than the rows' budgets need. A loop has a fixed trip count, so
        one chained after every row used up its max_tokens (or max_model_len) would run the whole
        model for nothing: at the end of a batch of equal lengths, depth loops of K iterations."""
        running, pipeline = self.scheduler.running, self.pipeline
        if not (self.config.async_scheduling and not self.scheduler.waiting
                and not self.scheduler.swapped and running and not pipeline.ran_dry
                and pipeline.covers(s for r in running for s in r.live_sequences)):
            return 0
        in_flight = pipeline.steps_in_flight()
        max_model_len = self.config.max_model_len
        budget = max((min(row.request.params.max_tokens
                          - (len(row.seq.token_ids) - row.seq.num_prompt_tokens),
                          max_model_len - len(row.seq.token_ids))
                      for row, keep in zip(pipeline.newest.rows, pipeline.newest.keep)
                      if keep and not row.seq.is_finished), default=0)
        steps = pipeline.newest.launched.static["max_steps"]
        return max(0, min(pipeline.depth + 1 - len(pipeline.loops),
                          -(-(budget - in_flight) // steps)))

    def _room_to_chain(self, num_loops: int) -> bool:
        """Can the free stack serve the loops in flight and num_loops more, evicting cached
        blocks if needed? A loop allocates only from the free stack, so without this a pool full
        of evictable prefix-cache blocks would stop every chained loop early."""
        pipeline = self.pipeline
        released = self.scheduler.room_behind_loop(
            pipeline.live_sequences(),
            pipeline.tokens_behind() + num_loops * pipeline.newest.launched.static["max_steps"])
        if released is None:
            return False
        pipeline.defer_releases(released)
        return True

    def _run_step(self, schedule):
        """One compiled step of any mix; returns [(row, sample_index, samples)]."""
        rows = [(row.seq.slot, row.token_ids) for row in schedule.rows]
        sampling_rows, targets = [], []
        for index, row in enumerate(schedule.rows):
            position = row.start + row.num_tokens
            for sample_index in row.sample_indices:
                sampling_rows.append((index, SamplingRow(row.request.params, row.request.seed,
                                                         sample_index, position)))
                targets.append((row, sample_index))
        num_logprobs = max(row.request.params.logprobs or 0 for row in schedule.rows)
        token_ids, logprobs, top_ids, top_logprobs = self.runner.execute(
            rows, sampling_rows, num_logprobs)
        token_ids, logprobs = token_ids.tolist(), logprobs.tolist()
        return [(row, sample_index, Samples(token_ids[i:i + 1], logprobs[i:i + 1],
                                            top_ids[i:i + 1], top_logprobs[i:i + 1]))
                for i, (row, sample_index) in enumerate(targets)]

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """Token ids that end a sequence on the device: stop_token_ids, and EOS unless ignored."""
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return ids

    def _process(self, results, device_freed: list[Sequence]) -> list[RequestOutput]:
        """Apply sampled tokens: forks at a prompt's end, stops, frees, outputs."""
        touched: dict[str, Request] = {}
        children: dict[str, list[Sequence]] = {}
        finished: list[Sequence] = []
        now = time.monotonic()
        for row, sample_index, samples in results:
            request = row.request
            seq = row.seq
            if sample_index != seq.index:  # the n-1 siblings come to life at the prompt's end
                seq = self._new_child(request, row.seq, sample_index)
                children.setdefault(request.request_id, []).append(seq)
            self._append_samples(request, seq, samples)
            touched[request.request_id] = request
            if seq.is_finished:
                finished.append(seq)
        for seq in device_freed:
            assert seq.is_finished, "the device retired a sequence the host thinks is running"
        for request_id, new in children.items():  # fork before any free: parents may finish
            live = [seq for seq in new if not seq.is_finished]
            if live:
                self.scheduler.fork(touched[request_id], live)
        freed_ids = {id(seq) for seq in device_freed}
        host_finished = [seq for seq in finished if id(seq) not in freed_ids]
        held = [seq for seq in host_finished if self.pipeline.holds(seq)]
        self.scheduler.finish([seq for seq in host_finished if not self.pipeline.holds(seq)])
        self._defer_free(held)
        self.scheduler.release_slots(device_freed)
        outputs = []
        for request in touched.values():
            is_finished = request.is_finished
            if is_finished:
                self.scheduler.retire(request)
                self._requests.pop(request.request_id, None)
            if is_finished or request.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(request))
        return outputs

    def _new_child(self, request: Request, parent: Sequence, sample_index: int) -> Sequence:
        child = Sequence(sample_index, list(parent.token_ids[:parent.num_computed]),
                         parent.num_prompt_tokens)
        child.detokenizer = self._detokenizer(request.prompt_token_ids, request.params)
        request.sequences.append(child)
        request.sequences.sort(key=lambda s: s.index)
        return child

    def _append_samples(self, request, seq: Sequence, samples: Samples):
        """Append a step's or a loop's tokens to seq, up to the first that ends it: a stop
        string (the detokenizer's match), a stop id or EOS, max_tokens or max_model_len."""
        params = request.params
        tokens = samples.token_ids
        room = max(1, min(params.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens),
                          self.config.max_model_len - len(seq.token_ids)))
        stop_ids = request.stop_id_set
        end = next((i + 1 for i, token in enumerate(tokens[:room]) if token in stop_ids),
                   min(room, len(tokens)))
        consumed = seq.detokenizer.num_tokens
        delta, hit_stop_string = seq.detokenizer.append(tokens[:end])
        is_delta = params.output_kind == RequestOutputKind.DELTA
        if is_delta:
            seq.unsent_text += delta
        if hit_stop_string:
            end = seq.detokenizer.num_tokens - consumed
        taken = tokens[:end]
        seq.token_ids.extend(taken)
        seq.cumulative_logprob += sum(samples.logprobs[:end])
        if params.logprobs is not None:
            for i, token in enumerate(taken):
                entry = dict(zip(samples.top_ids[i, :params.logprobs].tolist(),
                                 samples.top_logprobs[i, :params.logprobs].tolist()))
                entry[token] = samples.logprobs[i]
                seq.logprobs.append(entry)
        self.num_generated_tokens += end
        if hit_stop_string or (taken and taken[-1] in stop_ids):
            seq.finish_reason = "stop"
        elif end == room:
            seq.finish_reason = "length"
        if seq.is_finished and not hit_stop_string:
            rest = seq.detokenizer.flush()
            if is_delta:
                seq.unsent_text += rest

    def _output(self, request: Request) -> RequestOutput:
        """The request's output of this step, as its params' output_kind asks: everything so
        far, or (DELTA) the tokens, logprobs and text new since its previous output."""
        want_logprobs = request.params.logprobs is not None
        is_delta = request.params.output_kind == RequestOutputKind.DELTA
        completions = []
        for seq in request.sequences:
            if is_delta:
                start, text = seq.num_prompt_tokens + seq.num_sent, seq.unsent_text
                logprobs = seq.logprobs[seq.num_sent:] if want_logprobs else None
                seq.num_sent, seq.unsent_text = len(seq.token_ids) - seq.num_prompt_tokens, ""
            else:
                start, text = seq.num_prompt_tokens, seq.detokenizer.text
                logprobs = list(seq.logprobs) if want_logprobs else None
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.token_ids[start:],
                cumulative_logprob=seq.cumulative_logprob if want_logprobs else None,
                logprobs=logprobs, finish_reason=seq.finish_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, request.is_finished, request.num_preemptions,
                             request.num_recomputed_tokens, request.num_cached_tokens)

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        runner = self.runner
        store, cache = runner.swap_store, self.scheduler.prefix_cache
        return {
            "num_kv_blocks": self.config.num_kv_blocks,
            "num_free_blocks": self.num_free_blocks,
            "block_size": self.config.block_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_compilations": runner.num_compilations,
            "compile_seconds": runner.compile_seconds,
            "warmup_seconds": self.warmup_seconds,
            "num_swapped": len(self.scheduler.swapped),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_recomputed_tokens": self.scheduler.num_recomputed_tokens,
            "num_swapped_out_blocks": self.scheduler.ledger.num_swapped_out_blocks,
            "num_swapped_in_blocks": self.scheduler.ledger.num_swapped_in_blocks,
            "num_free_swap_blocks": len(self.scheduler.ledger.free_host_blocks),
            "swap_bytes_out": store.bytes_out if store else 0,
            "swap_bytes_in": store.bytes_in if store else 0,
            "prefix_cache_hit_rate": cache.hit_rate if cache else 0.0,
            "num_cached_blocks": len(cache) if cache else 0,
            "num_loops_out_of_blocks": self.num_loops_out_of_blocks,
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            "padding_waste": (runner.num_padded_tokens / runner.num_real_tokens
                              if runner.num_real_tokens else 0.0),
            "host_seconds_per_step": ((self.host_seconds - self.device_seconds) / self.num_steps
                                      if self.num_steps else 0.0),
            "device_seconds_per_step": (self.device_seconds / self.num_steps
                                        if self.num_steps else 0.0),
            "backend": jax.default_backend(),
            "attention_backend": self.config.attention_backend,
        }

