"""Paged KV cache: writes by slot (padding dropped), block copies, swap gather/scatter, sizes."""

import jax.numpy as jnp
import numpy as np

from jpaged import kv_cache


def numbered_cache(num_layers=2, kv_heads=2, blocks=6, size=4, dim=3):
    """Every element distinct (negated for values, offset by 1000 per layer)."""
    values = jnp.arange(kv_heads * blocks * size * dim, dtype=jnp.float32).reshape(
        kv_heads, blocks, size, dim)
    return kv_cache.KVCache(tuple(values + 1000 * l for l in range(num_layers)),
                            tuple(-(values + 1000 * l) for l in range(num_layers)))


def test_rotate_and_write_layer_writes_slots_and_drops_padding():
    """The model's write path, one layer: 2 query heads, 2 kv heads, D = 4, tokens at slots 5,
    padding (-1) and 14. Rotation by 90 degrees maps each head's (a, b, c, d) to (-c, -d, a, b)."""
    cache = kv_cache.init_cache(2, 2, 4, 4, 4, jnp.float32)
    qkv = jnp.arange(3 * 6 * 4, dtype=jnp.float32).reshape(3, 1, 6, 4) + 1   # [T, P, H + 2K, D]
    cos, sin = jnp.zeros((3, 4)), jnp.ones((3, 4))
    slots = jnp.array([5, kv_cache.PAD_SLOT, 14])
    q, out = kv_cache.rotate_and_write_layer(cache, 1, qkv, cos, sin, slots)

    def rotated(x):
        return np.concatenate([-x[..., 2:], x[..., :2]], axis=-1)
    heads = np.asarray(qkv[:, 0])
    np.testing.assert_array_equal(np.asarray(q), rotated(heads[:, :2]))
    k, v = np.asarray(out.k_pages[1]), np.asarray(out.v_pages[1])
    for token, (block, offset) in ((0, (1, 1)), (2, (3, 2))):   # slot 5 = block 1, offset 1
        np.testing.assert_array_equal(k[:, block, offset], rotated(heads[token, 2:4]))
        np.testing.assert_array_equal(v[:, block, offset], heads[token, 4:6])   # values unrotated
    assert np.count_nonzero(k) == np.count_nonzero(v) == 2 * 2 * 4   # padding wrote nothing
    assert np.count_nonzero(np.asarray(out.k_pages[0])) == 0         # other layers untouched


def test_copy_blocks_reads_all_sources_first():
    cache = numbered_cache()
    before = np.asarray(cache.k_pages[1])
    # 1 -> 2 and 2 -> 3 in one call: block 3 must receive block 2's *old* contents.
    out = kv_cache.copy_blocks(cache, jnp.array([[1, 2], [2, 3], [-1, -1]]))
    after = np.asarray(out.k_pages[1])
    np.testing.assert_array_equal(after[:, 2], before[:, 1])
    np.testing.assert_array_equal(after[:, 3], before[:, 2])
    np.testing.assert_array_equal(after[:, [0, 1, 4, 5]], before[:, [0, 1, 4, 5]])
    np.testing.assert_array_equal(np.asarray(out.v_pages[0])[:, 3],
                                  np.asarray(cache.v_pages[0])[:, 2])


def test_gather_scatter_round_trip():
    cache = numbered_cache()
    k, v = kv_cache.gather_blocks(cache, jnp.array([4, 1]))
    assert k.shape == (2, 2, 2, 4, 3)
    empty = kv_cache.init_cache(2, 2, 6, 4, 3, jnp.float32)
    back = kv_cache.scatter_blocks(empty, jnp.array([2, -1]), k, v)
    np.testing.assert_array_equal(np.asarray(back.k_pages[1])[:, 2],
                                  np.asarray(cache.k_pages[1])[:, 4])
    assert np.count_nonzero(np.asarray(back.k_pages[1])[:, [0, 1, 3, 4, 5]]) == 0


def test_bytes_per_block():
    per_block = kv_cache.bytes_per_block(32, 8, 128, 16, jnp.bfloat16)
    assert per_block == 2 * 32 * 8 * 16 * 128 * 2
