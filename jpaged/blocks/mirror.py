"""Host-side mirror of the block manager: predicts every device allocation without a sync.

It runs the same deterministic algorithm as `jpaged.blocks.allocator` on plain Python/numpy data, one
operation per scheduler decision, so the scheduler knows block ids (for prefix caching and swap)
and the free count before the device has run. Tests hold the device functions to it, block id
for block id.
"""

from jpaged.kv_cache import PAD_SLOT, SINK_BLOCK


class HostBlockMirror:
    """The allocator state on the host: free stack, refcounts, tables as lists, lengths."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int):
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_blocks = num_blocks
        self.free_stack = list(range(num_blocks - 1, 0, -1))   # top = end of list
        # Plain lists: numpy scalar indexing would cost more than the arithmetic here.
        self.refcounts = [0] * num_blocks
        self.refcounts[SINK_BLOCK] = 1
        self.tables: list[list[int]] = [[] for _ in range(max_seqs)]
        self.seq_lens = [0] * max_seqs
        self.num_popped = 0          # blocks ever taken off the free stack (for accounting)

    @property
    def num_free(self) -> int:
        return len(self.free_stack)

    def blocks_needed(self, rows: list[tuple[int, int]], holders: dict | None = None) -> int:
        """New blocks appending rows of (seq_id, num_tokens) in batch order would pop.

        Copy-on-write included: of several rows writing into one shared partial block, each copies
        while another holder remains, so the last holder writes in place. `holders` carries the
        remaining holders of shared blocks between calls, so a batch can be costed piecewise
        (pass the same dict for rows appended after earlier ones); it is updated in place.
        """
        size, total = self.block_size, 0
        holders = {} if holders is None else holders
        for seq_id, count in rows:
            if seq_id < 0 or count == 0:
                continue
            old_len = self.seq_lens[seq_id]
            total += -(-(old_len + count) // size) - (-(-old_len // size))
            if old_len % size:
                last = self.tables[seq_id][-1]
                remaining = holders.get(last, self.refcounts[last])
                if remaining > 1:
                    total += 1
                    holders[last] = remaining - 1
        return total

    def blocks_for_tokens(self, seq_ids: list[int], num_tokens: int) -> int:
        """Most blocks appending num_tokens to each of seq_ids could pop: boundary crossings,
        plus a copy-on-write where a partly filled last block is shared."""
        size, total = self.block_size, 0
        for seq_id in seq_ids:
            if seq_id < 0:
                continue
            length = self.seq_lens[seq_id]
            total += -(-(length + num_tokens) // size) - (-(-length // size))
            if length % size and self.refcounts[self.tables[seq_id][-1]] > 1:
                total += 1
        return total

    def append(self, rows: list[tuple[int, int]]):
        """Mirror of append_tokens over (seq_id, num_tokens) rows in batch order.

        Returns (ok, slots per row, copies as (src, dst) per row or None). All or nothing.
        """
        total = self.blocks_needed(rows)
        fits = all(-(-(self.seq_lens[s] + n) // self.block_size) <= self.max_blocks_per_seq
                   for s, n in rows if s >= 0)
        if total > self.num_free or not fits:
            return False, [[] for _ in rows], [None for _ in rows]
        all_slots, all_copies = [], []
        for seq_id, count in rows:
            if seq_id < 0:
                all_slots.append([])
                all_copies.append(None)
                continue
            copy = None
            table = self.tables[seq_id]
            old_len = self.seq_lens[seq_id]
            if count and old_len % self.block_size and self.refcounts[table[-1]] > 1:
                fresh = self._pop()
                copy = (table[-1], fresh)
                self.refcounts[table[-1]] -= 1
                self.refcounts[fresh] = 1
                table[-1] = fresh
            while len(table) * self.block_size < old_len + count:
                fresh = self._pop()
                self.refcounts[fresh] = 1
                table.append(fresh)
            positions = range(old_len, old_len + count)
            all_slots.append([table[p // self.block_size] * self.block_size + p % self.block_size
                              for p in positions])
            all_copies.append(copy)
            self.seq_lens[seq_id] = old_len + count
        return True, all_slots, all_copies

    def add_block(self, seq_id: int):
        """A fresh block at the end of seq_id's table: a decode-loop append that crossed a block
        boundary, replayed (the length is the caller's to update)."""
        fresh = self._pop()
        self.refcounts[fresh] = 1
        self.tables[seq_id].append(fresh)

    def free(self, seq_ids: list[int]) -> list[int]:
        """Mirror of free_seqs: decrement all, then push zeros in first-occurrence order.
        Returns the blocks that lost a reference, in table order."""
        touched = [b for s in seq_ids if s >= 0 for b in self.tables[s] if b != SINK_BLOCK]
        self._drop(touched)
        for s in seq_ids:
            if s >= 0:
                self.tables[s] = []
                self.seq_lens[s] = 0
        return touched

    def trim(self, rows: list[tuple[int, int]]) -> list[int]:
        """Mirror of trim_seqs over (seq_id, num_dead) rows: the leading entries drop their
        reference and become SINK_BLOCK. Returns the blocks that lost a reference, in order."""
        touched = []
        for seq_id, num_dead in rows:
            table = self.tables[seq_id]
            for i in range(min(num_dead, len(table))):
                if table[i] != SINK_BLOCK:
                    touched.append(table[i])
                    table[i] = SINK_BLOCK
        self._drop(touched)
        return touched

    def _drop(self, blocks: list[int]):
        for block in blocks:
            self.refcounts[block] -= 1
        seen = set()
        for block in blocks:
            if block not in seen and self.refcounts[block] == 0:
                self.free_stack.append(block)
            seen.add(block)

    def retain(self, blocks: list[int]):
        """Mirror of retain_blocks."""
        for block in blocks:
            self.refcounts[block] += 1

    def release(self, blocks: list[int]):
        """Mirror of release_blocks."""
        self._drop(blocks)

    def pop(self, count: int) -> list[int]:
        """Mirror of pop_blocks: the ids taken, in pop order."""
        if count > self.num_free:
            raise ValueError(f"pop of {count} blocks with {self.num_free} free")
        return [self._pop() for _ in range(count)]

    def _pop(self) -> int:
        self.num_popped += 1
        return self.free_stack.pop()

    def adopt(self, items: list[tuple[int, list[int], int]]):
        """Mirror of adopt_blocks over (seq_id, blocks, length) items; blocks has exactly
        ceil(length / S) entries and the sequence is empty."""
        for seq_id, blocks, length in items:
            assert not self.tables[seq_id], "adopt into a sequence that holds blocks"
            assert len(blocks) == -(-length // self.block_size)
            for block in blocks:
                if block != SINK_BLOCK:
                    self.refcounts[block] += 1
            self.tables[seq_id] = list(blocks)
            self.seq_lens[seq_id] = length

    def fork(self, pairs: list[tuple[int, int]]):
        """Mirror of fork_seqs over (parent, child) pairs."""
        for parent, child in pairs:
            if child < 0:
                continue
            for block in self.tables[parent]:
                if block != SINK_BLOCK:
                    self.refcounts[block] += 1
            self.tables[child] = list(self.tables[parent])
            self.seq_lens[child] = self.seq_lens[parent]

    def padded_table(self, seq_id: int) -> list[int]:
        """The device-format row: owned blocks, then SINK_BLOCK up to M entries."""
        table = self.tables[seq_id]
        return table + [SINK_BLOCK] * (self.max_blocks_per_seq - len(table))


__all__ = ["HostBlockMirror", "PAD_SLOT"]
