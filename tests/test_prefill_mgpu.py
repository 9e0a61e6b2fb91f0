"""The Hopper prefill kernel (Pallas Mosaic GPU) equals the jnp reference.

On a CPU (jax >= 0.11) the kernel runs in Mosaic GPU's own interpreter over a small grid and is
lowered for CUDA over more shapes (that catches layout and tiling errors without a GPU); on a
Hopper GPU the same grid runs compiled, plus the `gpu`-marked tests with realistic shapes.
With jax < 0.11 (no Mosaic GPU interpreter, older API) the whole file is skipped.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import reference, testing
from pallas_kernels._compat import mosaic_gpu_problem
from pallas_kernels.gpu import prefill_mgpu
from pallas_kernels.testing import TOLERANCE, make_problem, max_row_error

pytestmark = pytest.mark.skipif(mosaic_gpu_problem() is not None,
                                reason=f"Mosaic GPU kernels unavailable: {mosaic_gpu_problem()}")

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA (Hopper) GPU")
BF16, F16 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
HEADS = {"mha": (2, 2), "gqa": (8, 2), "mqa": (4, 1), "g3": (3, 1)}

ref_prefill = jax.jit(reference.paged_attention_prefill,
                      static_argnames=("scale", "sliding_window", "logits_soft_cap"))
kernel = prefill_mgpu.paged_attention_prefill


def assert_matches(out, ref):
    """Both 16-bit dtypes against the bf16 tolerance (float16 rounds finer)."""
    error = max_row_error(out, ref)
    assert error < TOLERANCE[BF16], f"max row error {error}"


def prefill(heads, head_dim, block_size, dtype=BF16, seed=0):
    num_heads, num_kv_heads = HEADS[heads]
    return testing.prefill_problem(seed, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, block_size=block_size, dtype=dtype)


def check(problem, *, sliding_window=None, logits_soft_cap=None, hide_old_blocks=False,
          **tiling):
    """Run the kernel (on `problem` with the blocks before every window pointing at the NaN sink
    when hide_old_blocks) and compare with the reference; padding rows must be zeros."""
    options = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    given = problem
    if hide_old_blocks:
        given = testing.poison_blocks_before_window(problem, sliding_window, 0)
    out = kernel(*given.prefill_args, **options, interpret=INTERPRET, **tiling)
    assert out.shape == problem.q.shape and out.dtype == problem.q.dtype
    assert_matches(out, ref_prefill(*problem.prefill_args, **options))
    num_rows = int(problem.query_start_loc[-1])
    assert not np.any(np.asarray(out[num_rows:], np.float32)), "padding rows must be zeros"
    return out


# Each case: prompts, chunks after cached prefixes (aligned and not), decode rows, an empty
# sequence and padding rows (`testing.prefill_problem`), unused slots NaN, tables shuffled.
@pytest.mark.parametrize("heads,head_dim,block_size,dtype", [
    ("gqa", 64, 16, BF16), ("mha", 128, 32, BF16), ("g3", 64, 32, BF16)])
def test_matches_reference(heads, head_dim, block_size, dtype):
    check(prefill(heads, head_dim, block_size, dtype))


def test_window_and_soft_cap_skip_old_blocks():
    """Windows of 1 and S + 3 keys with soft caps; the blocks before every window point at the
    NaN sink, so a kernel that read them (instead of skipping them) would return NaN."""
    check(prefill("gqa", 64, 16, seed=5), sliding_window=19, logits_soft_cap=2.0,
          hide_old_blocks=True)
    check(prefill("mqa", 64, 16, seed=6), sliding_window=1, logits_soft_cap=30.0,
          hide_old_blocks=True)


# The experimental warp-specialized schedules: lowered here, not run (they hang in the
# interpreter once a walk is longer than the ring; see the kernel's docstring).
SPECIALIZED = {"producer-two-wgs": dict(warp_specialized=True, compute_wgs=2),
               "producer-one-wg": dict(warp_specialized=True, compute_wgs=1)}


def test_tiling_knobs_and_unread_table_entries():
    """Small tiles, 64-key steps of two 32-token pages, a 3-deep ring; table entries past each
    sequence's last block point far outside the pool and must not be read."""
    problem = testing.poison_unused_table_entries(prefill("mqa", 64, 32, seed=2))
    check(problem, block_q=16, block_kv=64, num_stages=3)


@pytest.mark.parametrize("num_stages,sliding_window", [(1, None), (2, 70)])
def test_walks_longer_than_the_ring(num_stages, sliding_window):
    """Up to 5 steps of 64 keys through 1 or 2 stages: every stage is refilled, some twice."""
    problem = make_problem(3, num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                           dtype=BF16, context_lens=[300, 200, 1, 130],
                           query_lens=[40, 200, 1, 3], padding_rows=2)
    check(problem, sliding_window=sliding_window, block_kv=64, num_stages=num_stages)


def test_decode_batch_float16_and_dispatch():
    """Only q_len 1 rows, in float16, through the backend switch of `pallas_kernels`."""
    problem = make_problem(4, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                           dtype=F16, context_lens=[1, 15, 16, 40, 0, 70])
    out = pk.paged_attention_prefill(*problem.prefill_args, backend="pallas_mosaic_gpu",
                                     interpret=INTERPRET)
    assert_matches(out, ref_prefill(*problem.prefill_args))


@pytest.mark.parametrize("change,message", [
    (dict(head_dim=96), "head_dim"), (dict(dtype=jnp.float32), "dtype"),
    (dict(block_q=3), "block_q"), (dict(block_kv=48), "block_kv"),
    (dict(num_stages=0), "num_stages"), (dict(num_stages=7, block_kv=128), "shared memory"),
    (dict(compute_wgs=2, warp_specialized=False), "compute_wgs")])
def test_unsupported_shapes_and_tilings_raise(change, message):
    """Refused with a ValueError naming the argument; `unsupported_reason` gives the same words."""
    shape = dict(head_dim=64, dtype=BF16)
    tiling = {name: value for name, value in change.items() if name not in shape}
    shape.update({name: value for name, value in change.items() if name in shape})
    problem = make_problem(0, num_heads=4, num_kv_heads=2, block_size=16, context_lens=[5],
                           query_lens=[5], **shape)
    with pytest.raises(ValueError, match=message):
        kernel(*problem.prefill_args, interpret=INTERPRET, **tiling)
    if not tiling:
        reason = pk.unsupported_reason("pallas_mosaic_gpu", block_size=16, **shape)
        assert reason is not None and message in reason


def test_default_block_q_fills_wgmma_rows():
    """block_q * G: the fewest rows that split into 64-row multiples per compute warpgroup and
    reach the target (128 rows per warpgroup alone, 64 each for two or at D = 256), for any group
    size; e.g. G = 3 with two warpgroups needs 384."""
    assert prefill_mgpu.default_block_q(3, 128, compute_wgs=2) * 3 == 384
    assert [prefill_mgpu.default_compute_wgs(g, warp_specialized=True)
            for g in (1, 3, 8, 12, 256)] == [2, 1, 2, 1, 2]
    assert prefill_mgpu.default_compute_wgs(8) == 1
    for group in (1, 2, 3, 4, 6, 8, 16, 32, 64, 128):
        for head_dim in (64, 128, 256):
            for compute_wgs in (1, 2):
                per_wg = 64 if head_dim > 128 or compute_wgs > 1 else 128
                target = per_wg * compute_wgs
                rows = prefill_mgpu.default_block_q(group, head_dim, compute_wgs) * group
                step = math.lcm(group, 64 * compute_wgs)  # rows one more token per tile may add
                assert rows % step == 0 and rows >= target and rows - step < target


# --- lowering for CUDA on any machine ------------------------------------------------------

@pytest.mark.skipif(ON_GPU, reason="the grid above runs compiled on a GPU")
@pytest.mark.parametrize("heads,head_dim,block_size,options", [
    ("gqa", 128, 16, {}), ("mha", 64, 64, dict(block_kv=64, num_stages=3)),
    ("gqa", 256, 16, dict(sliding_window=700, logits_soft_cap=50.0)),
    ("g3", 128, 128, dict(block_kv=128, num_stages=1)),
    ("gqa", 128, 32, SPECIALIZED["producer-two-wgs"]),
    ("mha", 256, 16, SPECIALIZED["producer-one-wg"]),
    ("gqa", 192, 16, dict(logits_soft_cap=30.0, num_stages=3))])
def test_lowers_for_cuda(heads, head_dim, block_size, options):
    """Lowering runs Mosaic GPU's layout inference and emits the wgmma/TMA module without a GPU:
    one Mosaic GPU call per prefill, holding wgmma and TMA instructions (and register
    reallocation between the warpgroups when warp-specialized)."""
    problem = prefill(heads, head_dim, block_size)
    lowered = jax.jit(functools.partial(kernel, **options)).trace(*problem.prefill_args)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "wgmma.mma_async" in text and "cp.async.bulk.tensor" in text
    assert ("setmaxnreg" in text) == options.get("warp_specialized", False)


# --- compiled on a Hopper GPU only: realistic shapes ---------------------------------------
# Their jnp reference materializes every query's whole context (10 GiB and more): one worker
# runs them all (`make test-gpu` distributes by group), so no two of them share the card at
# once; an 80 GB card ran out of memory with them spread over the workers.
one_worker = pytest.mark.xdist_group("large_reference")


@pytest.mark.gpu
@needs_gpu
@one_worker
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("block_kv,num_stages", [(64, 2), (128, 2), (128, 3), (64, 4)])
def test_llama_chunks_with_prefix_and_decodes(block_size, block_kv, num_stages):
    """Llama-3-8B heads (32 query, 8 kv, D=128), bf16: two 512-token chunks after 600- and
    0-token prefixes, a 77-token prompt and 30 decode rows, then padding rows."""
    if block_kv % block_size:
        pytest.skip("a step holds whole pages")
    rng = np.random.default_rng(block_size)
    query_lens = [512, 512, 77] + [1] * 30
    context_lens = [1112, 512, 77] + [int(n) for n in rng.integers(1, 1000, 30)]
    problem = make_problem(6, num_heads=32, num_kv_heads=8, head_dim=128, block_size=block_size,
                           dtype=jnp.bfloat16, context_lens=context_lens, query_lens=query_lens,
                           padding_rows=10)
    check(problem, block_kv=block_kv, num_stages=num_stages)


@pytest.mark.gpu
@needs_gpu
@one_worker
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype,sliding_window,cap", [
    (16, 8, 256, BF16, 700, 50.0), (32, 32, 64, F16, None, None), (32, 4, 128, BF16, 333, None),
    (12, 4, 64, BF16, None, 30.0), (64, 1, 128, F16, None, None), (16, 16, 256, BF16, None, None),
    (8, 2, 192, BF16, 1000, None)])
def test_heads_windows_and_caps(num_heads, num_kv_heads, head_dim, dtype, sliding_window, cap):
    """Gemma-2-like (D=256, window 700, soft cap 50), MHA, GQA 8 and 3, MQA of 64 heads, fp16,
    D=192:
    a 512-token chunk after a 1000-token prefix, a 300-token prompt, 30 decode rows."""
    rng = np.random.default_rng(head_dim + num_heads)
    query_lens = [512, 300] + [1] * 30
    context_lens = [1512, 300] + [int(n) for n in rng.integers(1, 1500, 30)]
    problem = make_problem(10, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           head_dim=head_dim, block_size=16, dtype=dtype,
                           context_lens=context_lens, query_lens=query_lens, padding_rows=10)
    check(problem, sliding_window=sliding_window, logits_soft_cap=cap,
          hide_old_blocks=sliding_window is not None)


@pytest.mark.gpu
@needs_gpu
@one_worker
@pytest.mark.parametrize("block_q", [None, 16, 32])
def test_long_prompt_equals_triton_kernel(block_q):
    """One 4096-token prompt (Llama heads, bf16): the Mosaic GPU kernel agrees with the dense
    oracle on the gathered sequence and with the Triton kernel. (The paged reference gathers
    every token's keys, [T, C, K, D] in float32: 130 GiB here, more than the GPU holds.)"""
    length = 4096
    problem = make_problem(11, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                           dtype=jnp.bfloat16, context_lens=[length], query_lens=[length])
    out = kernel(*problem.prefill_args, interpret=INTERPRET, block_q=block_q)
    num_kv_heads, _, block_size, head_dim = problem.k_pages.shape

    def contiguous(pages):   # [K, N, S, D] -> the sequence's [C, K, D]
        rows = pages[:, problem.block_tables[0]].reshape(num_kv_heads, -1, head_dim)
        return rows[:, :length].transpose(1, 0, 2)

    dense = pk.dense_causal_attention(problem.q[:length], contiguous(problem.k_pages),
                                      contiguous(problem.v_pages))
    assert_matches(out[:length], dense)
    assert_matches(out, pk.paged_attention_prefill_gpu(*problem.prefill_args))
