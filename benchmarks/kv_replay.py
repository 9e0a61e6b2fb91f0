"""Replay a request trace against a KV allocator and classify every KV slot at every step.

Three designs share one pool of `capacity` token slots:
  - contiguous, maximum length: each request reserves `max_model_len` slots at admission (the
    pre-PagedAttention servers);
  - contiguous, final length: each request reserves exactly the slots it will use (an oracle that
    knows the output length), placed first-fit in one address space, so freed ranges fragment;
  - paged: jpaged's own scheduler (`jpaged.engine.scheduler.Scheduler`: FCFS admission with its 1%
    watermark, recompute preemption) over its host block allocator (`HostBlockMirror`, the exact
    mirror of the device allocator), blocks of S slots, physical block 0 the reserved sink.

Time is counted in scheduler steps: each step every running sequence writes one token's K/V (its
previous sample) and samples the next, and an admitted request writes its whole prompt. A request
of P prompt and O output tokens thus holds at most P + O - 1 token states, and leaves after O
steps. Every slot of the pool is, at the end of a step's allocation:
  useful    holds a token state;
  reserved  allocated, and a token of this request will be written there later;
  internal  allocated, and never written (past the request's final length);
  external  free while a request waits to be admitted (first-fit holes too small, or free space
            the allocator cannot hand out: fragmentation and the admission watermark);
  idle      free with no request waiting (the load, not the allocator);
  other     the paged pool's sink block.
"""

import bisect
import collections
import dataclasses

from jpaged.blocks.ledger import BlockLedger
from jpaged.request import Request
from jpaged.sampling_params import SamplingParams
from jpaged.engine.scheduler import Scheduler

CATEGORIES = ("useful", "reserved", "internal", "external", "idle", "other")


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """One step: slots per category (token slots), sequences running and waiting."""
    useful: int
    reserved: int
    internal: int
    external: int
    idle: int
    other: int
    in_flight: int
    waiting: int

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in CATEGORIES)


class FirstFitArena:
    """Contiguous ranges of one address space [0, capacity): holes sorted by start, first fit,
    neighbours merged on free."""

    def __init__(self, capacity: int):
        self.starts, self.sizes = [0], [capacity]

    @property
    def num_free(self) -> int:
        return sum(self.sizes)

    def allocate(self, size: int) -> int | None:
        """Start of a fresh range of `size` slots, or None when no hole is large enough."""
        for index, hole in enumerate(self.sizes):
            if hole >= size:
                start = self.starts[index]
                if hole == size:
                    del self.starts[index], self.sizes[index]
                else:
                    self.starts[index], self.sizes[index] = start + size, hole - size
                return start
        return None

    def free(self, start: int, size: int):
        index = bisect.bisect(self.starts, start)
        self.starts.insert(index, start)
        self.sizes.insert(index, size)
        if index + 1 < len(self.starts) and start + size == self.starts[index + 1]:
            self.sizes[index] += self.sizes.pop(index + 1)
            self.starts.pop(index + 1)
        if index > 0 and self.starts[index - 1] + self.sizes[index - 1] == start:
            self.sizes[index - 1] += self.sizes.pop(index)
            self.starts.pop(index)


def final_len(request) -> int:
    """Token states a request holds at most: its prompt and all but its last sampled token."""
    return request.input_len + request.output_len - 1


def _arrivals(trace):
    """(step of arrival, trace index) in arrival order: a request arriving at time t joins the
    queue at step ceil(t)."""
    return collections.deque(sorted((int(-(-r.arrival_time // 1)), i) for i, r in enumerate(trace)))


def replay_contiguous(trace, *, capacity: int, max_model_len: int, reserve_max: bool,
                      max_num_batched_tokens: int = 16384) -> list[Occupancy]:
    """Contiguous reservation, FCFS: each step running sequences decode one token, then waiting
    requests are admitted in order while their reservation fits (first-fit) and their prompt fits
    the step's token budget. reserve_max: reserve max_model_len slots, else the final length."""
    arena, arrivals, waiting = FirstFitArena(capacity), _arrivals(trace), collections.deque()
    running = {}   # trace index -> [start, size, kv_len, steps_left]
    records, step = [], 0
    while arrivals or waiting or running:
        while arrivals and arrivals[0][0] <= step:
            waiting.append(arrivals.popleft()[1])
        for seq in running.values():
            seq[2] += 1                      # writes its previous sample
        budget = max_num_batched_tokens - len(running)
        while waiting and trace[waiting[0]].input_len <= budget:
            request = trace[waiting[0]]
            size = max_model_len if reserve_max else final_len(request)
            start = arena.allocate(size)
            if start is None:
                break
            running[waiting.popleft()] = [start, size, request.input_len, request.output_len]
            budget -= request.input_len
        useful = sum(seq[2] for seq in running.values())
        allocated = sum(seq[1] for seq in running.values())
        will_use = sum(min(seq[1], final_len(trace[i])) for i, seq in running.items())
        free = arena.num_free
        records.append(Occupancy(useful, will_use - useful, allocated - will_use,
                                 free if waiting else 0, 0 if waiting else free, 0,
                                 len(running), len(waiting)))
        for index in [i for i, seq in running.items() if seq[3] == 1]:
            start, size, _, _ = running.pop(index)
            arena.free(start, size)
        for seq in running.values():
            seq[3] -= 1
        step += 1
    return records


def replay_paged(trace, *, capacity: int, block_size: int, max_model_len: int,
                 max_num_seqs: int = 4096, max_num_batched_tokens: int = 16384,
                 watermark: float = 0.01) -> tuple[list[Occupancy], int]:
    """jpaged's scheduler and host block allocator over capacity // block_size blocks (the sink
    included); returns (records, preemptions). Prefix caching is off (the prompts share
    nothing), preemption recomputes."""
    num_blocks = capacity // block_size
    ledger = BlockLedger(num_blocks, block_size, max_num_seqs, -(-max_model_len // block_size))
    scheduler = Scheduler(ledger, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, watermark=watermark,
                          preemption_mode="recompute")
    arrivals, records, step = _arrivals(trace), [], 0
    while arrivals or scheduler.num_unfinished:
        while arrivals and arrivals[0][0] <= step:
            index = arrivals.popleft()[1]
            request = trace[index]
            scheduler.add(Request(
                request_id=str(index), prompt=None, prompt_token_ids=[0] * request.input_len,
                params=SamplingParams(max_tokens=request.output_len, ignore_eos=True), seed=0,
                arrival_index=index))
        output = scheduler.schedule()
        ledger.take_ops()                    # no device to replay them on
        records.append(_paged_occupancy(scheduler, trace, capacity))
        finished = []
        for row in output.rows:
            if row.sample_indices:
                row.seq.token_ids.append(0)
                if len(row.seq.output_token_ids) == row.request.params.max_tokens:
                    row.seq.finish_reason = "length"
                    finished.append(row)
        ledger.release([row.seq for row in finished])
        for row in finished:
            scheduler.retire(row.request)
        step += 1
    return records, scheduler.num_preemptions


def _paged_occupancy(scheduler: Scheduler, trace, capacity: int) -> Occupancy:
    mirror = scheduler.ledger.mirror
    size = mirror.block_size
    useful = allocated = will_use = 0
    for request in scheduler.running:
        slot = request.sequences[0].slot
        blocks = len(mirror.tables[slot]) * size
        useful += mirror.seq_lens[slot]
        allocated += blocks
        will_use += min(blocks, final_len(trace[int(request.request_id)]))
    free = mirror.num_free * size + capacity - mirror.num_blocks * size  # and the unusable tail
    waiting = len(scheduler.waiting)
    return Occupancy(useful, will_use - useful, allocated - will_use, free if waiting else 0,
                     0 if waiting else free, size, len(scheduler.running), waiting)


def summarize(records: list[Occupancy]) -> dict:
    """Mean fraction of the pool per category over the loaded steps (a request waiting), the
    number of such steps, and the most and mean sequences in flight over them."""
    loaded = [r for r in records if r.waiting] or records
    capacity = records[0].total
    means = {name: sum(getattr(r, name) for r in loaded) / (len(loaded) * capacity)
             for name in CATEGORIES}
    return dict(means, loaded_steps=sum(1 for r in records if r.waiting), steps=len(records),
                max_in_flight=max(r.in_flight for r in records),
                mean_in_flight=sum(r.in_flight for r in loaded) / len(loaded))
