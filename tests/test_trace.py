"""The benchmark trace has the paper's mean lengths and is reproducible."""

import numpy as np

from benchmarks.trace import ALPACA, SHAREGPT, make_trace


def test_sharegpt_and_alpaca_means():
    for spec in (SHAREGPT, ALPACA):
        trace = make_trace(20_000, **spec, seed=1)
        assert abs(np.mean([r.input_len for r in trace]) / spec["input_mean"] - 1) < 0.03
        assert abs(np.mean([r.output_len for r in trace]) / spec["output_mean"] - 1) < 0.03
        assert min(r.input_len for r in trace) >= 4 and max(r.output_len for r in trace) <= 1024


def test_reproducible_and_poisson_arrivals():
    assert make_trace(256, seed=0) == make_trace(256, seed=0)
    arrivals = [r.arrival_time for r in make_trace(2000, seed=2, request_rate=10.0)]
    assert np.all(np.diff(arrivals) >= 0)
    assert abs(arrivals[-1] / 2000 - 0.1) < 0.01
