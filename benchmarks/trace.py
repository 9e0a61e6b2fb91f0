"""The standard request trace of jpaged's benchmarks: ShareGPT-like lengths, fixed seed.

Input and output lengths are drawn from lognormal distributions whose means, after clipping to
[4, 1024], match the vLLM paper's ShareGPT trace (about 161 input and 338 output tokens); the
Alpaca-like variant matches about 19 / 58. Requests arrive all at once (offline) unless a rate is
given, then with Poisson arrivals.
"""

import dataclasses

import numpy as np

SHAREGPT = dict(input_mean=161.0, output_mean=338.0)
ALPACA = dict(input_mean=19.0, output_mean=58.0)
SIGMA = 1.0
CLIP = (4, 1024)


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_time: float
    input_len: int
    output_len: int


def _mu_for_mean(target: float, sigma: float, rng_seed: int = 12345) -> float:
    """The lognormal mu whose clipped mean is target (bisection on a fixed large sample)."""
    normal = np.random.default_rng(rng_seed).standard_normal(200_000)
    low, high = -5.0, 10.0
    for _ in range(60):
        mid = (low + high) / 2
        mean = np.clip(np.round(np.exp(mid + sigma * normal)), *CLIP).mean()
        low, high = (mid, high) if mean < target else (low, mid)
    return (low + high) / 2


def make_trace(num_requests=256, *, input_mean=161.0, output_mean=338.0, seed=0,
               request_rate=None) -> list[TraceRequest]:
    """num_requests requests; request_rate (req/s) None means all arrive at time 0."""
    rng = np.random.default_rng(seed)
    lengths = []
    for mean in (input_mean, output_mean):
        mu = _mu_for_mean(mean, SIGMA)
        lengths.append(np.clip(np.round(np.exp(mu + SIGMA * rng.standard_normal(num_requests))),
                               *CLIP).astype(int))
    if request_rate is None:
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, num_requests))
    return [TraceRequest(float(t), int(i), int(o)) for t, i, o in zip(arrivals, *lengths)]
