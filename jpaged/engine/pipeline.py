"""Pipelined decode loops (async scheduling): while the host processes one loop's tokens, the
next loops already run on the device, each started from its predecessor's device-side results.
Up to `depth` loops stay in flight behind the one being processed, so a slow host step (a
dispatch, a burst of output processing) leaves the device with queued work instead of idle.

Ordering is what keeps the host mirror exact. Device operations run in dispatch order, so a
block operation dispatched while loops are in flight (a free, a cached block's release, a
sliding window's trim) lands after the newest of them; the mirror therefore applies it only after
replaying that loop (its `after` list, in the order the operations were queued). A sequence
finished on the host (a stop string, an abort) while it is still live in loops in flight is
dropped from the next loop dispatched (`keep`), and its tokens from the loops already in flight
are discarded.
"""

import collections
import dataclasses
from collections.abc import Callable

from jpaged.blocks.ledger import BlockLedger
from jpaged.engine.batch_arrays import loop_batch
from jpaged.engine.executor import Executor, LaunchedLoop
from jpaged.engine.scheduler import ScheduledRow
from jpaged.request import Samples, Sequence
from jpaged.sampling import SamplingRow


@dataclasses.dataclass
class InFlight:
    rows: list[ScheduledRow]
    launched: LaunchedLoop
    active: list[bool] | None   # rows live when the loop started; known once its parent is fetched
    first_planned: bool         # schedule() already put iteration 0's appends in the mirror
    keep: list[bool]
    # mirror halves of block operations dispatched after this loop, run after its replay
    after: list[Callable[[], None]] = dataclasses.field(default_factory=list)


class DecodePipeline:
    """Decode loops in flight, oldest first. The executor runs them; the ledger replays each
    one's allocations on the mirror once its results are back.

    depth: loops kept in flight while the host processes one (the engine's `async_depth`).
    """

    def __init__(self, executor: Executor, ledger: BlockLedger, *, depth: int,
                 max_model_len: int):
        self.executor = executor
        self.ledger = ledger
        self.depth = depth
        self.max_model_len = max_model_len
        self.loops: collections.deque[InFlight] = collections.deque()
        self.ran_dry = False                 # the last fetched loop stopped for lack of blocks
        self.num_ran_dry = 0                 # loops that stopped early for lack of blocks

    @property
    def in_flight(self) -> InFlight | None:
        """The oldest loop in flight (the next to be fetched), or None."""
        return self.loops[0] if self.loops else None

    @property
    def newest(self) -> InFlight:
        return self.loops[-1]

    def behind_newest(self, mirror_half: Callable[[], None] | None):
        """The mirror half of a block operation queued now (it lands on the device after the
        newest loop in flight): run after that loop's replay."""
        if mirror_half is not None:
            self.newest.after.append(mirror_half)

    def free(self, sequences: list[Sequence]):
        """Free sequences that loops in flight still hold: on the device after the newest of
        them (the free is queued now), in the mirror after that loop's replay."""
        if sequences:
            self.behind_newest(self.ledger.defer_free(sequences))

    def hold_back(self, sequences: list[Sequence]) -> list[Sequence]:
        """Of finished sequences, free those that loops in flight still hold (see `free`) and
        return the others, which can be freed at once."""
        if not self.loops:
            return sequences
        held = {id(seq) for seq in sequences if self.holds(seq)}
        self.free([seq for seq in sequences if id(seq) in held])
        return [seq for seq in sequences if id(seq) not in held]

    def loops_to_chain(self, running) -> int:
        """How many loops to dispatch now behind the ones in flight, continuing the newest (the
        caller has checked that async scheduling is on and nothing waits): up to `depth` left
        in flight once the oldest is fetched; none if the pool ran dry (preemption needs the
        scheduler) or the newest loop does not cover every running sequence (a request left
        out by the token budget must not starve); and no more than the rows' budgets need. A
        loop has a fixed trip count, so one chained after every row used up its max_tokens (or
        max_model_len) would run the whole model for nothing.

        None either once the live rows fit a smaller batch than the newest loop's: a chained
        loop keeps its predecessor's rows, finished ones included, so chaining on would run the
        whole first batch to the end of the longest request (on a trace of mixed lengths, most
        of a K = 8 run's rows were finished ones). The loops in flight drain, and the scheduler
        starts a loop of the live rows alone."""
        if not running or self.ran_dry or not self.covers(
                seq for request in running for seq in request.live_sequences):
            return 0
        newest = self.newest
        if (loop_batch(len(self.live_sequences()), self.executor.max_num_seqs)
                < newest.launched.batch[0]):
            return 0
        budget = max((min(row.request.params.max_tokens
                          - (len(row.seq.token_ids) - row.seq.num_prompt_tokens),
                          self.max_model_len - len(row.seq.token_ids))
                      for row, keep in zip(newest.rows, newest.keep)
                      if keep and not row.seq.is_finished), default=0)
        steps = newest.launched.static["max_steps"]
        return max(0, min(self.depth + 1 - len(self.loops),
                          -(-(budget - self.steps_in_flight()) // steps)))

    def make_room(self, num_loops: int) -> bool:
        """Can the free stack serve the loops in flight and num_loops more, evicting cached
        blocks behind the loops if needed? A loop allocates only from the free stack, so without
        this a pool full of evictable prefix-cache blocks would stop every chained loop early."""
        mirror_half = self.ledger.room_behind_loop(
            self.live_sequences(),
            self.tokens_behind() + num_loops * self.newest.launched.static["max_steps"])
        self.behind_newest(mirror_half)
        return mirror_half is not None

    def steps_in_flight(self) -> int:
        """Iterations the loops in flight run (tokens each live row may still get from them)."""
        return sum(loop.launched.static["max_steps"] for loop in self.loops)

    def tokens_behind(self) -> int:
        """Tokens per live row that loops in flight may append and the mirror has not seen."""
        return self.steps_in_flight() - sum(loop.first_planned for loop in self.loops)

    def launch(self, rows: list[ScheduledRow], num_steps: int, block_ops: list):
        """Apply the step's block operations, then dispatch a loop of num_steps iterations (its
        static trip count) for freshly scheduled decode rows (iteration 0 already planned)."""
        self.executor.apply(block_ops)
        launched = self.executor.launch_decode(
            [(row.seq.slot, row.token_ids[0]) for row in rows],
            [SamplingRow(row.request.params, row.request.seed, row.seq.index, row.start + 1)
             for row in rows],
            [row.request.params.max_tokens - len(row.seq.output_token_ids) for row in rows],
            [row.request.stop_ids for row in rows],
            num_steps, num_steps, self.max_model_len,
            max(row.request.params.logprobs or 0 for row in rows),
            [row.seq.constraint for row in rows])
        self.loops.append(InFlight(rows, launched, [True] * len(rows), True, [True] * len(rows)))

    def advance(self, chain: int):
        """Apply the ledger's queued block operations (they land behind the loops in flight),
        dispatch `chain` loops, each continuing the newest in flight, then fetch and replay the
        oldest loop.

        Returns ([(row, sample_index, samples)], sequences the device retired in the loop: they
        still hold their blocks, which the host frees once it has indexed them).
        """
        self.executor.apply(self.ledger.take_ops())
        for _ in range(chain):
            newest = self.newest
            keep = [not row.seq.is_finished for row in newest.rows]
            self.loops.append(InFlight(newest.rows, self.executor.continue_decode(
                newest.launched, keep, newest.launched.static["max_steps"]), None, False, keep))
        current = self.loops.popleft()
        result = self.executor.fetch_decode(current.launched, len(current.rows))
        if int(result.missed_copies):
            raise RuntimeError("a decode loop met a shared partial block its scheduler did not "
                               "plan a copy for: the host mirror and the device diverged")
        done_at = result.done_at.tolist()
        num_done = int(result.num_done)
        self.ran_dry = bool(result.out_of_blocks)
        self.num_ran_dry += self.ran_dry
        self.ledger.replay_decode_loop([row.seq.slot for row in current.rows], current.active,
                                       done_at, num_done, current.first_planned)
        for mirror_half in current.after:
            mirror_half()
        token_ids, logprobs = result.token_ids.T.tolist(), result.logprobs.T.tolist()
        top_ids, top_logprobs = result.top_ids.swapaxes(0, 1), result.top_logprobs.swapaxes(0, 1)
        results, retired = [], []
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
                retired.append(row.seq)
        if self.loops:  # the next loop's live rows: this one's, less retired or dropped rows
            following = self.loops[0]
            following.active = [a and d < 0 and k for a, d, k in
                                zip(current.active, done_at, following.keep)]
        return results, retired

    def live_sequences(self) -> list[Sequence]:
        """Sequences the newest loop decodes and the next loop would continue."""
        return [row.seq for row, keep in zip(self.newest.rows, self.newest.keep)
                if keep and not row.seq.is_finished]

    def covers(self, sequences) -> bool:
        """Does the newest loop decode every one of these sequences (so chaining it starves none
        of them)?"""
        live = {id(row.seq) for row, keep in zip(self.newest.rows, self.newest.keep) if keep}
        return all(id(seq) in live for seq in sequences)

    def holds(self, seq: Sequence) -> bool:
        """Is seq live in a loop now in flight (so its free must wait for those loops)?"""
        return any(row.seq is seq and keep for loop in self.loops
                   for row, keep in zip(loop.rows, loop.keep))
