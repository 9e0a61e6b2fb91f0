"""The Pallas TPU kernels equal the jnp reference, run in the TPU interpreter on the CPU.

No TPU is available, so these interpret-mode tests are the kernels' proof: `pltpu.InterpretParams()`
models SMEM/VMEM, the page DMAs and their semaphores, fills uninitialized scratch with NaN and raises
IndexError on any out-of-range read (a block-table entry or a page). Pages no sequence owns are NaN.
"""

import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference, testing
from pallas_kernels.testing import TOLERANCE, max_row_error
from tests import child_process

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="TPU interpret tests run on the CPU only")

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# (heads, head_dim, block_size, dtype, pages_per_chunk): chunks of one page, several pages, and
# more pages than any sequence has. Interpreting costs ~5 s per shape: keep the grid small.
GRID = [("mha", 64, 16, F32, 2), ("gqa", 64, 16, BF16, 1), ("mqa", 128, 32, F32, 2),
        ("gqa", 128, 64, BF16, 2), ("gqa", 64, 128, F32, 1), ("gqa", 256, 16, BF16, 8)]
# Head dims that are not powers of two (96 and the rest run in the GPU kernels' grid too).
HEAD_DIM_GRID = [("gqa", 48, 16, F32, 2), ("mqa", 80, 32, BF16, 1), ("gqa", 112, 64, BF16, 3),
                 ("mqa", 192, 16, F32, 2)]
# (sliding window as a function of the block size S, logits_soft_cap, pages_per_chunk): not a
# multiple of S (equal to prefill_problem's S+3 prompt) with soft-capping, in one-page chunks;
# equal to decode_problem's 2S context, in chunks of several pages. Each problem's lengths (1 to
# 3S+5) put rows on both sides of a window; blocks before every window point outside the pool.
OPTIONS = [(lambda s: s + 3, 2.0, 1), (lambda s: 2 * s, None, 3)]
OPTION_IDS = ["WS+3-cap2", "W2S-P3"]
OPTION_CASE = ("gqa", 80, 16, F32, None)

ref_decode = jax.jit(reference.paged_attention_decode,
                     static_argnames=("sliding_window", "logits_soft_cap"))
ref_prefill = jax.jit(reference.paged_attention_prefill,
                      static_argnames=("sliding_window", "logits_soft_cap"))


def grid_id(case):
    heads, head_dim, block_size, dtype, pages_per_chunk = case
    return f"{heads}-D{head_dim}-S{block_size}-{dtype.name}-P{pages_per_chunk}"


def problem_kwargs(case):
    heads, head_dim, block_size, dtype, _ = case
    num_heads, num_kv_heads = HEADS[heads]
    return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                block_size=block_size, dtype=dtype)


def assert_matches(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    error = max_row_error(out, ref)
    assert error < TOLERANCE[dtype], f"max row relative error {error}"


@pytest.mark.parametrize("case", GRID + HEAD_DIM_GRID, ids=grid_id)
def test_decode_matches_reference(case):
    problem = testing.decode_problem(0, **problem_kwargs(case))
    # Entries past each sequence's last block point outside the pool: reading one raises.
    poisoned = testing.poison_unused_table_entries(problem)
    out = pk.paged_attention_decode_tpu(*poisoned.decode_args, interpret=True,
                                        pages_per_chunk=case[4])
    assert_matches(out, ref_decode(*problem.decode_args), case[3])
    assert not np.any(np.asarray(out[testing.DECODE_PADDING_ROW], np.float32))


@pytest.mark.parametrize("case", GRID[:5] + HEAD_DIM_GRID[::3], ids=grid_id)
def test_prefill_matches_reference(case):
    problem = testing.prefill_problem(0, **problem_kwargs(case))
    poisoned = testing.poison_unused_table_entries(problem)
    out = pk.paged_attention_prefill_tpu(*poisoned.prefill_args, interpret=True, block_q=16,
                                         pages_per_chunk=case[4])
    assert_matches(out, ref_prefill(*problem.prefill_args), case[3])
    padding_rows = np.asarray(out[-testing.PREFILL_PADDING_ROWS:], np.float32)
    assert not np.any(padding_rows), "padding rows must be zeros"


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_decode_window_and_soft_cap_match_reference(options):
    window, cap, pages_per_chunk = options
    sliding_window = window(OPTION_CASE[2])
    problem = testing.decode_problem(5, **problem_kwargs(OPTION_CASE))
    hidden = testing.poison_blocks_before_window(problem, sliding_window, 10 ** 6)
    attention = dict(sliding_window=sliding_window, logits_soft_cap=cap)
    out = pk.paged_attention_decode_tpu(*hidden.decode_args, **attention, interpret=True,
                                        pages_per_chunk=pages_per_chunk)
    assert_matches(out, ref_decode(*problem.decode_args, **attention), OPTION_CASE[3])
    assert not np.any(np.asarray(out[testing.DECODE_PADDING_ROW], np.float32))


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_prefill_window_and_soft_cap_match_reference(options):
    """Query tiles of 16 rows hold several sequences, each with its own window."""
    window, cap, pages_per_chunk = options
    sliding_window = window(OPTION_CASE[2])
    problem = testing.prefill_problem(5, **problem_kwargs(OPTION_CASE))
    hidden = testing.poison_blocks_before_window(problem, sliding_window, 10 ** 6)
    attention = dict(sliding_window=sliding_window, logits_soft_cap=cap)
    out = pk.paged_attention_prefill_tpu(*hidden.prefill_args, **attention, interpret=True,
                                         block_q=16, pages_per_chunk=pages_per_chunk)
    assert_matches(out, ref_prefill(*problem.prefill_args, **attention), OPTION_CASE[3])
    assert not np.any(np.asarray(out[-testing.PREFILL_PADDING_ROWS:], np.float32))


@pytest.mark.parametrize("head_dim", [44, 264])
def test_head_dims_no_kernel_takes_raise_naming_head_dim(head_dim):
    case = ("gqa", head_dim, 16, F32, 1)
    problem = testing.prefill_problem(0, **problem_kwargs(case))
    reason = pk.unsupported_reason("pallas_tpu", head_dim=head_dim)
    with pytest.raises(ValueError, match="head_dim") as error:
        pk.paged_attention_prefill_tpu(*problem.prefill_args, interpret=True)
    assert str(error.value) == reason
    problem = testing.decode_problem(0, **problem_kwargs(case))
    with pytest.raises(ValueError, match="head_dim"):
        pk.paged_attention_decode_tpu(*problem.decode_args, interpret=True)


def test_prefill_one_tile_holds_many_sequences():
    """block_q larger than the batch: one program walks every sequence (q is padded to the tile)."""
    case = GRID[0]
    problem = testing.prefill_problem(1, **problem_kwargs(case))
    out = pk.paged_attention_prefill_tpu(*problem.prefill_args, interpret=True, block_q=64,
                                         pages_per_chunk=3)
    assert_matches(out, ref_prefill(*problem.prefill_args), case[3])


_OUT_OF_RANGE_CHECK = """
import sys
import jax, jax.numpy as jnp, numpy as np
import pallas_kernels as pk
from pallas_kernels import testing
from tests.test_kernels_tpu import GRID, problem_kwargs
case = GRID[0]
problem = testing.decode_problem(0, **problem_kwargs(case))
tables = np.asarray(problem.block_tables).copy()
tables[1, 0] = problem.k_pages.shape[1] + 7  # a block this sequence does read
bad = (*problem.decode_args[:3], jnp.asarray(tables), problem.context_lens)
try:
    jax.block_until_ready(pk.paged_attention_decode_tpu(*bad, interpret=True,
                                                        pages_per_chunk=case[4]))
except Exception as error:
    print("raised:", error)
    sys.exit(0)
sys.exit("the out-of-range read was not caught")
"""


def test_out_of_range_page_read_is_caught():
    """The interpreter really raises on a bad read, so the poisoned-table tests above can fail.

    In a process of its own: a failed read in interpret mode can leave JAX's process-wide token
    for ordered effects holding the error (when the CPU ran the kernel asynchronously, as under
    a loaded test run), and then every later interpreted kernel in the process fails with it."""
    root = Path(__file__).resolve().parent.parent
    proc = child_process.run([sys.executable, "-c", _OUT_OF_RANGE_CHECK], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search("(?i)out of bounds|out-of-bounds|index", proc.stdout), proc.stdout[-3000:]


def test_dispatch_routes_to_tpu_kernels():
    case = GRID[0]
    problem = testing.decode_problem(0, **problem_kwargs(case))
    direct = pk.paged_attention_decode_tpu(*problem.decode_args, interpret=True,
                                           pages_per_chunk=case[4])
    routed = pk.paged_attention_decode(*problem.decode_args, backend="pallas_tpu",
                                       interpret=True, pages_per_chunk=case[4])
    np.testing.assert_array_equal(direct, routed)


@pytest.mark.parametrize("change,argument", [
    (lambda a: {**a, "q": a["q"][0]}, "^q must"),
    (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.float32)}, "block_tables"),
    (lambda a: {**a, "context_lens": a["context_lens"][:-1]}, "context_lens"),
    (lambda a: {**a, "v_pages": a["v_pages"][:, :-1]}, "v_pages"),
    (lambda a: {**a, "q": a["q"][:, :3]}, "kv heads"),
])
def test_bad_arguments_raise_naming_them(change, argument):
    problem = testing.decode_problem(0, **problem_kwargs(GRID[0]))
    names = ("q", "k_pages", "v_pages", "block_tables", "context_lens")
    args = change(dict(zip(names, problem.decode_args)))
    with pytest.raises(ValueError, match=argument):
        pk.paged_attention_decode_tpu(**args, interpret=True)
    with pytest.raises(ValueError, match=argument):
        pk.paged_attention_prefill_tpu(**args, query_start_loc=problem.query_start_loc,
                                       interpret=True)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kernels_lower_to_mosaic_tpu(dtype):
    """Lowering for TPU runs on any machine: catches Mosaic-lowering errors without a TPU.

    Realistic tile sizes (D=128, S=16, 8 pages per chunk, 128-row query tiles)."""
    kwargs = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)
    decode = testing.decode_problem(0, **kwargs)
    prefill = testing.prefill_problem(0, **kwargs)
    options = dict(sliding_window=100, logits_soft_cap=50.0)
    for fn, args in [(pk.paged_attention_decode_tpu, decode.decode_args),
                     (pk.paged_attention_prefill_tpu, prefill.prefill_args),
                     (functools.partial(pk.paged_attention_decode_tpu, **options),
                      decode.decode_args),
                     (functools.partial(pk.paged_attention_prefill_tpu, **options),
                      prefill.prefill_args)]:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
        assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.parametrize("precision, expected", [
    (None, "HIGHEST"), ("highest", "HIGHEST"), ("high", "HIGHEST"), ("default", "DEFAULT")])
def test_float32_dots_run_at_a_precision_mosaic_lowers(precision, expected):
    """Mosaic TPU lowers only DEFAULT and HIGHEST: float32 dots asked for HIGH run at HIGHEST
    (at least the precision asked for), and every precision lowers; bfloat16 dots stay DEFAULT."""
    kwargs = dict(num_heads=4, num_kv_heads=1, head_dim=128, block_size=16)
    for dtype, expected_dots in [(F32, expected), (BF16, "DEFAULT")]:
        decode = testing.decode_problem(0, **kwargs, dtype=dtype)
        prefill = testing.prefill_problem(0, **kwargs, dtype=dtype)
        for fn, args in [(pk.paged_attention_decode_tpu, decode.decode_args),
                         (pk.paged_attention_prefill_tpu, prefill.prefill_args)]:
            fn = functools.partial(fn, precision=precision)
            dots = testing.dot_precisions(functools.partial(fn, interpret=True), *args)
            assert dots and {p.name for p in dots} == {expected_dots}, (fn, dots)
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
            assert "tpu_custom_call" in lowered.as_text()
