"""The Mosaic GPU prefill kernel's bodies: a tile's walk over its pages, the TMA ring that feeds
it, one online-softmax step, and the two schedules that drive them (one warpgroup pipelining its
own copies, or copies in a producer warpgroup with one or two compute warpgroups).

Launch, tiling and the contract: `pallas_kernels.gpu.prefill_mgpu`.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._compat import pl, plmgpu

_LOG2E = math.log2(math.e)
_LAYOUT = plmgpu.Layout.WGMMA if plmgpu is not None else None


@dataclasses.dataclass(frozen=True)
class Walk:
    """One query tile's keys: [key_begin, key_end) in steps of block_kv keys (block_kv / S pages).

    key_begin is page-aligned (a window's first page); steps [0, unmasked) hold keys some row's
    window has left, [unmasked, diagonal) are visible to every row, [diagonal, num_steps) cross
    the causal diagonal (the last one may run past key_end).
    """
    seq: jax.Array
    first_position: jax.Array  # position of the tile's first query token
    key_begin: jax.Array
    key_end: jax.Array
    num_steps: jax.Array
    unmasked: jax.Array
    diagonal: jax.Array
    block_kv: int
    block_size: int
    num_stages: int

    @classmethod
    def of_tile(cls, plan_ref, tile, *, block_kv, block_size, num_stages, sliding_window):
        seq, first_position = plan_ref[tile, 0], plan_ref[tile, 1]
        key_begin, key_end = plan_ref[tile, 2], plan_ref[tile, 3]
        num_steps = pl.cdiv(key_end - key_begin, block_kv)
        # A step needs no causal mask when its last key is <= the first row's position.
        diagonal = jnp.clip((first_position + 1 - key_begin) // block_kv, 0, num_steps)
        unmasked = jnp.zeros_like(num_steps)
        if sliding_window is not None:  # whole for every row once its first key is in the
            oldest = key_end - sliding_window  # last row's window (key_end - 1 is its position)
            unmasked = jnp.clip(pl.cdiv(oldest - key_begin, block_kv), 0, num_steps)
        return cls(seq, first_position, key_begin, key_end, num_steps, unmasked,
                   jnp.maximum(diagonal, unmasked), block_kv, block_size, num_stages)

    def slot(self, step):
        return lax.rem(step, jnp.int32(self.num_stages))

    def step_start(self, step):
        return self.key_begin + step * self.block_kv

    def pages(self, block_tables_ref, step):
        """Physical pages of a step. A page past key_end is not needed: in its place the step
        copies the walk's first page (owned, so in bounds; its keys get masked and its values
        zeroed), so a stage always counts the same copies, and table entries past the sequence's
        last block are never read."""
        pages = []
        for page_in_step in range(self.block_kv // self.block_size):
            first_key = self.step_start(step) + page_in_step * self.block_size
            logical = jnp.where(first_key < self.key_end, first_key, self.key_begin)
            pages.append(block_tables_ref[self.seq, logical // self.block_size])
        return pages


@dataclasses.dataclass(frozen=True)
class Ring:
    """K/V pages of one kv head, and the shared-memory ring [num_stages, block_kv, D] they are
    copied into, with one barrier per stage for keys and one for values."""
    k_pages_ref: object
    v_pages_ref: object
    k_smem: object
    v_smem: object
    k_barriers: object
    v_barriers: object
    kv_head: jax.Array

    def issue(self, walk, step, pages, parts=("k", "v")):
        """TMA the step's pages into its stage, one copy per page (each arrives on the stage's
        barrier, which counts pages-per-step arrivals)."""
        slot = walk.slot(step)
        for part in parts:
            pages_ref, ring, barriers = ((self.k_pages_ref, self.k_smem, self.k_barriers)
                                         if part == "k" else
                                         (self.v_pages_ref, self.v_smem, self.v_barriers))
            for page_in_step, page in enumerate(pages):
                rows = pl.ds(page_in_step * walk.block_size, walk.block_size)
                plmgpu.copy_gmem_to_smem(pages_ref.at[self.kv_head, page], ring.at[slot, rows],
                                         barriers.at[slot])


@dataclasses.dataclass(frozen=True)
class Rows:
    """One compute warpgroup's rows: q [rows, D] in shared memory (later its output), the position
    of each row (row r of the tile is token r // G), and the interpreter's staging buffer."""
    q_smem: object
    first_row: jax.Array | int  # of the tile
    group: int
    probs_staging: object  # [rows, block_kv] shared memory in the interpreter, else None

    def positions(self, walk, shape):
        row = self.first_row + plmgpu.broadcasted_iota(jnp.int32, shape, 0, layout=_LAYOUT)
        return walk.first_position + row // self.group


def initial_state(rows, head_dim):
    """(acc [rows, D], m [rows], l [rows]) in float32, in wgmma layouts; m in base-2 units."""
    return (plmgpu.layout_cast(jnp.zeros((rows, head_dim), jnp.float32), _LAYOUT),
            plmgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), _LAYOUT.reduce(1)),
            plmgpu.layout_cast(jnp.zeros((rows,), jnp.float32), _LAYOUT.reduce(1)))


def _scores(rows, ring, slot, block_kv, *, scale, logits_soft_cap):
    """q @ k^T of one stage by wgmma, scaled (and soft-capped) into base-2 logits, float32."""
    def product(scores_ref):
        plmgpu.wgmma(scores_ref, rows.q_smem, ring.k_smem.at[slot].transpose((1, 0)))
        return scores_ref[...]  # reading it back waits for the wgmma
    scores = pl.run_scoped(product, plmgpu.ACC((rows.q_smem.shape[0], block_kv), jnp.float32))
    if logits_soft_cap is None:
        return scores * (scale * _LOG2E)
    return (logits_soft_cap * _LOG2E) * jnp.tanh(scores * (scale / logits_soft_cap))


def _visible(walk, rows, step, shape, sliding_window):
    position = rows.positions(walk, shape)
    key = walk.step_start(step) + plmgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_LAYOUT)
    is_visible = (key <= position) & (key < walk.key_end)
    if sliding_window is not None:
        is_visible &= key > position - sliding_window
    return is_visible


def _zero_values_past_end(walk, values_smem, step):
    """Value rows at or past key_end (a page's unwritten tail, any bits, or a stand-in page)
    become zeros: their probabilities are 0, but 0 * NaN inside the wgmma would still be NaN.

    With two compute warpgroups both rewrite the stage (a race the interpreter's detector
    reports, and a harmless one): each writes the same bytes, a valid row's own value or a zero,
    whatever it reads, and each zeroes before its own wgmma reads the stage."""
    values = values_smem[...]
    key = walk.step_start(step) + plmgpu.broadcasted_iota(
        jnp.int32, values.shape, 0, layout=_LAYOUT)
    values_smem[...] = jnp.where(key < walk.key_end, values, jnp.zeros_like(values))
    plmgpu.commit_smem()


def _add_product(acc, probs, values_smem, staging):
    """acc + probs @ values by wgmma, probs in registers, accumulating in acc's registers.
    Mosaic GPU's interpreter has neither `pl.run_state` nor register operands: there probs go
    through `staging` (shared memory) into a zeroed accumulator, and the sum is an add."""
    if staging is None:
        def accumulate(acc_ref):
            plmgpu.wgmma(acc_ref, probs, values_smem)
        return pl.run_state(accumulate)(plmgpu.ACC.init(acc))

    def product(acc_ref):
        staging[...] = probs
        plmgpu.commit_smem()
        plmgpu.wgmma(acc_ref, staging, values_smem)
        return acc_ref[...]
    return acc + pl.run_scoped(product, plmgpu.ACC(acc.shape, jnp.float32))


def attend_step(walk, ring, rows, step, state, *, is_masked, consumed=None, sliding_window,
                **score_options):
    """Fold step `step` (landed in its stage) into the online-softmax state. consumed: the
    (keys, values) barriers this warpgroup arrives on once it has read each, or None."""
    acc, m_prev, l_prev = state
    slot = walk.slot(step)
    plmgpu.barrier_wait(ring.k_barriers.at[slot])
    scores = _scores(rows, ring, slot, walk.block_kv, **score_options)
    if consumed is not None:
        plmgpu.barrier_arrive(consumed[0].at[slot])
    if is_masked:
        visible = _visible(walk, rows, step, scores.shape, sliding_window)
        scores = jnp.where(visible, scores, -jnp.inf)
    m_new = jnp.maximum(m_prev, scores.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no key yet
    correction = jnp.exp2(m_prev - m_safe)
    probs = jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0]))
    l_new = l_prev * correction + probs.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
    values_smem = ring.v_smem.at[slot]
    plmgpu.barrier_wait(ring.v_barriers.at[slot])
    if is_masked:
        pl.when(walk.step_start(step + 1) > walk.key_end)(
            lambda: _zero_values_past_end(walk, values_smem, step))
    acc = _add_product(acc, probs.astype(values_smem.dtype), values_smem, rows.probs_staging)
    if consumed is not None:
        plmgpu.barrier_arrive(consumed[1].at[slot])
    return acc, m_new, l_new


def walk_all_steps(walk, step_fn, state):
    """Run step_fn(step, state, is_masked) over the walk: masked steps only where needed."""
    masked = functools.partial(step_fn, is_masked=True)
    state = lax.fori_loop(0, walk.unmasked, masked, state)
    state = lax.fori_loop(walk.unmasked, walk.diagonal,
                          functools.partial(step_fn, is_masked=False), state)
    return lax.fori_loop(walk.diagonal, walk.num_steps, masked, state)


def store_output(rows, state, out_ref):
    """acc / l (rows that saw no key: zeros) through q's buffer to out_ref ([rows, D] in GMEM)."""
    acc, _, l_sum = state
    l_safe = jnp.where(l_sum > 0, l_sum, 1.0)
    acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    rows.q_smem[...] = acc.astype(rows.q_smem.dtype)  # q is no longer needed
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(rows.q_smem, out_ref)
    plmgpu.wait_smem_to_gmem(0)


def _refs(plan_ref, block_tables_ref, k_pages_ref, v_pages_ref, k_smem, v_smem, k_barriers,
          v_barriers, *, block_kv, num_stages, sliding_window):
    """(walk, ring) of this program's (tile, kv head)."""
    tile, kv_head = lax.axis_index("tile"), lax.axis_index("kv_head")
    walk = Walk.of_tile(plan_ref, tile, block_kv=block_kv, block_size=k_pages_ref.shape[2],
                        num_stages=num_stages, sliding_window=sliding_window)
    ring = Ring(k_pages_ref, v_pages_ref, k_smem, v_smem, k_barriers, v_barriers, kv_head)
    return walk, ring


def pipelined_kernel(plan_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref, out_ref,
                     q_smem, k_smem, v_smem, q_barrier, k_barriers, v_barriers, *staging, group,
                     block_kv, num_stages, sliding_window, **score_options):
    """One warpgroup does everything: it copies step i + num_stages into the stage step i used as
    soon as step i's wgmmas are done. q_smem [R, D]; staging: [R, block_kv] (interpreter only)."""
    walk, ring = _refs(plan_ref, block_tables_ref, k_pages_ref, v_pages_ref, k_smem, v_smem,
                       k_barriers, v_barriers, block_kv=block_kv, num_stages=num_stages,
                       sliding_window=sliding_window)
    tile = lax.axis_index("tile")
    rows = Rows(q_smem, 0, group, staging[0] if staging else None)
    plmgpu.copy_gmem_to_smem(q_ref.at[tile, ring.kv_head], q_smem, q_barrier)
    for step in range(num_stages):
        pl.when(step < walk.num_steps)(functools.partial(
            ring.issue, walk, step, walk.pages(block_tables_ref, jnp.int32(step))))

    def step_fn(step, state, *, is_masked):
        # Table entries of the step this stage gets next, read now so that their latency hides
        # behind this step (the index is clamped to a real step).
        next_step = step + num_stages
        pages = walk.pages(block_tables_ref, jnp.minimum(next_step, walk.num_steps - 1))
        state = attend_step(walk, ring, rows, step, state, is_masked=is_masked,
                            sliding_window=sliding_window, **score_options)
        pl.when(next_step < walk.num_steps)(lambda: ring.issue(walk, next_step, pages))
        return state

    plmgpu.barrier_wait(q_barrier)
    state = walk_all_steps(walk, step_fn, initial_state(*q_smem.shape))
    store_output(rows, state, out_ref.at[tile, ring.kv_head])


def specialized_kernel(plan_ref, block_tables_ref, q_ref, k_pages_ref, v_pages_ref, out_ref,
                       q_smem, k_smem, v_smem, q_barriers, k_barriers, v_barriers, k_consumed,
                       v_consumed, *staging, group, block_kv, num_stages, sliding_window,
                       **score_options):
    """Warp specialization: compute warpgroups 0..W-1 each own R / W rows of the tile and walk
    the same stages; warpgroup W only copies, refilling a stage once every compute warpgroup has
    arrived on its consumed barrier. q_smem [W, R / W, D]; staging [W, R / W, block_kv]."""
    walk, ring = _refs(plan_ref, block_tables_ref, k_pages_ref, v_pages_ref, k_smem, v_smem,
                       k_barriers, v_barriers, block_kv=block_kv, num_stages=num_stages,
                       sliding_window=sliding_window)
    tile, wg = lax.axis_index("tile"), lax.axis_index("wg")
    compute_wgs, rows_per_wg = q_smem.shape[:2]

    @pl.when(wg < compute_wgs)
    def _compute():
        plmgpu.set_max_registers(232, action="increase")
        first_row = wg * rows_per_wg
        tile_rows = pl.ds(first_row, rows_per_wg)
        rows = Rows(q_smem.at[wg], first_row, group, staging[0].at[wg] if staging else None)
        plmgpu.copy_gmem_to_smem(q_ref.at[tile, ring.kv_head, tile_rows], rows.q_smem,
                                 q_barriers.at[wg])
        plmgpu.barrier_wait(q_barriers.at[wg])

        def step_fn(step, state, *, is_masked):
            return attend_step(walk, ring, rows, step, state, is_masked=is_masked,
                               consumed=(k_consumed, v_consumed),
                               sliding_window=sliding_window, **score_options)

        state = walk_all_steps(walk, step_fn, initial_state(rows_per_wg, q_smem.shape[2]))
        store_output(rows, state, out_ref.at[tile, ring.kv_head, tile_rows])

    @pl.when(wg == compute_wgs)
    def _producer():
        plmgpu.set_max_registers(40, action="decrease")
        for step in range(num_stages):
            pl.when(step < walk.num_steps)(functools.partial(
                ring.issue, walk, step, walk.pages(block_tables_ref, jnp.int32(step))))

        def refill(step, carry):
            slot = walk.slot(step)
            pages = walk.pages(block_tables_ref, step)
            plmgpu.barrier_wait(k_consumed.at[slot])
            ring.issue(walk, step, pages, parts=("k",))
            plmgpu.barrier_wait(v_consumed.at[slot])
            ring.issue(walk, step, pages, parts=("v",))
            return carry

        lax.fori_loop(num_stages, walk.num_steps, refill, None)
