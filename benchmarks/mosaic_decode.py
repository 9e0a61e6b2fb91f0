"""GPU paged decode attention on Hopper (Pallas Mosaic GPU): TMA page copies, SMEM ring, WGMMA.

Status: experimental, correct but SLOWER than the Triton kernel (`pallas_kernels.gpu.decode`), so
it lives with the benchmarks, outside the installed `pallas_kernels` package, and nothing in the
engine calls it. Measured by benchmarks/mosaic_decode_check.py on an H200 (jax 0.11.2, H=32, K=8,
D=128, bf16, S=16; us per call, Triton default tiling vs this file's default): B8 ctx1024 17.1 vs
22.2; B64 ctx1024 69.5 vs 90.3; B64 ctx4096 250.6 vs 271.8 (3.95 TB/s); B256 ctx2048 493.3 vs
518.9 (4.15 TB/s); B8 ctx32768 250.8 vs 274.2, i.e. 0.77-0.95x. All 15 bf16 correctness cases at
64 tokens per step (S 16/32/64/128, GQA/MHA/MQA, B 1/8/64, 2-4 stages, padding rows, NaN-filled
unused slots, poisoned table tails) matched the reference to
< 3.7e-3 (max row error; tolerance 1e-2). tokens_per_step=128 gave
WRONG results (max row error 1.0) on the H200 once q moved from SMEM to registers (it was right
with q in SMEM, and is right in the interpreter), so only 64 is accepted. Needs jax >= 0.11 (Mosaic
GPU kernels and their CPU interpreter); bf16/f16 only, because WGMMA runs float32 as TF32.
What limits it: WGMMA needs 64 query rows, so a GQA group of 4 does 16x the useful QK/PV and
softmax work, and each CTA runs its steps serially (no warp specialization): the measured gains
came from more CTAs per SM (2 stages in a 64 KiB SMEM union) and more splits.

Design. The grid is (sequence, kv head, split); one CTA of one warpgroup serves all query heads
of a GQA group from a single read of that kv head's pages. The group's query rows are padded to
the 64-row WGMMA tile by loading a 64-row window of the flattened [B*H, D] queries into registers
(rows of other heads ride along and are ignored: WGMMA rows are independent). The CTA walks its
split `tokens_per_step` tokens at a time: a step is one or more pages (or part of one when
S > step), each copied by TMA straight from its physical block (block-table entries are loaded one
step ahead) into slot `step % stages` of an SMEM ring, with one barrier per slot for keys and one
for values, so `stages - 1` steps are in flight while the warpgroup computes. Per step:
scores = q @ k^T (WGMMA, f32 accumulator), masked past the split's end, online softmax in base 2
in float32, acc += p @ v (WGMMA, p in registers). Each CTA writes partial (acc, max, sum); a small
jnp combine merges the splits.

Never-read guarantee: a copy is issued only for pages below ceil(context_len / S) (for a page past
it the warpgroup arrives on the slot barrier without a copy), and table entries past that are
never loaded (their index is clamped to the step's first block). The tail of the last page is
copied (TMA moves whole page rows) but masked: its scores become -inf and its value rows are zeroed
in SMEM before the PV matmul, so NaN there cannot leak (0 * NaN = NaN inside a matmul).
The plain-jnp reference is `pallas_kernels.reference.paged_attention_decode`.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._compat import mosaic_gpu_interpret, pl, plmgpu
from pallas_kernels._validate import check_decode_args, check_power_of_two

_ROWS = 64  # rows of one warpgroup's WGMMA tile: a GQA group (<= 64 query heads) is padded to it
_SWIZZLE_BYTES = 128  # 128-byte swizzle: 64 bf16 columns per tile
# Splits aim at this many CTAs (about five waves of three CTAs on each of the H200's 132 SMs: many
# short CTAs balanced better than a few long ones in benchmarks/mosaic_decode_check.py), with at
# least _MIN_STEPS_PER_SPLIT steps each.
_TARGET_CTAS = 2048
_MIN_STEPS_PER_SPLIT = 4
_LOG2E = math.log2(math.e)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class _Cta:
    """What one (sequence, kv head, split) CTA knows while tracing: its refs, bounds and tiling."""

    block_tables_ref: object
    k_pages_ref: object
    v_pages_ref: object
    k_smem: object  # [stages, C, D] key ring
    v_smem: object  # [stages, C, D] value ring
    k_barriers: object  # [stages]: keys of a step landed in a slot
    v_barriers: object
    seq: jax.Array
    kv_head: jax.Array
    split_start: jax.Array  # first token of this split
    split_end: jax.Array  # min(end of this split, context_len): tokens at or past it are masked
    tokens_per_step: int

    @property
    def block_size(self):
        return self.k_pages_ref.shape[2]

    @property
    def chunk(self):
        """Tokens per TMA copy: a whole page, or part of one when S > tokens_per_step."""
        return min(self.block_size, self.tokens_per_step)

    def chunk_tokens(self, step):
        """First token of each chunk of `step`, and whether it lies before split_end."""
        step_start = self.split_start + step * self.tokens_per_step
        tokens = [step_start + c * self.chunk for c in range(self.tokens_per_step // self.chunk)]
        return [(token, token < self.split_end) for token in tokens]

    def load_pages(self, step):
        """Physical block of each chunk of `step` (which must hold >= 1 cached token): an entry
        past the context is never loaded, its index is clamped to the step's first block."""
        first_block = lax.div(self.split_start + step * self.tokens_per_step, self.block_size)
        return [self.block_tables_ref[self.seq, jnp.where(
                    is_cached, lax.div(token, self.block_size), first_block)]
                for token, is_cached in self.chunk_tokens(step)]

    def issue(self, step, slot, pages):
        """Start the TMA copies of `step` into ring `slot`. A chunk past the context arrives on
        the barrier without a copy (the interpreter has no predicated copies), so each slot
        barrier always counts chunks-per-step arrivals."""
        for c, ((token, is_cached), page) in enumerate(zip(self.chunk_tokens(step), pages)):
            rows = (pl.ds(lax.rem(token, self.block_size), self.chunk)
                    if self.chunk < self.block_size else slice(None))
            for pages_ref, ring, barriers in ((self.k_pages_ref, self.k_smem, self.k_barriers),
                                              (self.v_pages_ref, self.v_smem, self.v_barriers)):
                pl.when(is_cached)(functools.partial(
                    plmgpu.copy_gmem_to_smem, pages_ref.at[self.kv_head, page, rows],
                    ring.at[slot, pl.ds(c * self.chunk, self.chunk)], barriers.at[slot]))
                pl.when(jnp.logical_not(is_cached))(functools.partial(
                    plmgpu.barrier_arrive, barriers.at[slot]))


def _decode_kernel(context_lens_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref,
                   acc_out_ref, m_out_ref, l_out_ref, rings_or_partials, k_barriers, v_barriers,
                   *staging, num_heads, group, tokens_per_step, tokens_per_split, num_stages,
                   scale):
    """One (sequence, kv head, split) CTA.

    GMEM refs: context_lens [B]; block_tables [B, M]; q [max(B*H, 64), D] (flattened heads);
    k_pages, v_pages [K, N, S, D]; outputs acc [B, K, P, G, D], m and l [B, K, P, 64] (float32,
    m in base-2 units, rows of the 64-row window). SMEM: a union of the k, v rings [stages, C, D]
    and the staging buffers of the partials (acc [64, D] and m, l [2, 64], float32, used only once
    the rings are drained): 64 KiB at 2 stages of 64 tokens, so three CTAs fit on an SM.
    q goes from GMEM straight to registers, the WGMMA's left operand. `staging` is empty when
    compiled; in the interpreter (whose WGMMA reads operands from SMEM only) it holds two buffers,
    [64, D] and [64, C], through which q and the probabilities reach the WGMMAs.
    """
    seq, kv_head, split = (lax.axis_index(name) for name in ("seq", "kv_head", "split"))
    (k_smem, v_smem), (acc_smem, ml_smem) = rings_or_partials
    q_staging, probs_staging = staging or (None, None)
    split_start = split * tokens_per_split
    split_end = jnp.minimum(split_start + tokens_per_split, context_lens_ref[seq])
    num_steps = lax.div(jnp.maximum(split_end - split_start, 0) + tokens_per_step - 1,
                        tokens_per_step)
    cta = _Cta(block_tables_ref, k_pages_ref, v_pages_ref, k_smem, v_smem, k_barriers,
               v_barriers, seq, kv_head, split_start, split_end, tokens_per_step)

    for stage in range(num_stages):  # fill the ring: step s goes to slot s
        pl.when(stage < num_steps)(functools.partial(_issue_step, cta, stage, stage))
    first_row = seq * num_heads + kv_head * group
    window_row = jnp.minimum(first_row, q_ref.shape[0] - _ROWS)  # stays inside q
    q = plmgpu.load(q_ref.at[pl.ds(window_row, _ROWS)], layout=plmgpu.Layout.WGMMA,
                    optimized=False)  # "optimized" transfers exist for SMEM only
    q = _wgmma_lhs(q, q_staging)

    def step(i, carry):
        slot = lax.rem(i, num_stages)
        # The table entries for the step this slot gets next, loaded now so that their latency
        # hides behind this step's compute (the step index is clamped to a real step).
        next_pages = cta.load_pages(jnp.minimum(i + num_stages, num_steps - 1))
        carry = _attend_step(cta, i, slot, carry, q, probs_staging, scale)
        pl.when(i + num_stages < num_steps)(lambda: cta.issue(i + num_stages, slot, next_pages))
        return carry

    row_layout = plmgpu.Layout.WGMMA.reduce(1)
    initial = (plmgpu.layout_cast(jnp.zeros(acc_smem.shape, jnp.float32), plmgpu.Layout.WGMMA),
               plmgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32), row_layout),
               plmgpu.layout_cast(jnp.zeros((_ROWS,), jnp.float32), row_layout))
    acc, m, l_sum = lax.fori_loop(0, num_steps, step, initial)

    acc_smem[...] = acc  # every copy into the rings was awaited and every WGMMA read back
    ml_smem.at[0][...] = m
    ml_smem.at[1][...] = l_sum
    plmgpu.commit_smem()
    partial = (seq, kv_head, split)
    plmgpu.copy_smem_to_gmem(acc_smem.at[pl.ds(first_row - window_row, group)],
                             acc_out_ref.at[partial])
    plmgpu.copy_smem_to_gmem(ml_smem.at[0], m_out_ref.at[partial])
    plmgpu.copy_smem_to_gmem(ml_smem.at[1], l_out_ref.at[partial])
    plmgpu.wait_smem_to_gmem(0)


def _wgmma_lhs(array, staging):
    """A register array as a WGMMA left operand: itself, or (interpreter) its copy in SMEM."""
    if staging is None:
        return array
    staging[...] = array
    plmgpu.commit_smem()
    return staging


def _issue_step(cta, step, slot):
    cta.issue(step, slot, cta.load_pages(step))


def _attend_step(cta, i, slot, carry, q, probs_staging, scale):
    """Fold step i (in ring `slot`) into the online softmax state (acc [64, D], m, l [64])."""
    acc, m_prev, l_prev = carry
    step_start = cta.split_start + i * cta.tokens_per_step
    plmgpu.barrier_wait(cta.k_barriers.at[slot])

    def qk(scores_ref):
        plmgpu.wgmma(scores_ref, q, cta.k_smem.at[slot].transpose((1, 0)))
        return scores_ref[...]  # reading it back waits for the WGMMA

    scores = pl.run_scoped(qk, plmgpu.ACC((_ROWS, cta.tokens_per_step), jnp.float32))
    token = step_start + plmgpu.broadcasted_iota(
        jnp.int32, scores.shape, 1, layout=plmgpu.Layout.WGMMA)
    scores = jnp.where(token < cta.split_end, scores * (scale * _LOG2E), -jnp.inf)
    # Every step holds >= 1 cached token, so m_new is finite and exp2(-inf - m_new) = 0.
    m_new = jnp.maximum(m_prev, scores.max(axis=1))
    alpha = jnp.exp2(m_prev - m_new)
    probs = jnp.exp2(scores - lax.broadcast_in_dim(m_new, scores.shape, [0]))
    l_new = l_prev * alpha + probs.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    plmgpu.barrier_wait(cta.v_barriers.at[slot])
    values_smem = cta.v_smem.at[slot]

    @pl.when(step_start + cta.tokens_per_step > cta.split_end)
    def _zero_uncached_values():  # the last page's tail (NaN in tests) and never-copied rows
        values = values_smem[...]
        row = plmgpu.broadcasted_iota(jnp.int32, values.shape, 0, layout=plmgpu.Layout.WGMMA)
        values_smem[...] = jnp.where(step_start + row < cta.split_end, values,
                                     jnp.zeros_like(values))
        plmgpu.commit_smem()

    probs = _wgmma_lhs(probs.astype(values_smem.dtype), probs_staging)

    def pv(pv_ref):
        plmgpu.wgmma(pv_ref, probs, values_smem)
        return pv_ref[...]

    # A fresh accumulator, added in registers: the interpreter has no run_state/ACC.init.
    return acc + pl.run_scoped(pv, plmgpu.ACC(acc.shape, jnp.float32)), m_new, l_new


def default_tiling(batch, num_kv_heads, max_context, tokens_per_step):
    """num_splits used when the caller passes None. `max_context` is M*S, a static bound."""
    max_steps = pl.cdiv(max_context, tokens_per_step)
    return max(1, min(pl.cdiv(_TARGET_CTAS, batch * num_kv_heads),
                      max_steps // _MIN_STEPS_PER_SPLIT))


def _check_mosaic_args(q, k_pages, tokens_per_step, num_stages):
    if plmgpu is None:
        raise NotImplementedError("this jax build has no Pallas Mosaic GPU backend")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} not supported by the Mosaic GPU kernel (WGMMA would "
                         f"run float32 as TF32); use one of {[str(d) for d in SUPPORTED_DTYPES]}")
    num_kv_heads, _, block_size, head_dim = k_pages.shape
    group = q.shape[1] // num_kv_heads
    if group > _ROWS:
        raise ValueError(f"q has {q.shape[1]} heads for {num_kv_heads} kv heads: a GQA group of "
                         f"{group} exceeds the {_ROWS}-row WGMMA tile")
    if head_dim % 64 or head_dim > 256:
        raise ValueError(f"head dim must be 64, 128, 192 or 256 (128-byte swizzle), got {head_dim}")
    check_power_of_two("block size (k_pages.shape[2])", block_size, 8)
    if tokens_per_step != _ROWS:  # see the module docstring: 128 computed wrong results
        raise ValueError(f"tokens_per_step must be {_ROWS} (the only value verified on a GPU), "
                         f"got {tokens_per_step}")
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2, got {num_stages}")


@functools.partial(jax.jit, static_argnames=(
    "scale", "interpret", "num_splits", "tokens_per_step", "num_stages"))
def paged_attention_decode(q, k_pages, v_pages, block_tables, context_lens, *, scale=None,
                           interpret=False, num_splits=None, tokens_per_step=64, num_stages=2):
    """Paged decode attention on a Hopper GPU (Pallas Mosaic GPU); same contract as the reference.

    q: [B, H, D] bf16/f16; k_pages, v_pages: [K, N, S, D] (kv-head-major pages, block 0 a never-read
    sink); block_tables: [B, M] int32 (entries past ceil(context_len/S) are not read);
    context_lens: [B] int32 including the current token; 0 marks a padding row (zeros out).
    Returns [B, H, D] in q's dtype; softmax in float32.

    Static tiling: tokens_per_step (tokens per WGMMA step, may span pages; only 64 is accepted),
    num_stages (SMEM ring depth), num_splits (split-K partitions of the M*S context; None picks
    `default_tiling`). interpret=True runs the Mosaic GPU interpreter (jax >= 0.11, CPU tests).
    """
    check_decode_args(q, k_pages, v_pages, block_tables, context_lens)
    _check_mosaic_args(q, k_pages, tokens_per_step, num_stages)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    max_context = block_tables.shape[1] * block_size
    num_splits = num_splits or default_tiling(batch, num_kv_heads, max_context, tokens_per_step)
    tokens_per_split = pl.cdiv(pl.cdiv(max_context, num_splits), tokens_per_step) * tokens_per_step
    num_splits = pl.cdiv(max_context, tokens_per_split)
    scale = head_dim ** -0.5 if scale is None else scale

    q_rows = q.reshape(batch * num_heads, head_dim)  # [B*H, D]; a 64-row window must fit
    if q_rows.shape[0] < _ROWS:
        q_rows = jnp.pad(q_rows, ((0, _ROWS - q_rows.shape[0]), (0, 0)))
    acc, m, l_sum = _launch(q_rows, k_pages, v_pages, block_tables, context_lens,
                            batch=batch, num_heads=num_heads, group=group, num_splits=num_splits,
                            tokens_per_step=tokens_per_step, tokens_per_split=tokens_per_split,
                            num_stages=num_stages, scale=scale, interpret=interpret)

    # Rows of this group inside each CTA's 64-row window (same arithmetic as the kernel).
    first_row = (jnp.arange(batch)[:, None] * num_heads + jnp.arange(num_kv_heads)[None] * group)
    window_row = jnp.minimum(first_row, q_rows.shape[0] - _ROWS)
    rows = (first_row - window_row)[:, :, None, None] + jnp.arange(group)  # [B, K, 1, G]
    rows = jnp.broadcast_to(rows, (batch, num_kv_heads, num_splits, group))
    m = jnp.take_along_axis(m, rows, axis=3)[..., None]
    l_sum = jnp.take_along_axis(l_sum, rows, axis=3)[..., None]
    out = _combine_splits(acc, m, l_sum)  # [B, K, G, D]
    return out.reshape(batch, num_heads, head_dim).astype(q.dtype)


def _combine_splits(acc, m, l_sum):
    """Merge the partials along the split axis (2), in plain jnp: acc [B, K, P, G, D], m (base 2)
    and l [B, K, P, G, 1]. Empty splits (m = -inf, l = 0) add nothing; a row empty in every split
    (a padding sequence) comes out as zeros."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    weight = jnp.exp2(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))
    l_total = jnp.sum(weight * l_sum, axis=2)
    return jnp.sum(weight * acc, axis=2) / jnp.where(l_total > 0, l_total, 1.0)


def _launch(q_rows, k_pages, v_pages, block_tables, context_lens, *, batch, num_heads, group,
            num_splits, tokens_per_step, tokens_per_split, num_stages, scale, interpret):
    """The plgpu.kernel call: partial (acc [B, K, P, G, D], m [B, K, P, 64], l [B, K, P, 64])."""
    num_kv_heads, _, block_size, head_dim = k_pages.shape
    dtype = k_pages.dtype
    swizzled = (plmgpu.TilingTransform((8, _SWIZZLE_BYTES // dtype.itemsize)),
                plmgpu.SwizzleTransform(_SWIZZLE_BYTES))
    chunks_per_step = tokens_per_step // min(block_size, tokens_per_step)
    ring_shape = (num_stages, tokens_per_step, head_dim)
    scratch = [
        plmgpu.RefUnion((plmgpu.SMEM(ring_shape, dtype, transforms=swizzled),   # key ring
                         plmgpu.SMEM(ring_shape, dtype, transforms=swizzled)),  # value ring
                        (plmgpu.SMEM((_ROWS, head_dim), jnp.float32),           # acc staging
                         plmgpu.SMEM((2, _ROWS), jnp.float32))),                # m, l staging
        plmgpu.Barrier(num_arrivals=chunks_per_step, num_barriers=num_stages),  # keys in slot
        plmgpu.Barrier(num_arrivals=chunks_per_step, num_barriers=num_stages),  # values in slot
    ]
    if interpret:  # WGMMA left operands (q, probabilities) through SMEM
        scratch += [plmgpu.SMEM((_ROWS, head_dim), dtype, transforms=swizzled),
                    plmgpu.SMEM((_ROWS, tokens_per_step), dtype, transforms=swizzled)]
    partial_shape = (batch, num_kv_heads, num_splits)
    kernel = functools.partial(
        _decode_kernel, num_heads=num_heads, group=group, tokens_per_step=tokens_per_step,
        tokens_per_split=tokens_per_split, num_stages=num_stages, scale=scale)
    return plmgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((*partial_shape, group, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((*partial_shape, _ROWS), jnp.float32),
                  jax.ShapeDtypeStruct((*partial_shape, _ROWS), jnp.float32)),
        scratch_types=scratch,
        grid=partial_shape,
        grid_names=("seq", "kv_head", "split"),
        # Lane semantics: layouts are explicit (WGMMA), which the warpgroup-semantics layout
        # inference of jax 0.11.2 failed to solve for this kernel.
        # No reduction scratch: the only reductions are along WGMMA rows, within a warp.
        compiler_params=plmgpu.CompilerParams(
            approx_math=True, lowering_semantics=plmgpu.LoweringSemantics.Lane,
            reduction_scratch_bytes=0),
        interpret=mosaic_gpu_interpret(interpret),
        kernel_name="jpaged_decode_mosaic",
    )(context_lens, block_tables, q_rows, k_pages, v_pages)
