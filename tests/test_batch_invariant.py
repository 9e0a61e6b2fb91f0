"""The batch-invariant mode: a seeded request's tokens and logprobs are bitwise the same alone,
batched, chunked, with a cached prefix, preempted by swap or recompute, at K = 1 and 8 and with
asynchronous scheduling, and equal the training forward's (`jpaged.models.sequence_logprobs`);
its attention kernel and row tiles hold the property on their own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jpaged import LLM, SamplingParams
from jpaged.config import ModelConfig
from jpaged.engine.builder import decide_engine_config
from jpaged.models import random_model, row_tiles, sequence_logits, sequence_logprobs
from jpaged.models.forward import COMPILER_OPTIONS
from jpaged.options import OptionError, check_options
from pallas_kernels import batch_invariant, reference, row_ops
from pallas_kernels.gpu import matmul as triton_matmul

# Compiled on the GPU by `make test-gpu` as well: the mode's claim is made there too.
pytestmark = pytest.mark.gpu_suite

PARAMS = SamplingParams(temperature=1.0, seed=7, max_tokens=24, logprobs=0, ignore_eos=True)
BASE = dict(enable_prefix_caching=False, max_model_len=256, num_kv_blocks=128, warmup=False,
            batch_invariant=True)


def workload():
    """The target request (100 prompt tokens) and seven others of 20 to 90."""
    rng = np.random.default_rng(0)
    target = rng.integers(3, 250, size=100).tolist()
    others = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(20, 90, size=7)]
    return target, others


def run(dtype, *, batched=False, cached_prefix=0, **options):
    """([(token ids, logprobs)] per request, the RequestOutputs, the engine's model) of the
    target request alone, or (batched) of all eight at once. cached_prefix: a request sharing
    that many of the target's prompt tokens runs first, with prefix caching on."""
    target, others = workload()
    llm = LLM(dtype=dtype, **{**BASE, **options})
    if cached_prefix:
        llm.generate(prompt_token_ids=[target[:cached_prefix] + [5, 6, 7]],
                     sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
    prompts = [target] + others if batched else [target]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        results.append((completion.token_ids, np.array(
            [step[token] for step, token in zip(completion.logprobs, completion.token_ids)])))
    executor = llm.engine.executor
    return results, outputs, executor.model_def.merge(executor.param_leaves)


@functools.cache
def served(dtype, case):
    """`run` of one of CASES (kept: several tests read the same run)."""
    return run(dtype, **CASES[case])


@functools.cache
def alone(dtype):
    """Each of the eight requests served alone (one sequence per batch), in order."""
    results, outputs, _ = run(dtype, batched=True, max_num_seqs=1)
    assert all(output.num_preemptions == 0 for output in outputs)
    return results


def assert_bitwise_equal(results, expected):
    for (tokens, logprobs), (expected_tokens, expected_logprobs) in zip(results, expected,
                                                                        strict=False):
        assert tokens == expected_tokens
        assert np.array_equal(logprobs, expected_logprobs)


CASES = {
    "batched, K=8, async": dict(batched=True, num_scheduler_steps=8, async_scheduling=True),
    "chunks of 32": dict(max_num_batched_tokens=32),
    "batched, chunks of 64, K=8": dict(batched=True, max_num_batched_tokens=64,
                                       num_scheduler_steps=8),
    "48 prompt tokens cached, K=8": dict(cached_prefix=48, enable_prefix_caching=True,
                                         num_scheduler_steps=8),
    "preempted by swap, K=8": dict(batched=True, num_kv_blocks=14, preemption_mode="swap",
                                   swap_space=0.01, num_scheduler_steps=8),
    "preempted by recompute": dict(batched=True, num_kv_blocks=14,
                                   preemption_mode="recompute"),
}


def assert_served_as_alone(dtype, case):
    """The target served as CASES[case] says: tokens and logprobs bitwise those of it alone,
    its cached prefix or its preemption having happened."""
    results, outputs, _ = served(dtype, case)
    assert_bitwise_equal(results, alone(dtype))
    if "cached" in case:
        assert outputs[0].num_cached_tokens == 48
    if "preempted" in case:
        assert sum(output.num_preemptions for output in outputs) > 0


@pytest.mark.parametrize("case", CASES)
def test_float32_requests_are_bitwise_the_same_however_they_are_served(case):
    assert_served_as_alone("float32", case)


# bfloat16: the whole matrix compiled on the GPU; two of its cases on a CPU (CI's time).
CPU_BFLOAT16_CASES = ("batched, chunks of 64, K=8", "preempted by recompute")


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_requests_are_bitwise_the_same_however_they_are_served(case):
    if jax.default_backend() != "gpu" and case not in CPU_BFLOAT16_CASES:
        pytest.skip("the whole bfloat16 matrix runs compiled on a GPU (make test-gpu)")
    assert_served_as_alone("bfloat16", case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_forward_gives_the_engines_logprobs(dtype):
    """sequence_logprobs over prompt + output, in a right-padded batch of three, equals what the
    engine reported (chunked and batched)."""
    results, _, model = served(dtype, "batched, chunks of 64, K=8")
    (tokens, logprobs), target = results[0], workload()[0]
    sequence = np.asarray(target + list(tokens), np.int32)
    batch = np.full((3, len(sequence) + 5), 9, np.int32)
    batch[1, :len(sequence)] = sequence
    forward = jax.jit(sequence_logprobs, compiler_options=COMPILER_OPTIONS)(model,
                                                                           jnp.asarray(batch))
    assert forward.shape == (3, len(sequence) + 4)
    assert np.array_equal(np.asarray(forward)[1, len(target) - 1:len(sequence) - 1], logprobs)


def test_training_forward_is_differentiable():
    *_, model = served("float32", "batched, chunks of 64, K=8")
    sequence = jnp.asarray([workload()[0][:40]], jnp.int32)
    grads = nnx.jit(nnx.grad(lambda m: -sequence_logprobs(m, sequence).mean()))(model)
    leaves = jax.tree.leaves(nnx.state(grads))
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in leaves)
    assert any(bool(jnp.any(leaf != 0)) for leaf in leaves)


def test_training_forward_of_the_default_mode_matches_the_invariant_one_closely():
    """The same forward in the default mode (plain matmuls, the reference attention) agrees to
    float32 rounding: the mode changes the order of sums, not the model."""
    *_, model = served("float32", "batched, chunks of 64, K=8")
    plain = nnx.merge(*nnx.split(model))
    plain.batch_invariant = False
    sequence = jnp.asarray([workload()[0]], jnp.int32)
    np.testing.assert_allclose(sequence_logits(plain, sequence), sequence_logits(model, sequence),
                               rtol=1e-5, atol=1e-5)


def test_option_is_validated():
    with pytest.raises(OptionError, match="^batch_invariant must be True or False"):
        LLM(batch_invariant="yes")
    with pytest.raises(OptionError, match="attention_backend must be 'auto'"):
        LLM(batch_invariant=True, attention_backend="reference")
    with pytest.raises(OptionError, match="set batch_invariant=True"):
        LLM(attention_backend="batch_invariant")


def test_mixture_of_experts_model_is_refused_by_name():
    config = ModelConfig.from_dict(dict(
        architectures=["MixtralForCausalLM"], vocab_size=32, hidden_size=16,
        intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, num_local_experts=4, num_experts_per_tok=2))
    model = random_model(config, dtype="float32")
    with pytest.raises(OptionError, match="^batch_invariant does not cover mixture-of-experts"):
        decide_engine_config(model, check_options({"batch_invariant": True,
                                                   "num_kv_blocks": 16}))


# ---- the pieces on their own ---------------------------------------------------------------------
def _pages(seed=0, *, kv_heads=2, blocks=40, block_size=16, head_dim=32, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    shape = (kv_heads, blocks, block_size, head_dim)
    k_pages = rng.standard_normal(shape).astype(np.float32)
    v_pages = rng.standard_normal(shape).astype(np.float32)
    k_pages[:, 0] = v_pages[:, 0] = np.nan          # the sink, never read
    return jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype)


# The two paths of the kernel: the jnp walk, and the Triton decode kernel over every token
# (compiled on a GPU, in the Pallas interpreter elsewhere).
PATHS = {"walk": dict(kernel=False),
         "triton": dict(kernel=True, interpret=jax.default_backend() != "gpu")}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window, cap", [(None, None), (24, None), (None, 20.0)])
def test_attention_matches_the_reference_and_ignores_the_batch(window, cap, path):
    """Close to the reference (NaN sink, shuffled blocks, GQA); bitwise the same for a token alone
    or batched, prefilled whole, chunked or decoded, whatever the block-table width."""
    k_pages, v_pages = _pages()
    rng = np.random.default_rng(1)
    length, heads = 70, 6
    q = jnp.asarray(rng.standard_normal((length, heads, 32)), jnp.float32)
    blocks = rng.permutation(np.arange(1, 40))[:5].astype(np.int32)
    options = dict(sliding_window=window, logits_soft_cap=cap, **PATHS[path])

    def prefill(queries, table_width, start=0):
        table = np.zeros((1, table_width), np.int32)
        table[0, :5] = blocks
        return np.asarray(batch_invariant.paged_attention_prefill(
            queries, k_pages, v_pages, jnp.asarray(table), jnp.asarray([length], jnp.int32),
            jnp.asarray([0, length - start], jnp.int32), **options))

    whole = prefill(q, 5)
    table = jnp.asarray(blocks[None])
    expected = reference.paged_attention_prefill(
        q, k_pages, v_pages, table, jnp.asarray([length], jnp.int32),
        jnp.asarray([0, length], jnp.int32), sliding_window=window, logits_soft_cap=cap)
    np.testing.assert_allclose(whole, expected, rtol=1e-5, atol=1e-5)
    assert np.array_equal(prefill(q, 12), whole)
    assert np.array_equal(prefill(q[32:], 5, start=32), whole[32:])
    for batch in (1, 3, 17):                     # the last token decoded beside others
        others = jnp.asarray(rng.standard_normal((batch - 1, heads, 32)), jnp.float32)
        tables = np.zeros((batch, 7), np.int32)
        tables[:, :5] = blocks
        lens = np.full(batch, length, np.int32)
        lens[0] = length if batch == 1 else 0                    # a padding row too
        decoded = batch_invariant.paged_attention_decode(
            jnp.concatenate([others, q[-1:]]), k_pages, v_pages, jnp.asarray(tables),
            jnp.asarray(lens), **options)
        assert np.array_equal(np.asarray(decoded)[-1], whole[-1])
        if batch > 1:
            assert not np.asarray(decoded)[0].any()


def test_map_rows_is_the_function_and_independent_of_the_row_count():
    rng = np.random.default_rng(0)
    weight = jnp.asarray(rng.standard_normal((192, 257)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((37, 192)), jnp.float32)
    project = jax.jit(lambda x: row_tiles.map_rows(
        lambda tile: jax.nn.log_softmax(jnp.dot(tile, weight, precision="highest")), x))
    np.testing.assert_allclose(project(rows), jax.nn.log_softmax(
        jnp.dot(rows, weight, precision="highest")), rtol=1e-5, atol=1e-5)
    alone_row = np.asarray(project(rows[:1]))
    for count in (2, 8, 9, 37):
        assert np.array_equal(np.asarray(project(rows[:count]))[:1], alone_row)
        assert np.array_equal(np.asarray(project(jnp.roll(rows[:count], -1, axis=0)))[-1:],
                              alone_row)
    empty = row_tiles.map_rows(lambda a, b: (a, b[:, :0]), rows[:3], rows[:3, :0])
    assert [leaf.shape for leaf in empty] == [(3, 192), (3, 0)]


# The two paths of the mode's matmul: XLA's dot in row tiles, and the Triton GEMM of one fixed
# tiling over every row (compiled on a GPU, in the Pallas interpreter elsewhere).
MATMUL_PATHS = {"tiles": dict(kernel=False),
                "triton": dict(kernel=True, interpret=jax.default_backend() != "gpu")}


@pytest.mark.parametrize("path", MATMUL_PATHS)
@pytest.mark.parametrize("dtype, transposed", [(jnp.float32, False), (jnp.float32, True),
                                               (jnp.bfloat16, False)])
def test_matmul_is_the_product_and_independent_of_the_row_count(path, dtype, transposed):
    """x @ w within float32 rounding of the exact product (an I axis of 100: one full step of
    64 and a masked one; 72 output columns: a masked column block); a row's result bitwise the
    same alone, among 5, 64 (one row block), 65 and 130 rows, wherever it sits."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((130, 100)), dtype)
    w = jnp.asarray(rng.standard_normal((72, 100) if transposed else (100, 72)), dtype)
    matmul = functools.partial(batch_invariant.matmul, transposed=transposed,
                               precision=jax.lax.Precision.HIGHEST, out_dtype=jnp.float32,
                               **MATMUL_PATHS[path])
    whole = np.asarray(matmul(x, w))
    exact = np.asarray(x, np.float64) @ np.asarray(w.T if transposed else w, np.float64)
    np.testing.assert_allclose(whole, exact, rtol=1e-5, atol=1e-4)
    for count in (1, 5, 64, 65):
        assert np.array_equal(np.asarray(matmul(x[:count], w)), whole[:count])
        assert np.array_equal(np.asarray(matmul(jnp.roll(x[:count], -1, axis=0), w))[-1],
                              whole[0])
    in_model_dtype = np.asarray(batch_invariant.matmul(x, w, transposed=transposed,
                                                       **MATMUL_PATHS[path]))
    assert in_model_dtype.dtype == dtype
    rounded = np.asarray(jnp.asarray(whole).astype(dtype))
    if path == "triton":   # the GEMM rounds its float32 sums once, at the end
        assert np.array_equal(in_model_dtype, rounded)
    else:                  # XLA picks the dot's algorithm for its output type too
        np.testing.assert_allclose(in_model_dtype.astype(np.float32),
                                   rounded.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_gemm_split_along_i_is_the_product_and_independent_of_the_row_count():
    """The GEMM with its I axis in parts (300 = 5 steps of 64: parts of 2, 2 and 1 steps): the
    product to float32 rounding, a row's result bitwise the same among 1 to 130 rows; the
    number of parts is the weight's shape's alone (the 8B shape's o and down projections:
    4, with 32 column blocks each)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((130, 300)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((300, 200)), jnp.bfloat16)
    matmul = functools.partial(triton_matmul.matmul, out_dtype=jnp.float32, splits=3,
                               interpret=jax.default_backend() != "gpu")
    whole = np.asarray(matmul(x, w))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(whole, exact, rtol=1e-5, atol=1e-4)
    for count in (1, 5, 64, 65):
        assert np.array_equal(np.asarray(matmul(x[:count], w)), whole[:count])
        assert np.array_equal(np.asarray(matmul(jnp.roll(x[:count], -1, axis=0), w))[-1],
                              whole[0])
    assert [triton_matmul.num_splits(i, o) for i, o in (
        (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256), (100, 72))
    ] == [2, 4, 1, 4, 1, 1]
    with pytest.raises(ValueError, match="splits must be in"):
        matmul(x, w, splits=6)


def test_matmul_path_and_gradient():
    """The GEMM is taken on a GPU by default; its gradient is the dot's (a trainer
    differentiates the training forward through it)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((9, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((40, 48)), jnp.float32)
    if jax.default_backend() != "gpu":
        assert "pallas_call" not in str(jax.make_jaxpr(batch_invariant.matmul)(x, x.T))
    assert row_tiles.runner(False) is row_tiles.WHOLE
    assert row_tiles.runner(True) == row_tiles.Rows(is_tiled=True, kernel=None)
    assert row_tiles.runner(True, mesh=object()).kernel is False   # sharded weights: tiles
    weights = jnp.linspace(-1.0, 1.0, 9 * 40).reshape(9, 40)

    def loss(x, w, path):
        return jnp.sum(batch_invariant.matmul(x, w, transposed=True, precision="highest",
                                              **MATMUL_PATHS[path]) * weights)

    expected = jax.grad(lambda x, w: jnp.sum(jnp.dot(x, w.T, precision="highest") * weights),
                        argnums=(0, 1))(x, w)
    for path in MATMUL_PATHS:
        for grad, want in zip(jax.grad(loss, argnums=(0, 1))(x, w, path), expected,
                              strict=True):
            np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


# The two paths of the mode's norms and gating: the jnp ops in row tiles, and the GPU row
# kernels, one launch over every row (compiled on a GPU, in the Pallas interpreter elsewhere).
ROW_OPS = {
    "norm": lambda x, w, **path: batch_invariant.rms_norm(x, w, eps=1e-5, **path),
    "gemma norm": lambda x, w, **path: batch_invariant.rms_norm(x, w, eps=1e-6,
                                                                unit_offset=True, **path),
    "silu, 2 blocks": lambda x, w, **path: batch_invariant.gated(x, blocks=2, **path),
    "gelu": lambda x, w, **path: batch_invariant.gated(x, activation="gelu_pytorch_tanh",
                                                       **path),
}
ROW_OPS_REFERENCE = {
    "norm": lambda x, w: row_ops.rms_norm(x, w, eps=1e-5),
    "gemma norm": lambda x, w: row_ops.rms_norm(x, w, eps=1e-6, unit_offset=True),
    "silu, 2 blocks": lambda x, w: row_ops.gated(x, blocks=2),
    "gelu": lambda x, w: row_ops.gated(x, activation="gelu_pytorch_tanh"),
}


@pytest.mark.parametrize("path", MATMUL_PATHS)
@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_norms_and_gating_are_the_ops_and_independent_of_the_row_count(op, path, dtype):
    """The jnp op in float32 to the dtype's rounding (rows of 80 columns: a masked power-of-two block in the
    kernel; gating of 2 x 1,100: two output blocks, the second masked); a row's result bitwise
    the same alone, among 5, 64, 65 and 70 rows, wherever it sits; gradient the op's."""
    rng = np.random.default_rng(5)
    width = 80 if "norm" in op else 2200
    x = jnp.asarray(3 * rng.standard_normal((70, width)), dtype)
    w = jnp.asarray(rng.standard_normal(80), dtype)
    run = jax.jit(functools.partial(ROW_OPS[op], **MATMUL_PATHS[path]))
    whole = np.asarray(run(x, w))
    assert whole.dtype == dtype
    # bf16: the jnp ops round each step (a gelu of -3 is 0 there, -0.004 in float32)
    tolerance = 1e-5 if dtype == jnp.float32 else 4e-2
    exact = ROW_OPS_REFERENCE[op](x.astype(jnp.float32), w.astype(jnp.float32))
    np.testing.assert_allclose(whole.astype(np.float32), np.asarray(exact),
                               rtol=tolerance, atol=tolerance)
    for count in (1, 5, 64, 65):
        assert np.array_equal(np.asarray(run(x[:count], w)), whole[:count])
        assert np.array_equal(np.asarray(run(jnp.roll(x[:count], -1, axis=0), w))[-1],
                              whole[0])
    if dtype == jnp.float32:
        weights = jnp.linspace(-1.0, 1.0, whole.size).reshape(whole.shape)
        loss = lambda fn: lambda x, w: jnp.sum(fn(x, w) * weights)  # noqa: E731
        grads = jax.grad(loss(run), argnums=(0, 1))(x, w)
        expected = jax.grad(loss(ROW_OPS_REFERENCE[op]), argnums=(0, 1))(x, w)
        for grad, want in zip(grads, expected, strict=True):
            np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", MATMUL_PATHS)
def test_rotate_and_write_is_the_reference_and_independent_of_the_batch(path):
    """Rotated queries and written pages as the reference's; a token's rotated query and key
    bitwise the same alone and among 37 tokens; the kernel path's gradient the reference's."""
    rng = np.random.default_rng(6)
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 24, 37
    qkv = jnp.asarray(rng.standard_normal((num_tokens, num_heads + 2 * num_kv_heads, head_dim)),
                      jnp.float32)
    angles = jnp.asarray(rng.uniform(0, 6, (num_tokens, head_dim)), jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    k_pages, v_pages = (jnp.zeros((num_kv_heads, 8, 8, head_dim), jnp.float32),) * 2
    slots = jnp.asarray(rng.permutation(64)[:num_tokens], jnp.int32).at[3].set(-1)
    run = jax.jit(functools.partial(batch_invariant.rotate_and_write, num_heads=num_heads,
                                    **MATMUL_PATHS[path]))
    q, k_out, v_out = run(qkv, cos, sin, k_pages, v_pages, slots)
    want = reference.rotate_and_write(qkv, cos, sin, k_pages, v_pages, slots,
                                      num_heads=num_heads)
    for got, expected in zip((q, k_out, v_out), want, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    token = 5
    q_alone, k_alone, _ = run(qkv[token:token + 1], cos[token:token + 1], sin[token:token + 1],
                              k_pages, v_pages, slots[token:token + 1])
    assert np.array_equal(np.asarray(q_alone)[0], np.asarray(q)[token])
    slot = int(slots[token])
    assert np.array_equal(np.asarray(k_alone)[:, slot // 8, slot % 8],
                          np.asarray(k_out)[:, slot // 8, slot % 8])

    def loss(rotate, qkv, k_pages, v_pages):
        q, k_out, v_out = rotate(qkv, cos, sin, k_pages, v_pages, slots)
        return jnp.sum(q * q[::-1]) + jnp.sum(k_out * jnp.roll(v_out, 1, axis=1))

    reference_rotate = functools.partial(reference.rotate_and_write, num_heads=num_heads)
    grads = jax.grad(functools.partial(loss, run), argnums=(0, 1, 2))(qkv, k_pages + 1,
                                                                         v_pages - 1)
    expected = jax.grad(functools.partial(loss, reference_rotate), argnums=(0, 1, 2))(
        qkv, k_pages + 1, v_pages - 1)
    for grad, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


def test_the_triton_path_is_taken_on_a_gpu_where_it_can_run():
    k_pages, _ = _pages(dtype=jnp.bfloat16)
    q = jnp.zeros((3, 4, 32), jnp.bfloat16)
    assert batch_invariant.uses_kernel(q, k_pages) == (jax.default_backend() == "gpu")
    assert not batch_invariant.uses_kernel(q.astype(jnp.float32), k_pages)   # pages in bf16
    assert batch_invariant.kernel_problem(q.astype(jnp.float32), k_pages) == (
        "pages in bfloat16, queries in float32")
    odd_pages, _ = _pages(head_dim=12)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        batch_invariant.uses_kernel(jnp.zeros((3, 4, 12)), odd_pages, kernel=True)
    assert not batch_invariant.uses_kernel(jnp.zeros((3, 4, 12)), odd_pages)


def test_the_triton_path_differentiates_as_the_walk():
    """A trainer differentiates the training forward: the Triton path's gradient is the jnp
    walk's (the kernel itself has no derivative)."""
    k_pages, v_pages = _pages(blocks=6)
    k_pages, v_pages = (jnp.nan_to_num(pages) for pages in (k_pages, v_pages))
    q = jnp.asarray(np.random.default_rng(2).standard_normal((20, 4, 32)), jnp.float32)
    args = (jnp.asarray([[1, 2, 3, 0]], jnp.int32), jnp.asarray([40], jnp.int32),
            jnp.asarray([0, 20], jnp.int32))
    weights = jnp.linspace(-1.0, 1.0, q.size).reshape(q.shape)

    def loss(q, k_pages, v_pages, path):
        out = batch_invariant.paged_attention_prefill(q, k_pages, v_pages, *args, **PATHS[path])
        return jnp.sum(out * weights)

    grads = {path: jax.grad(loss, argnums=(0, 1, 2))(q, k_pages, v_pages, path) for path in PATHS}
    for triton, walk in zip(grads["triton"], grads["walk"], strict=True):
        np.testing.assert_allclose(triton, walk, rtol=1e-6, atol=1e-6)
        assert bool(jnp.any(triton != 0))


def repeated_runs(preset: str, dtype: str, *, trace: str, max_model_len: int, max_tokens: int):
    """benchmarks/batch_invariant.py's determinism rows: the trace's first 64 requests sampled
    (outputs capped at max_tokens) through five engines that batch differently."""
    import argparse

    from benchmarks import batch_invariant as bench
    from benchmarks import e2e
    from benchmarks.trace import ALPACA, SHAREGPT, make_trace
    from jpaged.models.llama import LlamaForCausalLM

    config = ModelConfig.preset(preset)
    model = LlamaForCausalLM(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    requests = make_trace(64, **(SHAREGPT if trace == "sharegpt" else ALPACA), seed=0)
    args = argparse.Namespace(budget_seqs=16, max_model_len=max_model_len, max_num_seqs=64,
                              max_num_batched_tokens=2048, det_requests=64,
                              det_runs=len(bench.DETERMINISM_RUNS), det_max_tokens=max_tokens)
    return bench.determinism(model, requests, e2e.trace_prompts(requests, config.vocab_size),
                             args, log=lambda *_, **__: None)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled on a CUDA GPU")
def test_the_traces_first_64_requests_repeat_bit_for_bit_on_the_gpu():
    """Five engines that batch differently (K = 8 twice, K = 1, asynchronous, chunks of 256)
    sample the e2e trace's first 64 requests: every token and logprob identical."""
    rows = repeated_runs("llama3.2-1b", "bfloat16", trace="sharegpt", max_model_len=2048,
                         max_tokens=32)
    assert len(rows) == 5 and rows[0]["tokens"] > 64
    assert [row["differs"] for row in rows] == [None] * 5
