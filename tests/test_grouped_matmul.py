"""The Pallas grouped matmul (pallas_kernels/gpu/grouped_matmul.py) against its oracle,
`jax.lax.ragged_dot`: in the Pallas interpreter on a CPU, compiled on a GPU (`make test-gpu`)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.gpu import grouped_matmul as gm

# Compiled on the GPU by `make test-gpu` as well: the whole grid, not only the marked case.
pytestmark = pytest.mark.gpu_suite

ON_GPU = jax.default_backend() == "gpu"

# (rows, I, O, group sizes): empty groups first, last and between; a group over several tiles;
# rows past the sizes' sum; one row per group over many groups; I and O off the blocks.
CASES = {
    "mixed": (50, 96, 200, [7, 0, 20, 3, 0, 15]),
    "one group": (37, 64, 128, [37]),
    "empty ends": (40, 80, 130, [0, 0, 33, 7, 0]),
    "a row each": (12, 72, 64, [1] * 12 + [0] * 4),
    "short of rows": (30, 64, 96, [5, 0, 9]),
}


def inputs(case, dtype, seed=0):
    num_rows, num_in, num_out, sizes = CASES[case]
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_rows, num_in)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), num_in, num_out)) / np.sqrt(num_in), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def reference(x, w, sizes):
    """ragged_dot in float32 of the same (rounded) inputs."""
    return np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes,
                                         precision=jax.lax.Precision.HIGHEST))


@pytest.mark.parametrize("block_rows", [16, gm.BLOCK_ROWS])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_grouped_matmul_is_ragged_dot(case, dtype, block_rows):
    x, w, sizes = inputs(case, dtype)
    got = gm.grouped_matmul(x, w, sizes, interpret=not ON_GPU, block_rows=block_rows)
    assert got.shape == (x.shape[0], w.shape[2]) and got.dtype == dtype
    defined = int(sizes.sum())
    expected = reference(x, w, sizes)[:defined]
    tolerance = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[:defined], np.float32), expected,
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", ["mixed", "a row each"])
def test_reduction_split_into_parts_is_ragged_dot(case, dtype, splits):
    """I of 96 / 72 is 2 steps of BLOCK_K: 3 and 7 parts leave parts without steps."""
    x, w, sizes = inputs(case, dtype)
    got = gm.grouped_matmul(x, w, sizes, interpret=not ON_GPU, splits=splits)
    assert got.shape == (x.shape[0], w.shape[2]) and got.dtype == dtype
    defined = int(sizes.sum())
    tolerance = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got[:defined], np.float32),
                               reference(x, w, sizes)[:defined], rtol=tolerance, atol=tolerance)


def test_parts_follow_the_shapes():
    """Qwen3-30B-A3B at one decode token (8 rows, 128 experts) splits both projections; from
    64 rows on the tiles alone fill the grid; Mixtral's long down projection splits at a token."""
    assert gm.num_splits(8, 128, 2048, 1536) == 8           # gate/up: 108 programs x 32 steps
    assert gm.num_splits(8, 128, 768, 2048) == 6            # down: 144 programs x 12 steps
    assert gm.num_splits(512, 128, 2048, 1536) == 1
    assert gm.num_splits(2, 8, 14336, 4096) > 1
    assert gm.num_splits(4, 2, 64, 64) == 1                 # one step of I: nothing to split
    for rows in (1, 8, 64, 512):
        parts = gm.num_splits(rows, 128, 2048, 1536)
        steps = -(-2048 // gm.BLOCK_K)
        assert steps // parts >= gm.MIN_SPLIT_STEPS or parts == 1


def test_float32_output_of_bfloat16_inputs():
    x, w, sizes = inputs("mixed", jnp.bfloat16)
    got = gm.grouped_matmul(x, w, sizes, out_dtype=jnp.float32, interpret=not ON_GPU)
    assert got.dtype == jnp.float32
    defined = int(sizes.sum())
    np.testing.assert_allclose(np.asarray(got[:defined]), reference(x, w, sizes)[:defined],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_rows", [16, 64])
def test_tiles_cover_each_row_once_within_its_group(block_rows):
    rng = np.random.default_rng(1)
    for _ in range(20):
        num_groups = int(rng.integers(1, 12))
        sizes = rng.integers(0, 3 * block_rows, size=num_groups)
        sizes[rng.random(num_groups) < 0.3] = 0
        num_rows = int(sizes.sum()) + int(rng.integers(0, 5))
        if num_rows == 0:
            continue
        group, start, end = np.asarray(gm.tile_list(jnp.asarray(sizes), num_rows, block_rows))
        assert len(group) == gm.max_tiles(num_rows, num_groups, block_rows)
        ends = np.cumsum(sizes)
        covered = np.zeros(num_rows, int)
        for g, s, e in zip(group, start, end):
            rows = np.arange(s, min(s + block_rows, e))
            if len(rows):
                assert ends[g] - sizes[g] <= s and e == ends[g], (sizes, g, s, e)
            covered[rows] += 1
        assert list(covered) == [1] * int(sizes.sum()) + [0] * (num_rows - int(sizes.sum()))
        assert (end > start).sum() == sum(-(-int(n) // block_rows) for n in sizes)


@pytest.mark.parametrize("splits", [1, 2])
def test_lowers_to_a_triton_kernel_for_the_gpu(splits):
    """The kernel lowers for CUDA here too (the Pallas-to-Triton step, without a GPU): a CPU
    machine catches an unsupported operation before a GPU run does."""
    lowered = export.export(
        jax.jit(functools.partial(gm.grouped_matmul, splits=splits)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((64, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((8, 256, 384), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    assert "jpaged_grouped_matmul" in lowered.mlir_module()


def _loops_outside_composites(module: str) -> list[str]:
    """Functions of an exported module that hold a while loop, leaving out the decompositions
    of composite ops: from jax 0.11 `jnp.cumsum` exports as a "chlo.scan" composite whose
    fallback body is a loop, while XLA's GPU compiler runs the composite itself."""
    decompositions = set(re.findall(r"decomposition = @([\w.$-]+)", module))
    functions = re.split(r"\n\s*func\.func ", module)
    return [name for name, body in (
        (re.search(r"@([\w.$-]+)\(", text).group(1), text) for text in functions[1:])
        if "stablehlo.while" in body and name not in decompositions]


def test_the_tile_list_is_one_pass_without_a_device_loop(monkeypatch):
    """The tile list (computed twice per MoE layer) compares tiles against groups in one pass:
    no while loop (jnp.searchsorted's default searches in a device loop; on an H100 that cost
    ~180 us per layer call at Qwen3-30B-A3B's shapes, against ~40 us)."""
    def loops_for_cuda():
        return _loops_outside_composites(export.export(
            jax.jit(lambda sizes: gm.tile_list(sizes, 64)), platforms=["cuda"])(
                jax.ShapeDtypeStruct((128,), jnp.int32)).mlir_module())

    assert loops_for_cuda() == []
    searchsorted = jnp.searchsorted   # the check sees the loop the default search brings
    monkeypatch.setattr(jnp, "searchsorted", lambda *args, **kwargs: searchsorted(
        *args, **{**kwargs, "method": "scan"}))
    assert loops_for_cuda()


def test_bad_shapes_are_named():
    x, w, sizes = inputs("mixed", jnp.float32)
    with pytest.raises(ValueError, match="columns"):
        gm.grouped_matmul(x[:, :10], w, sizes, interpret=True)
    with pytest.raises(ValueError, match="group sizes"):
        gm.grouped_matmul(x, w, sizes[:3], interpret=True)
    with pytest.raises(ValueError, match="one dtype"):
        gm.grouped_matmul(x, w.astype(jnp.bfloat16), sizes, interpret=True)
    with pytest.raises(ValueError, match="block_rows"):
        gm.grouped_matmul(x, w, sizes, interpret=True, block_rows=24)
    with pytest.raises(ValueError, match="splits"):
        gm.grouped_matmul(x, w, sizes, interpret=True, splits=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled on a GPU (make test-gpu)")
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_compiled_at_a_mixture_of_experts_decode_shape(num_tokens):
    """Qwen3-30B-A3B's gate/up at 1 and 8 decode tokens (8 / 64 rows over 128 experts; one
    token's reduction runs in parts), bf16."""
    rng = np.random.default_rng(2)
    ids = np.sort(rng.choice(128, size=(num_tokens, 8), replace=True).reshape(-1))
    sizes = jnp.asarray(np.bincount(ids, minlength=128), jnp.int32)
    x = jnp.asarray(rng.standard_normal((8 * num_tokens, 2048)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, 2048, 1536)) * 0.02, jnp.bfloat16)
    got = gm.grouped_matmul(x, w, sizes)
    np.testing.assert_allclose(np.asarray(got, np.float32), reference(x, w, sizes),
                               rtol=2e-2, atol=2e-2)


def test_moe_benchmark_tables_the_pallas_column():
    """benchmarks/moe.py's second table (filled on a GPU): a timed cell and a failed one."""
    from benchmarks import moe

    row = {"tokens": 8, "experts used": 40, "grouped s": 2e-4, "dense loop s": 4e-4,
           "grouped error": 1e-3, "dense loop error": 1e-3, "ragged s": 1e-4, "matmul s": 1e-5,
           "ragged flops": 4e9, "weight bytes": 3e8, "gate/up bytes": 2e8}
    text = moe.table([{**row, "pallas s": 5e-5, "pallas error": 2e-3},
                      {**row, "tokens": 64, "pallas s": "error: ValueError: no"}], 4e12, 8e14)
    lines = text.splitlines()
    assert "| 8 | 100.0 us | 50.0 us | 0.50x | 50.0 us | 1.00x | 80.0 | 2.0e-03 |" in lines
    assert "| 64 | 100.0 us | error: ValueError: no | - | 50.0 us | - | - | nan |" in lines


def test_moe_benchmark_tables_the_split_sweep():
    """benchmarks/moe.py's third table (filled on a GPU): per projection, the chosen number of
    parts and the time at each."""
    from benchmarks import moe

    sweep = {("gate/up", None): 1e-5, ("gate/up", 1): 4e-5, ("gate/up", 2): 2e-5,
             ("gate/up", "chosen"): 8, ("down", None): 3e-5, ("down", 1): 3e-5,
             ("down", 2): "error: ValueError: no", ("down", "chosen"): 1}
    lines = moe.split_table([{"tokens": 1, "splits": sweep}], [1, 2]).splitlines()
    assert "| 1 | gate/up | 8 | 10.0 us | 40.0 us | 20.0 us |" in lines
    assert "| 1 | down | 1 | 30.0 us | 30.0 us | error: ValueError: no |" in lines
