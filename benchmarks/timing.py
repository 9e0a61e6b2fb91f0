"""Wall-clock timing shared by the benchmarks."""

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
