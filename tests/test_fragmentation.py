"""The fragmentation study's replay (benchmarks/kv_replay.py): the first-fit arena, hand-worked
occupancy for each allocator, and accounting invariants on a small ShareGPT-like trace."""

import pytest

from benchmarks.kv_replay import (CATEGORIES, FirstFitArena, Occupancy, replay_contiguous,
                                  replay_paged, summarize)
from benchmarks.trace import SHAREGPT, TraceRequest, make_trace


def test_first_fit_takes_the_first_hole_and_merges_on_free():
    arena = FirstFitArena(12)
    assert [arena.allocate(4) for _ in range(3)] == [0, 4, 8]
    assert arena.allocate(1) is None
    arena.free(4, 4)
    arena.free(0, 4)                      # merges with the right neighbour
    assert (arena.starts, arena.sizes) == ([0], [8])
    assert arena.allocate(3) == 0 and arena.allocate(5) == 3
    arena.free(0, 3)
    arena.free(8, 4)
    assert arena.num_free == 7 and arena.allocate(4) == 8   # 7 free, but the 3-hole is skipped
    arena.free(3, 5)                      # merges with both neighbours
    assert (arena.starts, arena.sizes) == ([0], [8])


def test_contiguous_max_length_by_hand():
    """Capacity 8, max length 4: two requests of 1 prompt + 3 outputs fit, the third waits."""
    trace = [TraceRequest(0.0, 1, 3)] * 3
    records = replay_contiguous(trace, capacity=8, max_model_len=4, reserve_max=True)
    # step 0: two admitted, kv 1 each, final length 3 each (1 + 3 - 1): reserved 2, internal 1
    assert records[0] == Occupancy(2, 4, 2, 0, 0, 0, in_flight=2, waiting=1)
    assert records[2] == Occupancy(6, 0, 2, 0, 0, 0, in_flight=2, waiting=1)
    assert records[3] == Occupancy(1, 2, 1, 0, 4, 0, in_flight=1, waiting=0)
    assert len(records) == 6


def test_contiguous_final_length_fragments():
    """Capacity 10: A (5 slots) and B (3) run; A leaves; C needs 6 of the 7 free slots, but the
    holes are 5 and 2 wide: external fragmentation until B leaves."""
    trace = [TraceRequest(0.0, 4, 2), TraceRequest(0.0, 1, 3), TraceRequest(1.0, 6, 1)]
    records = replay_contiguous(trace, capacity=10, max_model_len=10, reserve_max=False)
    assert records[1] == Occupancy(7, 1, 0, 2, 0, 0, in_flight=2, waiting=1)
    assert records[2] == Occupancy(3, 0, 0, 7, 0, 0, in_flight=1, waiting=1)
    assert records[3] == Occupancy(6, 0, 0, 0, 4, 0, in_flight=1, waiting=0)
    assert len(records) == 4


def test_paged_block_occupancy_by_hand():
    """Blocks of 4, capacity 16 (3 usable blocks and the sink): prompt 3, output 4."""
    trace = [TraceRequest(0.0, 3, 4)]
    records, preemptions = replay_paged(trace, capacity=16, block_size=4, max_model_len=16,
                                        watermark=0.0)
    assert preemptions == 0
    # step 0: 3 tokens in one block; final length 6 -> reserved 1 (slot 4 of block 1)
    assert records[0] == Occupancy(3, 1, 0, 0, 8, 4, in_flight=1, waiting=0)
    assert records[1] == Occupancy(4, 0, 0, 0, 8, 4, in_flight=1, waiting=0)
    # step 2: 5 tokens in two blocks; 6 will be used -> reserved 1, internal 2
    assert records[2] == Occupancy(5, 1, 2, 0, 4, 4, in_flight=1, waiting=0)
    assert len(records) == 4


@pytest.fixture(scope="module")
def small_study():
    trace = make_trace(120, **SHAREGPT, seed=3, request_rate=2.0)
    contiguous = replay_contiguous(trace, capacity=16384, max_model_len=2048, reserve_max=True)
    first_fit = replay_contiguous(trace, capacity=16384, max_model_len=2048, reserve_max=False)
    paged = {size: replay_paged(trace, capacity=16384, block_size=size, max_model_len=2048)
             for size in (1, 16)}
    return trace, contiguous, first_fit, paged


def test_every_slot_is_counted_once(small_study):
    _, contiguous, first_fit, paged = small_study
    for records in (contiguous, first_fit, paged[1][0], paged[16][0]):
        assert all(r.total == 16384 and min(getattr(r, c) for c in CATEGORIES) >= 0
                   for r in records)


def test_every_output_token_is_produced(small_study):
    """Useful slots grow by one per running sequence per step, so the sum over steps of
    sequences in flight equals the trace's output tokens (plus recomputed steps)."""
    trace, contiguous, first_fit, _ = small_study
    outputs = sum(r.output_len for r in trace)
    assert sum(r.in_flight for r in contiguous) == outputs
    assert sum(r.in_flight for r in first_fit) == outputs


def test_paged_beats_contiguous_and_block_one_wastes_nothing(small_study):
    _, contiguous, first_fit, paged = small_study
    useful = {name: summarize(records)["useful"] for name, records in
              [("max", contiguous), ("first_fit", first_fit), ("paged16", paged[16][0])]}
    assert useful["max"] < useful["first_fit"] < useful["paged16"]
    assert useful["paged16"] > 0.9
    assert all(r.reserved == r.internal == 0 for r in paged[1][0])
    assert max(r.in_flight for r in paged[16][0]) > max(r.in_flight for r in contiguous) == 8
