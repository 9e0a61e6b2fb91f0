"""Typed block operations: whatever the ledger decides, the operations it hands out leave the
device allocator equal to the mirror, block for block; padded operations change nothing; an
operation's warm-up compiles every shape its runs use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import kv_cache
from jpaged.blocks import allocator, ops
from jpaged.blocks.ledger import BlockLedger
from jpaged.request import Request, Sequence
from jpaged.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS = 48, 4, 6, 12
_APPEND = jax.jit(allocator.append_tokens, static_argnames="max_tokens")


class Device:
    """The executor's part that operations run against, on the CPU."""

    def __init__(self):
        self.manager = allocator.init_state(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS)
        self.cache = kv_cache.init_cache(1, 1, NUM_BLOCKS, BLOCK_SIZE, 2, jnp.float32)
        self.swap_store = None
        self.max_num_seqs, self.max_blocks_per_seq = MAX_SEQS, MAX_BLOCKS
        self.compiled: set = set()

    def dispatch(self, key, program, *args):
        self.compiled.add(key)
        return program(*args)

    def append(self, rows):
        """What a step's program does for the rows the ledger planned."""
        seq_ids = np.full(MAX_SEQS, -1, np.int32)
        counts = np.zeros(MAX_SEQS, np.int32)
        for index, (slot, count) in enumerate(rows):
            seq_ids[index], counts[index] = slot, count
        self.manager, result = _APPEND(self.manager, seq_ids, counts, max_tokens=16)
        assert bool(result.ok)


def assert_equal(device: Device, ledger: BlockLedger):
    state, mirror = jax.device_get(device.manager), ledger.mirror
    free = int(state.num_free)
    assert free == mirror.num_free
    assert np.asarray(state.free_stack)[:free].tolist() == mirror.free_stack
    assert np.asarray(state.refcounts).tolist() == mirror.refcounts
    for slot in range(MAX_SEQS):
        assert np.asarray(state.block_tables)[slot].tolist() == mirror.padded_table(slot)
        assert int(state.seq_lens[slot]) == mirror.seq_lens[slot]


def new_sequence(ledger, rng) -> Sequence:
    length = int(rng.integers(1, 14))
    tokens = (list(range(length)) if rng.random() < 0.5          # a prefix shared by many
              else rng.integers(0, 3, size=length).tolist())
    seq = Sequence(0, tokens, len(tokens))
    seq.slot = ledger.take_slots(1)[0]
    return seq


@pytest.mark.parametrize("seed", range(3))
def test_operations_keep_the_device_equal_to_the_mirror(seed):
    rng = np.random.default_rng(seed)
    ledger, device = BlockLedger(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS,
                                 enable_prefix_caching=True), Device()
    live: list[Sequence] = []
    kinds_seen = set()
    for _ in range(80):
        choice = rng.integers(0, 4)
        if choice == 0 and ledger.num_free_slots:                      # a prompt joins
            seq = new_sequence(ledger, rng)
            hits = ledger.lookup([seq])
            if ledger.num_free < len(seq.token_ids) // BLOCK_SIZE + 2:
                ledger.return_slots([seq.slot])
                continue
            ledger.adopt_hits([seq], hits)
            seq.num_computed = len(hits[0]) * BLOCK_SIZE
            rows = [(seq.slot, len(seq.token_ids) - seq.num_computed)]
            assert ledger.append(rows)
            run(device, ledger.take_ops(), kinds_seen)
            device.append(rows)
            seq.num_computed = len(seq.token_ids)
            live.append(seq)
        elif choice == 1 and live and ledger.num_free_slots:           # a sibling forks
            parent = live[int(rng.integers(len(live)))]
            child = Sequence(1, list(parent.token_ids), parent.num_prompt_tokens)
            child.slot, child.num_computed = ledger.take_slots(1)[0], parent.num_computed
            ledger.fork([(parent.slot, child.slot)])
            live.append(child)
        elif choice == 2 and live:                                     # decode one token
            rows = [(seq.slot, 1) for seq in live]
            if not ledger.append(rows):
                continue
            run(device, ledger.take_ops(), kinds_seen)
            device.append(rows)
            for seq in live:
                seq.token_ids.append(int(rng.integers(0, 3)))
                seq.num_computed += 1
        elif live:                                                     # one finishes
            seq = live.pop(int(rng.integers(len(live))))
            ledger.release([seq])
            if rng.random() < 0.3:
                ledger.evict(min(2, ledger.num_evictable()))
        run(device, ledger.take_ops(), kinds_seen)
        assert_equal(device, ledger)
    assert {"free", "fork", "retain", "adopt", "copy"} <= kinds_seen, kinds_seen


def run(device, block_ops, kinds_seen):
    for op in block_ops:
        assert isinstance(op, ops.BlockOp)
        kinds_seen.add(op.kind)
        op.run(device)


def test_padded_operations_change_nothing_and_warm_up_covers_every_shape():
    device, ledger = Device(), BlockLedger(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS)
    seq = new_sequence(ledger, np.random.default_rng(0))
    assert ledger.append([(seq.slot, 7)])
    device.append([(seq.slot, 7)])
    for kind in ops.OPERATIONS:
        kind.warm_up(device)
    assert_equal(device, ledger)
    warmed = set(device.compiled)
    # Real operations of every size the engine can send use only warmed shapes.
    request = Request("r", None, [1, 2], SamplingParams(), 0, 0)
    for count in (1, 3, MAX_SEQS):
        run(device, [ops.Free((-1,) * count), ops.Fork(((-1, -1),) * count),
                     ops.Adopt(((-1, (), 0),) * count), ops.Copy(((-1, -1),) * count)], set())
    run(device, [ops.Retain((-1,) * 300), ops.Release((-1,) * 5), ops.Pop(0)], set())
    assert device.compiled == warmed
    assert request.sequences[0].slot == -1


def test_room_for_a_loop_is_made_before_its_first_append_is_planned():
    """A decode loop's first iteration appends on the device after the step's operations. If
    making room for the loop evicts cached blocks, the mirror must see the eviction before the
    append too, or the two pop different blocks off their free stacks."""
    from jpaged.engine.scheduler import Scheduler

    ledger, device = BlockLedger(NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS,
                                 enable_prefix_caching=True), Device()
    scheduler = Scheduler(ledger, max_num_seqs=MAX_SEQS, max_num_batched_tokens=64,
                          watermark=0.0, num_scheduler_steps=16)

    def step():
        schedule = scheduler.schedule()
        run(device, schedule.block_ops, set())
        device.append([(row.seq.slot, row.num_tokens) for row in schedule.rows])
        assert_equal(device, ledger)
        return schedule

    for index in range(11):     # eleven 4-block prompts, finished and cached: 3 blocks stay free
        prompt = [index + 1] * (4 * BLOCK_SIZE)
        scheduler.add(Request(f"cached{index}", None, prompt, SamplingParams(max_tokens=1), 0,
                              index))
        (row,) = step().rows
        ledger.release([row.seq])
        scheduler.retire(row.request)
    assert ledger.num_free == NUM_BLOCKS - 1 - 44
    scheduler.add(Request("decoder", None, [9] * BLOCK_SIZE, SamplingParams(max_tokens=50), 0, 9))
    (row,) = step().rows                  # its prompt fills one block exactly
    row.seq.token_ids.append(5)
    evictable = ledger.num_evictable()
    schedule = step()                     # a loop: 1 token now and room for 15 more
    assert schedule.is_loop and ledger.num_evictable() < evictable
