"""Block manager: random operation sequences through the jitted functions, checked step by step
against the host mirror (block id for block id), allocator invariants, and cache contents."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jpaged import kv_cache
from jpaged.blocks import allocator
from jpaged.blocks.mirror import HostBlockMirror

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS = 12, 4, 6, 5
ROWS, MAX_TOKENS = 4, 9

append_jit = jax.jit(functools.partial(allocator.append_tokens, max_tokens=MAX_TOKENS))
free_jit = jax.jit(allocator.free_seqs)
fork_jit = jax.jit(allocator.fork_seqs)
retain_jit = jax.jit(allocator.retain_blocks)
release_jit = jax.jit(allocator.release_blocks)
pop_jit = jax.jit(allocator.pop_blocks)
adopt_jit = jax.jit(allocator.adopt_blocks)
scatter_jit = jax.jit(kv_cache.scatter_blocks)


@jax.jit
def write_and_copy(cache, copies, slots, values):
    """Apply CoW copies, then write each new token's value as its key and value through the
    model's write path (one query and one kv head, D = 2, rotation by angle 0)."""
    cache = kv_cache.copy_blocks(cache, copies)
    num_tokens = values.size
    qkv = jnp.broadcast_to(values.reshape(-1, 1, 1, 1), (num_tokens, 1, 3, 2))  # [T, P, H + 2K, D]
    cos, sin = jnp.ones((num_tokens, 2)), jnp.zeros((num_tokens, 2))
    _, cache = kv_cache.rotate_and_write_layer(cache, 0, qkv, cos, sin, slots.reshape(-1))
    return cache


def padded(values, fill):
    return np.array(list(values) + [fill] * (ROWS - len(values)), np.int32)


operation = st.one_of(
    st.tuples(st.just("append"),
              st.lists(st.tuples(st.integers(0, MAX_SEQS - 1), st.integers(0, MAX_TOKENS)),
                       min_size=1, max_size=ROWS, unique_by=lambda r: r[0])),
    st.tuples(st.just("fork"), st.tuples(st.integers(0, MAX_SEQS - 1),
                                         st.integers(0, MAX_SEQS - 1))),
    st.tuples(st.just("free"), st.lists(st.integers(0, MAX_SEQS - 1), min_size=1,
                                        max_size=ROWS, unique=True)),
    # The prefix cache's extra reference on a full block, its release, a hit (an empty sequence
    # adopting retained blocks) and a swap-in (popped blocks adopted, then filled by scatter).
    st.tuples(st.just("retain"), st.tuples(st.integers(0, MAX_SEQS - 1),
                                           st.integers(0, MAX_BLOCKS - 1))),
    st.tuples(st.just("release"), st.integers(0, 100)),
    st.tuples(st.just("adopt"), st.tuples(st.integers(0, MAX_SEQS - 1), st.integers(0, 100),
                                          st.integers(1, 3))),
    st.tuples(st.just("swap_in"), st.tuples(st.integers(0, MAX_SEQS - 1),
                                            st.integers(1, MAX_BLOCKS * BLOCK_SIZE))),
)


def check_against_mirror(state, mirror: HostBlockMirror):
    num_free = int(state.num_free)
    assert num_free == mirror.num_free
    assert list(np.asarray(state.free_stack[:num_free])) == mirror.free_stack
    np.testing.assert_array_equal(np.asarray(state.refcounts), mirror.refcounts)
    np.testing.assert_array_equal(np.asarray(state.seq_lens), mirror.seq_lens)
    tables = np.asarray(state.block_tables)
    for seq_id in range(MAX_SEQS):
        assert list(tables[seq_id]) == mirror.padded_table(seq_id)


def check_invariants(state, retained=()):
    refcounts = np.asarray(state.refcounts)
    num_free = int(state.num_free)
    free = np.asarray(state.free_stack[:num_free])
    assert len(set(free.tolist())) == num_free, "a block is on the free stack twice"
    assert kv_cache.SINK_BLOCK not in free
    assert np.all(refcounts[free] == 0), "a free block is referenced"
    owners = np.zeros(NUM_BLOCKS, np.int64)
    tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
    for seq_id in range(MAX_SEQS):
        num_owned = -(-int(lens[seq_id]) // BLOCK_SIZE)
        owners[tables[seq_id, :num_owned]] += 1
        # At most one partly filled block: exactly ceil(len / S) entries, the rest is the sink.
        assert np.all(tables[seq_id, num_owned:] == kv_cache.SINK_BLOCK)
    owners[kv_cache.SINK_BLOCK] = 1
    for block in retained:  # references held outside any table (the prefix cache's)
        owners[block] += 1
    np.testing.assert_array_equal(owners, refcounts)  # shared exactly as often as counted
    assert num_free + int(np.sum(refcounts[1:] > 0)) == NUM_BLOCKS - 1


def check_contents(cache, state, histories):
    """Every live sequence reads back its own token values through its block table."""
    pages = np.asarray(cache.k_pages[0])[0, :, :, 0].reshape(-1)
    tables, lens = np.asarray(state.block_tables), np.asarray(state.seq_lens)
    for seq_id, history in histories.items():
        positions = np.arange(lens[seq_id])
        slots = tables[seq_id, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        np.testing.assert_array_equal(pages[slots], history, err_msg=f"seq {seq_id}")


@functools.cache
def initial_state_and_cache():
    """Immutable, so every example can start from the same objects."""
    return (allocator.init_state(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS),
            kv_cache.init_cache(1, 1, NUM_BLOCKS, BLOCK_SIZE, 2, jnp.float32))


def run_operations(operations):
    state, cache = initial_state_and_cache()
    mirror = HostBlockMirror(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS)
    histories: dict[int, list[float]] = {}
    retained: list[tuple[int, list[float]]] = []   # (block, its values) with an extra reference
    next_value = 1.0
    for kind, args in operations:
        before = state
        if kind in ("retain", "release", "adopt", "swap_in"):
            state, cache, next_value = run_cache_operation(
                kind, args, state, cache, mirror, histories, retained, next_value)
            host_state = jax.device_get(state)
            check_against_mirror(host_state, mirror)
            check_invariants(host_state, [block for block, _ in retained])
            check_contents(cache, host_state, histories)
            continue
        if kind == "append":
            seq_ids = padded([s for s, _ in args], -1)
            counts = padded([n for _, n in args], 0)
            state, result = append_jit(state, jnp.asarray(seq_ids), jnp.asarray(counts))
            result = jax.device_get(result)
            ok, slots, copies = mirror.append(list(zip(seq_ids.tolist(), counts.tolist())))
            assert bool(result.ok) == ok
            device_slots = np.asarray(result.slot_mapping)
            for row, expected in enumerate(slots):
                assert list(device_slots[row, :len(expected)]) == expected
                assert np.all(device_slots[row, len(expected):] == kv_cache.PAD_SLOT)
                want = [-1, -1] if copies[row] is None else list(copies[row])
                assert list(np.asarray(result.copies[row])) == want
            if not ok:
                # Out of blocks (or table full): reported, and nothing changed.
                jax.tree.map(np.testing.assert_array_equal, state, before)
                assert int(result.num_blocks_needed) > int(state.num_free) or any(
                    -(-(int(before.seq_lens[s]) + n) // BLOCK_SIZE) > MAX_BLOCKS for s, n in args)
                continue
            values = np.zeros((ROWS, MAX_TOKENS), np.float32)
            for row, (seq_id, count) in enumerate(args):
                values[row, :count] = np.arange(next_value, next_value + count)
                histories.setdefault(seq_id, []).extend(values[row, :count].tolist())
                next_value += count
            cache = write_and_copy(cache, result.copies, result.slot_mapping, jnp.asarray(values))
        elif kind == "fork":
            parent, child = args
            if child == parent or int(state.seq_lens[child]) != 0:
                continue  # the engine forks only into empty sequences
            state = fork_jit(state, jnp.asarray(padded([parent], 0)),
                             jnp.asarray(padded([child], -1)))
            mirror.fork([(parent, child)])
            if parent in histories:
                histories[child] = list(histories[parent])
        else:
            state = free_jit(state, jnp.asarray(padded(args, -1)))
            mirror.free(args)
            for seq_id in args:
                histories.pop(seq_id, None)
        host_state = jax.device_get(state)
        check_against_mirror(host_state, mirror)
        check_invariants(host_state, [block for block, _ in retained])
        check_contents(cache, host_state, histories)


def run_cache_operation(kind, args, state, cache, mirror, histories, retained, next_value):
    """The prefix-cache and swap operations: retain/release/adopt, pop + adopt + scatter."""
    if kind == "retain":
        seq_id, index = args
        if (index + 1) * BLOCK_SIZE <= mirror.seq_lens[seq_id]:  # only full blocks are cached
            block = mirror.tables[seq_id][index]
            state = retain_jit(state, jnp.asarray(padded([block], -1)))
            mirror.retain([block])
            retained.append((block, histories[seq_id][index * BLOCK_SIZE:
                                                      (index + 1) * BLOCK_SIZE]))
    elif kind == "release" and retained:
        block, _ = retained.pop(args % len(retained))
        state = release_jit(state, jnp.asarray(padded([block], -1)))
        mirror.release([block])
    elif kind == "adopt" and retained and mirror.seq_lens[args[0]] == 0:
        seq_id, first, count = args
        distinct = list({block: (block, values) for block, values in retained}.values())
        chosen = [distinct[(first + i) % len(distinct)] for i in range(min(count, len(distinct)))]
        count = len(chosen)
        blocks = [block for block, _ in chosen]
        table = np.full((ROWS, MAX_BLOCKS), kv_cache.SINK_BLOCK, np.int32)
        table[0, :count] = blocks
        state = adopt_jit(state, jnp.asarray(padded([seq_id], -1)), jnp.asarray(table),
                          jnp.asarray(padded([count * BLOCK_SIZE], 0)))
        mirror.adopt([(seq_id, blocks, count * BLOCK_SIZE)])
        histories[seq_id] = [value for _, values in chosen for value in values]
    elif kind == "swap_in" and mirror.seq_lens[args[0]] == 0:
        seq_id, length = args
        count = -(-length // BLOCK_SIZE)
        if count > mirror.num_free:
            return state, cache, next_value
        state = pop_jit(state, jnp.int32(count))
        blocks = mirror.pop(count)
        table = np.full((ROWS, MAX_BLOCKS), kv_cache.SINK_BLOCK, np.int32)
        table[0, :count] = blocks
        state = adopt_jit(state, jnp.asarray(padded([seq_id], -1)), jnp.asarray(table),
                          jnp.asarray(padded([length], 0)))
        mirror.adopt([(seq_id, blocks, length)])
        values = np.arange(next_value, next_value + count * BLOCK_SIZE, dtype=np.float32)
        next_value += count * BLOCK_SIZE
        data = jnp.asarray(np.repeat(values.reshape(1, 1, count, BLOCK_SIZE, 1), 2, axis=-1))
        cache = scatter_jit(cache, jnp.asarray(blocks, jnp.int32), data, data)
        histories[seq_id] = values[:length].tolist()
    return state, cache, next_value


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(operation, min_size=1, max_size=14))
def test_random_operations_match_mirror_and_keep_invariants(operations):
    run_operations(operations)


def test_out_of_blocks_is_reported_and_state_unchanged():
    state = allocator.init_state(4, 4, 2, 4)
    state, result = allocator.allocate_prompt(state, jnp.array([0]), jnp.array([12]),
                                           max_prompt_len=16)
    assert bool(result.ok) and int(state.num_free) == 0
    after, result = allocator.allocate_prompt(state, jnp.array([1]), jnp.array([1]),
                                           max_prompt_len=16)
    assert not bool(result.ok)
    assert int(result.num_blocks_needed) == 1
    assert np.all(np.asarray(result.slot_mapping) == kv_cache.PAD_SLOT)
    jax.tree.map(np.testing.assert_array_equal, after, state)


def test_append_crosses_block_boundary_only_when_full():
    state = allocator.init_state(8, 4, 2, 4)
    state, result = allocator.allocate_prompt(state, jnp.array([0]), jnp.array([3]),
                                           max_prompt_len=4)
    assert np.asarray(result.slot_mapping)[0, :3].tolist() == [4, 5, 6]  # block 1
    state, slots, _, ok = allocator.append_one(state, jnp.array([0]))
    assert bool(ok) and int(slots[0]) == 7 and int(state.num_free) == 6
    state, slots, _, ok = allocator.append_one(state, jnp.array([0]))
    assert bool(ok) and int(slots[0]) == 8 and int(state.num_free) == 5  # block 2, offset 0


def test_fork_then_copy_on_write_copies_only_the_written_block():
    state = allocator.init_state(8, 4, 3, 4)
    state, _ = allocator.allocate_prompt(state, jnp.array([0]), jnp.array([6]), max_prompt_len=8)
    state = allocator.fork_seqs(state, jnp.array([0, 0]), jnp.array([1, 2]))
    assert np.asarray(state.refcounts)[[1, 2]].tolist() == [3, 3]
    # All three write into the shared partial block 2: two copy, the last holder writes in place.
    state, slots, copies, ok = allocator.append_one(state, jnp.array([0, 1, 2]))
    assert bool(ok)
    assert np.asarray(copies).tolist() == [[2, 3], [2, 4], [-1, -1]]
    assert np.asarray(state.refcounts)[[1, 2, 3, 4]].tolist() == [3, 1, 1, 1]
    assert np.asarray(slots).tolist() == [3 * 4 + 2, 4 * 4 + 2, 2 * 4 + 2]


def test_padding_rows_touch_nothing():
    state = allocator.init_state(8, 4, 2, 4)
    after, result = allocator.allocate_prompt(state, jnp.array([-1, -1]), jnp.array([5, 3]),
                                           max_prompt_len=8)
    assert bool(result.ok)
    assert np.all(np.asarray(result.slot_mapping) == kv_cache.PAD_SLOT)
    jax.tree.map(np.testing.assert_array_equal, after, state)
    jax.tree.map(np.testing.assert_array_equal, allocator.free_seqs(state, jnp.array([-1])), state)


def test_functions_run_inside_fori_loop():
    """Allocation inside a device loop: 10 decode steps of two sequences in one fori_loop."""
    state = allocator.init_state(16, 4, 2, 8)
    state, _ = allocator.allocate_prompt(state, jnp.array([0, 1]), jnp.array([3, 4]),
                                      max_prompt_len=4)

    def body(_, carry):
        new_state, _, _, ok = allocator.append_one(carry[0], jnp.array([0, 1]))
        return new_state, carry[1] & ok

    state, all_ok = jax.jit(lambda s: jax.lax.fori_loop(0, 10, body, (s, jnp.bool_(True))))(state)
    assert bool(all_ok)
    assert np.asarray(state.seq_lens).tolist() == [13, 14]
    assert int(state.num_free) == 15 - 4 - 4


@pytest.mark.parametrize("bad", [dict(num_blocks=1), dict(block_size=0), dict(max_seqs=0)])
def test_init_validates(bad):
    args = dict(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        allocator.init_state(**args)


def test_freeing_shared_blocks_pushes_each_once_in_first_occurrence_order():
    """A parent and its fork freed together: their shared blocks appear twice in the freed ids,
    reach zero references once, and go back on the stack once, in first-occurrence order."""
    state = allocator.init_state(16, 4, 3, 4)
    state, _ = allocator.allocate_prompt(state, jnp.array([0, 2]), jnp.array([9, 5]),
                                      max_prompt_len=12)
    state = allocator.fork_seqs(state, jnp.array([0]), jnp.array([1]))
    tables = np.asarray(state.block_tables)
    num_free = int(state.num_free)
    state = free_jit(state, jnp.array([2, 1, 0]))   # seq 2's blocks first, then 1's = 0's
    expected = list(tables[2, :2]) + list(tables[1, :3])
    assert int(state.num_free) == num_free + len(expected)
    assert np.asarray(state.free_stack[num_free:int(state.num_free)]).tolist() == expected
    assert np.all(np.asarray(state.refcounts)[expected] == 0)

    state, _ = allocator.allocate_prompt(state, jnp.array([0]), jnp.array([4]), max_prompt_len=12)
    block = int(state.block_tables[0, 0])
    state = allocator.free_seqs(allocator.retain_blocks(state, jnp.array([block, block, -1])),
                             jnp.array([0]))
    num_free = int(state.num_free)
    state = release_jit(state, jnp.array([block, -1, block]))   # its last two references
    assert int(state.num_free) == num_free + 1 and int(state.free_stack[num_free]) == block
