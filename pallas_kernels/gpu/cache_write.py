"""GPU cache write (Pallas Triton): new keys/values scattered into their pages by slot, in place.

The same contract as `pallas_kernels.reference.write_to_pages` (the XLA scatter, also the oracle):
the pages are aliased input -> output, so with the caller's buffers donated nothing but the new
rows is written. On the H200 it takes 0.61-0.69x XLA's scatter time at 256 tokens and 0.15-0.17x
at 2048 (benchmarks/results/kernels_h200.md). The grid runs `tokens_per_program` tokens (all kv
heads) per program.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._compat import pl, plgpu, triton_params
from pallas_kernels.reference import check_page_layout


def _write_kernel(slots_ref, k_new_ref, v_new_ref, _k_in, _v_in, k_pages_ref, v_pages_ref, *,
                  num_kv_heads, tokens_per_program):
    """slots [T]; k_new, v_new [T, K, D]; pages [K, N, S, D] (the whole pool, aliased)."""
    num_tokens, _, head_dim = k_new_ref.shape
    block_size = k_pages_ref.shape[2]
    token = pl.program_id(0) * tokens_per_program + jnp.arange(tokens_per_program)
    slot = plgpu.load(slots_ref.at[token], mask=token < num_tokens, other=-1)
    head = jnp.arange(pl.next_power_of_2(num_kv_heads))
    dims = jnp.arange(head_dim)
    shape = (tokens_per_program, head.shape[0], head_dim)
    live = jnp.broadcast_to(((slot >= 0)[:, None] & (head < num_kv_heads)[None, :])[:, :, None],
                            shape)
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
    if k_new.shape != v_new.shape or k_new.shape[1] != k_pages.shape[0]:
        raise ValueError(f"k_new/v_new must be [T, {k_pages.shape[0]}, D], got {k_new.shape} "
                         f"and {v_new.shape}")
    if slot_mapping.shape != k_new.shape[:1] or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32 [{k_new.shape[0]}], got "
                         f"{slot_mapping.dtype} {slot_mapping.shape}")
    whole = lambda array: pl.BlockSpec(array.shape, lambda i: (0,) * array.ndim)  # noqa: E731
    kernel = functools.partial(_write_kernel, num_kv_heads=k_pages.shape[0],
                               tokens_per_program=tokens_per_program)
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
