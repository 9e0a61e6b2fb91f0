"""AsyncEngine: drives one LLMEngine on its own thread for asyncio callers (the HTTP server).

The engine is not thread-safe, so only the engine thread touches it. Callers send commands
(add, abort) through a queue and get each request's outputs on an asyncio queue of their own
(`OutputSink`). The thread steps while work exists and blocks on the command queue when idle, so
an idle server uses no CPU. New requests join the running batch at the next step.

Per-request events reach the sink as:
  ("accepted", request_id, None)       the engine queued it
  ("error", request_id, ValueError)    rejected by add_request (nothing was queued), or failed
                                       by an engine error (an EngineError; its blocks were freed),
                                       or refused because the engine is dead (EngineDeadError)
  ("output", request_id, RequestOutput) progress; the last one has finished=True

A failed step fails the requests in flight and the engine carries on. The engine is dead once
MAX_CONSECUTIVE_STEP_FAILURES steps failed in a row or the thread itself stopped on an error:
the requests in flight fail, every later `add` is refused at once, and `dead_reason` says why
(the server then answers /health 503 and exits: `cli.main`). `stop` ends the thread the same way.

The outputs are of the kind the request's params ask for: the server streams DELTA outputs and
collects CUMULATIVE ones for a full reply; the token counts here (latency histograms, usage) read
either.
"""

import asyncio
import logging
import queue
import threading
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jpaged.engine.llm_engine import LLMEngine
from jpaged.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

# One failed step may be a transient fault or one bad batch, and only its requests fail; this many
# in a row, with no step succeeding between them, mean the engine cannot make progress, and a
# server that kept accepting work would fail all of it.
MAX_CONSECUTIVE_STEP_FAILURES = 3
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineError(RuntimeError):
    """The engine failed while this request was in flight."""


class EngineDeadError(EngineError):
    """The engine can no longer run steps, so the request was not queued (the server's 503)."""


class OutputSink:
    """Where one HTTP handler receives the events of its request(s), on its own event loop."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: tuple):  # called from the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def get(self) -> tuple:
        return await self._queue.get()


class _OutputTokenCounts:
    """Output tokens of each sequence of one request so far, read from its outputs in order:
    a DELTA output adds its tokens, any other kind holds them all."""

    def __init__(self, params):
        self._is_delta = params.output_kind == RequestOutputKind.DELTA
        self._counts: dict[int, int] = {}  # sample index -> output tokens

    def update(self, output):
        for completion in output.outputs:
            before = self._counts.get(completion.index, 0) if self._is_delta else 0
            self._counts[completion.index] = before + len(completion.token_ids)

    @property
    def longest(self) -> int:
        return max(self._counts.values(), default=0)

    @property
    def total(self) -> int:
        return sum(self._counts.values())


class RequestGroup:
    """The engine requests of one API call (one per prompt), read from one sink.

    Create it inside the caller's event loop; it queues its requests at once. Call
    `abort_unfinished` when the caller goes away (it is a no-op once everything finished).
    `num_prompt_tokens` and `num_output_tokens` (so far) are the call's usage.
    """

    def __init__(self, async_engine: "AsyncEngine", request_ids: list[str], params,
                 prompts: list[list[int]]):
        self._engine = async_engine
        self._sink = OutputSink()
        self.request_ids = list(request_ids)
        self._index = {request_id: i for i, request_id in enumerate(self.request_ids)}
        self._latest: list = [None] * len(self.request_ids)  # latest RequestOutput per prompt
        self._counts = [_OutputTokenCounts(params) for _ in self.request_ids]
        self.num_prompt_tokens = sum(len(prompt) for prompt in prompts)
        self._unfinished = set(self.request_ids)
        self._early: list[tuple] = []  # outputs that came before every request was accepted
        for request_id, prompt in zip(self.request_ids, prompts):
            async_engine.add(self._sink, request_id, params, prompt_token_ids=prompt)

    async def accepted(self):
        """Wait until the engine queued every request; a rejection aborts the others and raises
        its ValueError."""
        waiting = set(self.request_ids)
        while waiting:
            kind, request_id, payload = await self._sink.get()
            if kind == "error":
                self._unfinished.discard(request_id)
                self.abort_unfinished()
                raise payload
            if kind == "accepted":
                waiting.discard(request_id)
            else:
                self._early.append((kind, request_id, payload))

    async def events(self):
        """Yield (prompt index, RequestOutput) until every request finished; an engine failure
        raises EngineError."""
        while self._unfinished:
            kind, request_id, payload = (self._early.pop(0) if self._early
                                         else await self._sink.get())
            if kind == "error":
                self._unfinished.discard(request_id)
                self.abort_unfinished()
                raise payload if isinstance(payload, EngineError) else EngineError(str(payload))
            index = self._index[request_id]
            self._latest[index] = payload
            self._counts[index].update(payload)
            if payload.finished:
                self._unfinished.discard(request_id)
            yield index, payload

    @property
    def num_output_tokens(self) -> int:
        return sum(counts.total for counts in self._counts)

    async def final_outputs(self) -> list:
        """Every prompt's last output, in prompt order: the whole result if the outputs are
        CUMULATIVE (or FINAL_ONLY), only the last delta if DELTA."""
        async for _ in self.events():
            pass
        return self._latest

    def abort_unfinished(self):
        for request_id in sorted(self._unfinished):
            self._engine.abort(request_id)
        self._unfinished.clear()


class _Tracked:
    """Timing of one in-flight request, for the TTFT / TPOT / end-to-end histograms."""
    __slots__ = ("sink", "arrival", "last_output", "counts")

    def __init__(self, sink: OutputSink, arrival: float, params):
        self.sink, self.arrival, self.last_output = sink, arrival, None
        self.counts = _OutputTokenCounts(params)


class AsyncEngine:
    """Owns the engine thread. `add` / `abort` may be called from any thread or event loop."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServingMetrics(self)
        self._commands: queue.Queue = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._num_prompt_tokens = 0   # of accepted requests
        self._num_finished = 0        # requests that ran to the end (not aborted or failed)
        self.num_engine_errors = 0    # failed steps and add_requests, and the loop's own failure
        self._num_failed_in_a_row = 0  # steps
        self._dead_reason: str | None = None  # set once by the engine thread: it died or stopped
        self.snapshot = self._stats()  # replaced (never mutated) by the engine thread
        self._thread = threading.Thread(target=self._run, name="jpaged-engine", daemon=True)

    # ---- caller side --------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0):
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can no longer run steps; None while it can (and before `start`)."""
        if self._dead_reason is not None:
            return self._dead_reason
        if self._thread.ident is not None and not self._thread.is_alive():
            return "the engine loop is not running"
        return None

    def add(self, sink: OutputSink, request_id: str, params, *, prompt_token_ids: list[int]):
        """Queue a request; its events go to `sink` (see the module docstring)."""
        self._commands.put(("add", sink, request_id, params, list(prompt_token_ids),
                            time.monotonic()))
        if self._dead_reason is not None:   # no thread reads the queue any more
            self._refuse_queued()

    def abort(self, request_id: str):
        """Stop a request; its blocks return to the pool as soon as the engine thread reads this
        (between two steps)."""
        self._commands.put(("abort", request_id))

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self):
        try:
            self._loop()
        except BaseException as err:  # outside step and add_request: the loop cannot go on
            logger.exception("the engine loop failed")
            if self._dead_reason is None:
                self.num_engine_errors += 1
                self._die(f"the engine loop failed: {type(err).__name__}: {err}")

    def _loop(self):
        while self._dead_reason is None:
            block = not self.engine.has_unfinished()  # idle: sleep until a command comes
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    self._dead_reason = "the server is shutting down"
                    self._fail_all(EngineError(self._dead_reason))
                    self._refuse_queued()
                    return
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished():
                self._step()
            self.snapshot = self._stats()

    def _apply(self, command: tuple):
        if command[0] == "abort":
            self._tracked.pop(command[1], None)
            self.engine.abort(command[1])
            return
        _, sink, request_id, params, prompt_token_ids, arrival = command
        try:
            self.engine.add_request(request_id, params=params, prompt_token_ids=prompt_token_ids)
        except ValueError as err:  # bad input: the caller's 400
            sink.put(("error", request_id, err))
            return
        except Exception as err:  # an engine bug this request hit: fail it alone
            logger.exception("add_request failed for %s", request_id)
            self.num_engine_errors += 1
            self._abort_quietly(request_id)
            self._deliver([(sink, ("error", request_id, EngineError(f"engine error: {err}")))])
            return
        self._tracked[request_id] = _Tracked(sink, arrival, params)
        self._num_prompt_tokens += len(prompt_token_ids)
        sink.put(("accepted", request_id, None))

    def _step(self):
        try:
            outputs = self.engine.step()
        except Exception as err:  # one failed step must not take the server down; a few must
            logger.exception("engine step failed; failing the requests in flight")
            self.num_engine_errors += 1
            self._num_failed_in_a_row += 1
            if self._num_failed_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
                self._die(f"{self._num_failed_in_a_row} engine steps failed in a row, the last "
                          f"with {type(err).__name__}: {err}")
            else:
                self._fail_all(EngineError(f"engine error: {err}"))
            return
        self._num_failed_in_a_row = 0
        now = time.monotonic()
        deliveries = []
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:  # aborted after this step was scheduled
                continue
            if output.error is not None:  # the engine failed this request alone
                del self._tracked[output.request_id]
                deliveries.append((tracked.sink, ("error", output.request_id,
                                                  EngineError(f"engine error: {output.error}"))))
                continue
            self.metrics.observe_progress(tracked, output, now)
            deliveries.append((tracked.sink, ("output", output.request_id, output)))
            if output.finished:
                del self._tracked[output.request_id]
                self._num_finished += 1
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[OutputSink, tuple]]):
        """Take a stats snapshot, then hand out the events: a caller that saw its request end
        (finished or failed) then sees the metrics without its blocks."""
        try:
            self.snapshot = self._stats()
        except Exception:   # the events must go out even from a broken engine
            logger.exception("engine stats failed")
        for sink, event in deliveries:
            sink.put(event)

    def _die(self, reason: str):
        """Mark the engine dead (first, so a caller told of its failure sees a dead engine), fail
        the requests in flight and refuse those still queued; the loop then ends."""
        logger.error("the engine is dead: %s", reason)
        self._dead_reason = reason
        self._fail_all(EngineError(f"engine error: {reason}"))
        self._refuse_queued()

    def _refuse_queued(self):
        """Refuse every queued add (aborts have nothing left to stop). Both the dying engine
        thread and a late `add` call this: each command is taken from the queue once."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[1].put(("error", command[2], EngineDeadError(
                    f"the engine is not running: {self._dead_reason}")))

    def _fail_all(self, err: Exception):
        failed = list(self._tracked.items())
        self._tracked.clear()
        for request_id, _ in failed:
            self._abort_quietly(request_id)
        self._deliver([(tracked.sink, ("error", request_id, err))
                       for request_id, tracked in failed])

    def _abort_quietly(self, request_id: str):
        """Abort after an engine error; a second error is logged, not allowed to stop the thread."""
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of %s failed after an engine error", request_id)

    def _stats(self) -> dict:
        stats = self.engine.stats()
        stats["num_used_blocks"] = stats["num_kv_blocks"] - 1 - stats["num_free_blocks"]
        stats["num_prompt_tokens"] = self._num_prompt_tokens
        stats["num_finished_requests"] = self._num_finished
        return stats


class ServingMetrics:
    """Prometheus metrics, vLLM's names where vLLM has one (`vllm:`), else `jpaged:`.

    Gauges and counters are read from the engine thread's latest stats snapshot at scrape time;
    the latency histograms are observed by the engine thread as outputs arrive.
    """

    def __init__(self, async_engine: AsyncEngine):
        self._async_engine = async_engine
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Time per output token (between two outputs of a request)",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        for histogram in (self.ttft, self.tpot, self.e2e):  # exported (as zeros) from the start
            histogram.labels(async_engine.model_name)
        self.registry.register(_SnapshotCollector(async_engine))

    def observe_progress(self, tracked: _Tracked, output, now: float):
        name = self._async_engine.model_name
        before = tracked.counts.longest  # output tokens of the longest sequence so far
        tracked.counts.update(output)
        num_new = tracked.counts.longest - before
        if tracked.last_output is None:
            self.ttft.labels(name).observe(now - tracked.arrival)
        elif num_new > 0:  # a multi-step decode may bring several tokens
            per_token = (now - tracked.last_output) / num_new
            for _ in range(num_new):
                self.tpot.labels(name).observe(per_token)
        tracked.last_output = now
        if output.finished:
            self.e2e.labels(name).observe(now - tracked.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Gauges and counters from the engine thread's last stats snapshot."""

    def __init__(self, async_engine: AsyncEngine):
        self._async_engine = async_engine

    def collect(self):
        stats, name = self._async_engine.snapshot, self._async_engine.model_name
        usable = stats["num_kv_blocks"] - 1
        gauges = [
            ("vllm:num_requests_running", "Requests in the running batch", stats["num_running"]),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled",
             stats["num_waiting"]),
            ("vllm:num_requests_swapped", "Requests whose KV blocks are swapped to the host",
             stats["num_swapped"]),
            ("vllm:gpu_cache_usage_perc", "Fraction of KV blocks in use (1 = full)",
             stats["num_used_blocks"] / usable if usable else 0.0),
            ("vllm:gpu_prefix_cache_hit_rate", "Prefix-cache hit rate (hit tokens / looked-up "
             "prompt tokens)", stats["prefix_cache_hit_rate"]),
            ("jpaged:num_kv_blocks_cached", "KV blocks indexed by the prefix cache (held by "
             "requests or evictable)", stats["num_cached_blocks"]),
            ("jpaged:num_kv_blocks_used", "KV blocks held by requests", stats["num_used_blocks"]),
            ("jpaged:num_kv_blocks_free", "KV blocks free", stats["num_free_blocks"]),
            ("jpaged:num_kv_blocks_total", "KV blocks in the pool (the sink block excluded)",
             usable),
        ]
        for metric, doc, value in gauges:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
        counters = [
            ("vllm:num_preemptions", "Preemptions since start", stats["num_preemptions"]),
            ("jpaged:swapped_out_blocks", "KV blocks swapped to the host since start",
             stats["num_swapped_out_blocks"]),
            ("jpaged:swap_out_bytes", "Bytes swapped to the host since start",
             stats["swap_bytes_out"]),
            ("jpaged:swap_in_bytes", "Bytes swapped back from the host since start",
             stats["swap_bytes_in"]),
            ("jpaged:recomputed_tokens", "Tokens prefilled again after recompute preemption",
             stats["num_recomputed_tokens"]),
            ("vllm:generation_tokens", "Generated tokens since start",
             stats["num_generated_tokens"]),
            ("vllm:prompt_tokens", "Prompt tokens of accepted requests since start",
             stats["num_prompt_tokens"]),
            ("vllm:request_success", "Requests that finished (stop or length)",
             stats["num_finished_requests"]),
            ("jpaged:engine_errors", "Engine failures since start: failed steps, add_request "
             "errors other than bad input, and the engine loop's own failure",
             self._async_engine.num_engine_errors),   # live: the last snapshot may predate it
        ]
        for metric, doc, value in counters:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric([name], value)
            yield family
