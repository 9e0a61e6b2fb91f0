"""Iteration-level scheduling on the host: which requests run this step and with how many
tokens (admission with prefix-cache hits, chunked prefill, decode), and who is preempted (swap
or recompute) when blocks run out.

The scheduler makes policy decisions only: queues, token and sequence budgets, victims. Every
block it needs, frees or shares goes through the `BlockLedger`'s public methods, which predict the
device allocator exactly (so scheduling never waits for the device) and queue the matching
device operations.

Priority order each step: running requests (preempting victims when blocks run out), then
swapped requests coming back, then waiting requests (only once nothing is swapped out).
"""

import collections
import dataclasses

from jpaged.blocks.ledger import BlockLedger
from jpaged.logprobs import SCORED_POSITIONS_PER_STEP
from jpaged.options import PREEMPTION_MODES
from jpaged.request import Request, Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledRow:
    """One sequence's tokens in this step; `sample_indices` lists the samples drawn from its last
    token's logits (empty for a prefill chunk that does not reach the end of the sequence)."""
    request: Request
    seq: Sequence
    start: int            # first token index fed (== seq.num_computed before the step)
    num_tokens: int
    sample_indices: tuple

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens]


@dataclasses.dataclass
class _StepPlan:
    """One schedule() call's working state: blocks planned so far, the remaining holders of
    shared partial blocks (so copies-on-write are costed once), and the prefix-cache keys of
    blocks some row computes in this step."""
    planned_blocks: int = 0
    holders: dict = dataclasses.field(default_factory=dict)
    computing: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class SchedulerOutput:
    """This step's rows, the requests preempted to make room, whether the rows run as one
    multi-step decode loop (all pure decodes, nothing waiting), and the block operations the
    device must apply first (from the ledger, in order)."""
    rows: list[ScheduledRow]
    preempted: list[Request]
    is_loop: bool = False
    block_ops: list = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    @property
    def is_decode(self) -> bool:
        return all(row.num_tokens == 1 for row in self.rows)


class Scheduler:
    """FCFS admission under token, sequence and block budgets; swap or recompute preemption.

    ledger: the `BlockLedger` every block decision goes through (its prefix cache, or None, and
    its host swap blocks). sliding_window: set when every layer of the model slides one window;
    blocks behind it go back to the pool as sequences grow. preemption_mode: "swap", "recompute" or "auto"
    (`swap_policy(num_blocks, num_tokens)` says per victim whether swapping is cheaper;
    recompute until one is set).
    """

    def __init__(self, ledger: BlockLedger, *, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark: float = 0.01, preemption_mode: str = "recompute",
                 num_scheduler_steps: int = 1, sliding_window: int | None = None,
                 loops_take_constraints: bool = True):
        assert preemption_mode in PREEMPTION_MODES, preemption_mode  # checked by the options
        self.ledger = ledger
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * ledger.num_blocks)
        self.preemption_mode = preemption_mode
        self.num_scheduler_steps = num_scheduler_steps
        # Can a decode loop carry structured-output rows (their matchers advanced by the loop,
        # `LoopMatchers`)? If not, a batch holding one steps one token at a time.
        self.loops_take_constraints = loops_take_constraints
        self.sliding_window = sliding_window   # every layer's: older blocks go back to the pool
        self._scored_left = SCORED_POSITIONS_PER_STEP   # this step's scored prompt positions
        self.swap_policy = None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped: collections.deque[Request] = collections.deque()
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    @property
    def prefix_cache(self):
        return self.ledger.prefix_cache

    # ---- queue management -------------------------------------------------------------------
    def add(self, request: Request):
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    @property
    def has_queued(self) -> bool:
        """Is a request waiting or swapped out (so it must get a chance to join)?"""
        return bool(self.waiting or self.swapped)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and return its blocks (device or host) at once."""
        for queue in (self.running, self.waiting, self.swapped):
            request = next((r for r in queue if r.request_id == request_id), None)
            if request is None:
                continue
            queue.remove(request)
            if queue is self.running:
                self.ledger.release(request.sequences)
                self.ledger.return_slots(request.reserved_slots)  # the unforked samples'
                request.reserved_slots = []
            elif queue is self.swapped:
                self.ledger.drop_swap(request)
            for seq in request.live_sequences:
                seq.finish_reason = "abort"
            request.status = SequenceStatus.FINISHED
            return request
        return None

    def retire(self, request: Request):
        """Drop a finished request from the running set; unused reserved slots come back."""
        self.running.remove(request)
        self.ledger.return_slots(request.reserved_slots)
        request.reserved_slots = []
        request.status = SequenceStatus.FINISHED

    # ---- prefix cache: requests that would compute the same block in one step ---------------
    def _in_progress(self, plan: _StepPlan, request: Request, hits: list[list[int]]) -> bool:
        """Would the request's next block be computed by another request in this very step?
        Then it waits one step and shares it instead of computing it twice."""
        size = self.ledger.block_size
        for seq, seq_hits in zip(request.live_sequences, hits):
            if (len(seq_hits) + 1) * size < len(seq.token_ids):
                key = self.prefix_cache.keys_for(seq.token_ids, seq.block_keys,
                                                 len(seq_hits) + 1)[-1]
                if key in plan.computing:
                    return True
        return False

    def _note_computing(self, plan: _StepPlan, rows: list[ScheduledRow]):
        if self.prefix_cache is None:
            return
        size = self.ledger.block_size
        for row in rows:
            full = (row.start + row.num_tokens) // size
            if full > row.start // size:
                keys = self.prefix_cache.keys_for(row.seq.token_ids, row.seq.block_keys, full)
                plan.computing.update(keys[row.start // size:])

    # ---- preemption -------------------------------------------------------------------------
    def preempt(self, request: Request):
        """Preempt a running request: swap its blocks to host memory when the mode (or, for
        "auto", the swap policy) says so and host blocks suffice; otherwise drop them, to be
        prefilled again with the generated tokens."""
        self.running.remove(request)
        live = request.live_sequences
        self.ledger.index(live)
        blocks = self.ledger.distinct_blocks(live)
        tokens = sum(seq.num_computed for seq in live)
        if (self._wants_swap(len(blocks), tokens)
                and len(blocks) <= len(self.ledger.free_host_blocks)):
            self.ledger.swap_out(request, live, blocks)
            request.status = SequenceStatus.SWAPPED
            self.swapped.append(request)
        else:
            request.num_recomputed_tokens += tokens
            self.num_recomputed_tokens += tokens
            self.ledger.release(request.sequences, index=False)
            request.status = SequenceStatus.WAITING
            self.waiting.appendleft(request)
        self.ledger.return_slots(request.reserved_slots)
        request.reserved_slots = []
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _wants_swap(self, num_blocks: int, num_tokens: int) -> bool:
        if self.preemption_mode == "swap":
            return True
        if self.preemption_mode == "auto" and self.swap_policy is not None:
            return self.swap_policy(num_blocks, num_tokens)
        return False

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan()
        live = [seq for r in self.running for seq in r.live_sequences]
        self.ledger.index(live)
        if self.sliding_window is not None:
            self.ledger.trim_window(live, self.sliding_window)
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []
        budget = self.max_num_batched_tokens
        self._scored_left = SCORED_POSITIONS_PER_STEP
        index = 0
        while index < len(self.running):
            request = self.running[index]
            new_rows = self._rows_for(request, budget)
            while new_rows and not self._reserve(plan, new_rows, 0):
                victim = self._pick_victim(index)
                self.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    new_rows = []
            if request.status is SequenceStatus.RUNNING:
                self._note_computing(plan, new_rows)
                rows += new_rows
                budget -= sum(row.num_tokens for row in new_rows)
                index += 1
        while self.swapped and budget > 0 and not preempted:
            new_rows = self._resume_swapped(plan, budget)
            if new_rows is None:
                break
            rows += new_rows
            budget -= sum(row.num_tokens for row in new_rows)
        while self.waiting and budget > 0 and not preempted and not self.swapped:
            new_rows = self._admit_waiting(plan, budget)
            if new_rows is None:
                break
            rows += new_rows
            budget -= sum(row.num_tokens for row in new_rows)
        is_loop = bool(rows) and not self.has_queued and all(
            row.num_tokens == 1 and row.sample_indices == (row.seq.index,)
            and (row.seq.constraint is None or self.loops_take_constraints) for row in rows)
        if is_loop:
            # Room for every iteration, made before iteration 0's append is planned: the
            # device applies the evictions first and then appends inside the loop, so the
            # mirror must see them in that order too, or the two pop different blocks.
            self.ledger.make_room_for_loop([row.seq for row in rows], self.num_scheduler_steps)
        ok = self.ledger.append([(row.seq.slot, row.num_tokens) for row in rows])
        assert ok, "scheduler admitted rows the block mirror cannot serve"
        for row in rows:
            row.seq.num_computed += row.num_tokens
        return SchedulerOutput(rows, preempted, is_loop, self.ledger.take_ops())

    def step_skipped(self, rows: list[ScheduledRow]) -> list:
        """Rows of a step that did not run (it failed before changing the device): their
        sequences fall back to where the step started, and the returned block operations make
        the step's planned appends on the device (the KV of those tokens is never read)."""
        self.ledger.append_skipped([(row.seq.slot, row.num_tokens) for row in rows])
        for row in rows:
            row.seq.num_computed = row.start
        return self.ledger.take_ops()

    def update(self, outcome, retired: list[Sequence], hold_back):
        """The block side of a step's outcome (`jpaged.engine.output.StepOutcome`): siblings
        fork from their parent (before any free: parents may finish); finished sequences offer
        their full blocks to the prefix cache, then give their blocks back, at once or, for
        those loops still in flight hold, after those loops (`hold_back` frees those and
        returns the rest); finished requests leave the running set. `retired`: the sequences a
        device decode loop retired (they must be finished here too)."""
        for request, children in outcome.forks:
            self.ledger.fork_children(request, children)
        assert all(seq.is_finished for seq in retired), \
            "the device retired a sequence the host thinks is running"
        self.ledger.index(outcome.finished)   # all of them, held back or not
        self.ledger.release(hold_back(outcome.finished), index=False)
        for request in outcome.finished_requests:
            self.retire(request)

    def tend_behind_loops(self, behind_newest):
        """While decode loops are in flight (chained by async scheduling, so `schedule` does not
        run between them): offer the running sequences' newly full blocks to the prefix cache
        and let go of blocks behind a sliding window, as `schedule` does before every step. A
        block full as of the replayed loops never changes; the trim lands after the loops in
        flight, and its mirror half goes to `behind_newest`."""
        live = [seq for r in self.running for seq in r.live_sequences]
        self.ledger.index(live)
        if self.sliding_window is not None:
            behind_newest(self.ledger.trim_window(live, self.sliding_window, behind_loop=True))

    def _resume_swapped(self, plan: _StepPlan, budget: int) -> list[ScheduledRow] | None:
        """Swap the first swapped request back in if its blocks, the blocks of its rows for this
        step (a copy-on-write each at most) and its slots fit; its rows for this step."""
        request = self.swapped[0]
        live = request.live_sequences
        needed_slots = len(live) if request.is_forked else request.params.n
        size = self.ledger.block_size
        new_rows = self._rows_for(request, budget)
        need = len(request.swap.host_ids) + sum(
            -(-(row.start + row.num_tokens) // size) - (-(-row.start // size)) + 1
            for row in new_rows)
        if self.ledger.num_free_slots < needed_slots:
            return None
        # The bound may overcount copies-on-write; alone in the pool, the blocks suffice.
        swapped_blocks = len(request.swap.host_ids)
        if not self._room_for(plan, need) and (self.running
                                               or not self._room_for(plan, swapped_blocks)):
            return None
        self.swapped.popleft()
        self._assign_slots(request, needed_slots)
        self.ledger.swap_in(request)
        request.status = SequenceStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival_index)
        if not self._reserve(plan, new_rows, 0):
            return None   # back in the cache; its rows run next step, as a running request's
        return new_rows

    def _admit_waiting(self, plan: _StepPlan, budget: int) -> list[ScheduledRow] | None:
        request = self.waiting[0]
        needed_slots = request.params.n if not request.is_forked else len(request.live_sequences)
        if self.ledger.num_free_slots < needed_slots:
            return None
        hits = self.ledger.lookup(request.live_sequences)
        if request.num_cacheable_tokens is not None:  # owed prompt logprobs need their logits
            hits = [seq_hits[:request.num_cacheable_tokens // self.ledger.block_size]
                    for seq_hits in hits]
        if self.prefix_cache is not None and self._in_progress(plan, request, hits):
            return None
        size = self.ledger.block_size
        for seq, seq_hits in zip(request.live_sequences, hits):
            seq.num_computed = len(seq_hits) * size
        new_rows = self._rows_for(request, budget)
        protected = {block for seq_hits in hits for block in seq_hits}
        if not new_rows or not self._reserve(plan, new_rows, self.watermark_blocks, protected):
            for seq in request.live_sequences:
                seq.num_computed = 0
            return None
        self.waiting.popleft()
        self._assign_slots(request, needed_slots)
        self.ledger.adopt_hits(request.live_sequences, hits)
        request.num_cached_tokens = len(hits[0]) * size
        request.status = SequenceStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival_index)
        self._note_computing(plan, new_rows)
        return new_rows

    def _rows_for(self, request: Request, budget: int) -> list[ScheduledRow]:
        rows = []
        for seq in request.live_sequences:
            if budget <= 0:
                break
            count = self._within_scored_budget(request, seq.num_computed,
                                               min(seq.num_uncomputed, budget))
            if count <= 0:
                continue
            reaches_end = count == seq.num_uncomputed
            if not reaches_end:
                samples = ()
            elif request.is_forked:
                samples = (seq.index,)
            else:  # the prompt's last logits give every one of the n samples its first token
                samples = tuple(range(request.params.n))
            rows.append(ScheduledRow(request, seq, seq.num_computed, count, samples))
            budget -= count
        return rows

    def _within_scored_budget(self, request: Request, start: int, count: int) -> int:
        """count, cut so that the step's scored prompt positions (prompt logprobs, `score`) stay
        within SCORED_POSITIONS_PER_STEP; takes the positions it keeps from this step's share."""
        positions = request.scored_range(start, count)
        if len(positions) > self._scored_left:
            count = positions.start + self._scored_left - start
            positions = request.scored_range(start, count)
        self._scored_left -= len(positions)
        return count

    def _room_for(self, plan: _StepPlan, blocks: int, reserve: int = 0, protected=()) -> bool:
        """Can `blocks` more blocks than already planned be served, evicting cached blocks if
        needed (and only if that is enough)?"""
        deficit = plan.planned_blocks + blocks - (self.ledger.num_free - reserve)
        return deficit <= 0 or self.ledger.evict(deficit, protected)

    def _reserve(self, plan: _StepPlan, new_rows: list[ScheduledRow], reserve: int,
                 protected=()) -> bool:
        """Add new_rows' blocks to this step's plan if the pool (less `reserve`) can serve them.

        Costed incrementally: earlier rows' blocks and shared-block holders carry over, so a step
        costs O(rows), not O(rows^2). Sequences without a slot yet append onto an empty table
        (or onto their cached blocks, which end on a block boundary).
        """
        holders = dict(plan.holders)
        known = [(row.seq.slot, row.num_tokens) for row in new_rows if row.seq.slot >= 0]
        needed = self.ledger.blocks_needed(known, holders)
        block_size = self.ledger.block_size
        needed += sum(-(-row.num_tokens // block_size) for row in new_rows if row.seq.slot < 0)
        if not self._room_for(plan, needed, reserve, protected):
            return False
        plan.planned_blocks += needed
        plan.holders = holders
        return True

    def _assign_slots(self, request: Request, needed_slots: int):
        slots = self.ledger.take_slots(needed_slots)
        for seq in request.live_sequences:
            seq.slot = slots.pop(0)
        request.reserved_slots = slots          # the children's, forked once the prompt is done

    def _pick_victim(self, index: int) -> Request:
        """Lowest priority, then latest arrival, among requests not yet scheduled this step (the
        current one if it is the only candidate)."""
        candidates = self.running[index:]
        return max(candidates, key=lambda r: (-r.priority, r.arrival_index))
