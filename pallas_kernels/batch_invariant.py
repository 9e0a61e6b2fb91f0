"""Batch-invariant paged attention: a token's output is bitwise the same whatever else is batched.

A compiler picks a reduction's order from the shape it reduces, so the plain reference's
[T, K, G, C] scores and their softmax change in the last bits with the number of tokens T and the
block-table width (C = M * S, the batch's longest sequence); on a CPU a query's output moves by
about 1e-7 between a prefill and a decode step. Here every reduction has a shape fixed by the
mode, never by the batch:

- query tokens go through in tiles of `TILE_ROWS` rows (`map_tiles`), so no op sees T;
- each tile walks its tokens' logical blocks in order, one block of S keys at a time, with an
  online softmax (running max, rescaled sum and output), so no op sees M;
- a tile, and each block's step, is fenced by optimization barriers, so a compiler fuses it the
  same way in every program (on a GPU a multiply and an add fused into one kernel become one
  fused multiply-add, rounded once: where a fusion ends changes the last bit);
- a block that holds none of a row's visible keys leaves that row's running state untouched
  (selected, not added to), so the blocks past a token's context, or before its sliding window,
  change nothing, exactly.

A token's result then depends on its query, its own keys and values and its position alone: a
row of a prefill, of a chunk, a decode row and a recomputed row agree bit for bit. Axis names and
page layout as in `pallas_kernels.reference`; R is the tile's rows, G = H / K.

On a GPU that walk is a loop of small XLA kernels per block (84 ms a decode step of the 8B shape
at 1,024 tokens on the H200, against 4.3 ms in the default mode). There the same order runs in one
Triton launch instead (`kernel`): every query token is a decode row of the Triton decode kernel
(`pallas_kernels.gpu.decode`) with its own sequence's block table and its position + 1 keys,
pinned to one split and a fixed step of keys. Each program walks its token's keys from the first
(or the window's first) in steps of that many, its dots of one fixed shape (the group's query heads
padded to 16 rows; a row's dot never depends on the others'), so a token's result again depends
on the token alone. The two paths differ from each other in the last bits; a process takes one.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _validate, reference, row_ops
from pallas_kernels.gpu import cache_write as triton_cache_write
from pallas_kernels.gpu import decode as triton_decode
from pallas_kernels.gpu import matmul as triton_matmul
from pallas_kernels.gpu import rows as triton_rows
from pallas_kernels.reference import (_precision, apply_rotary, check_packed_heads,
                                      check_page_layout, write_to_pages)

# Rows per tile (the mode's numbers depend on it). A row-wise matmul reads its weights once per
# tile, so a decode batch of up to 64 rows reads them once; a smaller batch pays padded rows,
# nearly free where a step is bound by reading weights (8B shape on the H200: tiles of 8 made a
# decode step of 64 rows 9.2x one of 8).
TILE_ROWS = 64


# The Triton path's fixed tiling: one split (a token's keys in one program, in order), a step of
# 16 KiB of keys (`decode.step_tokens_of`: 64 tokens of bf16 at D = 128), 4 warps (they set the
# dots' layout); stages only pipeline the loads.
KERNEL_WARPS = 4
KERNEL_STAGES = 3


def kernel_problem(q, k_pages):
    """None if the Triton path can run these queries and pages, else why not."""
    return (_validate.head_dim_problem(q.shape[-1]) or _validate.dtype_problem("dtype", q.dtype)
            or _validate.power_of_two_problem("block size", k_pages.shape[2], 1)
            or (None if k_pages.dtype == q.dtype else
                f"pages in {k_pages.dtype}, queries in {q.dtype}"))


def uses_kernel(q, k_pages, kernel=None) -> bool:
    """Whether a call takes the Triton path: `kernel` if given (True raises when it cannot run),
    else on a GPU whenever it can run."""
    if kernel is None:
        return jax.default_backend() == "gpu" and kernel_problem(q, k_pages) is None
    if kernel:
        _validate.raise_if(kernel_problem(q, k_pages))
    return bool(kernel)


def paged_attention_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale=None,
                           sliding_window=None, logits_soft_cap=None, precision=None,
                           tile_rows=TILE_ROWS, kernel=None, interpret=False):
    """`reference.paged_attention_decode`'s contract: one query token per sequence. It runs as a
    prefill of one-token chunks, so a decode row is computed exactly as a prefill row is."""
    # A padding row (context 0) sees no key and comes back as zeros.
    query_start_loc = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    return paged_attention_prefill(
        q, k_pages, v_pages, block_tables, context_lens, query_start_loc, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, precision=precision,
        tile_rows=tile_rows, kernel=kernel, interpret=interpret)


def paged_attention_prefill(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, *,
                            scale=None, sliding_window=None, logits_soft_cap=None,
                            precision=None, tile_rows=TILE_ROWS, kernel=None, interpret=False):
    """`reference.paged_attention_prefill`'s contract (ragged chunks, a cached prefix first,
    rows past query_start_loc[B] zeros), each token reduced in the batch-independent order
    described in the module docstring. q: [T, H, D] -> [T, H, D] in q's dtype; softmax and
    accumulation in float32. tile_rows: rows per tile of the jnp walk (part of the numbers: a
    mode fixes it). kernel: take the Triton path (`uses_kernel`; None: on a GPU where it can run);
    interpret: run it in the Pallas interpreter (CPU tests)."""
    check_page_layout(k_pages, v_pages, head_dim=q.shape[-1])
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of kv heads {num_kv_heads}")
    batch = block_tables.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_token = jnp.minimum(
        jnp.searchsorted(query_start_loc[1:], token, side="right"), batch - 1).astype(jnp.int32)
    is_real = token < query_start_loc[-1]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    positions = (context_lens[seq_of_token] - q_lens[seq_of_token]
                 + token - query_start_loc[seq_of_token])
    lens = jnp.where(is_real, context_lens[seq_of_token], 0)   # 0: the row sees nothing
    scale = head_dim ** -0.5 if scale is None else scale
    if uses_kernel(q, k_pages, kernel):
        return _token_rows(q, k_pages, v_pages, block_tables[seq_of_token],
                           jnp.where(lens > 0, positions + 1, 0),
                           (scale, sliding_window, logits_soft_cap, precision, interpret))
    attend = functools.partial(
        _attend_tile, k_pages, v_pages, scale=scale, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, precision=_precision(q.dtype, precision))
    rows = (q, block_tables[seq_of_token], lens, positions)
    out = map_tiles(attend, *rows, tile_rows=tile_rows)
    return out.astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _token_rows(q, k_pages, v_pages, tables, context, settings):
    """The Triton path: token t a decode row over keys [0, context[t]) of its table row tables[t]
    (context 0: zeros). settings: (scale, sliding_window, logits_soft_cap, precision, interpret).
    Its gradient is the jnp walk's over the same rows (a trainer differentiates the training
    forward; Pallas kernels have no derivative)."""
    scale, sliding_window, logits_soft_cap, precision, interpret = settings
    step = triton_decode.step_tokens_of(triton_decode.padded_head_dim(q.shape[-1]), q.dtype)
    return triton_decode.paged_attention_decode(
        q, k_pages, v_pages, tables, context, scale=scale, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, precision=precision, interpret=interpret, num_splits=1,
        tokens_per_step=step, num_warps=KERNEL_WARPS, num_stages=KERNEL_STAGES)


def _token_rows_forward(q, k_pages, v_pages, tables, context, settings):
    return _token_rows(q, k_pages, v_pages, tables, context, settings), (
        q, k_pages, v_pages, tables, context)


def _token_rows_backward(settings, residuals, cotangent):
    q, k_pages, v_pages, tables, context = residuals
    scale, sliding_window, logits_soft_cap, precision, _ = settings
    walk = functools.partial(
        paged_attention_decode, block_tables=tables, context_lens=context, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, precision=precision,
        kernel=False)
    _, pullback = jax.vjp(walk, q, k_pages, v_pages)
    return (*pullback(cotangent), None, None)


_token_rows.defvjp(_token_rows_forward, _token_rows_backward)


def matmul(x, w, *, transposed=False, precision=None, out_dtype=None, kernel=None,
           interpret=False):
    """x [T, I] @ w [I, O] (w [O, I] when `transposed`) -> [T, O] in out_dtype (None: x's), each
    row's result independent of the other rows: one launch of the fixed-tiling Triton GEMM
    (`pallas_kernels.gpu.matmul`) where `kernel` is True or, when None, on a GPU; else XLA's dot
    over tiles of `TILE_ROWS` rows (`map_tiles`). precision: a `jax.lax.Precision` of float32
    dots (None: the dot's default; the GEMM then runs HIGHEST). The two paths differ in the last
    bits; a process takes one. Differentiable (the GEMM's gradient is XLA's dots')."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, I], got shape {x.shape}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    use_kernel = (jax.default_backend() == "gpu") if kernel is None else kernel
    if use_kernel:
        return _gemm(x, w, (transposed, precision, out_dtype, interpret))
    subscripts = "ti,oi->to" if transposed else "ti,io->to"
    return map_tiles(lambda tile: jnp.einsum(subscripts, tile, w, precision=precision,
                                             preferred_element_type=out_dtype), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gemm(x, w, settings):
    """The GEMM path; settings: (transposed, precision, out_dtype, interpret)."""
    transposed, precision, out_dtype, interpret = settings
    return triton_matmul.matmul(x, w, transposed=transposed, precision=precision,
                                out_dtype=out_dtype, interpret=interpret)


def _gemm_forward(x, w, settings):
    return _gemm(x, w, settings), (x, w)


def _gemm_backward(settings, residuals, cotangent):
    x, w = residuals
    transposed, precision = settings[:2]
    dot = functools.partial(jnp.einsum, precision=precision,
                            preferred_element_type=jnp.float32)
    dx = dot("to,oi->ti" if transposed else "to,io->ti", cotangent, w)
    dw = dot("to,ti->oi", cotangent, x) if transposed else dot("ti,to->io", x, cotangent)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_gemm.defvjp(_gemm_forward, _gemm_backward)


def _on_gpu(kernel) -> bool:
    """Whether a row-wise part takes its GPU kernel: `kernel`, or when None, on a GPU."""
    return jax.default_backend() == "gpu" if kernel is None else bool(kernel)


def rms_norm(x, weight, *, eps, unit_offset=False, kernel=None, interpret=False):
    """`row_ops.rms_norm` over x [T, E], each row's result independent of the other rows: one
    launch of the GPU row kernel (`pallas_kernels.gpu.rows`) where `kernel` is True or, when
    None, on a GPU; else the jnp op over tiles of `TILE_ROWS` rows (`map_tiles`). The two paths
    differ in the last bits; a process takes one. Differentiable (the kernel's gradient is the
    jnp op's)."""
    if _on_gpu(kernel):
        return _norm_rows(x, weight, (float(eps), unit_offset, interpret))
    return map_tiles(lambda rows: row_ops.rms_norm(rows, weight, eps=eps,
                                                   unit_offset=unit_offset), x)


def gated(gate_up, *, blocks=1, activation="silu", kernel=None, interpret=False):
    """`row_ops.gated` over gate_up [T, 2F] -> [T, F], each row's result independent of the other
    rows; paths as `rms_norm`'s."""
    if _on_gpu(kernel):
        return _gated_rows(gate_up, (blocks, activation, interpret))
    return map_tiles(functools.partial(row_ops.gated, blocks=blocks, activation=activation),
                     gate_up)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _norm_rows(x, weight, settings):
    """The kernel path of `rms_norm`; settings: (eps, unit_offset, interpret)."""
    eps, unit_offset, interpret = settings
    return triton_rows.rms_norm(x, weight, eps=eps, unit_offset=unit_offset, interpret=interpret)


def _norm_rows_forward(x, weight, settings):
    return _norm_rows(x, weight, settings), (x, weight)


def _norm_rows_backward(settings, residuals, cotangent):
    eps, unit_offset, _ = settings
    _, pullback = jax.vjp(functools.partial(row_ops.rms_norm, eps=eps, unit_offset=unit_offset),
                          *residuals)
    return pullback(cotangent)


_norm_rows.defvjp(_norm_rows_forward, _norm_rows_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gated_rows(gate_up, settings):
    """The kernel path of `gated`; settings: (blocks, activation, interpret)."""
    blocks, activation, interpret = settings
    return triton_rows.gated(gate_up, blocks=blocks, activation=activation, interpret=interpret)


def _gated_rows_forward(gate_up, settings):
    return _gated_rows(gate_up, settings), gate_up


def _gated_rows_backward(settings, gate_up, cotangent):
    blocks, activation, _ = settings
    _, pullback = jax.vjp(functools.partial(row_ops.gated, blocks=blocks,
                                            activation=activation), gate_up)
    return pullback(cotangent)


_gated_rows.defvjp(_gated_rows_forward, _gated_rows_backward)


def rotate_and_write(qkv, cos, sin, k_pages, v_pages, slot_mapping, *, num_heads,
                     tile_rows=TILE_ROWS, kernel=None, interpret=False):
    """`reference.rotate_and_write`'s contract, a token's rotated query and key never depending
    on the batch: on a GPU (or where `kernel` is True) one launch of the Triton rotate-and-write
    kernel (`pallas_kernels.gpu.cache_write`) pinned to one token per program, so every token
    meets the same code; else the rotations in tiles of tile_rows tokens (`map_tiles`) and XLA's
    scatter. Differentiable (the kernel's gradient is the reference's)."""
    num_kv_heads = check_packed_heads(qkv, k_pages, num_heads)
    if _on_gpu(kernel) and _validate.head_dim_problem(qkv.shape[-1]) is None:
        return _rotate_write_rows(qkv, cos, sin, k_pages, v_pages, slot_mapping,
                                  (num_heads, interpret))
    q, k = map_tiles(lambda heads, cos, sin: (
        apply_rotary(heads[:, :num_heads], cos, sin),
        apply_rotary(heads[:, num_heads:num_heads + num_kv_heads], cos, sin)),
        qkv, cos, sin, tile_rows=tile_rows)
    k_pages, v_pages = write_to_pages(k_pages, v_pages, k, qkv[:, num_heads + num_kv_heads:],
                                      slot_mapping)
    return q, k_pages, v_pages


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _rotate_write_rows(qkv, cos, sin, k_pages, v_pages, slot_mapping, settings):
    """The kernel path of `rotate_and_write`; settings: (num_heads, interpret)."""
    num_heads, interpret = settings
    return triton_cache_write.rotate_and_write(qkv, cos, sin, k_pages, v_pages, slot_mapping,
                                               num_heads=num_heads, interpret=interpret,
                                               tokens_per_program=1)


def _rotate_write_rows_forward(qkv, cos, sin, k_pages, v_pages, slot_mapping, settings):
    out = _rotate_write_rows(qkv, cos, sin, k_pages, v_pages, slot_mapping, settings)
    return out, (qkv, cos, sin, k_pages, v_pages, slot_mapping)


def _rotate_write_rows_backward(settings, residuals, cotangent):
    *arrays, slot_mapping = residuals
    _, pullback = jax.vjp(functools.partial(reference.rotate_and_write,
                                            slot_mapping=slot_mapping, num_heads=settings[0]),
                          *arrays)
    return (*pullback(cotangent), None)


_rotate_write_rows.defvjp(_rotate_write_rows_forward, _rotate_write_rows_backward)


def map_tiles(fn, *rows, tile_rows=TILE_ROWS):
    """fn(*rows) for a row-wise fn, computed tile by tile: every leaf of `rows` (pytrees) has the
    same leading axis T; the result's leaves have T leading rows. The last tile is padded with
    copies of row 0 (real rows, so nothing in a tile is NaN or inf). Each tile is one `lax.map`
    iteration fenced by optimization barriers: whatever the number of tiles, and whatever the
    program does around them, the compiler sees the same isolated computation of one shape."""
    leaves = jax.tree.leaves(rows)
    num_rows = leaves[0].shape[0]
    if any(leaf.shape[0] != num_rows for leaf in leaves):
        raise ValueError(f"every row input needs {num_rows} leading rows, got shapes "
                         f"{[leaf.shape for leaf in leaves]}")
    num_tiles = -(-num_rows // tile_rows)
    pad = num_tiles * tile_rows - num_rows

    def tiles(leaf):
        padded = jnp.concatenate([leaf, jnp.broadcast_to(leaf[:1], (pad, *leaf.shape[1:]))])
        return padded.reshape(num_tiles, tile_rows, *leaf.shape[1:])

    out = jax.lax.map(_fenced(lambda tile: fn(*tile)), jax.tree.map(tiles, rows))
    return jax.tree.map(
        lambda leaf: leaf.reshape(num_tiles * tile_rows, *leaf.shape[2:])[:num_rows], out)


def _fenced(fn):
    """fn with optimization barriers on its arguments and its result: nothing outside is fused
    into its computation, nor it into anything outside."""
    def fenced(*args):
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))
    return fenced


def _attend_tile(k_pages, v_pages, q, tables, lens, positions, *, scale, sliding_window,
                 logits_soft_cap, precision):
    """One tile: q [R, H, D], tables [R, M] (each row's sequence's blocks), lens [R] (keys in its
    cache, 0: none), positions [R] -> [R, H, D] float32 (zeros for a row that sees nothing)."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    queries = q.astype(jnp.float32).reshape(num_rows, num_kv_heads, group, head_dim)

    def visit(state, block_index):
        """Fold logical block `block_index` of every row's sequence into the running state."""
        row_max, row_sum, acc = state                                 # [R, K, G] x 2, [R, K, G, D]
        key_pos = block_index * block_size + jnp.arange(block_size, dtype=jnp.int32)   # [S]
        visible = (key_pos[None] < lens[:, None]) & (key_pos[None] <= positions[:, None])
        if sliding_window is not None:
            visible &= key_pos[None] > positions[:, None] - sliding_window           # [R, S]
        blocks = tables[:, block_index]                                              # [R]
        keys = k_pages[:, blocks].astype(jnp.float32)                             # [K, R, S, D]
        values = jnp.where(visible[None, :, :, None], v_pages[:, blocks].astype(jnp.float32), 0)
        scores = jnp.einsum("rkgd,krsd->rkgs", queries, keys, precision=precision) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
        shown = visible[:, None, None, :]                                            # [R,1,1,S]
        scores = jnp.where(shown, scores, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
        # The where keeps both the value and its gradient NaN-free where nothing is visible yet.
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        weights = jnp.where(shown, jnp.exp(scores - safe_max[..., None]), 0.0)
        rescale = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max, safe_max) - safe_max)
        new_sum = rescale * row_sum + jnp.sum(weights, axis=-1)
        new_acc = rescale[..., None] * acc + jnp.einsum("rkgs,krsd->rkgd", weights, values,
                                                        precision=precision)
        has_keys = jnp.any(visible, axis=-1)[:, None, None]                          # [R, 1, 1]
        state = (jnp.where(has_keys, new_max, row_max), jnp.where(has_keys, new_sum, row_sum),
                 jnp.where(has_keys[..., None], new_acc, acc))
        return state, None

    shape = (num_rows, num_kv_heads, group)
    start = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros((*shape, head_dim), jnp.float32))
    (_, row_sum, acc), _ = jax.lax.scan(_fenced(visit), start, jnp.arange(tables.shape[1]))
    out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
    return out.reshape(num_rows, num_heads, head_dim)
