"""The block manager: one immutable pytree and pure, jittable functions over it.

State: a free-block stack (the free blocks are `free_stack[:num_free]`, the top is popped first),
per-block refcounts, per-sequence block tables [max_seqs, M] and lengths. Every function takes the
state and returns a new one; none scans all blocks: allocation pops from the stack, freeing pushes
the blocks whose refcount reached zero. Extra references (`retain_blocks`/`release_blocks`) let
the prefix cache keep blocks alive with no sequence holding them; `pop_blocks` + `adopt_blocks`
hand ready-made tables to sequences (prefix hits, swap-in). All work inside `lax.fori_loop`/`while_loop` (the
multi-step decode loop allocates on the device).

Conventions the engine relies on:
- Physical block 0 is the reserved sink (`kv_cache.SINK_BLOCK`): never on the free stack, it fills
  every unused table entry. A sequence of length L owns exactly its first ceil(L / S) entries.
- Sequence id -1 in a batch is a padded row: it allocates nothing, its slots are -1 (`PAD_SLOT`,
  writes dropped), its copies are (-1, -1).
- Out of blocks: the function returns `ok=False` with the state unchanged. The caller must check.
- Ordering is deterministic (stack pops in batch order; pushes in first-occurrence order of
  (sequence, logical block)), so `HostBlockMirror` predicts every block id without a device sync.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.kv_cache import PAD_SLOT, SINK_BLOCK


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["free_stack", "num_free", "refcounts", "block_tables", "seq_lens"],
                   meta_fields=["block_size"])
@dataclasses.dataclass(frozen=True)
class BlockManagerState:
    free_stack: jax.Array    # [N] int32; entries [0, num_free) are the free blocks
    num_free: jax.Array      # [] int32
    refcounts: jax.Array     # [N] int32; 0 = free (the sink's count is pinned at 1)
    block_tables: jax.Array  # [max_seqs, M] int32; unused entries hold SINK_BLOCK
    seq_lens: jax.Array      # [max_seqs] int32; tokens stored per sequence
    block_size: int          # S (static)

    @property
    def num_blocks(self) -> int:
        return self.refcounts.shape[0]

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_mapping", "copies", "ok", "num_blocks_needed"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class AppendResult:
    slot_mapping: jax.Array       # [B, T] int32 physical slot (block * S + offset) per new token
    copies: jax.Array             # [B, 2] int32 copy-on-write (src, dst) per row, (-1, -1) if none
    ok: jax.Array                 # [] bool; False: nothing changed (out of blocks or table full)
    num_blocks_needed: jax.Array  # [] int32 blocks the request asked for


def init_state(num_blocks: int, block_size: int, max_seqs: int,
               max_blocks_per_seq: int) -> BlockManagerState:
    """All blocks but the sink free; block 1 is popped first. Built on the host and moved in one
    transfer: a start compiles no program for it (each jnp op would be one, about ten)."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be at least 2 (one is the sink), got {num_blocks}")
    for name, value in (("block_size", block_size), ("max_seqs", max_seqs),
                        ("max_blocks_per_seq", max_blocks_per_seq)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    refcounts = np.zeros(num_blocks, np.int32)
    refcounts[SINK_BLOCK] = 1
    return jax.device_put(BlockManagerState(
        free_stack=np.append(np.arange(num_blocks - 1, 0, -1, dtype=np.int32), np.int32(0)),
        num_free=np.int32(num_blocks - 1),
        refcounts=refcounts,
        block_tables=np.full((max_seqs, max_blocks_per_seq), SINK_BLOCK, np.int32),
        seq_lens=np.zeros(max_seqs, np.int32),
        block_size=block_size,
    ))


def _cdiv(a, b):
    return (a + b - 1) // b


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _plan(state: BlockManagerState, seq_ids, num_tokens):
    """What an append of num_tokens[b] to seq_ids[b] needs: blocks per row, copy-on-write, ok."""
    size = state.block_size
    active = seq_ids >= 0
    sid = jnp.where(active, seq_ids, 0)
    count = jnp.where(active, num_tokens, 0).astype(jnp.int32)
    old_len = state.seq_lens[sid]
    new_len = old_len + count
    old_blocks, new_blocks = _cdiv(old_len, size), _cdiv(new_len, size)
    last_idx = jnp.minimum(old_len // size, state.max_blocks_per_seq - 1)
    last_block = state.block_tables[sid, last_idx]
    writes_shared = active & (count > 0) & (old_len % size != 0)
    # Rows sharing one partial block copy in batch order while another holder remains, exactly as
    # if appended one by one: with r holders, the first r - 1 writers copy, the last writes in
    # place.
    earlier = jnp.tril(jnp.ones((seq_ids.shape[0],) * 2, bool), -1)
    same_block = (last_block[:, None] == last_block[None]) & writes_shared[None] & earlier
    rank = jnp.sum(same_block, axis=1)
    needs_cow = writes_shared & (rank < state.refcounts[last_block] - 1)
    need = new_blocks - old_blocks + needs_cow
    fits = jnp.all(jnp.where(active, new_blocks <= state.max_blocks_per_seq, True))
    ok = (jnp.sum(need) <= state.num_free) & fits
    return active, sid, count, old_len, new_len, last_idx, last_block, needs_cow, need, ok


def can_append(state: BlockManagerState, seq_ids, num_tokens):
    """[] bool: would append_tokens(state, seq_ids, num_tokens) succeed? Changes nothing."""
    return _plan(state, seq_ids, num_tokens)[-1]


def append_tokens(state: BlockManagerState, seq_ids, num_tokens, *, max_tokens: int):
    """Append num_tokens[b] tokens to each sequence seq_ids[b]; returns (state, AppendResult).

    seq_ids: [B] int32 (-1 = padded row; no id twice); num_tokens: [B] int32 in [0, max_tokens].
    New blocks come off the free stack only where a sequence crosses a block boundary. If the
    sequence's partly filled last block is shared (refcount > 1) and the row writes into it, a
    fresh block replaces it in the table first (copy-on-write) and (src, dst) is returned for the
    cache to copy. Covers prompt allocation (a fresh sequence), one-token decode appends and
    prefill chunks alike. slot_mapping is [B, max_tokens], -1 past each row's count.
    """
    size = state.block_size
    active, sid, count, old_len, new_len, last_idx, last_block, needs_cow, need, ok = _plan(
        state, seq_ids, num_tokens)
    old_blocks = _cdiv(old_len, size)
    total = jnp.sum(need)

    # Row b takes pops offsets[b] .. offsets[b] + need[b] - 1; the CoW block (if any) comes first.
    max_new = _cdiv(max_tokens, size) + 1
    k = jnp.arange(max_new, dtype=jnp.int32)[None]
    pop_index = state.num_free - 1 - (jnp.cumsum(need) - need)[:, None] - k
    taken = k < need[:, None]
    new_ids = state.free_stack[jnp.clip(pop_index, 0, state.num_blocks - 1)]
    logical = jnp.where(needs_cow[:, None], jnp.where(k == 0, last_idx[:, None],
                                                      old_blocks[:, None] + k - 1),
                        old_blocks[:, None] + k)
    row = jnp.where(taken, sid[:, None], state.max_seqs)  # out of range rows are dropped
    tables = state.block_tables.at[row, logical].set(new_ids, mode="drop")
    refcounts = state.refcounts.at[jnp.where(taken, new_ids, state.num_blocks)].set(
        1, mode="drop")
    refcounts = refcounts.at[jnp.where(needs_cow, last_block, state.num_blocks)].add(
        -1, mode="drop")

    t = jnp.arange(max_tokens, dtype=jnp.int32)[None]
    pos = old_len[:, None] + t
    block_of_token = tables[sid[:, None], jnp.minimum(pos // size, state.max_blocks_per_seq - 1)]
    slots = jnp.where((t < count[:, None]) & ok, block_of_token * size + pos % size, PAD_SLOT)
    copies = jnp.where((needs_cow & ok)[:, None],
                       jnp.stack([last_block, new_ids[:, 0]], axis=1), -1)
    new_state = dataclasses.replace(
        state, num_free=state.num_free - total, refcounts=refcounts, block_tables=tables,
        seq_lens=state.seq_lens.at[jnp.where(active, sid, state.max_seqs)].set(
            new_len, mode="drop"))
    result = AppendResult(slot_mapping=slots, copies=copies.astype(jnp.int32), ok=ok,
                          num_blocks_needed=total.astype(jnp.int32))
    return _select(ok, new_state, state), result


def grow_seqs(state: BlockManagerState, seq_ids, num_tokens) -> BlockManagerState:
    """append_tokens without a step: the tables grow (blocks popped, copies-on-write moved) but
    no slot mapping is wanted, so none is kept. For tokens whose KV nobody will read."""
    max_tokens = state.max_blocks_per_seq * state.block_size
    return append_tokens(state, seq_ids, num_tokens, max_tokens=max_tokens)[0]


def allocate_prompt(state, seq_ids, prompt_lens, *, max_prompt_len: int):
    """Blocks for fresh sequences' prompts: ceil(N / S) each. Same contract as append_tokens."""
    return append_tokens(state, seq_ids, prompt_lens, max_tokens=max_prompt_len)


def append_one(state, seq_ids):
    """One decode token per sequence; returns (state, slots [B], copies [B, 2], ok)."""
    state, result = append_tokens(state, seq_ids, jnp.ones_like(seq_ids), max_tokens=1)
    return state, result.slot_mapping[:, 0], result.copies, result.ok


def _drop_references(state: BlockManagerState, ids) -> BlockManagerState:
    """ids [P] (num_blocks = none): each loses one reference; blocks reaching zero go back on the
    stack in first-occurrence order."""
    refcounts = state.refcounts.at[ids].add(-1, mode="drop")
    # An id's first occurrence is the smallest position holding it: a scatter-min over the
    # blocks, not a sort of ids (the decode loop frees B x M entries every step; the argsort
    # was 27 us of an 8B step at B = 64 on the H200, the scatter is a few).
    position = jnp.arange(ids.shape[0], dtype=jnp.int32)
    in_range = ids < state.num_blocks
    block = jnp.minimum(ids, state.num_blocks - 1)
    first_at = jnp.full(state.num_blocks, ids.shape[0], jnp.int32).at[ids].min(
        position, mode="drop")
    is_first = first_at[block] == position
    released = in_range & is_first & (refcounts[block] == 0)
    rank = jnp.cumsum(released) - released
    push_at = jnp.where(released, state.num_free + rank, state.num_blocks)
    free_stack = state.free_stack.at[push_at].set(ids, mode="drop")
    return dataclasses.replace(state, free_stack=free_stack,
                               num_free=state.num_free + jnp.sum(released), refcounts=refcounts)


def _owned(state: BlockManagerState, active, rows, seq_lens):
    """[B, M] bool: the table entries rows [B, M] hold a reference on: the first
    ceil(len / S) of an active row, except SINK_BLOCK entries (blocks a sliding window let go)."""
    return (active[:, None] & (rows != SINK_BLOCK)
            & (jnp.arange(state.max_blocks_per_seq)[None]
               < _cdiv(seq_lens, state.block_size)[:, None]))


def trim_seqs(state: BlockManagerState, seq_ids, num_dead) -> BlockManagerState:
    """The first num_dead[b] table entries of each sequence seq_ids[b] (-1 = padded row) fell
    out of every layer's sliding window: each drops its reference (blocks reaching zero go back
    on the stack in first-occurrence order) and becomes SINK_BLOCK. Lengths are unchanged."""
    active = seq_ids >= 0
    sid = jnp.where(active, seq_ids, 0)
    rows = state.block_tables[sid]                                       # [B, M]
    dead = (_owned(state, active, rows, state.seq_lens[sid])
            & (jnp.arange(state.max_blocks_per_seq)[None] < num_dead[:, None]))
    state = _drop_references(state, jnp.where(dead, rows, state.num_blocks).reshape(-1))
    row = jnp.where(active, sid, state.max_seqs)
    return dataclasses.replace(state, block_tables=state.block_tables.at[row].set(
        jnp.where(dead, SINK_BLOCK, rows), mode="drop"))


def free_seqs(state: BlockManagerState, seq_ids) -> BlockManagerState:
    """Drop sequences (seq_ids [B], -1 = padded row, no id twice): each of their blocks loses one
    reference, and blocks reaching zero go back on the stack in first-occurrence order."""
    active = seq_ids >= 0
    sid = jnp.where(active, seq_ids, 0)
    rows = state.block_tables[sid]                                       # [B, M]
    owned = _owned(state, active, rows, state.seq_lens[sid])
    state = _drop_references(state, jnp.where(owned, rows, state.num_blocks).reshape(-1))
    drop_row = jnp.where(active, sid, state.max_seqs)
    return dataclasses.replace(
        state, block_tables=state.block_tables.at[drop_row].set(SINK_BLOCK, mode="drop"),
        seq_lens=state.seq_lens.at[drop_row].set(0, mode="drop"))


def retain_blocks(state: BlockManagerState, block_ids) -> BlockManagerState:
    """One more reference on each of block_ids [P] (-1 = padding), e.g. the prefix cache's own
    reference on a block it indexes, which keeps the block off the free stack."""
    ids = jnp.where(block_ids < 0, state.num_blocks, block_ids)
    return dataclasses.replace(state, refcounts=state.refcounts.at[ids].add(1, mode="drop"))


def release_blocks(state: BlockManagerState, block_ids) -> BlockManagerState:
    """The inverse of retain_blocks (block_ids [P], -1 = padding): blocks reaching zero
    references go back on the stack in first-occurrence order (prefix-cache eviction)."""
    return _drop_references(state, jnp.where(block_ids < 0, state.num_blocks, block_ids))


def pop_blocks(state: BlockManagerState, count) -> BlockManagerState:
    """Take the top `count` ([] int32) blocks off the free stack without a holder yet; the next
    operation (adopt_blocks) gives them their references. The caller knows the ids from the
    mirror: free_stack[num_free - 1], free_stack[num_free - 2], ... The caller checks count <=
    num_free (the host mirror does)."""
    return dataclasses.replace(state, num_free=state.num_free - count)


def adopt_blocks(state: BlockManagerState, seq_ids, tables, seq_lens) -> BlockManagerState:
    """Give empty sequences seq_ids [B] (-1 = padded row) ready-made tables [B, M] and lengths
    [B]: each owned entry (the first ceil(len / S)) gains one reference. Used for prefix-cache
    hits (cached blocks) and swap-in (blocks just popped)."""
    active = seq_ids >= 0
    owned = _owned(state, active, tables, seq_lens)
    rows = jnp.where(owned, tables, SINK_BLOCK)
    refcounts = state.refcounts.at[jnp.where(owned, tables, state.num_blocks)].add(
        1, mode="drop")
    row = jnp.where(active, seq_ids, state.max_seqs)
    return dataclasses.replace(
        state, refcounts=refcounts,
        block_tables=state.block_tables.at[row].set(rows, mode="drop"),
        seq_lens=state.seq_lens.at[row].set(jnp.where(active, seq_lens, 0), mode="drop"))


def fork_seqs(state: BlockManagerState, parent_ids, child_ids) -> BlockManagerState:
    """Each child (an empty sequence) shares all of its parent's blocks: refcounts +1.

    parent_ids, child_ids: [B] int32; a row with child -1 is padding. Children must be distinct,
    empty, and not parents in the same call. The shared partial block is copied on the first
    write of either side (see append_tokens).
    """
    active = child_ids >= 0
    pid = jnp.where(active, parent_ids, 0)
    rows = state.block_tables[pid]
    owned = _owned(state, active, rows, state.seq_lens[pid])
    refcounts = state.refcounts.at[jnp.where(owned, rows, state.num_blocks)].add(1, mode="drop")
    child_row = jnp.where(active, child_ids, state.max_seqs)
    return dataclasses.replace(
        state, refcounts=refcounts,
        block_tables=state.block_tables.at[child_row].set(rows, mode="drop"),
        seq_lens=state.seq_lens.at[child_row].set(state.seq_lens[pid], mode="drop"))
