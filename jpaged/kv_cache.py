"""The paged KV cache: the page layout (defined only here), writes by slot, block copies, sizing.

Layout: for every layer, `k_pages` and `v_pages` of shape [K, N, S, D] (kv heads, physical
blocks, tokens per block, head dim). Kv-head-major keeps one head's S x D tile of a block
contiguous: a single DMA on TPU, a coalesced 2-D load on GPU, and the axis tensor parallelism
shards. Each layer is its own buffer (not one [L, ...] array): a kernel then reads its operand
directly, where a slice of a stacked array would be copied out every step, and the step donates
every buffer so XLA scatters new tokens in place.

Physical block 0 is the reserved sink: never allocated, it backs every unused block-table entry,
so tables are always valid indices. Padded tokens carry slot -1 and their writes are dropped.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_kernels
from jpaged import parallel

SINK_BLOCK = 0
PAD_SLOT = -1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k_pages, v_pages: tuples of L arrays, each [K, N, S, D]."""
    k_pages: tuple
    v_pages: tuple

    @property
    def num_blocks(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def block_size(self) -> int:
        return self.k_pages[0].shape[2]


def init_cache(num_layers, num_kv_heads, num_blocks, block_size, head_dim, dtype,
               sharding=None) -> KVCache:
    """Zero-filled cache (zeros, so stale tails of partial blocks are always finite)."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if sharding is None:
        zeros = functools.partial(jnp.zeros, shape, dtype)
    else:  # built directly in its shards, never whole on one device
        zeros = jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)
    return KVCache(tuple(zeros() for _ in range(num_layers)),
                   tuple(zeros() for _ in range(num_layers)))


def rotate_and_write_layer(cache: KVCache, layer: int, qkv, cos, sin, slot_mapping, *,
                          backend="reference", interpret=False, mesh=None):
    """One layer's projected heads -> (rotated queries [T, H, D], cache with layer `layer`'s
    rotated keys and values written at slot_mapping [T]).

    qkv: [T, P, H/P + 2C/P, D], the packed projection with one block per tensor-parallel shard
    (P = 1 without a mesh; C = the cache's kv heads); cos, sin [T, D] float32. One kernel per
    device does the rotations and the write (`pallas_kernels.rotate_and_write`).
    """
    shards = parallel.mesh_size(mesh)
    local_heads = qkv.shape[2] - 2 * cache.k_pages[layer].shape[0] // shards

    def rotate_and_write(qkv, cos, sin, k_pages, v_pages, slots):
        return pallas_kernels.rotate_and_write(qkv[:, 0], cos, sin, k_pages, v_pages, slots,
                                               num_heads=local_heads, backend=backend,
                                               interpret=interpret)
    if mesh is not None:
        rotate_and_write = parallel.per_shard(
            rotate_and_write, mesh, out_specs=(parallel.HEADS, parallel.PAGES, parallel.PAGES),
            in_specs=(parallel.HEADS, parallel.REPLICATED, parallel.REPLICATED, parallel.PAGES,
                      parallel.PAGES, parallel.REPLICATED))
    q, k_layer, v_layer = rotate_and_write(qkv, cos, sin, cache.k_pages[layer],
                                           cache.v_pages[layer], slot_mapping)
    return q, _replace_layer(cache, layer, k_layer, v_layer)


def _replace_layer(cache: KVCache, layer: int, k_layer, v_layer) -> KVCache:
    k_pages = cache.k_pages[:layer] + (k_layer,) + cache.k_pages[layer + 1:]
    v_pages = cache.v_pages[:layer] + (v_layer,) + cache.v_pages[layer + 1:]
    return KVCache(k_pages, v_pages)


def copy_blocks(cache: KVCache, copies) -> KVCache:
    """Apply copy-on-write copies: copies [C, 2] int32 rows of (src, dst); dst -1 is skipped.

    All sources are read before any destination is written, in every layer.
    """
    src = jnp.maximum(copies[:, 0], 0)
    dst = jnp.where(copies[:, 1] < 0, cache.num_blocks, copies[:, 1])

    def apply(pages):
        return pages.at[:, dst].set(pages[:, src], mode="drop")

    return KVCache(tuple(map(apply, cache.k_pages)), tuple(map(apply, cache.v_pages)))


def gather_blocks(cache: KVCache, block_ids):
    """(k, v), each [L, K, n, S, D]: the given blocks of every layer (for swapping out)."""
    return (jnp.stack([pages[:, block_ids] for pages in cache.k_pages]),
            jnp.stack([pages[:, block_ids] for pages in cache.v_pages]))


def scatter_blocks(cache: KVCache, block_ids, k_blocks, v_blocks) -> KVCache:
    """Write [L, K, n, S, D] blocks back at block_ids [n]; an id of -1 is skipped."""
    dst = jnp.where(block_ids < 0, cache.num_blocks, block_ids)

    def apply(pages, blocks):
        return pages.at[:, dst].set(blocks.astype(pages.dtype), mode="drop")

    return KVCache(tuple(apply(p, b) for p, b in zip(cache.k_pages, k_blocks)),
                   tuple(apply(p, b) for p, b in zip(cache.v_pages, v_blocks)))


def bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype) -> int:
    """K and V bytes of one block across all layers."""
    return 2 * num_layers * num_kv_heads * block_size * head_dim * jnp.dtype(dtype).itemsize


def kv_footprint(config, *, tokens: int, block_size: int, dtype: str, users: int = 1,
                 shared_prefix: int = 0) -> dict:
    """KV memory arithmetic for a ModelConfig (the numbers `tools/kv_calc.py` prints).

    prefix_bytes_unshared: `users` private copies of a `shared_prefix`-token prompt;
    prefix_bytes_shared: one copy, token-exact; prefix_bytes_shared_paged: the whole blocks a
    paged cache actually holds for it.
    """
    for name, value in (("tokens", tokens), ("block_size", block_size), ("users", users)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if shared_prefix < 0:
        raise ValueError(f"shared_prefix must be >= 0, got {shared_prefix}")
    per_token = config.kv_bytes_per_token(dtype)
    per_block = per_token * block_size
    prefix_blocks = -(-shared_prefix // block_size)
    return {
        "bytes_per_token": per_token,
        "bytes_per_block": per_block,
        "blocks_per_sequence": -(-tokens // block_size),
        "sequence_bytes_paged": -(-tokens // block_size) * per_block,
        "prefix_bytes_unshared": users * shared_prefix * per_token,
        "prefix_bytes_shared": shared_prefix * per_token,
        "prefix_bytes_shared_paged": prefix_blocks * per_block,
    }
