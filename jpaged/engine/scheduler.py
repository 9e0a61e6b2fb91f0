"""Iteration-level scheduling on the host: admission with prefix-cache hits, chunked prefill,
decode, preemption (swap or recompute), and the block-manager operations each step needs.

Every decision is taken against `HostBlockMirror`, which predicts the device allocator exactly, so
scheduling never waits for the device; the `BlockLedger` applies each block operation to the
mirror and queues it for the device in the same order (`pending_ops`).

Priority order each step: running requests (preempting victims when blocks run out), then
swapped requests coming back, then waiting requests (only once nothing is swapped out).
"""

import collections
import dataclasses

from jpaged.blocks.ledger import BlockLedger
from jpaged.blocks.mirror import HostBlockMirror
from jpaged.blocks.prefix_cache import PrefixCache
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
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    @property
    def is_decode(self) -> bool:
        return all(row.num_tokens == 1 for row in self.rows)


class Scheduler:
    """FCFS admission under token, sequence and block budgets; swap or recompute preemption.

    prefix_cache: a PrefixCache, or None to share nothing. preemption_mode: "swap", "recompute"
    or "auto" (`swap_policy(num_blocks, num_tokens)` says per victim whether swapping is cheaper;
    recompute until one is set). num_swap_blocks: host blocks for swapped KV (0: never swap).
    """

    def __init__(self, mirror: HostBlockMirror, *, max_num_seqs: int,
                 max_num_batched_tokens: int, watermark: float = 0.01,
                 prefix_cache: PrefixCache | None = None, preemption_mode: str = "recompute",
                 num_swap_blocks: int = 0):
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {preemption_mode!r}")
        self.mirror = mirror
        self.ledger = BlockLedger(mirror, prefix_cache=prefix_cache,
                                  num_swap_blocks=num_swap_blocks)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * mirror.num_blocks)
        self.preemption_mode = preemption_mode
        self.swap_policy = None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped: collections.deque[Request] = collections.deque()
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.ledger.prefix_cache

    @property
    def pending_ops(self) -> list:
        """Block operations decided but not yet replayed on the device (see BlockLedger)."""
        return self.ledger.pending_ops

    @pending_ops.setter
    def pending_ops(self, ops: list):
        self.ledger.pending_ops = ops

    # ---- queue management -------------------------------------------------------------------
    def add(self, request: Request):
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and return its blocks (device or host) at once."""
        for queue in (self.running, self.waiting, self.swapped):
            request = next((r for r in queue if r.request_id == request_id), None)
            if request is None:
                continue
            queue.remove(request)
            if queue is self.running:
                self._release(request.sequences)
                self.free_slots.extend(request.reserved_slots)  # the unforked samples'
                request.reserved_slots = []
            elif queue is self.swapped:
                self.ledger.drop_swap(request)
            for seq in request.live_sequences:
                seq.finish_reason = "abort"
            request.status = SequenceStatus.FINISHED
            return request
        return None

    # ---- block-manager operations (mirror now, device later, same order) -------------------
    def _release(self, sequences: list[Sequence], *, index: bool = True):
        """Free sequences' blocks (their full blocks offered to the prefix cache first)."""
        if index:
            self.ledger.index(sequences)
        slots = [seq.slot for seq in sequences if seq.slot >= 0]
        self.ledger.free(slots)
        self.free_slots.extend(reversed(slots))
        for seq in sequences:
            seq.slot, seq.num_computed, seq.num_indexed = -1, 0, 0

    def finish(self, sequences: list[Sequence]):
        """Return finished sequences' blocks now (the caller has set their finish_reason)."""
        self._release(sequences)

    def release_slots(self, sequences: list[Sequence]):
        """Sequences whose blocks the device already freed (inside a decode loop): slots only."""
        for seq in sequences:
            if seq.slot >= 0:
                self.free_slots.append(seq.slot)
            seq.slot, seq.num_computed, seq.num_indexed = -1, 0, 0

    # ---- room for decode loops (they allocate on the device, from the free stack only) ------
    def make_room_for_loop(self, sequences: list[Sequence], num_tokens: int):
        """Before a decode loop is launched (none in flight): evict cached blocks until the free
        stack can serve num_tokens more tokens for every sequence. Best effort: what the cache
        cannot give, the loop reports as out_of_blocks and the next schedule preempts."""
        deficit = (self.mirror.blocks_for_tokens([seq.slot for seq in sequences], num_tokens)
                   - self.mirror.num_free)
        if deficit > 0:
            self.ledger.evict(min(deficit, self.ledger.num_evictable()))

    def room_behind_loop(self, sequences: list[Sequence], num_tokens: int) -> list[int] | None:
        """While a loop is in flight (its tokens not yet in the mirror): make the free stack able
        to serve num_tokens more tokens per sequence, counted from the mirror, by evicting cached
        blocks behind the loop. Returns the evicted blocks, which the mirror must release after
        replaying the in-flight loop ([] if none were needed), or None if there is no room."""
        deficit = (self.mirror.blocks_for_tokens([seq.slot for seq in sequences], num_tokens)
                   - self.mirror.num_free)
        return [] if deficit <= 0 else self.ledger.evict_behind_loop(deficit)

    def replay_decode_loop(self, rows: list[ScheduledRow], active: list[bool],
                           done_at: list[int], num_done: int, first_planned: bool):
        """Repeat on the mirror what a device decode loop did: iteration i appends one token to
        every row live at i, then frees the rows that finished at i. When `first_planned`,
        `schedule` already planned iteration 0's appends. The device did these frees itself:
        nothing is queued."""
        slots = [row.seq.slot for row in rows]
        first = int(first_planned)  # the first iteration still to replay
        mirror, size = self.mirror, self.mirror.block_size
        if not first_planned and any(
                live and mirror.seq_lens[slot] % size
                and mirror.refcounts[mirror.tables[slot][-1]] > 1
                for slot, live in zip(slots, active)):
            return self._replay_by_iteration(slots, active, done_at, num_done, first)
        # Only block-boundary crossings and retirements change the free stack, so replay those
        # events in the device's order (iteration, then appends before frees, then batch
        # order) instead of every token: O(events), not O(rows x iterations).
        events, grown = [], []
        for index, (slot, live, done) in enumerate(zip(slots, active, done_at)):
            if not live:
                continue
            last = done if done >= 0 else num_done - 1   # the last iteration it appended at
            # iteration i appends the token at position seq_len + i - first
            events += [(step, 0, index) for step in
                       range(first + (-mirror.seq_lens[slot]) % size, last + 1, size)]
            if done >= 0:
                events.append((done, 1, index))
            else:
                grown.append((slot, last + 1 - first))
        events.sort()
        retired = []
        for position, (step, is_free, index) in enumerate(events):
            if is_free:
                retired.append(slots[index])
                if position + 1 == len(events) or events[position + 1][:2] != (step, 1):
                    self.ledger.free_in_mirror(retired)   # one iteration's frees together
                    retired = []
            else:
                mirror.add_block(slots[index])
        for slot, count in grown:
            mirror.seq_lens[slot] += count

    def _replay_by_iteration(self, slots, active, done_at, num_done: int, first: int):
        """replay_decode_loop one iteration at a time: the general case (copies-on-write)."""
        for step in range(num_done):
            if step >= first:
                ok, _, _ = self.mirror.append([
                    (slot, 1) for slot, live, done in zip(slots, active, done_at)
                    if live and (done < 0 or done >= step)])
                assert ok, "device decode loop appended what the mirror cannot"
            retired = [slot for slot, live, done in zip(slots, active, done_at)
                       if live and done == step]
            if retired:
                self.ledger.free_in_mirror(retired)

    def queue_device_free(self, sequences: list[Sequence]):
        """Queue the device free of sequences whose mirror free comes later (pipelining)."""
        slots = [seq.slot for seq in sequences if seq.slot >= 0]
        if slots:
            self.ledger.queue("free", slots)

    def release_in_mirror(self, sequences: list[Sequence]):
        """The mirror half of a free already dispatched to the device, and the slots."""
        slots = [seq.slot for seq in sequences if seq.slot >= 0]
        if slots:
            self.ledger.free_in_mirror(slots)
        self.release_slots(sequences)

    def fork(self, request: Request, children: list[Sequence]):
        """Children share all of sequence 0's blocks; their slots were reserved at admission."""
        parent = request.sequences[0]
        pairs = []
        for child in children:
            child.slot = request.reserved_slots.pop()
            child.num_computed = parent.num_computed
            pairs.append((parent.slot, child.slot))
        self.ledger.fork(pairs)

    def retire(self, request: Request):
        """Drop a finished request from the running set; unused reserved slots come back."""
        self.running.remove(request)
        self.free_slots.extend(request.reserved_slots)
        request.reserved_slots = []
        request.status = SequenceStatus.FINISHED

    # ---- prefix cache: requests that would compute the same block in one step ---------------
    def _in_progress(self, request: Request, hits: list[list[int]]) -> bool:
        """Would the request's next block be computed by another request in this very step?
        Then it waits one step and shares it instead of computing it twice."""
        size = self.mirror.block_size
        for seq, seq_hits in zip(request.live_sequences, hits):
            if (len(seq_hits) + 1) * size < len(seq.token_ids):
                key = self.prefix_cache.keys_for(seq.token_ids, seq.block_keys,
                                                 len(seq_hits) + 1)[-1]
                if key in self._computing:
                    return True
        return False

    def _note_computing(self, rows: list[ScheduledRow]):
        if self.prefix_cache is None:
            return
        size = self.mirror.block_size
        for row in rows:
            full = (row.start + row.num_tokens) // size
            if full > row.start // size:
                keys = self.prefix_cache.keys_for(row.seq.token_ids, row.seq.block_keys, full)
                self._computing.update(keys[row.start // size:])

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
            slots = [seq.slot for seq in live]
            self.ledger.swap_out(request, live, blocks)
            self.free_slots.extend(reversed(slots))
            request.status = SequenceStatus.SWAPPED
            self.swapped.append(request)
        else:
            request.num_recomputed_tokens += tokens
            self.num_recomputed_tokens += tokens
            self._release(request.sequences, index=False)
            request.status = SequenceStatus.WAITING
            self.waiting.appendleft(request)
        self.free_slots.extend(request.reserved_slots)
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
        self._planned_blocks, self._holders, self._computing = 0, {}, set()
        self.ledger.index([seq for r in self.running for seq in r.live_sequences])
        rows: list[ScheduledRow] = []
        preempted: list[Request] = []
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running):
            request = self.running[index]
            new_rows = self._rows_for(request, budget)
            while new_rows and not self._reserve(new_rows, 0):
                victim = self._pick_victim(index)
                self.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    new_rows = []
            if request.status is SequenceStatus.RUNNING:
                self._note_computing(new_rows)
                rows += new_rows
                budget -= sum(row.num_tokens for row in new_rows)
                index += 1
        while self.swapped and budget > 0 and not preempted:
            new_rows = self._resume_swapped(budget)
            if new_rows is None:
                break
            rows += new_rows
            budget -= sum(row.num_tokens for row in new_rows)
        while self.waiting and budget > 0 and not preempted and not self.swapped:
            new_rows = self._admit_waiting(budget)
            if new_rows is None:
                break
            rows += new_rows
            budget -= sum(row.num_tokens for row in new_rows)
        ok, _, copies = self.mirror.append([(row.seq.slot, row.num_tokens) for row in rows])
        assert ok, "scheduler admitted rows the block mirror cannot serve"
        self.ledger.queue_copies(copies)
        for row in rows:
            row.seq.num_computed += row.num_tokens
        return SchedulerOutput(rows, preempted)

    def _resume_swapped(self, budget: int) -> list[ScheduledRow] | None:
        """Swap the first swapped request back in if its blocks, the blocks of its rows for this
        step (a copy-on-write each at most) and its slots fit; its rows for this step."""
        request = self.swapped[0]
        live = request.live_sequences
        needed_slots = len(live) if request.is_forked else request.params.n
        size = self.mirror.block_size
        new_rows = self._rows_for(request, budget)
        need = len(request.swap.host_ids) + sum(
            -(-(row.start + row.num_tokens) // size) - (-(-row.start // size)) + 1
            for row in new_rows)
        if len(self.free_slots) < needed_slots:
            return None
        # The bound may overcount copies-on-write; alone in the pool, the blocks suffice.
        swapped_blocks = len(request.swap.host_ids)
        if not self._room_for(need) and (self.running or not self._room_for(swapped_blocks)):
            return None
        self.swapped.popleft()
        self._assign_slots(request, needed_slots)
        self.ledger.swap_in(request)
        request.status = SequenceStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival_index)
        if not self._reserve(new_rows, 0):
            return None   # back in the cache; its rows run next step, as a running request's
        return new_rows

    def _admit_waiting(self, budget: int) -> list[ScheduledRow] | None:
        request = self.waiting[0]
        needed_slots = request.params.n if not request.is_forked else len(request.live_sequences)
        if len(self.free_slots) < needed_slots:
            return None
        hits = self.ledger.lookup(request.live_sequences)
        if self.prefix_cache is not None and self._in_progress(request, hits):
            return None
        size = self.mirror.block_size
        for seq, seq_hits in zip(request.live_sequences, hits):
            seq.num_computed = len(seq_hits) * size
        new_rows = self._rows_for(request, budget)
        protected = {block for seq_hits in hits for block in seq_hits}
        if not new_rows or not self._reserve(new_rows, self.watermark_blocks, protected):
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
        self._note_computing(new_rows)
        return new_rows

    def _rows_for(self, request: Request, budget: int) -> list[ScheduledRow]:
        rows = []
        for seq in request.live_sequences:
            if budget <= 0:
                break
            count = min(seq.num_uncomputed, budget)
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

    def _room_for(self, blocks: int, reserve: int = 0, protected=()) -> bool:
        """Can `blocks` more blocks than already planned be served, evicting cached blocks if
        needed (and only if that is enough)?"""
        deficit = self._planned_blocks + blocks - (self.mirror.num_free - reserve)
        return deficit <= 0 or self.ledger.evict(deficit, protected)

    def _reserve(self, new_rows: list[ScheduledRow], reserve: int, protected=()) -> bool:
        """Add new_rows' blocks to this step's plan if the pool (less `reserve`) can serve them.

        Costed incrementally: earlier rows' blocks and shared-block holders carry over, so a step
        costs O(rows), not O(rows^2). Sequences without a slot yet append onto an empty table
        (or onto their cached blocks, which end on a block boundary).
        """
        holders = dict(self._holders)
        known = [(row.seq.slot, row.num_tokens) for row in new_rows if row.seq.slot >= 0]
        needed = self.mirror.blocks_needed(known, holders)
        block_size = self.mirror.block_size
        needed += sum(-(-row.num_tokens // block_size) for row in new_rows if row.seq.slot < 0)
        if not self._room_for(needed, reserve, protected):
            return False
        self._planned_blocks += needed
        self._holders = holders
        return True

    def _assign_slots(self, request: Request, needed_slots: int):
        slots = [self.free_slots.pop() for _ in range(needed_slots)]
        for seq in request.live_sequences:
            seq.slot = slots.pop(0)
        request.reserved_slots = slots          # the children's, forked once the prompt is done

    def _pick_victim(self, index: int) -> Request:
        """Lowest priority, then latest arrival, among requests not yet scheduled this step (the
        current one if it is the only candidate)."""
        candidates = self.running[index:]
        return max(candidates, key=lambda r: (-r.priority, r.arrival_index))
