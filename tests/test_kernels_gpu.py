"""The Pallas GPU (Triton) kernels equal the jnp reference; and the reference equals hand-worked and dense attention.

On a CPU the kernels run in the Pallas interpreter over a small grid; on a GPU the same tests run
compiled over the full grid, plus the `gpu`-marked tests with realistic shapes.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference
from pallas_kernels import testing
from pallas_kernels.gpu import cache_write
from pallas_kernels.testing import TOLERANCE, make_problem, max_row_error

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# Head dims of real models; the ones that are not powers of two run on tiles padded in the kernel.
HEAD_DIMS = (48, 64, 80, 96, 112, 128, 192, 256)
# (heads, head_dim, block_size, dtype). Interpreting costs ~1 s of compile per shape: keep CPU small
# (each head dim that is not a power of two once, spread over heads, block sizes and dtypes).
CPU_GRID = [("mha", 64, 16, F32), ("gqa", 64, 16, BF16), ("mqa", 128, 32, F32),
            ("gqa", 128, 64, BF16), ("gqa", 64, 128, F32), ("gqa", 256, 16, BF16),
            ("gqa", 48, 16, F32), ("mqa", 80, 32, BF16), ("mha", 96, 16, F32),
            ("gqa", 112, 64, BF16), ("mqa", 192, 16, F32)]
GPU_GRID = [*itertools.product(HEADS, (64, 128), (16, 32, 64, 128), (BF16,)),
            ("mha", 64, 16, F32), ("gqa", 128, 32, F32), ("mqa", 128, 128, F32),
            ("gqa", 64, 64, F32), ("gqa", 256, 16, BF16), ("mqa", 256, 128, F32),
            *itertools.product(HEADS, (48, 80, 96, 112, 192, 256), (16, 64), (BF16, F32))]
GRID = GPU_GRID if ON_GPU else CPU_GRID

# Sliding windows, as functions of the block size S: the query alone; not a multiple of S (and
# equal to the S+3 prompt of prefill_problem); equal to the 2S context of decode_problem; larger
# than every context. Each problem's lengths (1 to 3S+5) put rows on both sides of a window.
WINDOWS = {"W1": lambda s: 1, "WS+3": lambda s: s + 3, "W2S": lambda s: 2 * s,
           "W100S": lambda s: 100 * s, "none": lambda s: None}
# (window, logits_soft_cap, decode kernel options, prefill kernel options); on the CPU the
# kernels' split-K and small-tile paths each meet a window once.
CPU_OPTIONS = [("W1", None, {}, {}),
               ("WS+3", 2.0, {}, dict(block_q=4, tokens_per_step=16)),
               ("W2S", None, dict(num_splits=3, tokens_per_step=16), {})]
GPU_OPTIONS = [(window, cap, decode, prefill) for window in WINDOWS for cap in (None, 2.0, 50.0)
               for decode, prefill in [({}, {}), (dict(num_splits=5, tokens_per_step=16),
                                                  dict(block_q=4, tokens_per_step=16))]
               if (window, cap) != ("none", None)]
OPTIONS = GPU_OPTIONS if ON_GPU else CPU_OPTIONS
# The shapes the options run on: on the CPU one that is not a power of two.
OPTION_CASES = ([("gqa", 128, 16, BF16), ("mqa", 80, 32, F32), ("mha", 256, 64, BF16),
                 ("gqa", 48, 128, F32)] if ON_GPU else [("gqa", 48, 16, F32)])

ref_decode = jax.jit(reference.paged_attention_decode,
                     static_argnames=("scale", "sliding_window", "logits_soft_cap"))
ref_prefill = jax.jit(reference.paged_attention_prefill,
                      static_argnames=("scale", "sliding_window", "logits_soft_cap"))


def grid_id(case):
    heads, head_dim, block_size, dtype = case
    return f"{heads}-D{head_dim}-S{block_size}-{dtype.name}"


def options_id(options):
    window, cap, decode, prefill = options
    tiling = "-".join(f"{k}{v}" for k, v in sorted({**decode, **prefill}.items()))
    return f"{window}-cap{cap}" + (f"-{tiling}" if tiling else "")


def problem_kwargs(case):
    heads, head_dim, block_size, dtype = case
    num_heads, num_kv_heads = HEADS[heads]
    return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                block_size=block_size, dtype=dtype)


def make_decode(case, seed=0):
    return testing.decode_problem(seed, **problem_kwargs(case))


def make_prefill(case, seed=0):
    return testing.prefill_problem(seed, **problem_kwargs(case))


def assert_matches(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    error = max_row_error(out, ref)
    assert error < TOLERANCE[dtype], f"max row relative error {error}"


# --- the reference itself -------------------------------------------------------------------

def hand_worked_cache():
    """K=H=1, D=2, S=2; one sequence of 3 tokens in blocks [3, 1] of a pool of 4 (0 is the sink).

    keys k0=[1,0], k1=[0,1], k2=[1,1]; values v0=[1,0], v1=[0,2], v2=[3,3]; everything else NaN.
    """
    pages = np.full((2, 1, 4, 2, 2), np.nan, np.float32)  # (k|v), K, N, S, D
    pages[0, 0, 3] = [[1, 0], [0, 1]]
    pages[0, 0, 1, 0] = [1, 1]
    pages[1, 0, 3] = [[1, 0], [0, 2]]
    pages[1, 0, 1, 0] = [3, 3]
    return jnp.asarray(pages[0]), jnp.asarray(pages[1]), jnp.array([[3, 1, 0]], jnp.int32)


def test_reference_decode_hand_worked():
    k_pages, v_pages, block_tables = hand_worked_cache()
    # scores = q.k * 1 = [ln2, 0, ln2] -> weights [2, 1, 2] / 5 -> (2 v0 + v1 + 2 v2) / 5.
    q = jnp.array([[[np.log(2.0), 0.0]]], jnp.float32)
    out = ref_decode(q, k_pages, v_pages, block_tables, jnp.array([3], jnp.int32), scale=1.0)
    np.testing.assert_allclose(out[0, 0], [8 / 5, 8 / 5], rtol=1e-6)


def test_reference_prefill_hand_worked():
    k_pages, v_pages, block_tables = hand_worked_cache()
    # A 2-token chunk after a cached prefix of 1: rows at positions 1 and 2, zero queries (uniform
    # weights over visible keys), then one padding row.
    q = jnp.zeros((3, 1, 2), jnp.float32)
    out = ref_prefill(q, k_pages, v_pages, block_tables, jnp.array([3], jnp.int32),
                      jnp.array([0, 2], jnp.int32))
    np.testing.assert_allclose(out[:, 0], [[0.5, 1.0], [4 / 3, 5 / 3], [0.0, 0.0]], rtol=1e-6)


def test_reference_window_and_soft_cap_hand_worked():
    """sliding_window=2 keeps the last two keys; the soft cap is undone by choosing q so that
    1 * tanh(q . k) gives the decode case's scores again: [ln2, 0, ln2] -> keys 1, 2 weigh 1 : 2."""
    k_pages, v_pages, block_tables = hand_worked_cache()
    context_lens = jnp.array([3], jnp.int32)
    q = jnp.array([[[np.arctanh(np.log(2.0)), 0.0]]], jnp.float32)
    capped = ref_decode(q, k_pages, v_pages, block_tables, context_lens, scale=1.0,
                        logits_soft_cap=1.0)
    np.testing.assert_allclose(capped[0, 0], [8 / 5, 8 / 5], rtol=1e-6)
    both = ref_decode(q, k_pages, v_pages, block_tables, context_lens, scale=1.0,
                      sliding_window=2, logits_soft_cap=1.0)
    np.testing.assert_allclose(both[0, 0], [2.0, 8 / 3], rtol=1e-6)   # (v1 + 2 v2) / 3
    # Prefill, zero queries: the row at position 1 sees keys 0-1, the one at 2 keys 1-2.
    out = ref_prefill(jnp.zeros((3, 1, 2), jnp.float32), k_pages, v_pages, block_tables,
                      context_lens, jnp.array([0, 2], jnp.int32), sliding_window=2)
    np.testing.assert_allclose(out[:, 0], [[0.5, 1.0], [1.5, 2.5], [0.0, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("num_heads,num_kv_heads,sliding_window,logits_soft_cap", [
    (4, 4, None, None), (8, 2, None, None), (4, 1, None, None), (8, 2, 3, None), (4, 1, 4, 1.5)])
def test_reference_equals_dense_attention(num_heads, num_kv_heads, sliding_window,
                                          logits_soft_cap):
    block_size, head_dim, context_len, q_len = 4, 8, 11, 6
    options = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    problem = make_problem(3, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           block_size=block_size, dtype=jnp.float32, context_lens=[context_len],
                           query_lens=[q_len])
    # Unpage the sequence: [C, K, D] in logical order.
    pages = [p[:, problem.block_tables[0]].reshape(num_kv_heads, -1, head_dim)[:, :context_len]
             for p in (problem.k_pages, problem.v_pages)]
    keys, values = (jnp.swapaxes(p, 0, 1) for p in pages)
    dense = jax.jit(reference.dense_causal_attention, static_argnames=(
        "query_offset", "sliding_window", "logits_soft_cap"))(
        problem.q, keys, values, query_offset=context_len - q_len, **options)
    np.testing.assert_allclose(ref_prefill(*problem.prefill_args, **options), dense, rtol=1e-5,
                               atol=1e-6)
    decode_q = problem.q[-1:]
    np.testing.assert_allclose(ref_decode(decode_q, *problem.decode_args[1:], **options),
                               dense[-1:], rtol=1e-5, atol=1e-6)


# --- GPU kernels against the reference ------------------------------------------------------

@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_decode_matches_reference(case):
    problem = make_decode(case)
    out = pk.paged_attention_decode_gpu(*problem.decode_args, interpret=INTERPRET)
    assert_matches(out, ref_decode(*problem.decode_args), case[3])
    padding_row = np.asarray(out[testing.DECODE_PADDING_ROW], np.float32)
    assert not np.any(padding_row), "padding row (context_len 0) must be zeros"


@pytest.mark.parametrize("num_splits,tokens_per_step", [(1, 16), (7, 16), (64, 32)])
def test_decode_split_k_variants(num_splits, tokens_per_step):
    """One split, splits that cut pages, and more splits than tokens (empty splits)."""
    case = ("gqa", 64, 16, F32)
    problem = make_decode(case, seed=1)
    out = pk.paged_attention_decode_gpu(*problem.decode_args, interpret=INTERPRET,
                                        num_splits=num_splits, tokens_per_step=tokens_per_step)
    assert_matches(out, ref_decode(*problem.decode_args), F32)


@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_prefill_matches_reference(case):
    problem = make_prefill(case)
    out = pk.paged_attention_prefill_gpu(*problem.prefill_args, interpret=INTERPRET)
    assert_matches(out, ref_prefill(*problem.prefill_args), case[3])
    padding_rows = np.asarray(out[-testing.PREFILL_PADDING_ROWS:], np.float32)
    assert not np.any(padding_rows), "padding rows must be zeros"


@pytest.mark.parametrize("block_q,tokens_per_step", [(4, 16), (32, 32)])
def test_prefill_tilings(block_q, tokens_per_step):
    """Many small tiles per sequence (4 tokens x 4 heads), and tiles larger than any chunk."""
    case = ("gqa", 64, 16, F32)
    problem = make_prefill(case, seed=3)
    out = pk.paged_attention_prefill_gpu(*problem.prefill_args, interpret=INTERPRET,
                                         block_q=block_q, tokens_per_step=tokens_per_step)
    assert_matches(out, ref_prefill(*problem.prefill_args), F32)


def window_and_cap(case, options):
    """(sliding_window for the case's block size, logits_soft_cap) of an OPTIONS entry."""
    window, cap, _, _ = options
    return WINDOWS[window](case[2]), cap


def hide_old_blocks(problem, sliding_window):
    """Blocks no window reaches point at the NaN sink: read (not skipped), they give NaN."""
    if sliding_window is None:
        return problem
    return testing.poison_blocks_before_window(problem, sliding_window, 0)


@pytest.mark.parametrize("options", OPTIONS, ids=options_id)
@pytest.mark.parametrize("case", OPTION_CASES, ids=grid_id)
def test_decode_window_and_soft_cap_match_reference(case, options):
    """Windows shorter than, equal to and longer than the contexts, not multiples of S, with
    split-K cutting them; blocks before every window are never read."""
    sliding_window, cap = window_and_cap(case, options)
    problem = make_decode(case, seed=5)
    attention = dict(sliding_window=sliding_window, logits_soft_cap=cap)
    out = pk.paged_attention_decode_gpu(*hide_old_blocks(problem, sliding_window).decode_args,
                                        **attention, interpret=INTERPRET, **options[2])
    assert_matches(out, ref_decode(*problem.decode_args, **attention), case[3])
    assert not np.any(np.asarray(out[testing.DECODE_PADDING_ROW], np.float32))


@pytest.mark.parametrize("options", OPTIONS, ids=options_id)
@pytest.mark.parametrize("case", OPTION_CASES, ids=grid_id)
def test_prefill_window_and_soft_cap_match_reference(case, options):
    """As for decode, over prompts, chunks after cached prefixes and decode rows."""
    sliding_window, cap = window_and_cap(case, options)
    problem = make_prefill(case, seed=5)
    attention = dict(sliding_window=sliding_window, logits_soft_cap=cap)
    tiling = dict(options[3])
    if "block_q" in tiling:  # at least the smallest legal tile: block_q * G' >= 16 rows
        num_heads, num_kv_heads = HEADS[case[0]]
        padded_group = 1 << (num_heads // num_kv_heads - 1).bit_length()
        tiling["block_q"] = max(tiling["block_q"], 16 // padded_group)
    out = pk.paged_attention_prefill_gpu(*hide_old_blocks(problem, sliding_window).prefill_args,
                                         **attention, interpret=INTERPRET, **tiling)
    assert_matches(out, ref_prefill(*problem.prefill_args, **attention), case[3])
    assert not np.any(np.asarray(out[-testing.PREFILL_PADDING_ROWS:], np.float32))


def test_hidden_old_blocks_are_noticed():
    """The check above can fail: a kernel that reads the blocks before the window gets NaN."""
    case = OPTION_CASES[0]
    problem = hide_old_blocks(make_decode(case, seed=5), case[2])
    out = pk.paged_attention_decode_gpu(*problem.decode_args, interpret=INTERPRET)
    assert np.isnan(np.asarray(out, np.float32)).any()


def test_prefill_decode_rows_equal_decode_kernel():
    """A batch of q_len 1 rows through the prefill kernel is a decode."""
    case = ("gqa", 64, 16, F32)
    problem = make_decode(case, seed=2)
    out = pk.paged_attention_prefill_gpu(*problem.prefill_args, interpret=INTERPRET)
    assert_matches(out, ref_decode(*problem.decode_args), F32)


def test_never_reads_table_entries_past_last_block():
    """Entries past a sequence's last block point far outside the pool: unread, nothing changes."""
    case = GRID[0]  # shapes already compiled by the grid tests
    problem = make_prefill(case, seed=4)
    poisoned = testing.poison_unused_table_entries(problem)
    prefill = pk.paged_attention_prefill_gpu(*poisoned.prefill_args, interpret=INTERPRET)
    assert_matches(prefill, ref_prefill(*problem.prefill_args), case[3])
    problem = testing.poison_unused_table_entries(make_decode(case, seed=4))
    decode = pk.paged_attention_decode_gpu(*problem.decode_args, interpret=INTERPRET)
    assert_matches(decode, ref_decode(*make_decode(case, seed=4).decode_args), case[3])


def test_dispatch_routes_to_kernels():
    case = GRID[0]
    problem = make_decode(case, seed=1)
    direct = pk.paged_attention_decode_gpu(*problem.decode_args, interpret=INTERPRET)
    routed = pk.paged_attention_decode(*problem.decode_args, backend="pallas_gpu",
                                       interpret=INTERPRET)
    np.testing.assert_array_equal(direct, routed)
    routed_reference = jax.jit(functools.partial(pk.paged_attention_decode, backend="reference"))
    np.testing.assert_array_equal(routed_reference(*problem.decode_args),
                                  ref_decode(*problem.decode_args))
    with pytest.raises(ValueError, match="backend"):
        pk.paged_attention_decode(*problem.decode_args, backend="auto")
    with pytest.raises(ValueError, match="reference"):
        pk.paged_attention_prefill(*problem.prefill_args, backend="reference", block_q=16)


@pytest.mark.parametrize("change,argument", [
    (lambda a: {**a, "q": a["q"][0]}, "^q must"),
    (lambda a: {**a, "block_tables": a["block_tables"].astype(jnp.float32)}, "block_tables"),
    (lambda a: {**a, "context_lens": a["context_lens"][:-1]}, "context_lens"),
    (lambda a: {**a, "v_pages": a["v_pages"][:, :-1]}, "v_pages"),
    (lambda a: {**a, "q": a["q"][:, :3]}, "kv heads"),
    (lambda a: {**a, "q": a["q"].astype(jnp.bfloat16)}, "k_pages dtype"),
])
def test_bad_arguments_raise_naming_them(change, argument):
    problem = make_decode(("gqa", 64, 16, F32))
    names = ("q", "k_pages", "v_pages", "block_tables", "context_lens")
    args = change(dict(zip(names, problem.decode_args)))
    with pytest.raises(ValueError, match=argument):
        pk.paged_attention_decode_gpu(**args, interpret=INTERPRET)
    prefill_args = {**args, "q": args["q"], "query_start_loc": problem.query_start_loc}
    with pytest.raises(ValueError, match=argument):
        pk.paged_attention_prefill_gpu(**prefill_args, interpret=INTERPRET)


def lower_for_cuda(fn, args):
    """The StableHLO text of fn(*args) lowered for CUDA (the Triton kernels lowered to Triton IR
    and verified on the way), or a skip where this jax cannot lower for CUDA without a GPU."""
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as error:  # jax >= 0.11 asks a real GPU for its compute capability
        if "No supported GPU devices" in str(error):
            pytest.skip("this jax cannot lower for CUDA without a GPU")
        raise


def test_kernels_lower_to_triton():
    """Lowering for CUDA runs on any machine: catches Triton-lowering errors without a GPU.

    Decode is one launch with or without splits (the split-K combine runs inside the kernel):
    exactly one Triton call and no XLA reduction around it.
    """
    problem = make_prefill(("gqa", 128, 16, BF16))
    decode_args = make_decode(("gqa", 128, 16, BF16)).decode_args
    cases = [(functools.partial(pk.paged_attention_decode_gpu, num_splits=1), decode_args),
             (functools.partial(pk.paged_attention_decode_gpu, num_splits=4), decode_args),
             (pk.paged_attention_prefill_gpu, problem.prefill_args),
             (cache_write.write_to_pages, cache_write_problem(4, BF16))]
    for fn, args in cases:
        text = lower_for_cuda(fn, args)
        assert text.count("xla.gpu.triton") == 1
        if fn is not pk.paged_attention_prefill_gpu:
            assert "stablehlo.reduce" not in text


def test_every_head_dim_lowers_to_triton():
    """Triton needs power-of-two tiles, which the interpreter does not check: lowering (which
    verifies the Triton IR) does. Every kernel, at head dims that are not powers of two, with
    and without a window and soft cap, one Triton call each."""
    options = dict(sliding_window=19, logits_soft_cap=50.0)
    for head_dim in (8, 48, 80, 192):  # padded to 16, 64, 128, 256
        kwargs = dict(num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=BF16)
        decode_args = testing.decode_problem(0, **kwargs).decode_args
        prefill_args = testing.prefill_problem(0, **kwargs).prefill_args
        cases = [
            (functools.partial(pk.paged_attention_decode_gpu, num_splits=1), decode_args),
            (functools.partial(pk.paged_attention_decode_gpu, num_splits=4, **options),
             decode_args),
            (pk.paged_attention_prefill_gpu, prefill_args),
            (functools.partial(pk.paged_attention_prefill_gpu, **options), prefill_args),
            (cache_write.write_to_pages, cache_write_problem(2, BF16, head_dim=head_dim)),
            (functools.partial(cache_write.rotate_and_write, num_heads=8),
             rotate_write_problem(8, 2, head_dim, BF16, 13))]
        for fn, args in cases:
            assert lower_for_cuda(fn, args).count("xla.gpu.triton") == 1, (head_dim, fn)


@pytest.mark.parametrize("head_dim", [44, 264])
def test_head_dims_no_kernel_takes_raise_naming_head_dim(head_dim):
    """Multiples of 8 up to 256 only; the message is unsupported_reason's."""
    reason = pk.unsupported_reason("pallas_gpu", head_dim=head_dim)
    assert "head_dim" in reason
    case = ("gqa", head_dim, 16, F32)
    decode, prefill = make_decode(case), make_prefill(case)
    calls = [lambda: pk.paged_attention_decode_gpu(*decode.decode_args),
             lambda: pk.paged_attention_prefill_gpu(*prefill.prefill_args),
             lambda: cache_write.write_to_pages(*cache_write_problem(2, F32, head_dim=head_dim)),
             lambda: cache_write.rotate_and_write(*rotate_write_problem(4, 2, head_dim, F32, 4),
                                                  num_heads=4)]
    for call in calls:
        with pytest.raises(ValueError, match="head_dim") as error:
            call()
        assert str(error.value) == reason


@pytest.mark.parametrize("options,argument", [
    (dict(sliding_window=0), "sliding_window"), (dict(sliding_window=2.5), "sliding_window"),
    (dict(sliding_window=True), "sliding_window"), (dict(logits_soft_cap=0.0), "logits_soft_cap"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), "logits_soft_cap")])
def test_bad_attention_options_raise_naming_them(options, argument):
    problem = make_prefill(("gqa", 64, 16, F32))
    for backend in ("reference", "pallas_gpu"):
        with pytest.raises(ValueError, match=argument):
            pk.paged_attention_prefill(*problem.prefill_args, backend=backend,
                                       interpret=INTERPRET, **options)
    with pytest.raises(ValueError, match=argument):
        pk.paged_attention_decode_gpu(*make_decode(("gqa", 64, 16, F32)).decode_args,
                                      interpret=INTERPRET, **options)



HIGHEST, HIGH, DEFAULT = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGH,
                          jax.lax.Precision.DEFAULT)


@pytest.mark.parametrize("precision, expected", [
    (None, HIGHEST), ("highest", HIGHEST), ("high", HIGH), ("default", DEFAULT), (HIGH, HIGH)])
def test_float32_dots_run_at_the_precision_asked(precision, expected):
    """Every dot of the GPU kernels and of the reference on float32 inputs runs at `precision`
    (None: HIGHEST, since a GPU's DEFAULT is TF32); on bfloat16 inputs the kernels' dots stay
    DEFAULT and the reference's (upcast to float32) HIGHEST, whatever precision says."""
    for dtype, kernel_dots, reference_dots in [(F32, expected, expected),
                                               (BF16, DEFAULT, HIGHEST)]:
        decode, prefill = make_decode(("mqa", 48, 16, dtype)), make_prefill(("mqa", 48, 16, dtype))
        kernel = dict(precision=precision, interpret=INTERPRET)
        for fn, args, expected_dots in [
                (functools.partial(pk.paged_attention_decode_gpu, **kernel), decode.decode_args,
                 kernel_dots),
                (functools.partial(pk.paged_attention_decode_gpu, **kernel, num_splits=3,
                                   tokens_per_step=16), decode.decode_args, kernel_dots),
                (functools.partial(pk.paged_attention_prefill_gpu, **kernel),
                 prefill.prefill_args, kernel_dots),
                (functools.partial(reference.paged_attention_decode, precision=precision),
                 decode.decode_args, reference_dots),
                (functools.partial(reference.paged_attention_prefill, precision=precision),
                 prefill.prefill_args, reference_dots)]:
            dots = testing.dot_precisions(fn, *args)
            assert len(dots) >= 2 and set(dots) == {expected_dots}, (fn, dots)


@pytest.mark.parametrize("precision", ["highest", "high", "default"])
def test_float32_kernels_lower_to_triton_at_every_precision(precision):
    """Triton takes each precision on float32 dots (IEEE for HIGHEST, TF32 for the others)."""
    decode, prefill = make_decode(("gqa", 64, 16, F32)), make_prefill(("gqa", 64, 16, F32))
    for fn, args in [(pk.paged_attention_decode_gpu, decode.decode_args),
                     (pk.paged_attention_prefill_gpu, prefill.prefill_args)]:
        text = lower_for_cuda(functools.partial(fn, precision=precision), args)
        assert text.count("xla.gpu.triton") == 1


@pytest.mark.parametrize("precision", ["tf32", 1, "HIGHEST "])
def test_bad_precision_raises_naming_it(precision):
    problem = make_prefill(("gqa", 64, 16, F32))
    for backend in ("reference", "pallas_gpu"):
        with pytest.raises(ValueError, match="^precision must be"):
            pk.paged_attention_prefill(*problem.prefill_args, backend=backend,
                                       interpret=INTERPRET, precision=precision)
    with pytest.raises(ValueError, match="^precision must be"):
        pk.paged_attention_decode_gpu(*make_decode(("gqa", 64, 16, BF16)).decode_args,
                                      interpret=INTERPRET, precision=precision)

def test_unsupported_reason():
    """None where a backend runs the model, else the reason its kernels would raise with."""
    assert pk.unsupported_reason("reference", head_dim=44, dtype=jnp.int8) is None
    for backend in ("pallas_gpu", "pallas_tpu"):
        for head_dim in (8, 48, 80, 96, 112, 128, 192, 256):
            assert pk.unsupported_reason(backend, head_dim=head_dim, dtype=BF16, block_size=16,
                                         sliding_window=4096, logits_soft_cap=50.0) is None
        assert "head_dim" in pk.unsupported_reason(backend, head_dim=76)
        assert "head_dim" in pk.unsupported_reason(backend, head_dim=512)
        assert "dtype" in pk.unsupported_reason(backend, head_dim=64, dtype=jnp.int8)
        assert "kv_cache_dtype" in pk.unsupported_reason(backend, head_dim=64, dtype=BF16,
                                                         kv_cache_dtype=F32)
        assert "sliding_window" in pk.unsupported_reason(backend, head_dim=64, sliding_window=0)
    assert "block_size" in pk.unsupported_reason("pallas_gpu", head_dim=64, block_size=24)
    assert pk.unsupported_reason("pallas_tpu", head_dim=64, block_size=24) is None
    with pytest.raises(ValueError, match="backend"):
        pk.unsupported_reason("auto", head_dim=64)


# --- cache writes -------------------------------------------------------------------------------

def cache_write_problem(num_kv_heads, dtype, num_tokens=13, seed=0, head_dim=16):
    """Pages [K, 9, 4, D] of random values; T new rows (float32) at distinct slots, two of -1."""
    rng = np.random.default_rng(seed)
    shape = (num_kv_heads, 9, 4, head_dim)
    k_pages, v_pages = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2))
    k_new, v_new = (jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads, head_dim)),
                                jnp.float32) for _ in range(2))
    slots = rng.permutation(np.arange(4, 9 * 4))[:num_tokens].astype(np.int32)
    slots[[2, 7]] = -1
    return k_pages, v_pages, k_new, v_new, jnp.asarray(slots)


CACHE_WRITE_CASES = [(2, F32, 4, 16), (3, BF16, 8, 16), (1, BF16, 16, 16), (2, F32, 4, 48),
                     (3, BF16, 8, 80), (1, F32, 8, 192)]
if ON_GPU:
    CACHE_WRITE_CASES += [(kv, dtype, 8, dim) for kv in (1, 8) for dtype in (BF16, F32)
                          for dim in HEAD_DIMS]


@pytest.mark.parametrize("num_kv_heads,dtype,tokens_per_program,head_dim", CACHE_WRITE_CASES)
def test_cache_write_kernel_equals_xla_scatter(num_kv_heads, dtype, tokens_per_program, head_dim):
    """Bit-identical to the reference scatter, -1 slots skipped, other slots untouched; head
    dims that are not powers of two write only their D columns."""
    args = cache_write_problem(num_kv_heads, dtype, head_dim=head_dim)
    expected = jax.jit(reference.write_to_pages)(*args)
    out = cache_write.write_to_pages(*args, interpret=INTERPRET,
                                     tokens_per_program=tokens_per_program)
    for got, want in zip(out, expected):
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    routed = pk.write_to_pages(*args, backend="pallas_gpu", interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(routed[0], np.float32), np.asarray(out[0], np.float32))


def test_cache_write_rejects_bad_shapes():
    k_pages, v_pages, k_new, v_new, slots = cache_write_problem(2, F32)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache_write.write_to_pages(k_pages, v_pages, k_new, v_new, slots[:-1],
                                   interpret=INTERPRET)
    with pytest.raises(ValueError, match="k_new"):
        cache_write.write_to_pages(k_pages, v_pages, k_new[:, :1], v_new, slots,
                                   interpret=INTERPRET)


def rotate_write_problem(num_heads, num_kv_heads, head_dim, dtype, num_tokens, seed=0):
    """qkv [T, H + 2K, D], rotary tables of scattered positions, pages [K, 9, 4, D] of random
    values (NaN in block 0, the sink, except where skipped tokens aim), distinct slots, two -1."""
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.normal(size=(num_tokens, num_heads + 2 * num_kv_heads, head_dim)),
                      dtype)
    positions = rng.integers(0, 4000, num_tokens)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2) / head_dim))
    angles = np.concatenate([positions[:, None] * inv_freq[None]] * 2, axis=-1)
    cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
    shape = (num_kv_heads, 9, 4, head_dim)
    k_pages, v_pages = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2))
    slots = rng.permutation(np.arange(4, 9 * 4))[:num_tokens].astype(np.int32)
    slots[[1, num_tokens - 1]] = -1
    return qkv, cos, sin, k_pages, v_pages, jnp.asarray(slots)


ROTATE_CASES = [(4, 4, 16, F32, 12, None), (8, 2, 64, BF16, 13, None), (4, 1, 32, BF16, 6, None),
                (28, 4, 128, BF16, 8, None), (16, 8, 16, F32, 2, None), (4, 4, 16, F32, 12, 4),
                (8, 2, 64, BF16, 8, 2), (8, 2, 48, BF16, 13, None), (4, 4, 80, F32, 8, 4)]
if ON_GPU:
    ROTATE_CASES += [(heads, kv, dim, dtype, 13, None) for heads, kv in HEADS.values()
                     for dim in HEAD_DIMS for dtype in (BF16, F32)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype,num_tokens,tokens_per_program",
                         ROTATE_CASES)
def test_rotate_and_write_equals_reference(num_heads, num_kv_heads, head_dim, dtype,
                                           num_tokens, tokens_per_program):
    """Rotated queries and keys within the dtype's tolerance of the reference (one rounding
    where XLA may round per operation), values bit-identical; skipped slots and every other
    slot untouched. Token counts that are odd or not a multiple of 4, head counts and head dims
    not powers of two, one token or several per program."""
    args = rotate_write_problem(num_heads, num_kv_heads, head_dim, dtype, num_tokens)
    want_q, want_k, want_v = jax.jit(functools.partial(reference.rotate_and_write,
                                                       num_heads=num_heads))(*args)
    q, k_pages, v_pages = cache_write.rotate_and_write(
        *args, num_heads=num_heads, interpret=INTERPRET, tokens_per_program=tokens_per_program)
    assert q.shape == want_q.shape and q.dtype == dtype and k_pages.dtype == dtype
    # Per (token, head) row, as the tolerance table is defined: an element where the rotation's
    # two terms cancel can differ by a bf16 rounding of the terms (seen on the H200 at D=80).
    assert max_row_error(q, want_q) < TOLERANCE[dtype]
    assert max_row_error(k_pages, want_k) < TOLERANCE[dtype]
    np.testing.assert_array_equal(np.asarray(v_pages, np.float32),
                                  np.asarray(want_v, np.float32))
    written = (np.asarray(args[3], np.float32) != np.asarray(k_pages, np.float32)).any(axis=(0, 3))
    slots = np.asarray(args[5])
    expected = np.zeros(written.size, bool)
    expected[slots[slots >= 0]] = True
    np.testing.assert_array_equal(written.reshape(-1), expected)   # the live tokens' slots only
    routed = pk.rotate_and_write(*args, num_heads=num_heads, backend="pallas_gpu",
                                 interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(routed[0], np.float32), np.asarray(q, np.float32))


def test_rotate_and_write_rejects_bad_shapes():
    qkv, cos, sin, k_pages, v_pages, slots = rotate_write_problem(4, 2, 16, F32, 4)
    with pytest.raises(ValueError, match="qkv"):
        cache_write.rotate_and_write(qkv, cos, sin, k_pages, v_pages, slots, num_heads=6,
                                     interpret=INTERPRET)
    with pytest.raises(ValueError, match="cos"):
        cache_write.rotate_and_write(qkv, cos[:, :8], sin, k_pages, v_pages, slots,
                                     num_heads=4, interpret=INTERPRET)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache_write.rotate_and_write(qkv, cos, sin, k_pages, v_pages, slots[:-1], num_heads=4,
                                     interpret=INTERPRET)
    with pytest.raises(ValueError, match="tokens_per_program"):
        cache_write.rotate_and_write(qkv, cos, sin, k_pages, v_pages, slots, num_heads=4,
                                     interpret=INTERPRET, tokens_per_program=3)


# --- compiled on a GPU only: realistic shapes -----------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("block_size", [16, 128])
def test_decode_llama_shapes(block_size):
    """Llama-3-8B heads (32 query, 8 kv, D=128), bf16, 24 sequences up to ~3k tokens."""
    rng = np.random.default_rng(block_size)
    context_lens = [int(n) for n in rng.integers(1, 3000, 24)] + [0, 1]
    problem = make_problem(5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=block_size,
                           dtype=jnp.bfloat16, context_lens=context_lens, spare_blocks=40)
    out = pk.paged_attention_decode_gpu(*problem.decode_args)
    assert_matches(out, ref_decode(*problem.decode_args), BF16)


@pytest.mark.gpu
@needs_gpu
def test_prefill_long_chunks_with_prefix_and_decodes():
    """Two 512-token chunks after 600- and 0-token prefixes, and 30 decode rows, bf16 Llama heads."""
    rng = np.random.default_rng(7)
    query_lens = [512, 512] + [1] * 30
    context_lens = [1112, 512] + [int(n) for n in rng.integers(1, 1000, 30)]
    problem = make_problem(6, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                           dtype=jnp.bfloat16, context_lens=context_lens, query_lens=query_lens,
                           padding_rows=10)
    out = pk.paged_attention_prefill_gpu(*problem.prefill_args)
    assert_matches(out, ref_prefill(*problem.prefill_args), BF16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,sliding_window,logits_soft_cap", [
    (16, 8, 256, 4096, 50.0), (32, 32, 96, None, None), (32, 8, 80, 2047, None),
    (32, 8, 112, None, 30.0)])
def test_decode_window_and_head_dim_shapes(num_heads, num_kv_heads, head_dim, sliding_window,
                                           logits_soft_cap):
    """Gemma-2-like (D=256, window 4096, soft cap 50) and head dims that are not powers of two,
    bf16, 24 sequences up to ~6k tokens: many longer than the window."""
    rng = np.random.default_rng(head_dim)
    context_lens = [int(n) for n in rng.integers(1, 6000, 24)] + [0, 1]
    problem = make_problem(8, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           block_size=16, dtype=jnp.bfloat16, context_lens=context_lens,
                           spare_blocks=40)
    options = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    hidden = hide_old_blocks(problem, sliding_window)
    out = pk.paged_attention_decode_gpu(*hidden.decode_args, **options)
    assert_matches(out, ref_decode(*problem.decode_args, **options), BF16)


@pytest.mark.gpu
@needs_gpu
def test_prefill_window_long_chunk_with_prefix_and_decodes():
    """A 512-token chunk after a 1000-token prefix (the window of 700 starts inside the prefix
    and moves through the chunk), a 300-token prompt and 30 decode rows; D=256, soft cap 50."""
    rng = np.random.default_rng(9)
    query_lens = [512, 300] + [1] * 30
    context_lens = [1512, 300] + [int(n) for n in rng.integers(1, 1500, 30)]
    problem = make_problem(10, num_heads=16, num_kv_heads=8, head_dim=256, block_size=16,
                           dtype=jnp.bfloat16, context_lens=context_lens, query_lens=query_lens,
                           padding_rows=10)
    options = dict(sliding_window=700, logits_soft_cap=50.0)
    out = pk.paged_attention_prefill_gpu(*hide_old_blocks(problem, 700).prefill_args, **options)
    assert_matches(out, ref_prefill(*problem.prefill_args, **options), BF16)
