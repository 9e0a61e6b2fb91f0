"""Random paged-attention problems and the tolerance table, for kernel tests and benchmarks.

A problem scatters each sequence's blocks over a larger pool in random order (block 0 stays the
sink), fills every slot no sequence owns with NaN (unused blocks, the sink, the tail of each
sequence's last block) and leaves block-table entries past a sequence's last block at 0, so a
kernel that reads anything it should not turns its output into NaN.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# One tolerance per dtype: max over output rows of |out - ref| / |ref| (row = one token, one head).
TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 1e-2}


@dataclasses.dataclass(frozen=True)
class PagedProblem:
    """q: [T, H, D] (decode: T = B); pages [K, N, S, D]; block_tables [B, M]; context_lens [B];
    query_start_loc [B+1] (prefill layout; for decode it is arange(B+1))."""

    q: jnp.ndarray
    k_pages: jnp.ndarray
    v_pages: jnp.ndarray
    block_tables: jnp.ndarray
    context_lens: jnp.ndarray
    query_start_loc: jnp.ndarray

    @property
    def decode_args(self):
        return self.q, self.k_pages, self.v_pages, self.block_tables, self.context_lens

    @property
    def prefill_args(self):
        return (self.q, self.k_pages, self.v_pages, self.block_tables, self.context_lens,
                self.query_start_loc)


def make_problem(seed, *, num_heads, num_kv_heads, head_dim, block_size, dtype, context_lens,
                 query_lens=None, padding_rows=0, spare_blocks=3, extra_table_columns=1,
                 nan_fill=True):
    """A random problem; query_lens None means decode (one query per sequence).

    context_lens[b] counts the cached tokens including the queries; query_lens[b] <= context_lens[b].
    padding_rows query rows are appended after the last sequence's rows (prefill only).
    """
    rng = np.random.default_rng(seed)
    context_lens = np.asarray(context_lens, np.int32)
    batch = len(context_lens)
    blocks_needed = -(-context_lens // block_size)
    num_blocks = 1 + int(blocks_needed.sum()) + spare_blocks
    max_blocks = int(blocks_needed.max(initial=0)) + extra_table_columns
    physical = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
    block_tables = np.zeros((batch, max_blocks), np.int32)
    is_owned = np.zeros((num_blocks, block_size), bool)
    next_free = 0
    for seq, (num_needed, length) in enumerate(zip(blocks_needed, context_lens)):
        owned = physical[next_free:next_free + num_needed]
        next_free += num_needed
        block_tables[seq, :num_needed] = owned
        slots_owned = np.arange(num_needed * block_size) < length
        is_owned[owned] = slots_owned.reshape(num_needed, block_size)
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pages, v_pages = (rng.standard_normal(shape, np.float32) for _ in range(2))
    if nan_fill:
        k_pages[:, ~is_owned] = np.nan
        v_pages[:, ~is_owned] = np.nan
    if query_lens is None:  # decode: one row per sequence (a padding row's context_len is 0)
        query_lens = np.ones(batch, np.int32)
        padding_rows = 0
    elif np.any(np.asarray(query_lens) > context_lens):
        raise ValueError("query_lens must not exceed context_lens")
    query_lens = np.asarray(query_lens, np.int32)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_tokens = int(query_start_loc[-1]) + padding_rows
    q = rng.standard_normal((num_tokens, num_heads, head_dim), np.float32)
    return PagedProblem(jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype),
                        jnp.asarray(v_pages, dtype), jnp.asarray(block_tables),
                        jnp.asarray(context_lens), jnp.asarray(query_start_loc))


def decode_problem(seed, *, block_size, **kwargs):
    """A decode batch covering every length class in one call: 1, S-1, S, 2S, 3S+5, a padding row
    (context_len 0, at index DECODE_PADDING_ROW) and a random length. kwargs: see make_problem."""
    random_len = int(np.random.default_rng(seed).integers(1, 4 * block_size))
    context_lens = [1, block_size - 1, block_size, 2 * block_size, 3 * block_size + 5, 0,
                    random_len]
    return make_problem(seed, block_size=block_size, context_lens=context_lens, **kwargs)


DECODE_PADDING_ROW = 5
PREFILL_PADDING_ROWS = 3


def prefill_problem(seed, *, block_size, **kwargs):
    """A mixed ragged batch: decode rows at 1, S-1 and 3S; whole prompts (S and S+3 tokens);
    chunks after cached prefixes (aligned and not); a sequence with no rows this step; then
    PREFILL_PADDING_ROWS padding rows. kwargs: see make_problem."""
    pairs = [(1, 1), (block_size, block_size), (1, block_size - 1), (5, 2 * block_size + 3),
             (0, 7), (1, 3 * block_size), (block_size + 3, block_size + 3), (7, block_size + 7)]
    return make_problem(seed, block_size=block_size, context_lens=[c for _, c in pairs],
                        query_lens=[q for q, _ in pairs], padding_rows=PREFILL_PADDING_ROWS,
                        **kwargs)


def poison_unused_table_entries(problem, value=10 ** 6):
    """The same problem with every block-table entry past a sequence's last block set to `value`
    (far outside the pool): a kernel that never reads those entries gives the same output."""
    block_size = problem.k_pages.shape[2]
    tables = np.asarray(problem.block_tables).copy()
    for seq, length in enumerate(np.asarray(problem.context_lens)):
        tables[seq, -(-int(length) // block_size):] = value
    return dataclasses.replace(problem, block_tables=jnp.asarray(tables))


def poison_blocks_before_window(problem, sliding_window, value):
    """The same problem with the table entry of every block older than each sequence's windows set
    to `value`: 0 (the NaN-filled sink) makes a read show up as NaN, a value outside the pool makes
    the TPU interpreter raise. A block is older when all its keys precede the window of the
    sequence's first query row (position context_len - q_len), so no row of any tile sees it and
    a kernel that skips such blocks, rather than masking them, gives the same output."""
    block_size = problem.k_pages.shape[2]
    tables = np.asarray(problem.block_tables).copy()
    q_lens = np.diff(np.asarray(problem.query_start_loc))
    for seq, length in enumerate(np.asarray(problem.context_lens)):
        first_key = int(length) - int(q_lens[seq]) - sliding_window + 1
        tables[seq, :max(first_key, 0) // block_size] = value
    return dataclasses.replace(problem, block_tables=jnp.asarray(tables))


def max_row_error(out, ref):
    """Max over [.., H, D] rows of |out - ref| / max(|ref|, 1e-6), in float32; NaN stays NaN."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    error = np.linalg.norm(out - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-6)
    return float(np.max(error)) if error.size else 0.0


def dot_precisions(fn, *args) -> list:
    """The precision of every dot_general fn(*args) traces to, kernel bodies (a pallas_call's
    jaxpr) and loop bodies included, in trace order: a `jax.lax.Precision` (the first operand's,
    both are the same here) or None (jnp's default, no precision asked for)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                precision = eqn.params["precision"]
                found.append(precision[0] if isinstance(precision, tuple) else precision)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)   # a ClosedJaxpr's open jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found
