"""Comparing the logprobs of two different requests: tokens exactly, float32 results to a tolerance.

Two requests that produce the same tokens still run in differently batched and chunked steps (a
request beside them, a prefix-cache hit, prompt logprobs computed too), so XLA sums their float32
results in other orders and a logprob may differ in the 7th significant digit
(-3.7172932624816895 vs -3.7172935009002686 was seen). Exact equality is to be expected only under
a batch-invariant mode, which jpaged does not have yet.
"""

import math

# About 40 times the largest difference seen, and far below what a wrong logprob is off by.
ACROSS_REQUESTS_ATOL = 1e-5


def assert_equal_but_floats_close(actual, expected, atol: float = ACROSS_REQUESTS_ATOL,
                                  where: str = "reply"):
    """`actual == expected` for JSON-like values (dicts, lists, strings, ints: token texts, ids,
    bytes and offsets compare exactly), except that floats may differ by `atol`."""
    if isinstance(expected, float) or isinstance(actual, float):
        assert isinstance(actual, (int, float)) and isinstance(expected, (int, float)) \
            and not isinstance(actual, bool) and not isinstance(expected, bool), \
            f"{where}: {actual!r} != {expected!r}"
        assert math.isclose(actual, expected, rel_tol=0.0, abs_tol=atol), \
            f"{where}: {actual!r} and {expected!r} differ by more than {atol}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), \
            f"{where}: {actual!r} != {expected!r}"   # as ==, key order aside
        for key in expected:
            assert_equal_but_floats_close(actual[key], expected[key], atol, f"{where}[{key!r}]")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), \
            f"{where}: {actual!r} != {expected!r}"
        for index, (got, wanted) in enumerate(zip(actual, expected)):
            assert_equal_but_floats_close(got, wanted, atol, f"{where}[{index}]")
    else:
        assert type(actual) is type(expected) and actual == expected, \
            f"{where}: {actual!r} != {expected!r}"
