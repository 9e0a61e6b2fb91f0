"""The host's ledger of KV memory: the only writer of the block-manager mirror and the only
producer of block operations.

Every decision about blocks goes through here: the ledger applies a typed operation
(`jpaged.blocks.ops`) to the mirror at once and queues the same operation for the device
(`take_ops`), so the device allocator, replaying the queue in order, stays block-for-block equal
to the mirror. It also keeps the block-manager rows ("slots") sequences occupy, the prefix
cache's index and evictions, the host blocks that hold swapped-out KV, and the replay of what a
device decode loop did to the device allocator on its own.

Pipelined decode loops are the one place where mirror and device part in time: an operation
dispatched while loops are in flight lands on the device after the newest of them, so its mirror
half waits until that loop is replayed. The methods that queue such an operation (`defer_free`,
`room_behind_loop`, `invalidate_prefix_cache`, `trim_window` with `behind_loop`) return its
mirror half, which the caller runs, in the order the operations were queued, once the newest loop
is replayed. Decode loops never free blocks themselves (a retired row keeps its blocks until the
host frees it), so a retain queued behind loops always finds its block still held.
"""

import itertools
import weakref
from collections.abc import Callable

from jpaged.blocks.mirror import HostBlockMirror
from jpaged.blocks.ops import (Adopt, Append, BlockOp, Copy, Fork, Free, Pop, Release, Retain,
                               SwapDrop, SwapIn, SwapOut, Trim)
from jpaged.blocks.prefix_cache import PrefixCache
from jpaged.kv_cache import SINK_BLOCK
from jpaged.request import Request, Sequence, SwapRecord


class BlockLedger:
    """Mirror + operation queue + free slots + prefix cache (off: share nothing) + host swap
    blocks (`num_swap_blocks`)."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_blocks_per_seq: int, *, enable_prefix_caching: bool = False,
                 num_swap_blocks: int = 0):
        self._mirror = HostBlockMirror(num_blocks, block_size, max_num_seqs, max_blocks_per_seq)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        self._ops: list[BlockOp] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_swap_blocks = num_swap_blocks
        self.free_host_blocks = list(range(num_swap_blocks - 1, -1, -1))
        self._handles = itertools.count()
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_trimmed_blocks = 0     # blocks let go by trim_window (a sliding window)
        self._stale: weakref.WeakSet[Sequence] = weakref.WeakSet()  # KV from replaced weights

    # ---- the queue --------------------------------------------------------------------------
    def take_ops(self) -> list[BlockOp]:
        """The operations decided since the last call, in order, for the device."""
        ops, self._ops = self._ops, []
        return ops

    @property
    def has_ops(self) -> bool:
        return bool(self._ops)

    def _do(self, op: BlockOp):
        """Apply op to the mirror now and queue it for the device."""
        self._ops.append(op)
        return op.apply(self._mirror)

    # ---- counts -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free stack (cached blocks nobody holds are not counted)."""
        return self._mirror.num_free

    @property
    def num_available(self) -> int:
        """Blocks a new request can get: the free stack plus cached blocks no request holds."""
        return self.num_free + self.num_evictable()

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_slots(self) -> tuple[int, ...]:
        return tuple(self._free_slots)

    @property
    def mirror(self) -> HostBlockMirror:
        """Read-only view for tests and diagnostics; only the ledger writes it."""
        return self._mirror

    def blocks_needed(self, rows: list[tuple[int, int]], holders: dict) -> int:
        """New blocks appending (slot, num_tokens) rows would pop (see HostBlockMirror)."""
        return self._mirror.blocks_needed(rows, holders)

    # ---- slots ------------------------------------------------------------------------------
    def take_slots(self, count: int) -> list[int]:
        return [self._free_slots.pop() for _ in range(count)]

    def return_slots(self, slots: list[int]):
        self._free_slots.extend(slots)

    # ---- appends ----------------------------------------------------------------------------
    def append(self, rows: list[tuple[int, int]]) -> bool:
        """Plan appending (slot, num_tokens) rows, in batch order, as the next step's device
        append will: the device allocates the same blocks itself, so only the copy-on-write
        contents are queued (a Copy). False (nothing changed) if the pool cannot serve them."""
        ok, _, copies = self._mirror.append(rows)
        planned = tuple(copy for copy in copies if copy is not None)
        if planned:
            self._ops.append(Copy(planned))
        return ok

    def append_unwritten(self, rows: list[tuple[int, int]]):
        """(slot, num_tokens) rows grow now, in the mirror and (queued) on the device, with no
        KV written: for context nobody reads (a benchmark's)."""
        if rows:
            self._do(Append(tuple(rows)))

    def append_skipped(self, rows: list[tuple[int, int]]):
        """A step planned with `append` did not run: queue its appends for the device alone
        (the mirror has them), so both allocators agree again. Must come before any operation
        decided after that `append`."""
        if rows:
            self._ops.append(Append(tuple(rows)))

    def trim_window(self, sequences: list[Sequence], window: int, *,
                    behind_loop: bool = False) -> Callable[[], None] | None:
        """For a model whose every layer slides a `window`: let go of the blocks no future
        query of these sequences can see. The next token to compute sits at num_computed and
        sees positions above num_computed - window, so a block is dead once its last position
        is at most num_computed - window. With the prefix cache on, only blocks it has been
        offered are let go (an entry it has not seen must not turn into the sink first).

        behind_loop: decode loops are in flight (num_computed counts the replayed ones; the
        loops in flight only write later positions and never read a dead block): the trim is
        queued and its mirror half returned (None if nothing was trimmed)."""
        rows = []
        for seq in sequences:
            dead = max(0, (seq.num_computed - window + 1) // self.block_size)
            if self.prefix_cache is not None:
                dead = min(dead, seq.num_indexed)
            if seq.slot >= 0 and dead > seq.num_trimmed:
                rows.append((seq.slot, dead))
                self.num_trimmed_blocks += dead - seq.num_trimmed
                seq.num_trimmed = dead
        if not rows:
            return None
        if behind_loop:
            return self._queue_behind_loop(Trim(tuple(rows)))
        self._released(self._do(Trim(tuple(rows))))
        return None

    # ---- frees and forks --------------------------------------------------------------------
    def release(self, sequences: list[Sequence], *, index: bool = True):
        """Sequences give up their blocks and slots (their full blocks offered to the prefix
        cache first, unless index=False)."""
        if index:
            self.index(sequences)
        slots = [seq.slot for seq in sequences if seq.slot >= 0]
        self.free(slots)
        self._free_slots.extend(reversed(slots))
        for seq in sequences:
            seq.slot, seq.num_computed, seq.num_indexed, seq.num_trimmed = -1, 0, 0, 0
            self._stale.discard(seq)

    def free(self, slots: list[int]):
        """Free rows' blocks in the mirror and (queued) on the device."""
        if slots:
            self._released(self._do(Free(tuple(slots))))

    def _released(self, touched: list[int]):
        if self.prefix_cache is not None:
            self.prefix_cache.released(touched, self._mirror.refcounts)

    def fork(self, pairs: list[tuple[int, int]]):
        """(parent slot, child slot) pairs: each empty child shares all its parent's blocks."""
        if pairs:
            self._do(Fork(tuple(pairs)))

    def fork_children(self, request: Request, children: list[Sequence]):
        """Children share all of sequence 0's blocks; their slots were reserved at admission."""
        parent = request.sequences[0]
        pairs = []
        for child in children:
            child.slot = request.reserved_slots.pop()
            child.num_computed, child.num_trimmed = parent.num_computed, parent.num_trimmed
            pairs.append((parent.slot, child.slot))
        self.fork(pairs)

    # ---- operations behind decode loops in flight --------------------------------------------
    def _queue_behind_loop(self, op: BlockOp, *, released: bool = True) -> Callable[[], None]:
        """Queue op for the device now (it lands after the newest decode loop in flight) and
        return its mirror half, to run once that loop is replayed. released: tell the prefix
        cache which blocks lost a reference (not for its own releases)."""
        self._ops.append(op)

        def mirror_half():
            touched = op.apply(self._mirror)
            if released:
                self._released(touched)
        return mirror_half

    def defer_free(self, sequences: list[Sequence]) -> Callable[[], None]:
        """Free sequences that loops in flight may still hold: the device free is queued now
        (it lands after the newest of them); returns the mirror half, which also gives their
        slots back."""
        slots = tuple(seq.slot for seq in sequences if seq.slot >= 0)
        free = self._queue_behind_loop(Free(slots)) if slots else None

        def mirror_half():
            if free is not None:
                free()
            self._release_slots(sequences)
        return mirror_half

    def _release_slots(self, sequences: list[Sequence]):
        """Sequences whose blocks are already free on both sides: slots only."""
        for seq in sequences:
            if seq.slot >= 0:
                self._free_slots.append(seq.slot)
            seq.slot, seq.num_computed, seq.num_indexed, seq.num_trimmed = -1, 0, 0, 0
            self._stale.discard(seq)

    # ---- prefix cache -----------------------------------------------------------------------
    def index(self, sequences):
        """Offer sequences' full, computed blocks to the prefix cache, which retains the ones it
        indexes. The mirror must hold these blocks as the device will when the retain lands:
        a block full as of the last replayed loop never changes, and a sequence live in loops
        in flight keeps its blocks until its free, queued after this retain (loops never free
        a sequence's blocks themselves). Blocks past the sequence's kept tokens (tokens of
        loops in flight that a finish on the host dropped) are not offered."""
        cache = self.prefix_cache
        if cache is None:
            return
        size, retained = self.block_size, []
        for seq in sequences:
            full = min(seq.num_computed, len(seq.token_ids)) // size
            if seq.slot < 0 or seq.num_indexed >= full or seq in self._stale:
                continue
            table = self._mirror.tables[seq.slot]
            keys = cache.keys_for(seq.token_ids, seq.block_keys, full)
            for i in range(seq.num_indexed, full):
                tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
                if cache.insert(keys[i], table[i], table[i - 1] if i else None, tokens):
                    retained.append(table[i])
            seq.num_indexed = full
        if retained:
            self._do(Retain(tuple(retained)))

    def num_evictable(self, protected=()) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.num_evictable(protected)

    def evict(self, count: int, protected=()) -> bool:
        """Make `count` more blocks free by evicting cached ones; False (nothing evicted) if the
        cache cannot."""
        if count <= 0:
            return True
        if self.num_evictable(protected) < count:
            return False
        self._do(Release(tuple(self.prefix_cache.evict(count, protected))))
        return True

    def evict_all(self):
        """Return every cached block nobody holds to the free stack."""
        self.evict(self.num_evictable())

    def invalidate_prefix_cache(self, live: list[Sequence], *,
                                behind_loop: bool) -> Callable[[], None] | None:
        """The KV cached so far came from other weights: unindex every cached block (held ones
        too, so no new request adopts them) and release the cache's reference on each, and never
        index the `live` sequences' blocks (what they computed so far is stale too; a sequence
        that gives up its blocks, e.g. to be recomputed, is indexable again).

        behind_loop: decode loops are in flight; the device release lands after them, and its
        mirror half is returned. Otherwise the mirror is updated now; None is returned then and
        when there was nothing to release."""
        self._stale.update(live)
        if self.prefix_cache is None:
            return None
        dropped = tuple(self.prefix_cache.clear())
        if not dropped:
            return None
        if behind_loop:
            return self._queue_behind_loop(Release(dropped), released=False)
        self._do(Release(dropped))
        return None

    def lookup(self, sequences: list[Sequence]) -> list[list[int]]:
        """Cached leading blocks per sequence (at least one token is left to compute)."""
        if self.prefix_cache is None:
            return [[] for _ in sequences]
        size = self.block_size
        return [self.prefix_cache.match(seq.token_ids, seq.block_keys,
                                        (len(seq.token_ids) - 1) // size) for seq in sequences]

    def adopt_hits(self, sequences: list[Sequence], hits: list[list[int]]):
        """Sequences (with slots, empty) take their cached blocks: +1 reference each."""
        if self.prefix_cache is None:
            return
        size = self.block_size
        for seq, seq_hits in zip(sequences, hits):
            self.prefix_cache.record_lookup(len(seq.token_ids), len(seq_hits) * size)
            self.prefix_cache.acquire(seq_hits)
            seq.num_indexed = len(seq_hits)
        items = tuple((seq.slot, tuple(seq_hits), len(seq_hits) * size)
                      for seq, seq_hits in zip(sequences, hits) if seq_hits)
        if items:
            self._do(Adopt(items))

    # ---- room for decode loops (they allocate on the device, from the free stack only) ------
    def make_room_for_loop(self, sequences: list[Sequence], num_tokens: int):
        """Before a decode loop is launched (none in flight): evict cached blocks until the free
        stack can serve num_tokens more tokens for every sequence. Best effort: what the cache
        cannot give, the loop reports as out_of_blocks and the next schedule preempts."""
        deficit = (self._mirror.blocks_for_tokens([seq.slot for seq in sequences], num_tokens)
                   - self._mirror.num_free)
        if deficit > 0:
            self.evict(min(deficit, self.num_evictable()))

    def room_behind_loop(self, sequences: list[Sequence],
                         num_tokens: int) -> Callable[[], None] | None:
        """While loops are in flight (their tokens not yet in the mirror): make the free stack
        able to serve num_tokens more tokens per sequence, counted from the mirror, by evicting
        cached blocks behind the loops (the device release queued now). Returns the mirror
        half (a no-op if nothing had to be evicted), or None if the cache cannot make the room
        (nothing evicted)."""
        deficit = (self._mirror.blocks_for_tokens([seq.slot for seq in sequences], num_tokens)
                   - self._mirror.num_free)
        if deficit <= 0:
            return lambda: None
        if self.num_evictable() < deficit:
            return None
        return self._queue_behind_loop(Release(tuple(self.prefix_cache.evict(deficit, ()))),
                                       released=False)

    def replay_decode_loop(self, slots: list[int], active: list[bool], done_at: list[int],
                           num_done: int, first_planned: bool):
        """Repeat on the mirror what a device decode loop did to the allocator: iteration i
        appends one token to every row live at i (a row that finished at i appended at i and
        keeps its blocks: the host frees them). When `first_planned`, `append` already planned
        iteration 0."""
        first = int(first_planned)  # the first iteration still to replay
        mirror, size = self._mirror, self.block_size
        if not first_planned and any(
                live and mirror.seq_lens[slot] % size
                and mirror.refcounts[mirror.tables[slot][-1]] > 1
                for slot, live in zip(slots, active)):
            return self._replay_by_iteration(slots, active, done_at, num_done, first)
        # Only block-boundary crossings change the free stack, so replay those in the device's
        # order (iteration, then batch order) instead of every token: O(events), not
        # O(rows x iterations).
        events, grown = [], []
        for index, (slot, live, done) in enumerate(zip(slots, active, done_at)):
            if not live:
                continue
            last = done if done >= 0 else num_done - 1   # the last iteration it appended at
            # iteration i appends the token at position seq_len + i - first
            events += [(step, index) for step in
                       range(first + (-mirror.seq_lens[slot]) % size, last + 1, size)]
            grown.append((slot, last + 1 - first))
        for _, index in sorted(events):
            mirror.add_block(slots[index])
        for slot, count in grown:
            mirror.seq_lens[slot] += count

    def _replay_by_iteration(self, slots, active, done_at, num_done: int, first: int):
        """replay_decode_loop one iteration at a time: the general case (copies-on-write)."""
        for step in range(num_done):
            if step >= first:
                ok, _, _ = self._mirror.append([
                    (slot, 1) for slot, live, done in zip(slots, active, done_at)
                    if live and (done < 0 or done >= step)])
                assert ok, "device decode loop appended what the mirror cannot"

    # ---- swap -------------------------------------------------------------------------------
    def distinct_blocks(self, sequences) -> list[int]:
        return list(dict.fromkeys(b for seq in sequences for b in self._mirror.tables[seq.slot]
                                  if b != SINK_BLOCK))

    def swap_out(self, request: Request, live: list[Sequence], blocks: list[int]):
        """Copy the live sequences' distinct blocks to host blocks (one transfer), then free
        them and their slots; the sequences keep num_computed."""
        host_ids = [self.free_host_blocks.pop() for _ in blocks]
        position = {block: i for i, block in enumerate(blocks)} | {SINK_BLOCK: -1}
        request.swap = SwapRecord(
            next(self._handles), host_ids,
            {seq.index: [position[b] for b in self._mirror.tables[seq.slot]] for seq in live},
            {seq.index: seq.num_computed for seq in live})
        self._ops.append(SwapOut(request.swap.handle, tuple(blocks)))
        self.num_swapped_out_blocks += len(blocks)
        slots = [seq.slot for seq in live]
        self.free(slots)
        self._free_slots.extend(reversed(slots))
        for seq in live:
            seq.slot = -1
            seq.num_indexed = seq.num_computed // self.block_size  # copies: not indexed

    def swap_in(self, request: Request):
        """Pop fresh blocks, give each live sequence (slots assigned) its table, copy the host
        blocks in (one transfer)."""
        record = request.swap
        fresh = self._do(Pop(len(record.host_ids)))
        self._do(Adopt(tuple((seq.slot, tuple(fresh[i] if i >= 0 else SINK_BLOCK
                                              for i in record.tables[seq.index]),
                              record.lengths[seq.index]) for seq in request.live_sequences)))
        self._ops.append(SwapIn(record.handle, tuple(fresh)))
        self.num_swapped_in_blocks += len(fresh)
        self.free_host_blocks.extend(record.host_ids)
        request.swap = None

    def drop_swap(self, request: Request):
        self._ops.append(SwapDrop(request.swap.handle))
        self.free_host_blocks.extend(request.swap.host_ids)
        request.swap = None
