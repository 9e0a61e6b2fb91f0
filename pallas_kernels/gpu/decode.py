"""GPU paged decode attention (Pallas Triton): one query token per sequence, split-K over the context.

Flash-decoding: the grid is (sequence, kv head, split). Each program serves all query heads of one
GQA group from a single read of that kv head's pages, walks its slice of the context `tokens_per_step`
tokens at a time (a tile may span several pages; each token's page comes from the block table), keeps
an online softmax in float32 and writes partial (acc, max, sum). A small jnp combine merges the
splits, so a batch of a few long sequences still fills the GPU.

Only blocks < ceil(context_len / S) are read: loads past the context are masked, never issued, so
the sink block 0 and stale slots are never touched (tests fill them with NaN).
The plain-jnp reference is `pallas_kernels.reference.paged_attention_decode`.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _online_softmax as softmax
from pallas_kernels._compat import dot_f32, pl, plgpu, triton_params
from pallas_kernels._validate import check_decode_args, check_power_of_two

# Enough programs for two waves on an H200 (132 SMs); splits are chosen to reach this.
_TARGET_PROGRAMS = 264
_MIN_DOT_ROWS = 16  # Triton's dot needs >= 16 rows: a GQA group is padded (by masked loads) to this.


def _decode_kernel(context_lens_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref,
                   acc_ref, m_ref, l_ref, *, group, tokens_per_step, tokens_per_split, scale):
    """One (sequence, kv head, split) program.

    Refs: context_lens [B]; block_tables [M] (this sequence's row); q [H, D] (this sequence);
    k_pages, v_pages [N, S, D] (this kv head). Outputs for this program: acc [R, D], m/l [R, 1],
    where R >= group rows of the GQA group (rows >= group are padding and stay zero).
    """
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, head_dim = acc_ref.shape
    block_size = k_pages_ref.shape[1]
    context_len = context_lens_ref[seq]
    split_start = split * tokens_per_split
    split_end = jnp.minimum(split_start + tokens_per_split, context_len)
    num_steps = pl.cdiv(jnp.maximum(split_end - split_start, 0), tokens_per_step)

    row = jnp.arange(rows)
    q_mask = jnp.broadcast_to((row < group)[:, None], (rows, head_dim))
    q = plgpu.load(q_ref.at[pl.ds(kv_head * group, rows), :], mask=q_mask, other=0)
    dims = jnp.arange(head_dim)

    def step(i, state):
        token = split_start + i * tokens_per_step + jnp.arange(tokens_per_step)  # [C] positions
        is_cached = token < split_end
        page = plgpu.load(block_tables_ref.at[token // block_size], mask=is_cached, other=0)
        index = (page[:, None], (token % block_size)[:, None], dims[None, :])
        kv_mask = jnp.broadcast_to(is_cached[:, None], (tokens_per_step, head_dim))
        keys = plgpu.load(k_pages_ref.at[index], mask=kv_mask, other=0)      # [C, D]
        values = plgpu.load(v_pages_ref.at[index], mask=kv_mask, other=0)    # [C, D]
        scores = dot_f32(q, keys, transpose_b=True) * scale                  # [R, C]
        visible = jnp.broadcast_to(is_cached[None, :], scores.shape)
        return softmax.update(state, scores, values, visible)

    m, l_sum, acc = jax.lax.fori_loop(0, num_steps, step, softmax.initial_state(rows, head_dim))
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l_sum


def default_tiling(batch, num_kv_heads, max_context, head_dim, dtype):
    """(tokens_per_step, num_splits) used when the caller passes None.

    A step holds ~16 KiB of K (64 bf16 tokens at D=128); splits aim at `_TARGET_PROGRAMS` programs
    with at least four steps each. `max_context` is M*S (the table width), a static bound.
    """
    tokens_per_step = max(16, 16384 // (head_dim * jnp.dtype(dtype).itemsize))
    max_steps = pl.cdiv(max_context, tokens_per_step)
    num_splits = max(1, min(pl.cdiv(_TARGET_PROGRAMS, batch * num_kv_heads), max_steps // 4))
    return tokens_per_step, num_splits


@functools.partial(jax.jit, static_argnames=(
    "scale", "interpret", "num_splits", "tokens_per_step", "num_warps", "num_stages"))
def paged_attention_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale=None,
                           interpret=False, num_splits=None, tokens_per_step=None,
                           num_warps=4, num_stages=2):
    """Paged decode attention on a GPU (Pallas Triton); same contract as the reference.

    q: [B, H, D]; k_pages, v_pages: [K, N, S, D] (kv-head-major pages, block 0 a never-read sink);
    block_tables: [B, M] int32 (entries past ceil(context_len/S) are not read);
    context_lens: [B] int32, including the current token; 0 marks a padding row (zeros out).
    Returns [B, H, D] in q's dtype; softmax in float32. H must be a multiple of K (MHA/GQA/MQA).

    Static tiling: tokens_per_step (power of two >= 16, tokens per inner step, may span pages),
    num_splits (split-K partitions of the M*S context), num_warps/num_stages (Triton); None picks
    `default_tiling`. interpret=True runs the kernel in the Pallas interpreter (CPU tests).
    """
    check_decode_args(q, k_pages, v_pages, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    check_power_of_two("head dim", head_dim, 16)
    check_power_of_two("block size (k_pages.shape[2])", block_size, 1)
    max_context = block_tables.shape[1] * block_size
    default_step, default_splits = default_tiling(batch, num_kv_heads, max_context, head_dim,
                                                  q.dtype)
    tokens_per_step = tokens_per_step or default_step
    check_power_of_two("tokens_per_step", tokens_per_step, 16)
    num_splits = num_splits or default_splits
    tokens_per_split = pl.cdiv(pl.cdiv(max_context, num_splits), tokens_per_step) * tokens_per_step
    num_splits = pl.cdiv(max_context, tokens_per_split)
    group = num_heads // num_kv_heads
    rows = max(_MIN_DOT_ROWS, pl.next_power_of_2(group))
    scale = head_dim ** -0.5 if scale is None else scale
    kernel = functools.partial(_decode_kernel, group=group, tokens_per_step=tokens_per_step,
                               tokens_per_split=tokens_per_split, scale=scale)
    partial_shape = (batch, num_kv_heads, num_splits, rows)
    partial_spec = lambda width: pl.BlockSpec(  # noqa: E731 - one tile per program
        (None, None, None, rows, width), lambda b, h, s: (b, h, s, 0, 0))
    acc, m, l_sum = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec(context_lens.shape, lambda b, h, s: (0,)),              # all lengths
            pl.BlockSpec((None, block_tables.shape[1]), lambda b, h, s: (b, 0)),  # row b
            pl.BlockSpec((None, num_heads, head_dim), lambda b, h, s: (b, 0, 0)),  # q[b]
            pl.BlockSpec((None, *k_pages.shape[1:]), lambda b, h, s: (h, 0, 0, 0)),  # head h
            pl.BlockSpec((None, *v_pages.shape[1:]), lambda b, h, s: (h, 0, 0, 0)),
        ],
        out_specs=[partial_spec(head_dim), partial_spec(1), partial_spec(1)],
        out_shape=[jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32),
                   jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32)],
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="jpaged_decode_triton",
    )(context_lens, block_tables, q, k_pages, v_pages)
    out = softmax.combine_splits(acc, m, l_sum, axis=2)  # [B, K, R, D]
    return out[:, :, :group].reshape(batch, num_heads, head_dim).astype(q.dtype)
