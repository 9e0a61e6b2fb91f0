"""A float32 model decodes greedily exactly as transformers does in float32, through the engine,
for every family (tests/hf_fixtures.py's PARITY_BUILDERS): MQA, head size 48, llama3 RoPE among
them.

On a GPU, XLA and Triton run float32 matmuls at TF32 unless asked for HIGHEST: such a model
once left transformers' greedy tokens at the 7th token of a 40-token prompt on the H200. So the
prompts here are ~40 tokens with NEW_TOKENS generated, and each token's logprob must agree to
LOGPROB_TOLERANCE: where TF32 leaves the tokens alone it still moves the logprobs by ~1e-3
(measured on the CPU with TF32 emulated, below). The engines start cheaply (warm-up off: only
the shapes used compile). The `gpu`-marked tests are the point (compiled kernels); on the CPU,
where float32 is always float32, two families check the same logic, and emulated TF32 shows the
check fails when it should.
"""

import functools

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged import LLM, SamplingParams
from tests.hf_fixtures import PARITY_BUILDERS, VOCAB_SIZE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ON_GPU = jax.default_backend() == "gpu"
PROMPT_LENS = (40, 37)          # spans 3 blocks of 16, neither a multiple of the block size
NEW_TOKENS = 24
# |jpaged's logprob - transformers'| per generated token. Measured on the CPU over every family:
# at most 6e-6 in full float32, 8e-4 to 9e-3 with TF32 emulated (`_tf32_dot`).
LOGPROB_TOLERANCE = 1e-4
ENGINE_OPTIONS = dict(block_size=16, num_kv_blocks=16, max_model_len=128, max_num_seqs=2,
                      max_num_batched_tokens=128, warmup=False)
CPU_FAMILIES = ("llama3", "gemma2")   # MQA + head 48 + llama3 RoPE; windows and soft caps


@pytest.fixture(scope="module")
def parity_checkpoint(tmp_path_factory):
    """name -> directory of that PARITY_BUILDERS checkpoint, written on first use."""
    root = tmp_path_factory.mktemp("float32_parity")

    @functools.cache
    def build(name: str) -> str:
        path = root / name
        path.mkdir()
        PARITY_BUILDERS[name](path)
        return str(path)

    return build


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(40)
    return [rng.integers(2, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]


def _jpaged_greedy(path: str, prompts, **options) -> list[tuple[list[int], list[float]]]:
    """(tokens, their logprobs) per prompt from one engine, eos ignored."""
    llm = LLM(path, **ENGINE_OPTIONS, **options)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        results.append((completion.token_ids, [entry[token] for entry, token in
                                               zip(completion.logprobs, completion.token_ids)]))
    return results


def _hf_greedy(path: str, prompt) -> tuple[list[int], list[float]]:
    """transformers' float32 greedy tokens and their log_softmax, a whole forward per token
    (no cache, no eos: exactly the model's argmax chain)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    token_ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([token_ids])).logits[0, -1]
            token = int(torch.argmax(logits))
            logprobs.append(float(torch.log_softmax(logits.double(), -1)[token]))
            tokens.append(token)
            token_ids.append(token)
    return tokens, logprobs


def _check_parity(path: str, **options):
    prompts = _prompts()
    for prompt, (tokens, logprobs) in zip(prompts, _jpaged_greedy(path, prompts, **options)):
        expected_tokens, expected_logprobs = _hf_greedy(path, prompt)
        first_difference = next((i for i, (a, b) in enumerate(zip(tokens, expected_tokens))
                                 if a != b), None)
        assert tokens == expected_tokens, f"greedy tokens differ from token {first_difference}"
        error = np.max(np.abs(np.asarray(logprobs) - np.asarray(expected_logprobs)))
        assert error < LOGPROB_TOLERANCE, f"logprobs differ from transformers' by {error:.1e}"


@pytest.mark.parametrize("name", CPU_FAMILIES)
def test_float32_greedy_decode_matches_transformers(parity_checkpoint, name):
    _check_parity(parity_checkpoint(name))


def _tf32(x):
    """float32 x rounded to TF32's 10-bit mantissa (to nearest, ties to even)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0xFFF) + ((bits >> 13) & 1)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _tf32_dot(lhs, rhs, dimension_numbers, precision=None, **kwargs):
    """lax.dot_general as a GPU runs float32 dots not asked for HIGHEST: on TF32 operands."""
    if (precision[0] if isinstance(precision, tuple) else precision) != jax.lax.Precision.HIGHEST:
        lhs, rhs = (_tf32(x) if x.dtype == jnp.float32 else x for x in (lhs, rhs))
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)


@pytest.mark.skipif("_dot_general" not in inspect.signature(jnp.einsum).parameters,
                    reason="this jax's einsum takes no dot_general to emulate TF32 with")
def test_the_check_fails_on_tf32_matmuls(parity_checkpoint, monkeypatch):
    """Every einsum of the model and of the reference attention on TF32-rounded operands (its
    matmul_precision "default" asks for no HIGHEST): the parity check fails. (No stored program:
    the emulation is invisible to the program store's key.)"""
    monkeypatch.setattr(jnp, "einsum", functools.partial(jnp.einsum, _dot_general=_tf32_dot))
    with pytest.raises(AssertionError, match="differ"):
        _check_parity(parity_checkpoint("llama3"), matmul_precision="default",
                      attention_backend="reference", compilation_cache_dir=False)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled float32 matmuls and kernels need a CUDA GPU")
@pytest.mark.parametrize("name", PARITY_BUILDERS)
def test_float32_greedy_decode_matches_transformers_on_gpu(parity_checkpoint, name):
    """Every family on the compiled Pallas GPU kernels, at the default matmul_precision."""
    _check_parity(parity_checkpoint(name))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled float32 matmuls need a CUDA GPU")
def test_float32_greedy_decode_matches_transformers_on_gpu_with_reference_attention(
        parity_checkpoint):
    """The reference attention backend diverged on the H200 too (its projections were TF32)."""
    _check_parity(parity_checkpoint("llama3"), attention_backend="reference")
