"""Warm-up: which programs a start compiles, in which order, and the progress line.

Every bucket shape gets a program: for each batch bucket B, decode loops (greedy, random and sort
samplers; with top logprobs greedy and sort, see `batch_arrays.loop_sampler`) and a single decode
step; a mixed step per token bucket T; each with and without top logprobs; one program per block
operation, and the swap transfers. The programs a first request needs (the smallest buckets, no
logprobs, every block operation) are compiled before the engine is ready; the rest are queued
behind them on the compile pool, smallest first, so that the engine serves while they compile.
All-padding inputs change no state, and nothing runs here: programs are lowered and compiled
ahead of time, so the executables warm-up makes are those dispatch calls.
"""

import functools
import sys
import threading

from jpaged.blocks.ops import OPERATIONS, bucket_sizes
from jpaged.sampling import SAMPLER_MODES, SamplingRow
from jpaged.sampling_params import SamplingParams

_MODE_ROWS = {  # a row that needs exactly this sampler mode
    "greedy": SamplingRow(SamplingParams(temperature=0.0), 0, 0, 0),
    "random": SamplingRow(SamplingParams(temperature=1.0), 0, 0, 0),
    "sort": SamplingRow(SamplingParams(temperature=1.0, top_p=0.5), 0, 0, 0)}


def _loop_call(executor, batch: int, mode: str, logprobs: int, max_steps, max_model_len):
    inputs = executor.decode_inputs([(-1, 0)] * batch, [_MODE_ROWS[mode]] * batch, [0] * batch,
                                    [[]] * batch, 1, max_steps, max_model_len, logprobs)
    return executor.loop_call(*inputs)


def _step_call(executor, size: int, logprobs: int, is_decode: bool):
    # One padded row per token bucket (seq -1 appends nothing, writes are dropped), or a batch
    # of padded one-token rows for a single decode step.
    rows = [(-1, [0])] * size if is_decode else [(-1, [0] * size)]
    return executor.step_call(rows, [(0, _MODE_ROWS["greedy"])], logprobs)


def program_calls(executor, *, max_steps: int, max_model_len: int) -> list[tuple]:
    """[(is_first, (key, program, args, static))] for every bucket program, in compile order:
    a first request's programs, then by logprobs, then by size."""
    batches = bucket_sizes(4, executor.max_num_seqs)
    tokens = bucket_sizes(min(128, executor.max_num_batched_tokens),
                          executor.max_num_batched_tokens)
    calls = []
    for logprobs in (0, 1):
        modes = SAMPLER_MODES if not logprobs else ("greedy", "sort")
        for index, batch in enumerate(batches):
            is_first = not logprobs and index == 0
            calls += [(is_first, _loop_call(executor, batch, mode, logprobs, max_steps,
                                            max_model_len)) for mode in modes]
            calls.append((is_first, _step_call(executor, batch, logprobs, True)))
        # The largest step is needed early when the start measures the prefill rate.
        for size in sorted(tokens, key=lambda size: (size != tokens[-1], size)):
            calls.append((not logprobs and size == tokens[0],
                          _step_call(executor, size, logprobs, False)))
    return sorted(calls, key=lambda call: not call[0])   # stable: first ones, then the order


def compile_programs(executor, *, max_steps: int, max_model_len: int, first_only: bool,
                     progress: bool):
    """Compile a first request's programs on the executor's compile pool, and the block
    operations here meanwhile; once they exist, queue the rest and return (first_only: not
    them). The rest keep compiling in the background, so they take no pool thread from the
    first ones."""
    calls = program_calls(executor, max_steps=max_steps, max_model_len=max_model_len)
    first = [call for is_first, call in calls if is_first]
    rest = [] if first_only else [call for is_first, call in calls if not is_first]
    reporter = Progress(executor.programs, len(calls if not first_only else first)
                        + len(OPERATIONS), progress)
    futures = [executor.programs.submit(*call) for call in first]
    for call, future in zip(first, futures):
        future.add_done_callback(functools.partial(reporter.done, call[0]))
    for operation in OPERATIONS:
        submitting = _Submitting(executor)
        operation.warm_up(submitting)
        futures += submitting.futures
        _when_all_done(submitting.futures, functools.partial(reporter.done, (operation.kind,)))
    for future in futures:
        future.result()
    for call in rest:
        executor.programs.submit(*call).add_done_callback(
            functools.partial(reporter.done, call[0]))
    executor.num_padded_tokens = executor.num_real_tokens = 0


class _Submitting:
    """The executor as a block operation sees it at warm-up: a dispatch queues its program on
    the compile pool and returns its first argument (the manager or cache that an operation on
    padding returns unchanged), so the operations' programs compile (or load) side by side with
    a first request's instead of one after another on this thread."""

    def __init__(self, executor):
        self._executor = executor
        self.futures = []

    def __getattr__(self, name):
        return getattr(self._executor, name)

    def dispatch(self, key: tuple, program, *args, **static):
        self.futures.append(self._executor.programs.submit(key, program, args, static))
        return args[0]


def _when_all_done(futures: list, callback):
    """callback() once every future is done (at once when there are none)."""
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    if not futures:
        callback()
    for future in futures:
        future.add_done_callback(one_done)


class Progress:
    """One line on the terminal: programs ready of all, persistent-cache hits, compile seconds,
    and the last program done (its key: kind and shape buckets)."""

    def __init__(self, programs, total: int, is_shown: bool):
        self.programs, self.total, self.is_shown = programs, total, is_shown
        self.count = 0
        self._lock = threading.Lock()

    def done(self, key: tuple, *_):
        with self._lock:
            self.count += 1
            if not self.is_shown:
                return
            programs = self.programs
            end = "\n" if self.count == self.total else ""
            print(f"\rjpaged: compiled {self.count}/{self.total} programs "
                  f"({programs.num_cache_hits} from the compilation cache, "
                  f"{programs.compile_seconds:.1f} s compiling; last: "
                  f"{' '.join(map(str, key))})", end=end, file=sys.stderr, flush=True)
