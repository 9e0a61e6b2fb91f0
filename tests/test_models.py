"""jpaged's Llama-family models equal transformers' (torch CPU) through the paged KV cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jpaged.config import ModelConfig
from jpaged.kv_cache import KVCache, init_cache
from jpaged.models import AttentionMetadata, LlamaForCausalLM, load_model
from jpaged.models.layers import RMSNorm, rotary_cos_sin
from pallas_kernels.reference import apply_rotary
from tests.hf_fixtures import FLOAT32_CHECKPOINTS, MOE_CHECKPOINTS, VOCAB_SIZE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4          # S: small, so every prompt spans several (shuffled) blocks
NUM_BLOCKS = 48         # N, block 0 is the sink
MAX_BLOCKS = 10         # M: 40 tokens per sequence at most
PROMPT_LENS = (5, 11, 18)
FIRST_CHUNK_LENS = (3, 6, 13)
PREFILL_TOKENS = 40     # T of every prefill step (34 real tokens + padding)
DECODE_ROWS = 4         # B of every decode step: 3 sequences + 1 padding row
NEW_TOKENS = 6
# Decoding is checked on every architecture variant; the sharded one differs only in loading.
GREEDY_CHECKPOINTS = tuple(n for n in FLOAT32_CHECKPOINTS if n != "llama_sharded")


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, token_ids, positions, cache, metadata):
    model = nnx.merge(graphdef, state)
    hidden, cache = model(token_ids, positions, cache, metadata)
    return model.compute_logits(hidden), cache


class PagedRun:
    """Drives a model over a few sequences with a randomly permuted block table."""

    def __init__(self, model, config: ModelConfig, num_seqs: int, seed: int,
                 backend: str = "reference"):
        self.backend = backend
        self.interpret = backend != "reference" and jax.default_backend() == "cpu"
        self.graphdef, self.state = nnx.split(model)
        cache = init_cache(config.num_hidden_layers, config.num_key_value_heads, NUM_BLOCKS,
                           BLOCK_SIZE, config.head_dim, model.dtype)
        # NaN everywhere not written this run: reading an unwritten slot would poison logits.
        nan = lambda pages: jnp.full_like(pages, jnp.nan)
        self.cache = KVCache(tuple(map(nan, cache.k_pages)), tuple(map(nan, cache.v_pages)))
        blocks = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))
        self.block_tables = blocks[:num_seqs * MAX_BLOCKS].reshape(num_seqs, MAX_BLOCKS)
        self.block_tables = self.block_tables.astype(np.int32)

    def prefill(self, chunks):
        """chunks: per sequence (token ids, position of the first) -> logits per sequence."""
        token_ids, positions, bounds = [], [], [0]
        for tokens, start in chunks:
            token_ids += list(tokens)
            positions += range(start, start + len(tokens))
            bounds.append(len(token_ids))
        seq_of_token = np.searchsorted(bounds[1:], np.arange(len(token_ids)), side="right")
        context_lens = [start + len(tokens) for tokens, start in chunks]
        logits = self._step(token_ids, positions, seq_of_token, self.block_tables, context_lens,
                            bounds, PREFILL_TOKENS, is_decode=False)
        return [logits[bounds[b]:bounds[b + 1]] for b in range(len(chunks))]

    def decode(self, tokens, positions):
        """One token per sequence at the given positions, plus one padding row -> [B, V]."""
        num_seqs = len(tokens)
        tables = np.zeros((DECODE_ROWS, MAX_BLOCKS), np.int32)
        tables[:num_seqs] = self.block_tables
        context_lens = list(np.asarray(positions) + 1) + [0] * (DECODE_ROWS - num_seqs)
        logits = self._step(list(tokens), list(positions), np.arange(num_seqs), tables,
                            context_lens, list(range(DECODE_ROWS + 1)), DECODE_ROWS,
                            is_decode=True)
        return logits[:num_seqs]

    def _step(self, token_ids, positions, seq_of_token, tables, context_lens, query_start_loc,
              num_rows, is_decode):
        positions = np.asarray(positions, np.int32)
        blocks = self.block_tables[seq_of_token, positions // BLOCK_SIZE]
        pad = num_rows - len(token_ids)
        slot_mapping = np.concatenate([blocks * BLOCK_SIZE + positions % BLOCK_SIZE, [-1] * pad])
        metadata = AttentionMetadata(
            slot_mapping=jnp.asarray(slot_mapping, jnp.int32),
            block_tables=jnp.asarray(tables, jnp.int32),
            context_lens=jnp.asarray(context_lens, jnp.int32),
            query_start_loc=jnp.asarray(query_start_loc, jnp.int32),
            is_decode=is_decode, backend=self.backend, interpret=self.interpret)
        ids = jnp.asarray(list(token_ids) + [0] * pad, jnp.int32)
        pos = jnp.asarray(np.concatenate([positions, np.zeros(pad, np.int32)]), jnp.int32)
        logits, self.cache = _forward(self.graphdef, self.state, ids, pos, self.cache, metadata)
        return np.asarray(logits)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]


def _rel_err(actual, expected) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@functools.cache
def _jpaged(path: str, dtype: str = "auto"):
    return load_model(path, dtype=dtype)


@functools.cache
def _transformers(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_logits(path: str, prompt) -> np.ndarray:
    with torch.no_grad():
        return _transformers(path)(torch.tensor([prompt])).logits[0].numpy()


@pytest.mark.parametrize("name", FLOAT32_CHECKPOINTS)
def test_prompt_logits_match_transformers(hf_checkpoints, name):
    path = hf_checkpoints[name]
    model, config = _jpaged(path)
    prompts = _prompts(seed=0)
    run = PagedRun(model, config, len(prompts), seed=1)
    logits = run.prefill([(prompt, 0) for prompt in prompts])
    for prompt, got in zip(prompts, logits):
        assert _rel_err(got, _hf_logits(path, prompt)) < 1e-4


@pytest.mark.parametrize("name", FLOAT32_CHECKPOINTS)
def test_chunked_prefill_attends_to_cached_chunk(hf_checkpoints, name):
    path = hf_checkpoints[name]
    model, config = _jpaged(path)
    prompts = _prompts(seed=2)
    run = PagedRun(model, config, len(prompts), seed=3)
    first = run.prefill([(p[:n], 0) for p, n in zip(prompts, FIRST_CHUNK_LENS)])
    second = run.prefill([(p[n:], n) for p, n in zip(prompts, FIRST_CHUNK_LENS)])
    for prompt, head, tail in zip(prompts, first, second):
        assert _rel_err(np.concatenate([head, tail]), _hf_logits(path, prompt)) < 1e-4


def _pallas_cases():
    """(backend, checkpoint) for the Pallas kernels on models that slide a window (and soft-cap
    scores: Gemma 2), have a head size that is not a power of two (Phi-3) or route tokens to
    experts (their GPU backends' grouped matmul is a Pallas kernel)."""
    return [(name, backend) for backend in ("pallas_gpu", "pallas_tpu")
            for name in ("mistral_window", "gemma2", "phi3")] + [
        (name, "pallas_gpu") for name in MOE_CHECKPOINTS]   # the Pallas grouped matmul too


@pytest.mark.parametrize("name", GREEDY_CHECKPOINTS)
def test_greedy_decode_matches_generate(hf_checkpoints, name):
    _check_greedy_decode(hf_checkpoints[name], "reference")


@pytest.mark.parametrize("name, backend", list(_pallas_cases()))
def test_greedy_decode_with_windows_on_pallas_kernels(hf_checkpoints, name, backend):
    _check_greedy_decode(hf_checkpoints[name], backend)


ON_GPU = jax.default_backend() == "gpu"
# The head sizes the GPU kernels take (multiples of 8 up to 256), padded inside the kernels
GPU_HEAD_DIMS = (48, 64, 80, 96, 112, 128, 192, 256)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas GPU kernels need a CUDA GPU")
@pytest.mark.parametrize("name", GREEDY_CHECKPOINTS)
def test_greedy_decode_compiled_on_gpu(hf_checkpoints, name):
    """Every family on the compiled GPU kernels (Triton lowering), token-exact against
    transformers."""
    _check_greedy_decode(hf_checkpoints[name], "pallas_gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas GPU kernels need a CUDA GPU")
@pytest.mark.parametrize("head_dim", GPU_HEAD_DIMS)
def test_greedy_decode_compiled_on_gpu_at_every_head_size(tmp_path, head_dim):
    pytest.importorskip("transformers")
    from tests.hf_fixtures import build_llama_with_head_dim

    build_llama_with_head_dim(tmp_path, head_dim)
    _check_greedy_decode(str(tmp_path), "pallas_gpu")


def _check_greedy_decode(path: str, backend: str):
    model, config = _jpaged(path)
    prompts = _prompts(seed=4)
    run = PagedRun(model, config, len(prompts), seed=5, backend=backend)
    last = [logits[-1] for logits in run.prefill([(prompt, 0) for prompt in prompts])]
    generated = [[int(np.argmax(row))] for row in last]
    for step in range(NEW_TOKENS - 1):
        positions = [len(prompt) + step for prompt in prompts]
        logits = run.decode([tokens[-1] for tokens in generated], positions)
        for tokens, row in zip(generated, logits):
            tokens.append(int(np.argmax(row)))
    for tokens, expected in zip(generated, _hf_generate(path, prompts)):
        assert len(expected) > 0
        assert tokens[:len(expected)] == expected, backend


def _hf_generate(path: str, prompts) -> list[list[int]]:
    """transformers' greedy tokens for all prompts in one left-padded batch, cut at eos."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = _transformers(path).generate(input_ids, attention_mask=attention_mask,
                                           max_new_tokens=NEW_TOKENS, do_sample=False,
                                           pad_token_id=0)
    eos_ids = set(_jpaged(path)[1].eos_token_ids)
    results = []
    for row in out[:, width:].tolist():
        stop = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        results.append(row[:stop])
    return results


def test_bfloat16_roughly_agrees(hf_checkpoints):
    path = hf_checkpoints["llama_gqa"]
    model, config = load_model(path, dtype="bfloat16")
    assert model.model.layers[0].self_attn.qkv_proj.weight[...].dtype == jnp.bfloat16
    prompts = _prompts(seed=6)
    logits = PagedRun(model, config, len(prompts), seed=7).prefill([(p, 0) for p in prompts])
    for prompt, got in zip(prompts, logits):
        assert got.dtype == np.float32
        expected = _hf_logits(path, prompt)
        assert _rel_err(got, expected) < 5e-2
        assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.8


def test_bfloat16_checkpoint_loads_as_bfloat16(hf_checkpoints):
    path = hf_checkpoints["llama_bf16"]
    model, config = load_model(path)
    assert config.torch_dtype == "bfloat16" and model.dtype == jnp.bfloat16
    prompt = _prompts(seed=8)[2]
    got = PagedRun(model, config, 1, seed=9).prefill([(prompt, 0)])[0]
    assert np.isfinite(got).all()
    assert _rel_err(got, _hf_logits(path, prompt)) < 5e-2  # transformers upcasts the bf16 weights


@pytest.mark.parametrize("arch, biases", [("Qwen2ForCausalLM", (True, False, False)),
                                            ("LlamaForCausalLM", (True, True, True)),
                                            ("MistralForCausalLM", (False, False, False))])
def test_parameter_shapes_follow_config(arch, biases):
    qkv_bias, o_proj_bias, mlp_bias = biases
    config = ModelConfig(architecture=arch, vocab_size=50, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=64, qkv_bias=qkv_bias,
                         o_proj_bias=o_proj_bias, mlp_bias=mlp_bias,
                         tie_word_embeddings=arch == "Qwen2ForCausalLM")
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=jnp.bfloat16,
                                                    rngs=nnx.Rngs(0)))
    assert (model.lm_head is None) == config.tie_word_embeddings
    attn = model.model.layers[1].self_attn
    assert attn.qkv_proj.weight.shape == (32, 64 + 2 * 32)   # [in, out]: q, k, v packed
    assert model.model.layers[1].mlp.gate_up_proj.weight.shape == (32, 2 * 48)
    assert model.model.layers[1].mlp.down_proj.weight.shape == (48, 32)
    assert (model.lm_head or model.model.embed_tokens).weight.shape == (50, 32)
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None,
            model.model.layers[1].mlp.gate_up_proj.bias is not None) == biases
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert sum(leaf.size for leaf in leaves) == config.num_parameters()


def test_attention_metadata_static_fields_and_backend_check():
    arrays = [jnp.zeros(2, jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.ones(2, jnp.int32),
              jnp.arange(3, dtype=jnp.int32)]
    metadata = AttentionMetadata(*arrays, is_decode=True)
    leaves, treedef = jax.tree.flatten(metadata)
    assert len(leaves) == 4
    assert jax.tree.unflatten(treedef, leaves).is_decode
    with pytest.raises(ValueError, match="backend"):
        AttentionMetadata(*arrays, backend="cuda")


def test_rotary_hand_worked():
    # One pair (D=2), inv_freq 1: position p rotates (x0, x1) by p radians.
    cos, sin = rotary_cos_sin(jnp.array([0, 1], jnp.int32), np.array([1.0]))
    x = jnp.array([[[1.0, 0.0]], [[1.0, 0.0]]])
    out = np.asarray(apply_rotary(x, cos, sin))
    np.testing.assert_allclose(out[0, 0], [1.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(out[1, 0], [np.cos(1.0), np.sin(1.0)], atol=1e-6)


def test_rms_norm_hand_worked():
    norm = RMSNorm(2, eps=0.0, dtype=jnp.float32)
    out = np.asarray(norm(jnp.array([[3.0, 4.0]])))
    np.testing.assert_allclose(out, [[3.0, 4.0]] / np.sqrt(12.5), rtol=1e-6)


def test_phi3_longrope_tables_match_transformers_on_both_sides_of_the_switch(hf_checkpoints):
    """Rotations by position: short factors below original_max_position_embeddings, long from
    there, each scaled by the attention factor, partial rotation spread over the packed dims.

    (Greedy parity holds while a sequence fits below that length, the parametrized tests above.
    Past it, transformers re-encodes the whole sequence with the long factors: Phi-3's generate
    drops its cache at the crossing. A paged cache whose blocks sequences share cannot re-rotate
    one sequence's prefix, so here a token's rotation depends on its position only.)"""
    from tests.hf_fixtures import PHI3_ORIGINAL_MAX

    path = hf_checkpoints["phi3"]
    model, config = _jpaged(path)
    (rotary,) = model.model.rotaries
    half, pad = len(rotary.inv_frequencies), config.head_dim // 2 - len(rotary.inv_frequencies)
    rotated = np.r_[0:half, half + pad:2 * half + pad]   # where the 18 rotated dims are packed
    for position in (0, 5, PHI3_ORIGINAL_MAX - 1, PHI3_ORIGINAL_MAX, 3 * PHI3_ORIGINAL_MAX):
        with torch.no_grad():   # one position per call: transformers picks the set by it
            hf_cos, hf_sin = _transformers(path).model.rotary_emb(
                torch.zeros(1, 1, config.hidden_size), torch.tensor([[position]]))
        cos, sin = map(np.asarray, rotary.cos_sin(jnp.array([position], jnp.int32)))
        np.testing.assert_allclose(cos[0, rotated], hf_cos[0, 0].numpy(), atol=1e-5)
        np.testing.assert_allclose(sin[0, rotated], hf_sin[0, 0].numpy(), atol=1e-5)
        passed = np.setdiff1d(np.arange(config.head_dim), rotated)
        assert (cos[0, passed] == 1).all() and (sin[0, passed] == 0).all()
