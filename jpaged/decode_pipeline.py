"""Pipelined decode loops (async scheduling): while the host processes one loop's tokens, the
next loop already runs on the device, started from the previous loop's device-side results.

Ordering is what keeps the host mirror exact. Device operations run in dispatch order, so a free
dispatched while loop Y is in flight lands after Y; the mirror therefore applies such frees only
after replaying Y (`deferred`). A sequence finished on the host (a stop string, an abort) while
it is still live in the in-flight loop is dropped from the loop after that one (`keep`), and its
tokens from the in-flight loop are discarded.
"""

import dataclasses

from jpaged.request import Samples, Sequence
from jpaged.runner import LaunchedLoop
from jpaged.sampling import SamplingRow
from jpaged.scheduler import ScheduledRow


@dataclasses.dataclass
class InFlight:
    rows: list[ScheduledRow]
    launched: LaunchedLoop
    active: list[bool] | None   # rows live when the loop started; known once its parent is fetched
    first_planned: bool         # schedule() already put iteration 0's appends in the mirror
    keep: list[bool]


class DecodePipeline:
    """At most one decode loop in flight, owned by the engine."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight: InFlight | None = None
        self.deferred: list[Sequence] = []   # frees dispatched after the in-flight loop
        self.deferred_releases: list[int] = []  # cached blocks evicted after it, likewise
        self.ran_dry = False                 # the last fetched loop stopped for lack of blocks

    def launch(self, rows: list[ScheduledRow], num_steps: int):
        """Dispatch a loop of num_steps iterations (its static trip count) for freshly scheduled
        decode rows (iteration 0 already planned)."""
        engine = self.engine
        launched = engine.runner.launch_decode(
            [(row.seq.slot, row.token_ids[0]) for row in rows],
            [SamplingRow(row.request.params, row.request.seed, row.seq.index, row.start + 1)
             for row in rows],
            [row.request.params.max_tokens - len(row.seq.output_token_ids) for row in rows],
            [engine.stop_ids(row.request.params) for row in rows],
            num_steps, num_steps, engine.config.max_model_len,
            max(row.request.params.logprobs or 0 for row in rows))
        self.in_flight = InFlight(rows, launched, [True] * len(rows), True, [True] * len(rows))

    def advance(self, chain: bool):
        """Optionally dispatch the continuation, then fetch and replay the in-flight loop.

        Returns ([(row, sample_index, samples)], sequences the device retired in the loop).
        """
        engine, current = self.engine, self.in_flight
        following = None
        if chain:
            keep = [not row.seq.is_finished for row in current.rows]
            following = InFlight(current.rows, engine.runner.continue_decode(
                current.launched, keep, current.launched.static["max_steps"]), None, False, keep)
        result = engine.runner.fetch_decode(current.launched, len(current.rows))
        done_at = [int(d) for d in result.done_at]
        num_done = int(result.num_done)
        self.ran_dry = bool(result.out_of_blocks)
        engine.num_loops_out_of_blocks += self.ran_dry
        engine.scheduler.replay_decode_loop(current.rows, current.active, done_at, num_done,
                                            current.first_planned)
        engine.scheduler.release_in_mirror(self.deferred)
        engine.scheduler.ledger.release_in_mirror(self.deferred_releases)
        self.deferred, self.deferred_releases = [], []
        token_ids, logprobs = result.token_ids.T.tolist(), result.logprobs.T.tolist()
        top_ids, top_logprobs = result.top_ids.swapaxes(0, 1), result.top_logprobs.swapaxes(0, 1)
        results, device_freed = [], []
        for b, row in enumerate(current.rows):
            if not current.active[b]:
                continue
            count = done_at[b] + 1 if done_at[b] >= 0 else num_done
            row.seq.num_computed += count - current.first_planned
            if row.seq.is_finished:  # finished on the host while this loop ran: tokens dropped
                continue
            results.append((row, row.seq.index, Samples(
                token_ids[b][:count], logprobs[b][:count], top_ids[b, :count],
                top_logprobs[b, :count])))
            if done_at[b] >= 0:
                device_freed.append(row.seq)
        if following is not None:
            following.active = [a and d < 0 and k for a, d, k in
                                zip(current.active, done_at, following.keep)]
        self.in_flight = following
        return results, device_freed

    def live_sequences(self) -> list[Sequence]:
        """Sequences the in-flight loop decodes and the next loop would continue."""
        return [row.seq for row, keep in zip(self.in_flight.rows, self.in_flight.keep)
                if keep and not row.seq.is_finished]

    def covers(self, sequences) -> bool:
        """Does the in-flight loop decode every one of these sequences (so chaining it starves
        none of them)?"""
        live = {id(row.seq) for row, keep in zip(self.in_flight.rows, self.in_flight.keep)
                if keep}
        return all(id(seq) in live for seq in sequences)

    def holds(self, seq: Sequence) -> bool:
        """Is seq live in the loop now in flight (so its free must wait for that loop)?"""
        if self.in_flight is None:
            return False
        return any(row.seq is seq and keep for row, keep in
                   zip(self.in_flight.rows, self.in_flight.keep))
