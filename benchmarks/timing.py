"""Wall-clock timing shared by the benchmarks, and the table cells they report it in."""

import statistics
import time

import numpy as np


def median_seconds(fn, repeats: int = 5) -> float:
    """Median seconds of fn() over `repeats` calls after one untimed warm call; fn must block
    until its work is done."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def median_dispatch_seconds(fn, arg_sets, *, wait, min_seconds=0.02, repeats=5) -> float:
    """Median seconds per dispatch of fn over rotating arg sets: each set run once first
    (compiled, warmed), then n dispatches and one wait(last output), n doubled until the run
    lasts min_seconds, so a dispatch-bound call is not timed one launch at a time."""
    for args in arg_sets:
        wait(fn(*args))

    def run(n):
        start = time.perf_counter()
        for i in range(n):
            out = fn(*arg_sets[i % len(arg_sets)])
        wait(out)
        return time.perf_counter() - start

    n = 1
    while run(n) < min_seconds and n < 4096:
        n *= 2
    return statistics.median(run(n) / n for _ in range(repeats))


def or_error(fn):
    """fn(), or "error: Type: first line" when it raises: one failing cell (out of memory, an
    unsupported shape) must not stop a table."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 (the cell shows it)
        return f"error: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:80]}"


def us(value) -> str:
    """A table cell: seconds as microseconds, "-" for None, an error string as is."""
    if value is None:
        return "-"
    return f"{value * 1e6:.1f}" if isinstance(value, float) else str(value)
