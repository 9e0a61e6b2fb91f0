"""Where a constrained decode loop's time goes on one GPU: the host callback that advances the
constrained rows' matchers after every iteration (`structured_outputs.LoopMatchers.advance`),
measured apart from everything else, then in the engine.

micro: a jitted loop of 8 iterations, each `--layers` matmuls of [64, D] x [D, D] (bf16,
  D = `--hidden`) with a SiLU, plain or ending each iteration in an `io_callback` that returns
  64 int32 ("small") or a [64, 4008] int32 mask (a 128k vocabulary's bitmask rows, "mask").
  Per variant: the loop's time, how long the dispatching call took to return (a plain loop's
  call returns as soon as it is queued), and the median time between two callbacks of one
  loop (an iteration's time with its callback). With `busy`, the calling thread runs Python
  for 30 ms after the call returns (a host processing results), at the interpreter's switch
  interval given; with `threaded`, the loop is dispatched from a thread of its own (as the
  engine dispatches a constrained loop), so the calling thread is busy while the loop runs and
  its callbacks wait for the interpreter's lock.
engine: `benchmarks/structured.py`'s batch (Llama-3-8B shape, random bf16 weights, 64 requests
  of 128 random prompt tokens, temperature 1, 256 tokens, K = 8, asynchronous scheduling), all
  rows unconstrained and then 16 of them constrained by its "enum" schema (that row twice).
  Per row: tokens/s, the summed and largest time the engine's loop launches held the calling
  thread, the callbacks' median duration, and the time between consecutive callbacks (median,
  10th and 90th percentiles: within a loop an iteration, across loops also the host's work
  between them).

Usage: python benchmarks/constrained_loop.py {micro,engine} [--tokenizer tokenizer.json]
  (the tokenizer: `benchmarks/structured.py`'s `train_tokenizer`; trained here when omitted)
"""

import argparse
import concurrent.futures
import gc
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged import structured_outputs  # noqa: E402
from jpaged.engine import executor as executor_module  # noqa: E402
from jpaged.engine import llm_engine  # noqa: E402

ROWS, MASK_WORDS, ITERATIONS = 64, 4008, 8


def micro_loop(kind: str, layers: int, stamps: list):
    def mask(values):
        stamps.append(time.perf_counter())
        return np.full((ROWS, MASK_WORDS), -1, np.int32)

    def small(values):
        stamps.append(time.perf_counter())
        return np.zeros((ROWS,), np.int32)

    def loop(x, weights):
        def body(step, carry):
            x, total = carry
            for layer in range(layers):
                x = jax.nn.silu(x @ weights[layer]) * 0.5 + x
            values = x[:, 0].astype(jnp.int32)
            if kind == "mask":
                total = total + io_callback(mask, jax.ShapeDtypeStruct((ROWS, MASK_WORDS),
                                                                       jnp.int32),
                                            values, ordered=False)[:, 0]
            elif kind == "small":
                total = total + io_callback(small, jax.ShapeDtypeStruct((ROWS,), jnp.int32),
                                            values, ordered=False)
            return x, total
        return jax.lax.fori_loop(0, ITERATIONS, body, (x, jnp.zeros(ROWS, jnp.int32)))

    return jax.jit(loop)


def micro(args) -> list[dict]:
    x = jnp.ones((ROWS, args.hidden), jnp.bfloat16) * 0.01
    weights = [jax.random.normal(jax.random.key(layer), (args.hidden, args.hidden),
                                 jnp.bfloat16) * 0.01 for layer in range(args.layers)]
    rows, stamps = [], []
    launcher = concurrent.futures.ThreadPoolExecutor(1)
    for kind in ("none", "small", "mask"):
        loop = micro_loop(kind, args.layers, stamps)
        jax.block_until_ready(loop(x, weights))
        variants = ([(False, False, 0.005)] if kind == "none"
                    else [(False, busy, interval) for busy in (False, True)
                          for interval in (0.005, 2e-4)]
                    + [(True, True, interval) for interval in (0.005, 2e-4)])
        for threaded, busy, interval in variants:
            sys.setswitchinterval(interval)
            times, calls, gaps = [], [], []
            for _ in range(15):
                stamps.clear()
                start = time.perf_counter()
                out = launcher.submit(loop, x, weights) if threaded else loop(x, weights)
                calls.append(time.perf_counter() - start)
                if busy:
                    end = time.perf_counter() + 0.03
                    while time.perf_counter() < end:
                        sum(range(100))
                jax.block_until_ready(out.result() if threaded else out)
                times.append(time.perf_counter() - start)
                if len(stamps) == ITERATIONS:
                    gaps.append((stamps[-1] - stamps[0]) / (ITERATIONS - 1))
            sys.setswitchinterval(0.005)
            row = dict(kind=kind, threaded=threaded, busy=busy, interval=interval,
                       loop_ms=float(np.median(times) * 1e3),
                       call_returns_ms=float(np.median(calls) * 1e3),
                       iteration_ms=float(np.median(gaps) * 1e3) if gaps else None)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


class Timings:
    """The engine's loop launches, loop dispatches (on the launcher thread), matcher callbacks,
    steps and result fetches, timed where they run."""

    def __init__(self):
        self.launches, self.callbacks = [], []
        self.dispatches, self.steps, self.fetches = [], [], []
        advance = structured_outputs.LoopMatchers.advance
        Executor, LLMEngine = executor_module.Executor, llm_engine.LLMEngine

        def timed(cls, name, into, with_start=False):
            method = getattr(cls, name)

            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                out = method(*args, **kwargs)
                end = time.perf_counter()
                into.append((start, end) if with_start else end - start)
                return out
            setattr(cls, name, wrapper)

        def timed_advance(matchers, *args):
            start = time.perf_counter()
            out = advance(matchers, *args)
            self.callbacks.append((start, time.perf_counter() - start))
            return out

        # Before any engine exists: a loop's executable holds the callback it was traced with.
        structured_outputs.LoopMatchers.advance = timed_advance
        timed(Executor, "_launch", self.launches)
        timed(Executor, "_dispatch_loop", self.dispatches, with_start=True)
        timed(Executor, "fetch_decode", self.fetches, with_start=True)
        timed(LLMEngine, "step", self.steps, with_start=True)

    def clear(self):
        for timings in (self.launches, self.callbacks, self.dispatches, self.steps, self.fetches):
            timings.clear()

    def boundaries(self) -> dict:
        """Medians (ms) at the boundary of two consecutive constrained loops dispatched on the
        launcher thread: the first loop's call returning after its last callback, the next
        dispatch starting after that, and its first callback coming after its dispatch began
        (the loop's first iteration and what precedes it)."""
        dispatches = sorted(self.dispatches)
        stamps = np.array(sorted(start for start, _ in self.callbacks))
        after_last, between, to_first = [], [], []
        for (start, end), (next_start, next_end) in zip(dispatches, dispatches[1:]):
            inside = stamps[(stamps >= start) & (stamps <= end)]
            following = stamps[(stamps >= next_start) & (stamps <= next_end)]
            if len(inside) and len(following):
                after_last.append(end - inside[-1])
                between.append(next_start - end)
                to_first.append(following[0] - next_start)
        median = (lambda values: float(np.median(values) * 1e3) if values else None)
        return dict(after_last_callback_ms=median(after_last), between_dispatches_ms=median(between),
                    to_first_callback_ms=median(to_first))

    def host_busy_ms(self) -> float:
        """The median step's time on the engine's thread less its waits for loop results."""
        busy = []
        for start, end in self.steps:
            waits = sum(min(e, end) - max(s, start) for s, e in self.fetches
                        if s < end and e > start)
            busy.append(end - start - waits)
        return float(np.median(busy) * 1e3) if busy else 0.0


def engine(args) -> list[dict]:
    import tokenizers

    from benchmarks.structured import (SCHEMAS, batch_inputs, build_engine, constrained_params,
                                       run_batch, train_tokenizer)
    from jpaged.config import ModelConfig

    timings = Timings()
    config = ModelConfig.preset(args.model)
    tokenizer = (tokenizers.Tokenizer.from_file(args.tokenizer) if args.tokenizer
                 else train_tokenizer(config.vocab_size, Path(args.out_dir) / "tokenizer.json"))
    model, prompts, plain = batch_inputs(config, ROWS, 256)
    constrained = constrained_params(plain, SCHEMAS["enum"])
    mixed = [constrained] * 16 + [plain] * (ROWS - 16)
    run = build_engine(model, tokenizer, argparse.Namespace(batch=ROWS), 8)
    rows = []
    for name, params, interval in (("none", [plain] * ROWS, 0.005), ("enum 25%", mixed, 0.005),
                                   ("enum 25%, again", mixed, 0.005),
                                   ("enum 25%, switch interval 0.2 ms", mixed, 2e-4)):
        run_batch(run, prompts, params, f"warm {name}")
        timings.clear()
        sys.setswitchinterval(interval)
        result = run_batch(run, prompts, params, f"timed {name}")
        sys.setswitchinterval(0.005)
        starts = np.array([start for start, _ in timings.callbacks])
        gaps = np.diff(starts) * 1e3 if len(starts) > 1 else np.zeros(1)
        row = dict(name=name, tokens=result["tokens"], seconds=result["wall"],
                   tokens_per_s=result["tokens"] / result["wall"],
                   launches=len(timings.launches), launches_held_s=sum(timings.launches),
                   longest_launch_ms=max(timings.launches, default=0.0) * 1e3,
                   callbacks=len(timings.callbacks),
                   callback_ms=(float(np.median([d for _, d in timings.callbacks]) * 1e3)
                                if timings.callbacks else None),
                   gap_ms=[float(np.percentile(gaps, q)) for q in (50, 10, 90)],
                   steps=len(timings.steps), host_busy_ms=timings.host_busy_ms(),
                   **timings.boundaries())
        print(json.dumps(row), flush=True)
        rows.append(row)
    del run
    gc.collect()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description="a constrained decode loop's time")
    parser.add_argument("part", choices=("micro", "engine"))
    parser.add_argument("--hidden", type=int, default=4096, help="micro: matmul size")
    parser.add_argument("--layers", type=int, default=48, help="micro: matmuls per iteration")
    parser.add_argument("--model", default="llama3-8b", help="engine: preset")
    parser.add_argument("--tokenizer", default=None, help="engine: a tokenizer.json to use")
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = micro(args) if args.part == "micro" else engine(args)
    (Path(args.out_dir) / f"constrained_loop_{args.part}.json").write_text(
        json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
