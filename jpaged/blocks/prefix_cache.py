"""Automatic prefix caching on the host: an index of full KV blocks by the tokens they hold.

A full block is keyed by `block_hash(parent_hash, its tokens)`, so a key names the whole prefix up
to and including the block. The cache holds one reference of its own on every block it indexes
(`allocator.retain_blocks`), so a block no sequence holds any more stays intact; such blocks are the
evictable ones, evicted least-recently-released first and only when the free stack cannot serve a
step. A sequence's blocks are released tail first, so a partly evicted chain keeps its head.

The hash only finds candidates. A hit is confirmed against the entry's stored token ids and its
parent block id, and an entry exists only while its parent's entry does (evicting a block
unregisters its descendants), so a confirmed chain holds exactly the KV of the prompt's prefix:
a hash collision can cost a hit, never serve wrong KV.
"""

import collections
import dataclasses

ROOT = None   # the parent hash of a sequence's first block


def block_hash(parent_hash, token_ids: tuple) -> int:
    """The key of a full block: its tokens chained with its parent block's key."""
    return hash((parent_hash, token_ids))


@dataclasses.dataclass
class CachedBlock:
    key: int
    parent: int | None          # parent block id (None: first block of a sequence)
    token_ids: tuple
    children: set = dataclasses.field(default_factory=set)


class PrefixCache:
    """block id <-> key index, the evictable (cache-only) set in LRU order, and hit counters.

    The caller (the scheduler) owns the block manager: this class decides, the caller applies the
    matching retain/release operations to the mirror and the device.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.by_key: dict[int, int] = {}
        self.entries: dict[int, CachedBlock] = {}
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens, over every lookup so far."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def keys_for(self, token_ids: list[int], memo: list[int], count: int) -> list[int]:
        """The keys of the first `count` full blocks of token_ids; `memo` (a sequence's list of
        keys computed so far) is extended in place and reused."""
        size = self.block_size
        while len(memo) < count:
            index = len(memo)
            parent = memo[-1] if memo else ROOT
            memo.append(block_hash(parent, tuple(token_ids[index * size:(index + 1) * size])))
        return memo[:count]

    def match(self, token_ids: list[int], memo: list[int], max_blocks: int) -> list[int]:
        """The longest confirmed run of cached blocks holding token_ids' first blocks (at most
        max_blocks). Changes nothing (a lookup counts once admitted: `record_lookup`)."""
        size = self.block_size
        hits: list[int] = []
        parent = None
        for index, key in enumerate(self.keys_for(token_ids, memo, max_blocks)):
            block = self.by_key.get(key)
            entry = self.entries.get(block) if block is not None else None
            if (entry is None or entry.parent != parent or entry.token_ids
                    != tuple(token_ids[index * size:(index + 1) * size])):
                break
            hits.append(block)
            parent = block
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int):
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def is_cached(self, block: int) -> bool:
        return block in self.entries

    def insert(self, key: int, block: int, parent: int | None, token_ids: tuple) -> bool:
        """Index a full block whose parent (None for a first block) is indexed. False (nothing
        indexed) when the key is taken or the parent is not indexed; on True the caller retains
        the block."""
        if key in self.by_key or block in self.entries:
            return False
        if parent is not None and parent not in self.entries:
            return False
        self.by_key[key] = block
        self.entries[block] = CachedBlock(key, parent, token_ids)
        if parent is not None:
            self.entries[parent].children.add(block)
        return True

    def acquire(self, blocks: list[int]):
        """Blocks a sequence now holds (a hit): no longer evictable."""
        for block in blocks:
            self.evictable.pop(block, None)

    def released(self, blocks: list[int], refcounts):
        """Blocks that just lost a holder (in table order): the indexed ones only the cache holds
        now become evictable, tail first, after everything released earlier."""
        for block in reversed(blocks):
            if block in self.entries and refcounts[block] == 1 and block not in self.evictable:
                self.evictable[block] = None

    def num_evictable(self, protected=()) -> int:
        return len(self.evictable) - sum(1 for block in protected if block in self.evictable)

    def evict(self, count: int, protected=()) -> list[int]:
        """Unindex at least `count` evictable blocks, least recently released first, skipping
        `protected`, and with them every indexed descendant. Returns every unindexed block: the
        caller releases the cache's reference on each (evictable ones go back on the stack)."""
        dropped: list[int] = []
        chosen = []
        for block in self.evictable:
            if len(chosen) == count:
                break
            if block not in protected:
                chosen.append(block)
        for block in chosen:
            if block in self.entries:
                self._unindex(block, dropped)
        return dropped

    def clear(self) -> list[int]:
        """Unindex every block, held or not (their KV is no longer what a lookup would expect:
        the weights changed). Returns them: the caller releases the cache's reference on each.
        Hit counters are kept."""
        dropped = list(self.entries)
        self.entries.clear()
        self.by_key.clear()
        self.evictable.clear()
        return dropped

    def _unindex(self, block: int, dropped: list[int]):
        stack = [block]
        while stack:
            current = stack.pop()
            entry = self.entries.pop(current)
            del self.by_key[entry.key]
            if entry.parent is not None and entry.parent in self.entries:
                self.entries[entry.parent].children.discard(current)
            self.evictable.pop(current, None)
            dropped.append(current)
            stack.extend(entry.children)
