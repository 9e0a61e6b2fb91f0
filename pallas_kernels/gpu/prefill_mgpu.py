"""Hopper ragged prefill/chunk attention (Pallas Mosaic GPU): wgmma tiles fed by TMA copies of pages.

Same contract as the Triton kernel in `pallas_kernels.gpu.prefill` and the reference
`pallas_kernels.reference.paged_attention_prefill`. Layout of the work:

- Tiles come from `_ragged.sequence_tiles` (never spanning sequences). Outside the kernel, XLA
  gathers each tile's rows of q into `q_tiles: [num_tiles, K, R, D]`, R = block_q * G rows per kv
  head (token-major, the G query heads of the group inside), and scatters `out_tiles` back, so the
  kernel moves whole [R, D] tiles with one TMA each way and never stores a ragged edge.
- One program per (tile, kv head), one warpgroup: S = Q K^T and O += P V are wgmma with Q, K, V in
  swizzled shared memory; the online softmax runs in float32 registers.
- Keys walk the sequence's pages through its block-table row (scalars read from global memory),
  block_kv keys per step = block_kv / S pages, one TMA copy per page into one stage of a
  num_stages-deep ring; the copy for step i + num_stages is issued as soon as step i's MMAs are done.
- Only steps on the causal diagonal (and the first steps of a sliding window) are masked; with a
  window of W the walk starts at the page holding the first row's oldest key, so older pages are
  never read. The last step zeroes the value rows past the tile's last key in shared memory:
  they may be unwritten slots (any bits, NaN included), and 0 * NaN would reach the output.

Head dims: multiples of 64 up to 256 (one 128-byte swizzle tile per 64 bf16 columns); others are
refused (`unsupported_reason`) and the Triton kernel serves them. dtypes: bfloat16 and float16 only.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._compat import mosaic_gpu_interpret, mosaic_gpu_problem, pl, plmgpu
from pallas_kernels._ragged import sequence_tiles
from pallas_kernels._validate import check_options, check_prefill_args, raise_if

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_LOG2E = math.log2(math.e)
_SWIZZLE_BYTES = 128
_SMEM_BYTES = 227 * 1024  # shared memory one Hopper CTA may hold (H100 / H200)


def unsupported_reason(*, head_dim, dtype=None, block_size=None):
    """None if this kernel can run these shapes, else a short reason (the wrapper's own checks)."""
    if head_dim % 64 or not 64 <= head_dim <= 256:
        return (f"head_dim must be a multiple of 64 in [64, 256] for the Mosaic GPU prefill "
                f"kernel (wgmma tiles of 128-byte swizzled rows), got {head_dim}")
    if dtype is not None and jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return (f"dtype {jnp.dtype(dtype)} not in {[str(d) for d in SUPPORTED_DTYPES]} for the "
                "Mosaic GPU prefill kernel (wgmma takes 16-bit operands here)")
    if block_size is not None and (block_size < 8 or block_size & (block_size - 1)):
        return f"block_size must be a power of two >= 8 for TMA page copies, got {block_size}"
    return None


def default_block_q(group, head_dim):
    """Query tokens per tile: the fewest giving R = block_q * G a multiple of 64 and >= the target
    rows (128, or 64 for D = 256, where two [R, D] float32 tiles would exhaust registers)."""
    target_rows = 64 if head_dim > 128 else 128
    step = 64 // math.gcd(group, 64)
    return max(step, -(-target_rows // (group * step)) * step)


def _tile_plan(tiles, context_lens, query_start_loc, *, block_size, sliding_window):
    """[num_tiles, 4] int32 per tile: sequence (>= 0), position of its first row, first key of the
    walk (page-aligned) and key end (exclusive; 0 for padding and empty tiles)."""
    seq, first_row, end_row = tiles[0], tiles[1], tiles[2]
    safe_seq = jnp.maximum(seq, 0)
    q_begin, q_end = query_start_loc[safe_seq], query_start_loc[safe_seq + 1]
    first_position = context_lens[safe_seq] - (q_end - q_begin) + first_row - q_begin
    key_end = jnp.where((seq >= 0) & (end_row > first_row),
                        first_position + end_row - first_row, 0)
    key_begin = jnp.zeros_like(key_end)
    if sliding_window is not None:
        key_begin = jnp.maximum(first_position - sliding_window + 1, 0)
        key_begin = jnp.minimum(key_begin // block_size * block_size, key_end)
    return jnp.stack([safe_seq, first_position, key_begin, key_end], axis=1).astype(jnp.int32)


def _step_ranges(first_position, num_rows, key_begin, key_end, *, block_kv, sliding_window):
    """(num_steps, first unmasked step, first causally masked step) of a tile's key walk."""
    num_steps = pl.cdiv(key_end - key_begin, block_kv)
    # A step needs no causal mask when its last key is <= the first row's position.
    diagonal = jnp.clip((first_position + 1 - key_begin) // block_kv, 0, num_steps)
    unmasked = jnp.zeros_like(num_steps)
    if sliding_window is not None:  # a step is whole for every row once its first key is in
        last_position = first_position + num_rows - 1  # the last row's window
        oldest = last_position - sliding_window + 1
        unmasked = jnp.clip(pl.cdiv(oldest - key_begin, block_kv), 0, num_steps)
    return num_steps, unmasked, jnp.maximum(diagonal, unmasked)


def _smem_transforms(dtype):
    """Tiling + swizzle for a [rows, D] wgmma operand: 128-byte rows, 8-row swizzle atoms."""
    columns = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plmgpu.TilingTransform((8, columns)), plmgpu.SwizzleTransform(_SWIZZLE_BYTES))


def _add_product(acc, lhs, rhs_smem, *, in_place):
    """acc + lhs @ rhs by wgmma, lhs in registers. in_place accumulates into acc's registers
    (`pl.run_state` with an initialized accumulator). Mosaic GPU's interpreter has neither
    run_state nor register operands, so there lhs goes through shared memory into a zeroed
    accumulator and the sum is an add (fine on a CPU, wasteful on a GPU)."""
    if in_place:
        def accumulate(acc_ref):
            plmgpu.wgmma(acc_ref, lhs, rhs_smem)
        return pl.run_state(accumulate)(plmgpu.ACC.init(acc))

    def product(lhs_smem, acc_ref):
        lhs_smem[...] = lhs
        plmgpu.commit_smem()
        plmgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
        return acc_ref[...]
    lhs_type = plmgpu.SMEM(lhs.shape, lhs.dtype, transforms=_smem_transforms(lhs.dtype))
    return acc + pl.run_scoped(
        lambda lhs_smem: pl.run_scoped(functools.partial(product, lhs_smem),
                                       plmgpu.ACC(acc.shape, jnp.float32)), lhs_type)


def _prefill_kernel(plan_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref, out_ref,
                    q_smem, k_smem, v_smem, q_barrier, k_barriers, v_barriers, *, group,
                    block_kv, num_stages, scale, sliding_window, logits_soft_cap, interpret):
    """One (tile, kv head) program; one warpgroup.

    plan [num_tiles, 4] (see `_tile_plan`), block_tables [B, M], q and out tiles
    [num_tiles, K, R, D], pages [K, N, S, D] in global memory; q_smem [R, D] and the rings
    k_smem, v_smem [num_stages, block_kv, D] in shared memory, one barrier per ring stage.
    """
    tile, kv_head = lax.axis_index("tile"), lax.axis_index("kv_head")
    rows, head_dim = q_smem.shape
    block_size = k_pages_ref.shape[2]
    pages_per_step = block_kv // block_size
    seq, first_position = plan_ref[tile, 0], plan_ref[tile, 1]
    key_begin, key_end = plan_ref[tile, 2], plan_ref[tile, 3]
    num_rows = jnp.maximum(key_end - first_position, 1)
    num_steps, unmasked, diagonal = _step_ranges(
        first_position, num_rows, key_begin, key_end, block_kv=block_kv,
        sliding_window=sliding_window)

    plmgpu.copy_gmem_to_smem(q_ref.at[tile, kv_head], q_smem, q_barrier)

    def issue_copies(step):
        """TMA the step's pages into its ring stage. A page past the last key is replaced by the
        walk's first page (owned, so in bounds; its keys are masked and its values zeroed): every
        copy still arrives, as the stage's barrier expects."""
        slot = lax.rem(step, jnp.int32(num_stages))
        for page_in_step in range(pages_per_step):
            first_key = key_begin + step * block_kv + page_in_step * block_size
            is_needed = first_key < key_end
            logical = jnp.where(is_needed, first_key // block_size, key_begin // block_size)
            page = block_tables_ref[seq, logical]
            rows_in_stage = pl.ds(page_in_step * block_size, block_size)
            plmgpu.copy_gmem_to_smem(k_pages_ref.at[kv_head, page], k_smem.at[slot, rows_in_stage],
                                     k_barriers.at[slot])
            plmgpu.copy_gmem_to_smem(v_pages_ref.at[kv_head, page], v_smem.at[slot, rows_in_stage],
                                     v_barriers.at[slot])

    def issue_copies_if_walked(step):
        pl.when(step < num_steps)(lambda: issue_copies(step))

    for step in range(num_stages):
        issue_copies_if_walked(jnp.int32(step))

    layout = plmgpu.Layout.WGMMA
    row_position = first_position + plmgpu.broadcasted_iota(
        jnp.int32, (rows, block_kv), 0, layout=layout) // group
    key_in_step = plmgpu.broadcasted_iota(jnp.int32, (rows, block_kv), 1, layout=layout)

    def visible(step):
        key = key_begin + step * block_kv + key_in_step
        is_visible = (key <= row_position) & (key < key_end)
        if sliding_window is not None:
            is_visible &= key > row_position - sliding_window
        return is_visible

    def zero_values_past_end(step, slot):
        """Value rows at or past key_end hold no key of this tile: make them finite zeros."""
        values = v_smem[slot]
        key = key_begin + step * block_kv + plmgpu.broadcasted_iota(
            jnp.int32, values.shape, 0, layout=layout)
        v_smem[slot] = jnp.where(key < key_end, values, jnp.zeros_like(values))
        plmgpu.commit_smem()

    def kv_step(step, carry, *, is_masked):
        acc, m_prev, l_prev = carry
        slot = lax.rem(step, jnp.int32(num_stages))
        plmgpu.barrier_wait(k_barriers.at[slot])

        def scores_scope(scores_ref):
            plmgpu.wgmma(scores_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            return scores_ref[...]

        scores = pl.run_scoped(scores_scope, plmgpu.ACC((rows, block_kv), jnp.float32))
        if logits_soft_cap is None:
            scores = scores * (scale * _LOG2E)  # log2 domain: exp2 below
        else:
            scores = (logits_soft_cap * _LOG2E) * jnp.tanh(scores * (scale / logits_soft_cap))
        if is_masked:
            scores = jnp.where(visible(step), scores, -jnp.inf)
        m_new = jnp.maximum(m_prev, scores.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
        correction = jnp.exp2(m_prev - m_safe)
        probs = jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0]))
        l_new = l_prev * correction + probs.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
        plmgpu.barrier_wait(v_barriers.at[slot])
        if is_masked:
            pl.when(step == num_steps - 1)(lambda: zero_values_past_end(step, slot))

        acc = _add_product(acc, probs.astype(v_smem.dtype), v_smem.at[slot],
                           in_place=not interpret)
        issue_copies_if_walked(step + num_stages)  # this stage is free again
        return acc, m_new, l_new

    acc = plmgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), layout)
    m_init = plmgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), layout.reduce(1))
    l_init = plmgpu.layout_cast(jnp.zeros((rows,), jnp.float32), layout.reduce(1))
    plmgpu.barrier_wait(q_barrier)
    carry = (acc, m_init, l_init)
    masked_step = functools.partial(kv_step, is_masked=True)
    carry = lax.fori_loop(0, unmasked, masked_step, carry)
    carry = lax.fori_loop(unmasked, diagonal, functools.partial(kv_step, is_masked=False), carry)
    acc, _, l_sum = lax.fori_loop(diagonal, num_steps, masked_step, carry)
    l_safe = jnp.where(l_sum > 0, l_sum, 1.0)  # rows that saw no key come out as zeros
    acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    q_smem[...] = acc.astype(q_smem.dtype)  # q is no longer needed: reuse its buffer
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(q_smem, out_ref.at[tile, kv_head])
    plmgpu.wait_smem_to_gmem(0)


def _gather_rows(tiles, num_tokens, block_q):
    """[num_tiles * block_q] int32 token of each tile row (clamped into q; extra rows repeat a
    token and are never scattered back)."""
    rows = tiles[1][:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    return jnp.minimum(rows, num_tokens - 1).reshape(-1)


def _scatter_rows(tiles, query_start_loc, num_tokens, block_q):
    """[T] int32: the tile row holding each token (padding tokens: any row; zeroed after)."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # First rows are non-decreasing and only empty tiles (first row T) repeat one, so the last
    # tile starting at or before a token is the one holding it.
    owner = jnp.searchsorted(tiles[1], token, side="right").astype(jnp.int32) - 1
    return owner * block_q + token - tiles[1][owner]


def _check_tiling(q, k_pages, block_q, block_kv, num_stages):
    num_heads, head_dim = q.shape[1:]
    group = num_heads // k_pages.shape[0]
    block_size = k_pages.shape[2]
    raise_if(unsupported_reason(head_dim=head_dim, dtype=q.dtype, block_size=block_size))
    if block_q < 1 or (block_q * group) % 64:
        raise ValueError(f"block_q * group size must be a multiple of 64 (wgmma rows), got "
                         f"block_q {block_q} x group {group}")
    if block_kv % 64 or block_kv % block_size:
        raise ValueError(f"block_kv must be a multiple of 64 and of the block size {block_size}, "
                         f"got {block_kv}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    smem_bytes = (block_q * group + 2 * num_stages * block_kv) * head_dim * q.dtype.itemsize
    if smem_bytes > _SMEM_BYTES:
        raise ValueError(f"q tile + K/V ring take {smem_bytes} bytes of shared memory, more than "
                         f"{_SMEM_BYTES}: lower num_stages ({num_stages}), block_kv ({block_kv}) "
                         f"or block_q ({block_q})")


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "logits_soft_cap", "interpret", "block_q", "block_kv",
    "num_stages"))
def paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                            scale=None, sliding_window=None, logits_soft_cap=None,
                            interpret=False, block_q=None, block_kv=None, num_stages=2):
    """Ragged causal prefill/chunk attention on a Hopper GPU (Pallas Mosaic GPU).

    Same contract as `pallas_kernels.gpu.prefill.paged_attention_prefill`: q [T, H, D]; pages
    [K, N, S, D] (block 0 a never-read sink); block_tables [B, M], context_lens [B] (including the
    chunk), query_start_loc [B+1], all int32; rows past query_start_loc[B] come back as zeros.
    Returns [T, H, D] in q's dtype; softmax in float32. D: a multiple of 64 up to 256; dtype
    bfloat16 or float16; S a power of two >= 8.

    Static tiling: block_q (query tokens per tile; block_q * G must be a multiple of 64; None:
    `default_block_q`), block_kv (keys per step, a multiple of 64 and of S; None: 128, or 64 for
    D = 256), num_stages (depth of the shared-memory K/V ring). interpret=True runs Mosaic GPU's
    own interpreter (jax 0.11+, CPU tests).
    """
    check_prefill_args(q, k_pages, v_pages, block_tables, context_lens, query_start_loc)
    check_options(sliding_window, logits_soft_cap)
    raise_if(mosaic_gpu_problem())
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    block_q = block_q or default_block_q(group, head_dim)
    block_kv = block_kv or max(64 if head_dim > 128 else 128, block_size)
    _check_tiling(q, k_pages, block_q, block_kv, num_stages)
    scale = head_dim ** -0.5 if scale is None else scale
    tiles = sequence_tiles(query_start_loc, num_tokens, block_q)
    num_tiles, rows = tiles.shape[1], block_q * group
    plan = _tile_plan(tiles, context_lens, query_start_loc, block_size=block_size,
                      sliding_window=sliding_window)
    q_tiles = q[_gather_rows(tiles, num_tokens, block_q)]                  # [num_tiles*block_q, H, D]
    q_tiles = q_tiles.reshape(num_tiles, block_q, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_dim)
    out_tiles = _launch(plan, block_tables, q_tiles, k_pages, v_pages, group=group,
                        block_kv=block_kv, num_stages=num_stages, scale=scale,
                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                        interpret=interpret)
    out = out_tiles.reshape(num_tiles, num_kv_heads, block_q, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_tiles * block_q, num_heads, head_dim)
    out = out[_scatter_rows(tiles, query_start_loc, num_tokens, block_q)]
    is_real = jnp.arange(num_tokens) < query_start_loc[-1]
    return jnp.where(is_real[:, None, None], out, 0).astype(q.dtype)


def _launch(plan, block_tables, q_tiles, k_pages, v_pages, *, group, block_kv, num_stages,
            interpret, **options):
    """The Mosaic GPU launch: grid (tile, kv head), one warpgroup, the SMEM ring as scratch."""
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    dtype = q_tiles.dtype
    pages_per_step = block_kv // k_pages.shape[2]
    transforms = _smem_transforms(dtype)
    ring = plmgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms)
    kernel = functools.partial(_prefill_kernel, group=group, block_kv=block_kv,
                               num_stages=num_stages, interpret=bool(interpret), **options)
    return plmgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, dtype),
        scratch_types=[
            plmgpu.SMEM((rows, head_dim), dtype, transforms=transforms),  # q, then the output
            ring, ring,                                                   # k, v
            plmgpu.Barrier(),
            plmgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
            plmgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
        ],
        grid=(num_tiles, num_kv_heads),
        grid_names=("tile", "kv_head"),
        compiler_params=plmgpu.CompilerParams(approx_math=True),
        interpret=mosaic_gpu_interpret(interpret),
        kernel_name="jpaged_prefill_mosaic_gpu",
    )(plan, block_tables, q_tiles, k_pages, v_pages)
