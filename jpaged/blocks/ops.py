"""Typed block operations: each owns its effect on the host mirror, its device program and the
padded shapes it compiles.

The ledger (`jpaged.blocks.ledger`) is the only producer: it decides an operation, applies it to
the mirror (`apply`) and hands it out, in order, for the executor to `run` on the device, so the
device allocator repeats the mirror's history block for block. Adding an operation means adding
a class here and a ledger method that produces it.

`run` takes the executor's device state as a `DeviceBlocks`: the block-manager pytree, the KV
cache and the swap store, plus `dispatch`, which counts compilations. Row lists are padded to the
batch size (at least 4), block lists to `OP_CHUNK` entries (longer lists go in chunks), so each
operation compiles ONE shape, at warm-up (`warm_up`): these programs are small scatters whose
padding costs microseconds, while every extra shape was one more program to compile at start.
Padded entries are -1: rows and blocks the device programs skip.
"""

import dataclasses
from typing import ClassVar, Protocol

import jax
import numpy as np

from jpaged import kv_cache
from jpaged.blocks import allocator
from jpaged.blocks.mirror import HostBlockMirror

OP_CHUNK = 256   # most blocks one retain/release program takes (longer lists go in chunks)

# The device programs. Each donates its first argument (the block-manager state, or the KV cache
# for copies), so XLA updates it in place and callers replace their reference with the result.
_FREE = jax.jit(allocator.free_seqs, donate_argnums=0)
_FORK = jax.jit(allocator.fork_seqs, donate_argnums=0)
_RETAIN = jax.jit(allocator.retain_blocks, donate_argnums=0)
_RELEASE = jax.jit(allocator.release_blocks, donate_argnums=0)
_POP = jax.jit(allocator.pop_blocks, donate_argnums=0)
_ADOPT = jax.jit(allocator.adopt_blocks, donate_argnums=0)
_COPY = jax.jit(kv_cache.copy_blocks, donate_argnums=0)
_APPEND = jax.jit(allocator.grow_seqs, donate_argnums=0)
_TRIM = jax.jit(allocator.trim_seqs, donate_argnums=0)


class DeviceBlocks(Protocol):
    """What an operation runs against (the executor)."""
    manager: allocator.BlockManagerState
    cache: kv_cache.KVCache
    swap_store: object            # a `SwapStore`, or None when swapping is off
    max_num_seqs: int
    max_blocks_per_seq: int

    def dispatch(self, key: tuple, program, *args):
        """program(*args), counting a compilation the first time `key` is seen."""


def bucket(n: int, floor: int, cap: int) -> int:
    """Smallest power of two >= n (at least floor), capped at cap (which must be >= n)."""
    if n > cap:
        raise ValueError(f"{n} exceeds the largest bucket {cap}")
    size = max(floor, 1 << max(n - 1, 0).bit_length())
    return min(size, cap)


def bucket_sizes(floor: int, cap: int) -> list[int]:
    """Every bucket `bucket(n, floor, cap)` can return, smallest first."""
    return sorted({bucket(n, floor, cap) for n in range(1, cap + 1)})


def _padded(items, size: int, width: int = 0) -> np.ndarray:
    """items as an int32 array of `size` rows, padded with -1."""
    out = np.full((size, width) if width else (size,), -1, np.int32)
    if items:
        out[:len(items)] = items
    return out


def _row_cap(device: DeviceBlocks) -> int:
    return max(4, device.max_num_seqs)


def _rows(device: DeviceBlocks, count: int) -> int:
    """The rows an operation on `count` rows pads to: always the cap (one shape)."""
    return bucket(count, _row_cap(device), _row_cap(device))


class BlockOp:
    """One block operation. Subclasses are frozen dataclasses."""
    kind: ClassVar[str]

    def apply(self, mirror: HostBlockMirror):
        """Its effect on the mirror (the ledger calls this)."""

    def run(self, device: DeviceBlocks):
        """Its effect on the device, the same as `apply`'s on the mirror."""
        raise NotImplementedError

    @classmethod
    def padding(cls, device: DeviceBlocks) -> list["BlockOp"]:
        """Operations on nothing, one per shape `run` can compile."""
        return []

    @classmethod
    def warm_up(cls, device: DeviceBlocks):
        """Compile every shape now (changes nothing)."""
        for op in cls.padding(device):
            op.run(device)


def _rows_op(program, key: str, device: DeviceBlocks, rows: tuple, width: int = 0):
    """The manager after program(manager, *columns of rows padded to a row bucket)."""
    padded = _padded(list(rows), _rows(device, len(rows)), width)
    columns = (padded,) if not width else tuple(padded[:, i] for i in range(width))
    return device.dispatch((key, padded.shape[0]), program, device.manager, *columns)


def _chunked_blocks_op(program, key: str, device: DeviceBlocks, blocks: tuple):
    for start in range(0, len(blocks), OP_CHUNK):
        part = list(blocks[start:start + OP_CHUNK])
        ids = _padded(part, OP_CHUNK)
        device.manager = device.dispatch((key, ids.shape[0]), program, device.manager, ids)


@dataclasses.dataclass(frozen=True)
class Free(BlockOp):
    """Sequences (block-manager rows) drop every block; blocks reaching zero references go back
    on the free stack in first-occurrence order."""
    slots: tuple[int, ...]
    kind: ClassVar[str] = "free"

    def apply(self, mirror):
        """Returns the blocks that lost a reference, in table order (for the prefix cache)."""
        return mirror.free(list(self.slots))

    def run(self, device):
        device.manager = _rows_op(_FREE, self.kind, device, self.slots)

    @classmethod
    def padding(cls, device):
        return [cls((-1,) * _row_cap(device))]


@dataclasses.dataclass(frozen=True)
class Trim(BlockOp):
    """(slot, num_dead) rows: the leading table entries that fell out of every layer's sliding
    window drop their reference (back on the free stack at zero) and become the sink block."""
    rows: tuple[tuple[int, int], ...]
    kind: ClassVar[str] = "trim"

    def apply(self, mirror):
        """Returns the blocks that lost a reference (for the prefix cache)."""
        return mirror.trim(list(self.rows))

    def run(self, device):
        device.manager = _rows_op(_TRIM, self.kind, device, self.rows, width=2)

    @classmethod
    def padding(cls, device):
        return [cls(((-1, 0),) * _row_cap(device))]


@dataclasses.dataclass(frozen=True)
class Fork(BlockOp):
    """Each (parent, child) pair: the empty child shares all of the parent's blocks."""
    pairs: tuple[tuple[int, int], ...]
    kind: ClassVar[str] = "fork"

    def apply(self, mirror):
        mirror.fork(list(self.pairs))

    def run(self, device):
        device.manager = _rows_op(_FORK, self.kind, device, self.pairs, width=2)

    @classmethod
    def padding(cls, device):
        return [cls(((-1, -1),) * _row_cap(device))]


class _ReferenceOp(BlockOp):
    """A reference more (Retain) or less (Release) on each of `blocks`, in chunks of OP_CHUNK."""
    blocks: tuple[int, ...]

    def run(self, device):
        _chunked_blocks_op(self._program, self.kind, device, self.blocks)

    @classmethod
    def padding(cls, device):
        return [cls((-1,) * OP_CHUNK)]


@dataclasses.dataclass(frozen=True)
class Retain(_ReferenceOp):
    """One more reference on each block (the prefix cache's own, on a block it indexes)."""
    blocks: tuple[int, ...]
    kind: ClassVar[str] = "retain"
    _program: ClassVar = staticmethod(_RETAIN)

    def apply(self, mirror):
        mirror.retain(list(self.blocks))


@dataclasses.dataclass(frozen=True)
class Release(_ReferenceOp):
    """The inverse of Retain: prefix-cache eviction."""
    blocks: tuple[int, ...]
    kind: ClassVar[str] = "release"
    _program: ClassVar = staticmethod(_RELEASE)

    def apply(self, mirror):
        mirror.release(list(self.blocks))


@dataclasses.dataclass(frozen=True)
class Pop(BlockOp):
    """Take `count` blocks off the free stack with no holder yet (an Adopt gives them one)."""
    count: int
    kind: ClassVar[str] = "pop"

    def apply(self, mirror):
        """Returns the ids taken, in pop order."""
        return mirror.pop(self.count)

    def run(self, device):
        device.manager = device.dispatch((self.kind,), _POP, device.manager,
                                         np.int32(self.count))

    @classmethod
    def padding(cls, device):
        return [cls(0)]


@dataclasses.dataclass(frozen=True)
class Adopt(BlockOp):
    """Empty sequences take ready-made tables: (slot, blocks, length) items; each block gains a
    reference (prefix-cache hits, swap-in)."""
    items: tuple[tuple[int, tuple[int, ...], int], ...]
    kind: ClassVar[str] = "adopt"

    def apply(self, mirror):
        mirror.adopt([(slot, list(blocks), length) for slot, blocks, length in self.items])

    def run(self, device):
        size = _rows(device, len(self.items))
        slots = np.full(size, -1, np.int32)
        tables = np.full((size, device.max_blocks_per_seq), kv_cache.SINK_BLOCK, np.int32)
        lengths = np.zeros(size, np.int32)
        for row, (slot, blocks, length) in enumerate(self.items):
            slots[row], lengths[row] = slot, length
            tables[row, :len(blocks)] = blocks
        device.manager = device.dispatch((self.kind, size), _ADOPT, device.manager, slots,
                                         tables, lengths)

    @classmethod
    def padding(cls, device):
        return [cls(((-1, (), 0),) * _row_cap(device))]


@dataclasses.dataclass(frozen=True)
class Append(BlockOp):
    """(slot, num_tokens) rows grow outside a model step, taking blocks exactly as the step's
    own append would, with no KV written and no copy-on-write contents copied: the device half
    of a step that failed before it ran (the mirror planned its appends already), or a
    benchmark's made-up context. Rows pad to the largest bucket: one program, rarely run."""
    rows: tuple[tuple[int, int], ...]
    kind: ClassVar[str] = "append"

    def apply(self, mirror):
        ok, _, _ = mirror.append(list(self.rows))
        assert ok, "an Append the mirror cannot serve"

    def run(self, device):
        rows = _padded(list(self.rows), _row_cap(device), width=2)
        device.manager = device.dispatch((self.kind, rows.shape[0]), _APPEND, device.manager,
                                         rows[:, 0], np.maximum(rows[:, 1], 0))

    @classmethod
    def padding(cls, device):
        return [cls(())]


@dataclasses.dataclass(frozen=True)
class Copy(BlockOp):
    """Copy-on-write contents, (src, dst) block pairs: the mirror's append already moved the
    tables (and the device's append allocates the same destinations); this copies the KV."""
    pairs: tuple[tuple[int, int], ...]
    kind: ClassVar[str] = "copy"

    def run(self, device):
        pairs = _padded(list(self.pairs), _rows(device, len(self.pairs)), width=2)
        device.cache = device.dispatch((self.kind, pairs.shape[0]), _COPY, device.cache, pairs)

    @classmethod
    def padding(cls, device):
        return [cls(((-1, -1),) * _row_cap(device))]


@dataclasses.dataclass(frozen=True)
class SwapOut(BlockOp):
    """Copy blocks to host memory under `handle` (one transfer); a Free of the sequences that
    held them follows."""
    handle: int
    blocks: tuple[int, ...]
    kind: ClassVar[str] = "swap_out"

    def run(self, device):
        device.swap_store.swap_out(device.cache, self.handle, list(self.blocks))

    @classmethod
    def warm_up(cls, device):
        """Queue the swap store's gathers and scatters (both directions) on the compile pool:
        no request needs them before its first preemption."""
        if device.swap_store is not None:
            for call in device.swap_store.warmup_calls(device.cache):
                device.programs.submit(*call)


@dataclasses.dataclass(frozen=True)
class SwapIn(BlockOp):
    """Write the host blocks stored under `handle` into freshly popped `blocks`."""
    handle: int
    blocks: tuple[int, ...]
    kind: ClassVar[str] = "swap_in"

    def run(self, device):
        device.cache = device.swap_store.swap_in(device.cache, self.handle, list(self.blocks))


@dataclasses.dataclass(frozen=True)
class SwapDrop(BlockOp):
    """Forget the host blocks stored under `handle` (an aborted swapped-out request)."""
    handle: int
    kind: ClassVar[str] = "swap_drop"

    def run(self, device):
        device.swap_store.drop(self.handle)


OPERATIONS: tuple[type[BlockOp], ...] = (Free, Trim, Fork, Retain, Release, Pop, Adopt, Append,
                                         Copy, SwapOut, SwapIn, SwapDrop)
