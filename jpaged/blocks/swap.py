"""Swap transfers: a victim's KV blocks to host memory in one batched transfer, and back.

Swap-out is one jitted gather of the victim's blocks (every layer) whose output lands in host
memory; swap-in is one host-to-device transfer and one jitted scatter into the donated cache.
Where the device has JAX's `pinned_host` memory kind the gather writes straight into pinned host
memory (a DMA at tens of GB/s on an H200, against ~1.4 GB/s through pageable numpy arrays);
elsewhere the blocks go through numpy (`jax.device_get` / `jax.device_put`).

Block counts are padded to power-of-two buckets (padding gathers the sink block and scatters
nowhere) and split into chunks of at most `MAX_CHUNK_BLOCKS`, so the programs compile a bounded
number of times, all of them at warm-up: in the background (`warmup_calls`), through the
engine's compiled programs when a `dispatch` is given (a start needs none of them before the
first request; a swap that comes early waits for its program).
"""

import time

import jax
import numpy as np

from jpaged import kv_cache

MIN_CHUNK_BLOCKS = 16
MAX_CHUNK_BLOCKS = 1024


def _scatter(cache, block_ids, k_blocks, v_blocks):
    return kv_cache.scatter_blocks(cache, block_ids, k_blocks, v_blocks)


# The cache (argument 0) is donated: the scatter updates it in place.
scatter_program = jax.jit(_scatter, donate_argnums=0)


def chunk_sizes(num_blocks: int) -> list[int]:
    """Every padded chunk size a swap of blocks from a pool of num_blocks can use."""
    cap = max(MIN_CHUNK_BLOCKS, min(MAX_CHUNK_BLOCKS, 1 << max(num_blocks - 1, 0).bit_length()))
    sizes, size = [], MIN_CHUNK_BLOCKS
    while size <= cap:
        sizes.append(size)
        size *= 2
    return sizes


def _padded(count: int, sizes: list[int]) -> int:
    return next(size for size in sizes if size >= count)


class SwapStore:
    """The swapped-out blocks on the host, by handle, and the transfers that move them.

    The scheduler owns the accounting (host block ids, capacity); this holds the data.
    """

    def __init__(self, num_blocks: int, bytes_per_block: int, *, pinned: bool | None = None,
                 dispatch=None):
        """dispatch(key, program, *args): runs a program through compiled executables by
        shape key (`Executor.dispatch`); None calls the jitted programs directly."""
        self.dispatch = dispatch or (lambda key, program, *args: program(*args))
        device = jax.devices()[0]
        kinds = {memory.kind for memory in device.addressable_memories()}
        self.pinned = ("pinned_host" in kinds) if pinned is None else pinned
        self.host_sharding = (jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
                              if self.pinned else None)
        self.device_sharding = jax.sharding.SingleDeviceSharding(device)
        self.sizes = chunk_sizes(num_blocks)
        self.bytes_per_block = bytes_per_block
        self.gather_program = jax.jit(kv_cache.gather_blocks, out_shardings=(
            (self.host_sharding, self.host_sharding) if self.pinned else None))
        self.stored: dict[int, list] = {}
        self.bytes_out = 0
        self.bytes_in = 0

    def swap_out(self, cache, handle: int, block_ids: list[int]):
        """Copy block_ids (all layers) to host memory under `handle`."""
        chunks = []
        for start in range(0, len(block_ids), self.sizes[-1]):
            part = block_ids[start:start + self.sizes[-1]]
            ids = np.full(_padded(len(part), self.sizes), kv_cache.SINK_BLOCK, np.int32)
            ids[:len(part)] = part
            k_blocks, v_blocks = self._gather(cache, ids)
            if not self.pinned:
                k_blocks, v_blocks = jax.device_get((k_blocks, v_blocks))
            chunks.append((len(part), k_blocks, v_blocks))
        self.stored[handle] = chunks
        self.bytes_out += len(block_ids) * self.bytes_per_block

    def swap_in(self, cache, handle: int, block_ids: list[int]):
        """Write the blocks stored under `handle` into block_ids (same order); returns the cache
        (the old one is donated)."""
        offset = 0
        for count, k_blocks, v_blocks in self.stored.pop(handle):
            ids = np.full(k_blocks.shape[2], -1, np.int32)
            ids[:count] = block_ids[offset:offset + count]
            k_dev, v_dev = jax.device_put((k_blocks, v_blocks), self.device_sharding)
            cache = self._scatter(cache, ids, k_dev, v_dev)
            offset += count
        self.bytes_in += len(block_ids) * self.bytes_per_block
        return cache

    def drop(self, handle: int):
        self.stored.pop(handle, None)

    def _gather(self, cache, ids):
        return self.dispatch(("swap_gather", ids.shape[0]), self.gather_program, cache, ids)

    def _scatter(self, cache, ids, k_blocks, v_blocks):
        return self.dispatch(("swap_scatter", ids.shape[0]), scatter_program, cache, ids,
                             k_blocks, v_blocks)

    def warmup_calls(self, cache) -> list[tuple]:
        """[(key, program, args, static)]: the gather and scatter of every chunk size, for the
        engine's compile pool (arguments as shapes: nothing runs)."""
        calls = []
        for size in self.sizes:
            ids = jax.ShapeDtypeStruct((size,), np.int32)
            k_blocks, v_blocks = (   # [L, K, n, S, D] (`kv_cache.gather_blocks`), no tracing
                jax.ShapeDtypeStruct((len(pages), pages[0].shape[0], size, *pages[0].shape[2:]),
                                     pages[0].dtype, sharding=self.device_sharding)
                for pages in (cache.k_pages, cache.v_pages))
            calls += [(("swap_gather", size), self.gather_program, (cache, ids), {}),
                      (("swap_scatter", size), scatter_program, (cache, ids, k_blocks, v_blocks),
                       {})]
        return calls

    def measure(self, cache, num_blocks: int, repeats: int = 3):
        """(cache, seconds) of one swap-out plus swap-in of num_blocks blocks, best of repeats.
        Gathers the sink block and scatters nowhere, so the cache is unchanged."""
        best = float("inf")
        ids = np.full(_padded(num_blocks, self.sizes), kv_cache.SINK_BLOCK, np.int32)
        nowhere = np.full(ids.shape[0], -1, np.int32)
        for _ in range(repeats):
            start = time.perf_counter()
            k_blocks, v_blocks = self._gather(cache, ids)
            if not self.pinned:
                k_blocks, v_blocks = jax.device_get((k_blocks, v_blocks))
            else:
                jax.block_until_ready((k_blocks, v_blocks))
            k_dev, v_dev = jax.device_put((k_blocks, v_blocks), self.device_sharding)
            cache = self._scatter(cache, nowhere, k_dev, v_dev)
            jax.block_until_ready(cache)
            best = min(best, time.perf_counter() - start)
        return cache, best


def transfer_rate_probe(store: SwapStore, cache, max_blocks: int):
    """(cache, fixed seconds, seconds per block) of a swap round trip, from two sizes."""
    small = store.sizes[0]
    large = max(small, min(store.sizes[-1], _padded(max(max_blocks, 1), store.sizes)))
    cache, t_small = store.measure(cache, small)
    cache, t_large = store.measure(cache, large)
    per_block = max(t_large - t_small, 0.0) / max(large - small, 1)
    if large == small:
        per_block = t_small / small
    return cache, max(t_small - per_block * small, 0.0), per_block
