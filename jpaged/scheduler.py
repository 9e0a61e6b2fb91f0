"""Iteration-level scheduling on the host: admission, chunked prefill, decode, recompute
preemption, and the block-manager operations each step needs.

Every decision is taken against `HostBlockMirror`, which predicts the device allocator exactly, so
scheduling never waits for the device. Each mirror operation is also queued (`pending_ops`) for
the runner, which replays them on the device state in the same order before the step's appends;
identical operation sequences keep both sides block-for-block identical.
"""

import collections
import dataclasses

from jpaged.block_mirror import HostBlockMirror
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
    """FCFS admission under token, sequence and block budgets; recompute preemption."""

    def __init__(self, mirror: HostBlockMirror, *, max_num_seqs: int,
                 max_num_batched_tokens: int, watermark: float = 0.01):
        self.mirror = mirror
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = int(watermark * mirror.num_blocks)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.pending_ops: list[tuple[str, list]] = []   # ("free", slots) | ("fork", pairs)
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------
    def add(self, request: Request):
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and return its blocks at once."""
        for request in list(self.waiting) + self.running:
            if request.request_id == request_id:
                if request in self.running:
                    self.running.remove(request)
                    self._release(request.sequences)
                    self.free_slots.extend(request.reserved_slots)  # the unforked samples'
                    request.reserved_slots = []
                else:
                    self.waiting.remove(request)
                for seq in request.live_sequences:
                    seq.finish_reason = "abort"
                request.status = SequenceStatus.FINISHED
                return request
        return None

    # ---- block-manager operations (mirror now, device later, same order) -------------------
    def _release(self, sequences: list[Sequence]):
        slots = [seq.slot for seq in sequences if seq.slot >= 0]
        if slots:
            self.mirror.free(slots)
            self.pending_ops.append(("free", slots))
            self.free_slots.extend(reversed(slots))
        for seq in sequences:
            seq.slot, seq.num_computed = -1, 0

    def finish(self, sequences: list[Sequence]):
        """Return finished sequences' blocks now (the caller has set their finish_reason)."""
        self._release(sequences)

    def release_slots(self, sequences: list[Sequence]):
        """Sequences whose blocks the device already freed (inside a decode loop): slots only."""
        for seq in sequences:
            if seq.slot >= 0:
                self.free_slots.append(seq.slot)
            seq.slot, seq.num_computed = -1, 0

    def replay_decode_loop(self, rows: list[ScheduledRow], active: list[bool],
                           done_at: list[int], num_done: int, first_planned: bool):
        """Repeat on the mirror what a device decode loop did: iteration i appends one token to
        every row live at i, then frees the rows that finished at i. When `first_planned`,
        `schedule` already planned iteration 0's appends. The device did these frees itself:
        nothing is queued."""
        slots = [row.seq.slot for row in rows]
        for step in range(num_done):
            if step > 0 or not first_planned:
                ok, _, _ = self.mirror.append([
                    (slot, 1) for slot, live, done in zip(slots, active, done_at)
                    if live and (done < 0 or done >= step)])
                assert ok, "device decode loop appended what the mirror cannot"
            retired = [slot for slot, live, done in zip(slots, active, done_at)
                       if live and done == step]
            if retired:
                self.mirror.free(retired)

    def queue_device_free(self, sequences: list[Sequence]):
        """Queue the device free of sequences whose mirror free comes later (pipelining)."""
        slots = [seq.slot for seq in sequences if seq.slot >= 0]
        if slots:
            self.pending_ops.append(("free", slots))

    def release_in_mirror(self, sequences: list[Sequence]):
        """The mirror half of a free already dispatched to the device, and the slots."""
        slots = [seq.slot for seq in sequences if seq.slot >= 0]
        if slots:
            self.mirror.free(slots)
        self.release_slots(sequences)

    def fork(self, request: Request, children: list[Sequence]):
        """Children share all of sequence 0's blocks; their slots were reserved at admission."""
        parent = request.sequences[0]
        pairs = []
        for child in children:
            child.slot = request.reserved_slots.pop()
            child.num_computed = parent.num_computed
            pairs.append((parent.slot, child.slot))
        self.mirror.fork(pairs)
        self.pending_ops.append(("fork", pairs))

    def retire(self, request: Request):
        """Drop a finished request from the running set; unused reserved slots come back."""
        self.running.remove(request)
        self.free_slots.extend(request.reserved_slots)
        request.reserved_slots = []
        request.status = SequenceStatus.FINISHED

    def preempt(self, request: Request):
        """Recompute preemption: drop the request's blocks, queue it first to be prefilled again
        with its generated tokens."""
        self.running.remove(request)
        live = request.live_sequences
        request.num_recomputed_tokens += sum(seq.num_computed for seq in live)
        self._release(request.sequences)
        self.free_slots.extend(request.reserved_slots)
        request.reserved_slots = []
        request.num_preemptions += 1
        request.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._planned_blocks, self._holders = 0, {}
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
                rows += new_rows
                budget -= sum(row.num_tokens for row in new_rows)
                index += 1
        while self.waiting and budget > 0 and not preempted:
            request = self.waiting[0]
            needed_slots = (request.params.n if not request.is_forked
                            else len(request.live_sequences))
            if len(self.free_slots) < needed_slots:
                break
            new_rows = self._rows_for(request, budget)
            if not new_rows or not self._reserve(new_rows, self.watermark_blocks):
                break
            self._admit(request, needed_slots)
            rows += new_rows
            budget -= sum(row.num_tokens for row in new_rows)
        ok, _, _ = self.mirror.append([(row.seq.slot, row.num_tokens) for row in rows])
        assert ok, "scheduler admitted rows the block mirror cannot serve"
        for row in rows:
            row.seq.num_computed += row.num_tokens
        return SchedulerOutput(rows, preempted)

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

    def _reserve(self, new_rows: list[ScheduledRow], reserve: int) -> bool:
        """Add new_rows' blocks to this step's plan if the pool (less `reserve`) can serve them.

        Costed incrementally: earlier rows' blocks and shared-block holders carry over, so a step
        costs O(rows), not O(rows^2). Sequences without a slot yet append onto an empty table.
        """
        holders = dict(self._holders)
        known = [(row.seq.slot, row.num_tokens) for row in new_rows if row.seq.slot >= 0]
        needed = self.mirror.blocks_needed(known, holders)
        block_size = self.mirror.block_size
        needed += sum(-(-row.num_tokens // block_size) for row in new_rows if row.seq.slot < 0)
        if self._planned_blocks + needed > self.mirror.num_free - reserve:
            return False
        self._planned_blocks += needed
        self._holders = holders
        return True

    def _admit(self, request: Request, needed_slots: int):
        self.waiting.popleft()
        slots = [self.free_slots.pop() for _ in range(needed_slots)]
        live = request.live_sequences
        for seq in live:
            seq.slot = slots.pop(0)
            seq.num_computed = 0
        request.reserved_slots = slots          # the children's, forked once the prompt is done
        request.status = SequenceStatus.RUNNING
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival_index)

    def _pick_victim(self, index: int) -> Request:
        """Lowest priority, then latest arrival, among requests not yet scheduled this step (the
        current one if it is the only candidate)."""
        candidates = self.running[index:]
        return max(candidates, key=lambda r: (-r.priority, r.arrival_index))
