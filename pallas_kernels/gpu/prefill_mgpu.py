"""Hopper ragged prefill/chunk attention (Pallas Mosaic GPU): wgmma tiles fed by TMA page copies.

Same contract as the Triton kernel in `pallas_kernels.gpu.prefill` and the reference
`pallas_kernels.reference.paged_attention_prefill`. Layout of the work:

- Tiles come from `_ragged.sequence_tiles` (never spanning sequences). Outside the kernel, XLA
  gathers each tile's rows of q into `q_tiles: [num_tiles, K, R, D]`, R = block_q * G rows per kv
  head (token-major, the G query heads of the group inside), and scatters `out_tiles` back, so the
  kernel moves whole [R, D] tiles with one TMA each way and never stores a ragged edge (the cost:
  two extra passes over q and the output in XLA).
- One CTA per (tile, kv head): S = Q K^T and O += P V are wgmma with Q, K, V in swizzled shared
  memory (P from registers); the online softmax runs in float32 registers, in base 2.
- Keys walk the sequence's pages through its block-table row (scalars read from global memory),
  block_kv keys per step = block_kv / S pages, one TMA copy per page into one stage of a
  num_stages-deep ring; the one warpgroup copies step i + num_stages right after computing step
  i (its table entries read before step i, so their latency hides behind it). An experimental
  warp-specialized schedule (a producer warpgroup, one or two compute warpgroups) is an option;
  it hangs in the interpreter on walks longer than the ring (see the wrapper's docstring).
- Only steps on the causal diagonal (and the first steps of a sliding window) are masked; with a
  window of W the walk starts at the page holding the first row's oldest key, so older pages are
  never read. The last step zeroes the value rows past the tile's last key in shared memory:
  they may be unwritten slots (any bits, NaN included), and 0 * NaN would reach the output.

The bodies live in `pallas_kernels.gpu.prefill_mgpu_body`. Head dims: multiples of 64 up to 256
(one 128-byte swizzle tile per 64 columns); others are refused (`unsupported_reason`) and the
Triton kernel serves them. dtypes: bfloat16 and float16 only (wgmma would run float32 as TF32).
"""

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels._compat import (float32_precision, mosaic_gpu_interpret, mosaic_gpu_problem,
                                    pl, plmgpu)
from pallas_kernels._ragged import sequence_tiles
from pallas_kernels._validate import check_options, check_prefill_args, raise_if
from pallas_kernels.gpu import prefill_mgpu_body as body_module

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
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


def default_compute_wgs(group, warp_specialized=False):
    """Two compute warpgroups when warp-specialized and the group size divides (or is a multiple
    of) their 128 rows; else one, whose tile needs only lcm(G, 64) rows (G = 3: 192, not 384)."""
    return 2 if warp_specialized and (128 % group == 0 or group % 128 == 0) else 1


def default_block_q(group, head_dim, compute_wgs=2):
    """Query tokens per tile: the fewest giving R = block_q * G rows that split into compute_wgs
    multiples of 64 (wgmma's M) and reach the target: 128 rows per warpgroup, or 64 when two
    [rows, D] float32 tiles per warpgroup would not fit in registers (D = 256, or two compute
    warpgroups sharing a register file)."""
    rows_per_wg = 64 if head_dim > 128 or compute_wgs > 1 else 128
    step = math.lcm(group, 64 * compute_wgs) // group
    return -(-rows_per_wg * compute_wgs // (group * step)) * step


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


def _smem_transforms(dtype):
    """Tiling + swizzle for a [rows, D] wgmma operand: 128-byte rows, 8-row swizzle atoms."""
    columns = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plmgpu.TilingTransform((8, columns)), plmgpu.SwizzleTransform(_SWIZZLE_BYTES))


def _gather_rows(tiles, num_tokens, block_q):
    """[num_tiles * block_q] int32 token of each tile row (clamped into q; extra rows repeat a
    token and are never scattered back)."""
    rows = tiles[1][:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    return jnp.minimum(rows, num_tokens - 1).reshape(-1)


def _scatter_rows(tiles, num_tokens, block_q):
    """[T] int32: the tile row holding each token (padding tokens: any row; zeroed after)."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # First rows are non-decreasing and only empty tiles (first row T) repeat one, so the last
    # tile starting at or before a token is the one holding it.
    owner = jnp.searchsorted(tiles[1], token, side="right").astype(jnp.int32) - 1
    return owner * block_q + token - tiles[1][owner]


def _check_tiling(q, k_pages, *, block_q, block_kv, num_stages, compute_wgs,
                  warp_specialized):
    num_heads, head_dim = q.shape[1:]
    group = num_heads // k_pages.shape[0]
    block_size = k_pages.shape[2]
    raise_if(unsupported_reason(head_dim=head_dim, dtype=q.dtype, block_size=block_size))
    if compute_wgs not in (1, 2) or (compute_wgs == 2 and not warp_specialized):
        raise ValueError(f"compute_wgs must be 1, or 2 with warp_specialized, got {compute_wgs}")
    if block_q < 1 or (block_q * group) % (64 * compute_wgs):
        raise ValueError(f"block_q * group size must be a multiple of 64 (wgmma rows) per compute "
                         f"warpgroup, got block_q {block_q} x group {group} over {compute_wgs}")
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
    "scale", "sliding_window", "logits_soft_cap", "precision", "interpret", "block_q",
    "block_kv", "num_stages", "compute_wgs", "warp_specialized"))
def paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                            scale=None, sliding_window=None, logits_soft_cap=None,
                            precision=None, interpret=False, block_q=None, block_kv=None,
                            num_stages=2, compute_wgs=None, warp_specialized=False):
    """Ragged causal prefill/chunk attention on a Hopper GPU (Pallas Mosaic GPU).

    Same contract as `pallas_kernels.gpu.prefill.paged_attention_prefill`: q [T, H, D]; pages
    [K, N, S, D] (block 0 a never-read sink); block_tables [B, M], context_lens [B] (including the
    chunk), query_start_loc [B+1], all int32; rows past query_start_loc[B] come back as zeros.
    Returns [T, H, D] in q's dtype; softmax in float32. D: a multiple of 64 up to 256; dtype
    bfloat16 or float16; S a power of two >= 8. precision (of float32 dots, the other kernels'
    argument) is checked but has nothing to act on: every operand here is 16-bit.

    Static tiling: block_q (query tokens per tile; block_q * G must split into compute_wgs
    multiples of 64 rows; None: `default_block_q`), block_kv (keys per step, a multiple of 64 and
    of S; None: 128, or 64 for D > 128; at least S), num_stages (depth of the shared-memory
    K/V ring), warp_specialized (EXPERIMENTAL, see below; False: the one compute warpgroup issues
    the copies between its steps), compute_wgs (compute warpgroups, 1 or 2; 2 only
    warp-specialized: each takes half the tile's rows; None: `default_compute_wgs`).
    warp_specialized=True (a producer warpgroup refills the ring) lowers and matches the
    reference in the interpreter while a tile's walk fits in the ring, but hangs there once the
    producer has to wait for a stage to be consumed (cause not found: the interpreter or the
    protocol); it has not run compiled. Do not use it before that is understood.
    interpret=True runs Mosaic GPU's own interpreter (jax 0.11+, CPU tests).
    """
    check_prefill_args(q, k_pages, v_pages, block_tables, context_lens, query_start_loc)
    check_options(sliding_window, logits_soft_cap)
    float32_precision(precision)
    raise_if(mosaic_gpu_problem())
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    if compute_wgs is None:
        compute_wgs = default_compute_wgs(group, warp_specialized)
    block_q = block_q or default_block_q(group, head_dim, compute_wgs)
    block_kv = block_kv or max(64 if head_dim > 128 else 128, block_size)
    schedule = dict(num_stages=num_stages, compute_wgs=compute_wgs,
                    warp_specialized=warp_specialized)
    _check_tiling(q, k_pages, block_q=block_q, block_kv=block_kv, **schedule)
    scale = head_dim ** -0.5 if scale is None else scale
    tiles = sequence_tiles(query_start_loc, num_tokens, block_q)
    num_tiles, rows = tiles.shape[1], block_q * group
    plan = _tile_plan(tiles, context_lens, query_start_loc, block_size=block_size,
                      sliding_window=sliding_window)
    q_tiles = q[_gather_rows(tiles, num_tokens, block_q)]          # [num_tiles * block_q, H, D]
    q_tiles = q_tiles.reshape(num_tiles, block_q, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_dim)
    out_tiles = _launch(plan, block_tables, q_tiles, k_pages, v_pages, group=group,
                        block_kv=block_kv, interpret=interpret, **schedule, scale=scale,
                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    out = out_tiles.reshape(num_tiles, num_kv_heads, block_q, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_tiles * block_q, num_heads, head_dim)
    out = out[_scatter_rows(tiles, num_tokens, block_q)]
    is_real = jnp.arange(num_tokens) < query_start_loc[-1]
    return jnp.where(is_real[:, None, None], out, 0).astype(q.dtype)


def _launch(plan, block_tables, q_tiles, k_pages, v_pages, *, group, block_kv, num_stages,
            compute_wgs, warp_specialized, interpret, **options):
    """The Mosaic GPU launch: grid (tile, kv head); the q tile, the K/V ring and its barriers
    (plus consumed barriers and a producer warpgroup when warp-specialized) as scratch."""
    num_tiles, num_kv_heads, rows, head_dim = q_tiles.shape
    dtype = q_tiles.dtype
    pages_per_step = block_kv // k_pages.shape[2]
    transforms = _smem_transforms(dtype)
    wg_rows = (compute_wgs, rows // compute_wgs) if warp_specialized else (rows,)
    ring = plmgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=transforms)
    stage_barriers = plmgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages)
    scratch = [plmgpu.SMEM((*wg_rows, head_dim), dtype, transforms=transforms),  # q, then out
               ring, ring,
               plmgpu.Barrier(num_barriers=compute_wgs) if warp_specialized else plmgpu.Barrier(),
               stage_barriers, stage_barriers]
    mesh = {}
    body = body_module.pipelined_kernel
    if warp_specialized:
        consumed = plmgpu.Barrier(num_arrivals=compute_wgs, num_barriers=num_stages)
        scratch += [consumed, consumed]
        mesh = dict(num_threads=compute_wgs + 1, thread_name="wg")
        body = body_module.specialized_kernel
    if interpret:  # the interpreter's wgmma reads the probabilities from shared memory
        scratch.append(plmgpu.SMEM((*wg_rows, block_kv), dtype, transforms=transforms))
    kernel = functools.partial(body, group=group, block_kv=block_kv, num_stages=num_stages,
                               **options)
    return plmgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, dtype),
        scratch_types=scratch,
        grid=(num_tiles, num_kv_heads),
        grid_names=("tile", "kv_head"),
        **mesh,
        compiler_params=plmgpu.CompilerParams(approx_math=True),
        interpret=mosaic_gpu_interpret(interpret),
        kernel_name="jpaged_prefill_mosaic_gpu",
    )(plan, block_tables, q_tiles, k_pages, v_pages)
