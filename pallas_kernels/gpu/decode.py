"""GPU paged decode attention (Pallas Triton): one query token per sequence, split-K over the context.

Flash-decoding in one launch: the grid is (sequence, kv head, split). Each program serves all query
heads of one GQA group from a single read of that kv head's pages, walks its slice of the context
`tokens_per_step` tokens at a time (a tile may span several pages; each token's page comes from the
block table, fetched one step ahead), and keeps an online softmax in float32. With one split the
program writes the output itself. With several, each program stores its partial (acc, max, sum) and
bumps an atomic counter for its (sequence, kv head); the program that finds it was the last merges
the partials and writes the output, so no second launch is needed for the combine.

Only blocks < ceil(context_len / S) are read: loads past the context are masked, never issued, so
the sink block 0 and stale slots are never touched (tests fill them with NaN). With a sliding window
of W the splits cover only the last W keys, [context_len - W, context_len): older pages are never
read, and the grid has only the splits W keys need (not M*S's).

Any head dim D that is a multiple of 8 (up to 256): tiles are D' = max(16, next power of two) wide
(Triton needs power-of-two blocks), loads past column D are masked; D' == D adds no mask at all.
The plain-jnp reference is `pallas_kernels.reference.paged_attention_decode`.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _online_softmax as softmax
from pallas_kernels._compat import dot_f32, float32_precision, pl, plgpu, triton_params
from pallas_kernels._validate import (check_decode_args, check_head_dim, check_options,
                                      check_power_of_two)

_NUM_SMS = 132  # H100/H200 SXM: the default tiling fills them with one wave of programs
_MANY_PROGRAMS = 1024  # from here on (about 8 per SM) 3 pipeline stages beat 4 (default_tiling)
_MIN_DOT_ROWS = 16  # Triton's dot needs >= 16 along each side: a GQA group and D are padded to it.


def _decode_kernel(context_lens_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref, *refs,
                   group, padded_dim, tokens_per_step, tokens_per_split, num_splits, scale,
                   sliding_window, logits_soft_cap, precision, interpret):
    """One (sequence, kv head, split) program.

    Refs: context_lens [B]; block_tables [M] (this sequence's row); q [H, D] and out [H, D] (this
    sequence); k_pages, v_pages [N, S, D] (this kv head). With splits, also the partials of this
    (sequence, kv head): acc [P, R, D'], m/l [P, R, 1], and the counters [B * K] (aliased in/out).
    R >= group rows: rows >= group are padding, loaded as zeros and never stored; so are columns
    >= D of the D' = padded_dim wide tiles.
    """
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if num_splits == 1:
        (out_ref,) = refs
    else:
        _, out_ref, acc_ref, m_ref, l_ref, counts_ref = refs  # refs[0] is the counters' input
    head_dim = q_ref.shape[-1]
    rows = max(_MIN_DOT_ROWS, pl.next_power_of_2(group))
    block_size = k_pages_ref.shape[1]
    context_len = context_lens_ref[seq]
    split_start = split * tokens_per_split
    if sliding_window is not None:  # splits start at the window's first key, not at key 0
        first_key = jnp.maximum(context_len - sliding_window, 0)
        split_start += first_key
    split_end = jnp.minimum(split_start + tokens_per_split, context_len)
    num_steps = pl.cdiv(jnp.maximum(split_end - split_start, 0), tokens_per_step)

    group_rows = lambda width: jnp.broadcast_to(  # noqa: E731 - [R, width] mask of real rows
        (jnp.arange(rows) < group)[:, None], (rows, width))
    is_group_row = group_rows(padded_dim)
    if padded_dim == head_dim:
        heads = (pl.ds(kv_head * group, rows), slice(None))
        is_io = is_group_row  # [R, D'] mask of q's and out's real entries
    else:  # gather D' columns, the ones past D masked
        columns = jnp.arange(padded_dim)
        heads = ((kv_head * group + jnp.arange(rows))[:, None], columns[None, :])
        is_io = is_group_row & (columns < head_dim)[None, :]
    q = plgpu.load(q_ref.at[heads], mask=is_io, other=0)
    dims = jnp.arange(padded_dim)

    def tokens_of(i):
        token = split_start + i * tokens_per_step + jnp.arange(tokens_per_step)  # [C] positions
        return token, token < split_end

    def pages_of(i):
        token, is_cached = tokens_of(i)
        return plgpu.load(block_tables_ref.at[token // block_size], mask=is_cached, other=0)

    def step(i, carry):
        state, page = carry
        next_page = pages_of(i + 1)  # issued now, used next step: hides the table's load latency
        token, is_cached = tokens_of(i)
        index = (page[:, None], (token % block_size)[:, None], dims[None, :])
        if padded_dim == head_dim:
            kv_mask = jnp.broadcast_to(is_cached[:, None], (tokens_per_step, head_dim))
        else:
            kv_mask = is_cached[:, None] & (dims < head_dim)[None, :]
        keys = plgpu.load(k_pages_ref.at[index], mask=kv_mask, other=0)      # [C, D']
        values = plgpu.load(v_pages_ref.at[index], mask=kv_mask, other=0)    # [C, D']
        scores = dot_f32(q, keys, transpose_b=True, precision=precision) * scale  # [R, C]
        scores = softmax.soft_cap(scores, logits_soft_cap)
        visible = jnp.broadcast_to(is_cached[None, :], scores.shape)
        return softmax.update(state, scores, values, visible, precision=precision), next_page

    state, _ = jax.lax.fori_loop(0, num_steps, step,
                                 (softmax.initial_state(rows, padded_dim), pages_of(0)))
    if num_splits == 1:
        plgpu.store(out_ref.at[heads], softmax.finalize(state).astype(out_ref.dtype),
                    mask=is_io)
        return

    m, l_sum, acc = state
    plgpu.store(acc_ref.at[split], acc, mask=is_group_row)
    plgpu.store(m_ref.at[split], m, mask=group_rows(1))
    plgpu.store(l_ref.at[split], l_sum, mask=group_rows(1))
    if not interpret:  # every thread's stores are issued before the (release) atomic below
        plgpu.debug_barrier()
    arrived = plgpu.atomic_add(counts_ref, seq * pl.num_programs(1) + kv_head, jnp.int32(1))

    @pl.when(arrived == num_splits - 1)
    def _combine():  # the last program of this (sequence, kv head): merge the non-empty splits
        def merge(other, state):
            partial = tuple(plgpu.load(ref.at[other], mask=group_rows(ref.shape[-1]),
                                       other=0, volatile=True)
                            for ref in (m_ref, l_ref, acc_ref))
            return softmax.merge(state, partial)

        used_keys = context_len if sliding_window is None else context_len - first_key
        used_splits = pl.cdiv(used_keys, tokens_per_split)
        merged = jax.lax.fori_loop(0, used_splits, merge, softmax.initial_state(rows, padded_dim))
        plgpu.store(out_ref.at[heads], softmax.finalize(merged).astype(out_ref.dtype),
                    mask=is_io)



def padded_head_dim(head_dim: int) -> int:
    """D' = the tile width for head dim D: a power of two, at least 16."""
    return max(_MIN_DOT_ROWS, pl.next_power_of_2(head_dim))


def step_tokens_of(padded_dim: int, dtype) -> int:
    """Tokens per step that hold 16 KiB of keys of width padded_dim (D'), at least 16."""
    return max(16, 16384 // (padded_dim * jnp.dtype(dtype).itemsize))


def default_tiling(batch, num_kv_heads, max_context, head_dim, dtype):
    """The tiling used when the caller passes None: dict(tokens_per_step, num_splits, num_stages).

    From the H200 sweep in benchmarks/results/kernels_h200.md (bf16, D=128, S=16):
    - batch * kv heads >= SMs: no split; 16 KiB of K per step (64 tokens), 4 pipeline stages,
      3 from 1024 programs up (K = 8: B = 64 at 4096 tokens took 250 us with 4 stages, 285 with
      3; B = 128 at 960: 126.6 / 124.2 us; 256 at 2048: 492 / 489; 512 at 192: 111.8 / 102.9).
    - fewer: one wave of split programs (SMs // (batch * kv heads) splits, each of >= 4 steps),
      32 KiB per step (128 tokens), 3 stages (K and V tiles of 3 stages just fit one SM).
    `max_context` is the most keys one sequence reads (M*S, the table width, or a sliding window
    if smaller), a static bound; head_dim is the padded tile width D'.
    """
    step_tokens = step_tokens_of(head_dim, dtype)
    programs = batch * num_kv_heads
    if programs >= _NUM_SMS:
        return dict(tokens_per_step=step_tokens, num_splits=1,
                    num_stages=3 if programs >= _MANY_PROGRAMS else 4)
    step_tokens *= 2
    max_splits = max(1, pl.cdiv(max_context, step_tokens) // 4)
    return dict(tokens_per_step=step_tokens, num_splits=min(_NUM_SMS // programs, max_splits),
                num_stages=3)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "precision", "interpret", "num_splits",
    "tokens_per_step", "num_warps", "num_stages"))
def paged_attention_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale=None,
                           sliding_window=None, logits_soft_cap=None, precision=None,
                           interpret=False, num_splits=None, tokens_per_step=None, num_warps=4,
                           num_stages=None):
    """Paged decode attention on a GPU (Pallas Triton); same contract as the reference.

    q: [B, H, D]; k_pages, v_pages: [K, N, S, D] (kv-head-major pages, block 0 a never-read sink);
    block_tables: [B, M] int32 (entries past ceil(context_len/S) are not read);
    context_lens: [B] int32, including the current token; 0 marks a padding row (zeros out).
    Returns [B, H, D] in q's dtype; softmax in float32. H must be a multiple of K (MHA/GQA/MQA);
    D a multiple of 8 up to 256. sliding_window, logits_soft_cap: see `pallas_kernels.reference`
    (None: off, and the kernel is the one without them). precision: of the dots when q is
    float32 (`_compat.float32_precision`; None: HIGHEST, full float32 rather than Triton's TF32).

    Static tiling: tokens_per_step (power of two >= 16, tokens per inner step, may span pages),
    num_splits (split-K partitions of the M*S context, or of the window), num_warps/num_stages
    (Triton); None picks `default_tiling`. interpret=True runs the kernel in the Pallas
    interpreter (CPU tests).
    """
    check_decode_args(q, k_pages, v_pages, block_tables, context_lens)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    check_head_dim(head_dim)
    check_options(sliding_window, logits_soft_cap)
    check_power_of_two("block size (k_pages.shape[2])", block_size, 1)
    padded_dim = padded_head_dim(head_dim)
    max_context = block_tables.shape[1] * block_size
    if sliding_window is not None:
        max_context = min(max_context, sliding_window)
    default = default_tiling(batch, num_kv_heads, max_context, padded_dim, q.dtype)
    tokens_per_step = tokens_per_step or default["tokens_per_step"]
    check_power_of_two("tokens_per_step", tokens_per_step, 16)
    num_splits = num_splits or default["num_splits"]
    num_stages = num_stages or default["num_stages"]
    tokens_per_split = pl.cdiv(pl.cdiv(max_context, num_splits), tokens_per_step) * tokens_per_step
    num_splits = pl.cdiv(max_context, tokens_per_split)
    group = num_heads // num_kv_heads
    rows = max(_MIN_DOT_ROWS, pl.next_power_of_2(group))
    kernel = functools.partial(
        _decode_kernel, group=group, padded_dim=padded_dim, tokens_per_step=tokens_per_step,
        tokens_per_split=tokens_per_split, num_splits=num_splits,
        scale=head_dim ** -0.5 if scale is None else scale, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, precision=float32_precision(precision),
        interpret=interpret)
    grid = (batch, num_kv_heads, num_splits)
    per_sequence = lambda b, h, s: (b, 0, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec(context_lens.shape, lambda b, h, s: (0,)),                 # all lengths
        pl.BlockSpec((None, block_tables.shape[1]), lambda b, h, s: (b, 0)),     # row b
        pl.BlockSpec((None, num_heads, head_dim), per_sequence),                 # q[b]
        pl.BlockSpec((None, *k_pages.shape[1:]), lambda b, h, s: (h, 0, 0, 0)),  # kv head h
        pl.BlockSpec((None, *v_pages.shape[1:]), lambda b, h, s: (h, 0, 0, 0)),
    ]
    out_specs = [pl.BlockSpec((None, num_heads, head_dim), per_sequence)]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    args = [context_lens, block_tables, q, k_pages, v_pages]
    aliases = {}
    if num_splits > 1:  # partials of every split of one (sequence, kv head), and arrival counters
        counters = jnp.zeros((batch * num_kv_heads,), jnp.int32)
        partial = lambda width: pl.BlockSpec(  # noqa: E731
            (None, None, num_splits, rows, width), lambda b, h, s: (b, h, 0, 0, 0))
        counter_spec = pl.BlockSpec(counters.shape, lambda b, h, s: (0,))
        in_specs.append(counter_spec)
        out_specs += [partial(padded_dim), partial(1), partial(1), counter_spec]
        partial_shape = (batch, num_kv_heads, num_splits, rows)
        out_shape += [jax.ShapeDtypeStruct((*partial_shape, padded_dim), jnp.float32),
                      jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32),
                      jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32),
                      jax.ShapeDtypeStruct(counters.shape, jnp.int32)]
        args.append(counters)
        aliases = {len(args) - 1: len(out_shape) - 1}
    outputs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="jpaged_decode_triton",
    )(*args)
    return outputs[0]
