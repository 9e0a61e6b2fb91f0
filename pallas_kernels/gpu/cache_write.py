"""GPU cache writes (Pallas Triton): new keys/values scattered into their pages by slot, in place.

`write_to_pages`: the same contract as `pallas_kernels.reference.write_to_pages` (the XLA
scatter, also the oracle): the pages are aliased input -> output, so with the caller's buffers
donated nothing but the new rows is written. On the H200 it takes 0.61-0.69x XLA's scatter time at
256 tokens and 0.15-0.17x at 2048 (benchmarks/results/kernels_h200.md). The grid runs
`tokens_per_program` tokens (all kv heads) per program.

`rotate_and_write`: the same from a layer's packed q/k/v projection (reference:
`reference.rotate_and_write`): one launch rotates the queries (returned) and the keys, and writes
keys and values, reading the projection where it lies. Apart, XLA ran the query rotation, the key
rotation and the value slice as three fusions before the write, four launches per layer
(7.5 us per layer of the 8B shape at batch 64 on the H200).

Both take any head dim D that is a multiple of 8 (up to 256): rows are moved as D' = next power of
two wide tiles (Triton needs power-of-two blocks) with the columns past D masked; D' == D adds no
mask at all.
"""

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels._compat import pl, plgpu, triton_params
from pallas_kernels._validate import check_head_dim
from pallas_kernels.reference import check_page_layout


def _column_mask(mask, head_dim, padded_dim):
    """mask [..., D'] restricted to the real columns < D; unchanged (no op) when D' == D."""
    if padded_dim == head_dim:
        return mask
    return mask & (jnp.arange(padded_dim) < head_dim)


def _write_kernel(slots_ref, k_new_ref, v_new_ref, _k_in, _v_in, k_pages_ref, v_pages_ref, *,
                  num_kv_heads, tokens_per_program, padded_dim):
    """slots [T]; k_new, v_new [T, K, D]; pages [K, N, S, D] (the whole pool, aliased)."""
    num_tokens, _, head_dim = k_new_ref.shape
    block_size = k_pages_ref.shape[2]
    token = pl.program_id(0) * tokens_per_program + jnp.arange(tokens_per_program)
    slot = plgpu.load(slots_ref.at[token], mask=token < num_tokens, other=-1)
    head = jnp.arange(pl.next_power_of_2(num_kv_heads))
    dims = jnp.arange(padded_dim)
    shape = (tokens_per_program, head.shape[0], padded_dim)
    live = jnp.broadcast_to(((slot >= 0)[:, None] & (head < num_kv_heads)[None, :])[:, :, None],
                            shape)
    live = _column_mask(live, head_dim, padded_dim)
    source = (token[:, None, None], head[None, :, None], dims[None, None, :])
    # Skipped rows address the sink slot 0 (masked: never written when compiled; the interpreter
    # writes back what it read there, which must not collide with a real row's slot).
    slot = jnp.maximum(slot, 0)
    target = (head[None, :, None], (slot // block_size)[:, None, None],
              (slot % block_size)[:, None, None], dims[None, None, :])
    for new_ref, pages_ref in ((k_new_ref, k_pages_ref), (v_new_ref, v_pages_ref)):
        rows = plgpu.load(new_ref.at[source], mask=live, other=0)
        plgpu.store(pages_ref.at[target], rows.astype(pages_ref.dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("interpret", "tokens_per_program", "num_warps"))
def write_to_pages(k_pages, v_pages, k_new, v_new, slot_mapping, *, interpret=False,
                   tokens_per_program=8, num_warps=4):
    """Write k_new, v_new [T, K, D] at slot_mapping [T] (slot = block * S + offset; -1 skips).

    k_pages, v_pages: [K, N, S, D]. Returns the updated pages. The pages are aliased to the
    outputs: a caller that donates them (the engine's step does) gets the write in place; one that
    does not gets XLA's copy of the pages first.
    """
    check_page_layout(k_pages, v_pages, head_dim=k_new.shape[-1])
    check_head_dim(k_new.shape[-1])
    if k_new.shape != v_new.shape or k_new.shape[1] != k_pages.shape[0]:
        raise ValueError(f"k_new/v_new must be [T, {k_pages.shape[0]}, D], got {k_new.shape} "
                         f"and {v_new.shape}")
    if slot_mapping.shape != k_new.shape[:1] or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32 [{k_new.shape[0]}], got "
                         f"{slot_mapping.dtype} {slot_mapping.shape}")
    whole = lambda array: pl.BlockSpec(array.shape, lambda i: (0,) * array.ndim)  # noqa: E731
    kernel = functools.partial(_write_kernel, num_kv_heads=k_pages.shape[0],
                               tokens_per_program=tokens_per_program,
                               padded_dim=pl.next_power_of_2(k_new.shape[-1]))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(k_new.shape[0], tokens_per_program),),
        in_specs=[whole(slot_mapping), whole(k_new), whole(v_new), whole(k_pages), whole(v_pages)],
        out_specs=[whole(k_pages), whole(v_pages)],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="jpaged_cache_write_triton",
    )(slot_mapping, k_new, v_new, k_pages, v_pages)


def _rotate_write_kernel(slots_ref, qkv_ref, cos_ref, sin_ref, _k_in, _v_in, q_ref, k_pages_ref,
                         v_pages_ref, *, num_heads, tokens_per_program, heads_per_tile,
                         padded_dim):
    """One (token tile, head tile) program. slots [T]; qkv [T, H + 2K, D]; cos, sin [T, D] f32;
    q [T, H, D] (out); pages [K, N, S, D] (the whole pool, aliased). Head tiles below H / tile
    rotate queries; the rest rotate keys and write keys and values of their kv heads. The tiles
    divide T and the heads exactly, so only the page writes of skipped tokens are masked (they
    address the sink slot 0, see _write_kernel)."""
    block_size = k_pages_ref.shape[2]
    head_dim = qkv_ref.shape[-1]
    half = head_dim // 2
    token = pl.program_id(0) * tokens_per_program + jnp.arange(tokens_per_program)
    tile = pl.program_id(1)
    dims = jnp.arange(padded_dim)
    partner = jnp.where(dims < half, dims + half, dims - half)   # rotate_half's source column
    sign = jnp.where(dims < half, -1.0, 1.0).astype(jnp.float32)
    within = jnp.arange(heads_per_tile)
    q_tiles = num_heads // heads_per_tile
    tile_shape = (tokens_per_program, heads_per_tile, padded_dim)
    # Columns past D (only when D' > D) are neither loaded nor stored; None: no mask at all.
    column_mask = lambda shape: (  # noqa: E731
        None if padded_dim == head_dim else jnp.broadcast_to(dims < head_dim, shape))
    is_column = column_mask(tile_shape)

    def at(head, columns):   # [C, Hs, D'] index of (token, head, column)
        return (token[:, None, None], head[None, :, None], columns[None, None, :])

    def load(ref, index, mask):
        if mask is None:
            return plgpu.load(ref.at[index])
        return plgpu.load(ref.at[index], mask=mask, other=0)

    def rotated(head):
        table = (token[:, None], dims[None, :])
        table_mask = column_mask((tokens_per_program, padded_dim))
        # cast to the activations' dtype first, as transformers (and the reference) do
        cos = load(cos_ref, table, table_mask).astype(qkv_ref.dtype).astype(jnp.float32)
        sin = load(sin_ref, table, table_mask).astype(qkv_ref.dtype).astype(jnp.float32)
        x = load(qkv_ref, at(head, dims), is_column).astype(jnp.float32)
        x_half = load(qkv_ref, at(head, partner), is_column).astype(jnp.float32)
        return x * cos[:, None, :] + sign * x_half * sin[:, None, :]

    @pl.when(tile < q_tiles)
    def _queries():
        head = tile * heads_per_tile + within
        plgpu.store(q_ref.at[at(head, dims)], rotated(head).astype(q_ref.dtype), mask=is_column)

    @pl.when(tile >= q_tiles)
    def _keys_and_values():
        kv_head = (tile - q_tiles) * heads_per_tile + within
        slot = plgpu.load(slots_ref.at[token])
        live = jnp.broadcast_to((slot >= 0)[:, None, None], tile_shape)
        live = _column_mask(live, head_dim, padded_dim)
        slot = jnp.maximum(slot, 0)
        target = (kv_head[None, :, None], (slot // block_size)[:, None, None],
                  (slot % block_size)[:, None, None], dims[None, None, :])
        keys = rotated(num_heads + kv_head)
        plgpu.store(k_pages_ref.at[target], keys.astype(k_pages_ref.dtype), mask=live)
        values = load(qkv_ref, at(num_heads + k_pages_ref.shape[0] + kv_head, dims), is_column)
        plgpu.store(v_pages_ref.at[target], values.astype(v_pages_ref.dtype), mask=live)


def _largest_power_of_two_dividing(value: int, cap: int) -> int:
    size = 1
    while size * 2 <= cap and value % (size * 2) == 0:
        size *= 2
    return size


@functools.partial(jax.jit, static_argnames=("num_heads", "interpret", "num_warps",
                                             "tokens_per_program"))
def rotate_and_write(qkv, cos, sin, k_pages, v_pages, slot_mapping, *, num_heads,
                     interpret=False, num_warps=4, tokens_per_program=None):
    """qkv [T, H + 2K, D] -> (q [T, H, D] rotated, k_pages, v_pages with the rotated keys and
    the values written at slot_mapping [T], -1 skips); cos, sin [T, D] float32.

    k_pages, v_pages: [K, N, S, D], aliased to the outputs as in `write_to_pages`. The grid is
    (token tiles, head tiles): a tile of up to 8 heads (dividing gcd(H, K)) of one token, or of
    up to 4 tokens once T passes 512, so a decode batch spreads over hundreds of programs (with
    16 programs of 4 tokens walking all heads, the 8B shape's batch of 64 took 5.7 us on the H200).
    tokens_per_program (a power of two dividing T) overrides that choice.
    """
    check_page_layout(k_pages, v_pages, head_dim=qkv.shape[-1])
    num_kv_heads = k_pages.shape[0]
    if qkv.ndim != 3 or qkv.shape[1] != num_heads + 2 * num_kv_heads:
        raise ValueError(f"qkv must be [T, {num_heads} + 2 x {num_kv_heads}, D], got "
                         f"{qkv.shape}")
    num_tokens, _, head_dim = qkv.shape
    check_head_dim(head_dim)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_tokens, head_dim) or table.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 [{num_tokens}, {head_dim}], got "
                             f"{table.dtype} {table.shape}")
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32 [{num_tokens}], got "
                         f"{slot_mapping.dtype} {slot_mapping.shape}")
    if tokens_per_program is None:
        tokens_per_program = _largest_power_of_two_dividing(num_tokens,
                                                            max(1, min(4, num_tokens // 512)))
    elif num_tokens % tokens_per_program or tokens_per_program & (tokens_per_program - 1):
        raise ValueError(f"tokens_per_program must be a power of two dividing {num_tokens}, "
                         f"got {tokens_per_program}")
    heads_per_tile = _largest_power_of_two_dividing(math.gcd(num_heads, num_kv_heads), 8)
    whole = lambda array: pl.BlockSpec(array.shape, lambda i, j: (0,) * array.ndim)  # noqa: E731
    q_shape = jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), qkv.dtype)
    kernel = functools.partial(_rotate_write_kernel, num_heads=num_heads,
                               tokens_per_program=tokens_per_program,
                               heads_per_tile=heads_per_tile,
                               padded_dim=pl.next_power_of_2(head_dim))
    return tuple(pl.pallas_call(
        kernel,
        grid=(num_tokens // tokens_per_program, (num_heads + num_kv_heads) // heads_per_tile),
        in_specs=[whole(slot_mapping), whole(qkv), whole(cos), whole(sin), whole(k_pages),
                  whole(v_pages)],
        out_specs=[whole(q_shape), whole(k_pages), whole(v_pages)],
        out_shape=[q_shape, jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="jpaged_rotate_write_triton",
    )(slot_mapping, qkv, cos, sin, k_pages, v_pages))
