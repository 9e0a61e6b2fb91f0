"""The host's ledger of KV memory: every block operation the scheduler decides, applied to the
block-manager mirror at once and queued (`pending_ops`) for the device in the same order; the
prefix cache's index and evictions; the host blocks that hold swapped-out KV.

Identical operation sequences keep the mirror and the device block-for-block identical, so the
runner replays `pending_ops` before the next step. Operation kinds: ("free", slots), ("fork",
pairs), ("retain", blocks), ("release", blocks), ("pop", count), ("adopt", [(slot, blocks,
length)]), ("copy", [(src, dst)]: copy-on-write contents of the next step's appends, whose
destinations the device allocates itself), ("swap_out", (handle, blocks)), ("swap_in", (handle,
blocks)), ("swap_drop", handle).
"""

import itertools

from jpaged.blocks.mirror import HostBlockMirror
from jpaged.blocks.prefix_cache import PrefixCache
from jpaged.request import Request, Sequence, SwapRecord


class BlockLedger:
    """Mirror + device-op queue + prefix cache (None: share nothing) + host swap blocks."""

    def __init__(self, mirror: HostBlockMirror, *, prefix_cache: PrefixCache | None = None,
                 num_swap_blocks: int = 0):
        self.mirror = mirror
        self.prefix_cache = prefix_cache
        self.pending_ops: list[tuple[str, object]] = []
        self.num_swap_blocks = num_swap_blocks
        self.free_host_blocks = list(range(num_swap_blocks - 1, -1, -1))
        self._handles = itertools.count()
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def queue(self, kind: str, items):
        self.pending_ops.append((kind, items))

    def queue_copies(self, copies):
        """Copy-on-write contents for an append the mirror just planned (its per-row (src, dst)
        or None): the device allocates the same destinations in its append but copies nothing."""
        planned = [copy for copy in copies if copy is not None]
        if planned:
            self.queue("copy", planned)

    @property
    def num_free(self) -> int:
        return self.mirror.num_free

    # ---- frees and forks --------------------------------------------------------------------
    def free(self, slots: list[int]):
        """Free sequences' blocks in the mirror and (queued) on the device."""
        if slots:
            self.free_in_mirror(slots)
            self.queue("free", slots)

    def free_in_mirror(self, slots: list[int]):
        """The mirror half of a free the device does itself (in a decode loop) or was sent."""
        touched = self.mirror.free(slots)
        if self.prefix_cache is not None:
            self.prefix_cache.released(touched, self.mirror.refcounts)

    def fork(self, pairs: list[tuple[int, int]]):
        self.mirror.fork(pairs)
        self.queue("fork", pairs)

    # ---- prefix cache -----------------------------------------------------------------------
    def index(self, sequences):
        """Offer sequences' full, computed blocks to the prefix cache, which retains the ones it
        indexes. Only where the mirror is in step with the device for these sequences (no
        decode loop in flight holds them)."""
        cache = self.prefix_cache
        if cache is None:
            return
        size, retained = self.mirror.block_size, []
        for seq in sequences:
            full = seq.num_computed // size
            if seq.slot < 0 or seq.num_indexed >= full:
                continue
            table = self.mirror.tables[seq.slot]
            keys = cache.keys_for(seq.token_ids, seq.block_keys, full)
            for i in range(seq.num_indexed, full):
                tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
                if cache.insert(keys[i], table[i], table[i - 1] if i else None, tokens):
                    retained.append(table[i])
            seq.num_indexed = full
        if retained:
            self.mirror.retain(retained)
            self.queue("retain", retained)

    def num_evictable(self, protected=()) -> int:
        return 0 if self.prefix_cache is None else self.prefix_cache.num_evictable(protected)

    def evict(self, count: int, protected=()) -> bool:
        """Make `count` more blocks free by evicting cached ones; False (nothing evicted) if the
        cache cannot."""
        if count <= 0:
            return True
        if self.num_evictable(protected) < count:
            return False
        dropped = self.prefix_cache.evict(count, protected)
        self.mirror.release(dropped)
        self.queue("release", dropped)
        return True

    def evict_behind_loop(self, count: int) -> list[int] | None:
        """Evict `count` cached blocks while a decode loop is in flight: the device release is
        queued now (it lands after that loop), and the caller applies the returned blocks to the
        mirror with `release_in_mirror` after replaying the loop, keeping the free stacks in the
        same order. None (nothing evicted) if the cache cannot."""
        if self.num_evictable() < count:
            return None
        dropped = self.prefix_cache.evict(count, ())
        self.queue("release", dropped)
        return dropped

    def release_in_mirror(self, blocks: list[int]):
        self.mirror.release(blocks)

    def lookup(self, sequences: list[Sequence]) -> list[list[int]]:
        """Cached leading blocks per sequence (at least one token is left to compute)."""
        if self.prefix_cache is None:
            return [[] for _ in sequences]
        size = self.mirror.block_size
        return [self.prefix_cache.match(seq.token_ids, seq.block_keys,
                                        (len(seq.token_ids) - 1) // size) for seq in sequences]

    def adopt_hits(self, sequences: list[Sequence], hits: list[list[int]]):
        """Sequences (with slots, empty) take their cached blocks: +1 reference each."""
        if self.prefix_cache is None:
            return
        size = self.mirror.block_size
        for seq, seq_hits in zip(sequences, hits):
            self.prefix_cache.record_lookup(len(seq.token_ids), len(seq_hits) * size)
            self.prefix_cache.acquire(seq_hits)
            seq.num_indexed = len(seq_hits)
        items = [(seq.slot, seq_hits, len(seq_hits) * size)
                 for seq, seq_hits in zip(sequences, hits) if seq_hits]
        if items:
            self.mirror.adopt(items)
            self.queue("adopt", items)

    # ---- swap -------------------------------------------------------------------------------
    def distinct_blocks(self, sequences) -> list[int]:
        return list(dict.fromkeys(b for seq in sequences for b in self.mirror.tables[seq.slot]))

    def swap_out(self, request: Request, live: list[Sequence], blocks: list[int]):
        """Copy the live sequences' distinct blocks to host blocks (one transfer), then free
        them on the device; the sequences keep num_computed and lose their slots."""
        host_ids = [self.free_host_blocks.pop() for _ in blocks]
        position = {block: i for i, block in enumerate(blocks)}
        request.swap = SwapRecord(
            next(self._handles), host_ids,
            {seq.index: [position[b] for b in self.mirror.tables[seq.slot]] for seq in live},
            {seq.index: seq.num_computed for seq in live})
        self.queue("swap_out", (request.swap.handle, blocks))
        self.num_swapped_out_blocks += len(blocks)
        self.free([seq.slot for seq in live])
        for seq in live:
            seq.slot = -1
            seq.num_indexed = seq.num_computed // self.mirror.block_size  # copies: not indexed

    def swap_in(self, request: Request):
        """Pop fresh blocks, give each live sequence (slots assigned) its table, copy the host
        blocks in (one transfer)."""
        record = request.swap
        fresh = self.mirror.pop(len(record.host_ids))
        self.queue("pop", len(fresh))
        items = [(seq.slot, [fresh[i] for i in record.tables[seq.index]],
                  record.lengths[seq.index]) for seq in request.live_sequences]
        self.mirror.adopt(items)
        self.queue("adopt", items)
        self.queue("swap_in", (record.handle, fresh))
        self.num_swapped_in_blocks += len(fresh)
        self.free_host_blocks.extend(record.host_ids)
        request.swap = None

    def drop_swap(self, request: Request):
        self.queue("swap_drop", request.swap.handle)
        self.free_host_blocks.extend(request.swap.host_ids)
        request.swap = None
