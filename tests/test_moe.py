"""Mixtures of experts (Mixtral, Qwen3-MoE): the grouped-matmul MLP against a per-token numpy
oracle, the routing worked by hand, the configs as transformers reads them, the presets at their
real sizes, dummy weights, the engine's features together against transformers' tokens, on one
device and split over two (tensor and expert parallelism).
(Prompt logits, chunked prefill, greedy decode and weight round trips of the two fixtures run
with every other family in tests/test_models.py and tests/test_update_weights.py.)"""

import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jpaged import LLM, SamplingParams
from jpaged.config import ModelConfig
from jpaged.models import LlamaForCausalLM, checkpoint_tensors, load_model
from jpaged.models.moe import SparseMoE
from jpaged.parallel import check_config, make_mesh
from tests import child_process, families_worker
from tests.hf_fixtures import MOE_CHECKPOINTS, VOCAB_SIZE

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, EXPERT_SIZE = 16, 8


def _moe_config(num_experts=6, top_k=2, norm_topk_prob=True, architecture="Qwen3MoeForCausalLM",
                **fields) -> ModelConfig:
    raw = dict(architectures=[architecture], vocab_size=32, hidden_size=HIDDEN,
               intermediate_size=EXPERT_SIZE, moe_intermediate_size=EXPERT_SIZE,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
               num_experts=num_experts, num_experts_per_tok=top_k,
               norm_topk_prob=norm_topk_prob)
    raw.update(fields)
    if architecture == "MixtralForCausalLM":
        raw["num_local_experts"] = raw.pop("num_experts")
        del raw["moe_intermediate_size"], raw["norm_topk_prob"]
    return ModelConfig.from_dict(raw)


def _moe(config: ModelConfig, dtype=jnp.float32, seed=0) -> SparseMoE:
    """A SparseMoE with weights large enough that routing and experts both matter."""
    moe = SparseMoE(config, dtype=dtype, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for var in (moe.gate.weight, moe.experts.gate_up_proj, moe.experts.down_proj):
        var[...] = jnp.asarray(rng.standard_normal(var[...].shape) * 0.5, dtype)
    return moe


def _oracle(moe: SparseMoE, x: np.ndarray) -> np.ndarray:
    """Each token alone, in float64: softmax router, top-k, (renormalise,) its experts' gated
    MLPs summed with their weights."""
    router = np.asarray(moe.gate.weight[...], np.float64)
    gate_up = np.asarray(moe.experts.gate_up_proj[...], np.float64)
    down = np.asarray(moe.experts.down_proj[...], np.float64)
    out = np.zeros(x.shape, np.float64)
    for t, row in enumerate(np.asarray(x, np.float64)):
        logits = router @ row
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[:moe.top_k]
        weights = probs[chosen] / (probs[chosen].sum() if moe.norm_topk_prob else 1.0)
        for expert, weight in zip(chosen, weights):
            gate, up = np.split(row @ gate_up[expert], 2)
            out[t] += weight * ((gate / (1 + np.exp(-gate)) * up) @ down[expert])
    return out


@pytest.mark.parametrize("backend", ["reference", "pallas_gpu"])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_grouped_experts_equal_each_token_computed_alone(num_tokens, norm_topk_prob, backend):
    """Few tokens leave most experts without rows, many give every expert several. Both
    grouped matmuls: ragged_dot (reference) and the Pallas GPU kernel (interpreted here)."""
    moe = _moe(_moe_config(norm_topk_prob=norm_topk_prob, top_k=3))
    x = np.random.default_rng(num_tokens).standard_normal((num_tokens, HIDDEN)).astype(np.float32)
    got = np.asarray(moe(jnp.asarray(x), "highest", backend=backend,
                         interpret=jax.default_backend() != "gpu"))
    np.testing.assert_allclose(got, _oracle(moe, x), rtol=1e-5, atol=1e-5)


def test_the_gpu_backends_run_the_pallas_grouped_matmul():
    """The step's backend picks the experts' kernel: the Pallas grouped matmul for the GPU
    backends, ragged_dot for the reference (and the differentiable training forward)."""
    moe = _moe(_moe_config())
    x = jnp.ones((4, HIDDEN), jnp.float32)

    def program(backend):
        return str(jax.make_jaxpr(lambda x: moe(x, backend=backend, interpret=True))(x))

    assert "ragged_dot" in program("reference") and "pallas_call" not in program("reference")
    for backend in ("pallas_gpu", "pallas_mosaic_gpu"):
        assert program(backend).count("jpaged_grouped_matmul") == 2     # gate/up and down
        assert "ragged_dot" not in program(backend)


def test_grouped_experts_in_bfloat16_stay_close():
    moe = _moe(_moe_config(top_k=2), dtype=jnp.bfloat16)
    x = np.random.default_rng(1).standard_normal((24, HIDDEN)).astype(np.float32)
    got = np.asarray(moe(jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    assert got.dtype == np.float32
    expected = _oracle(moe, np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)))
    assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()


def test_routing_worked_by_hand():
    """Router logits log(p) give probabilities p: the top two of (0.1, 0.4, 0.2, 0.3) are
    experts 1 and 3, returned in expert order, renormalised to (0.4, 0.3) / 0.7 or kept."""
    probs = np.array([0.1, 0.4, 0.2, 0.3])
    for norm, expected in ((True, [0.4 / 0.7, 0.3 / 0.7]), (False, [0.4, 0.3])):
        moe = _moe(_moe_config(num_experts=4, top_k=2, norm_topk_prob=norm))
        x = np.zeros((1, HIDDEN), np.float32)
        x[0, 0] = 1.0
        weight = np.zeros((4, HIDDEN), np.float32)
        weight[:, 0] = np.log(probs)
        moe.gate.weight[...] = jnp.asarray(weight)
        ids, weights = moe.route(jnp.asarray(x), "highest")
        assert ids.tolist() == [[1, 3]]
        np.testing.assert_allclose(np.asarray(weights)[0], expected, rtol=1e-6)


def test_routing_weights_dtype_follows_the_architecture():
    """Mixtral scales expert outputs by float32 weights; Qwen3-MoE casts them to the model's."""
    x = jnp.ones((3, HIDDEN), jnp.bfloat16)
    for architecture, dtype in (("MixtralForCausalLM", jnp.float32),
                                ("Qwen3MoeForCausalLM", jnp.bfloat16)):
        moe = _moe(_moe_config(architecture=architecture), dtype=jnp.bfloat16)
        assert moe.route(x)[1].dtype == dtype, architecture


def test_no_recompile_for_another_routing():
    """The routing is data: one program serves any assignment of tokens to experts."""
    moe = _moe(_moe_config())
    graphdef, state = nnx.split(moe)
    traces = []

    @jax.jit
    def run(state, x):
        traces.append(1)
        return nnx.merge(graphdef, state)(x)

    rng = np.random.default_rng(2)
    outputs = [run(state, jnp.asarray(rng.standard_normal((8, HIDDEN)), jnp.float32))
               for _ in range(3)]
    assert len(traces) == 1 and not np.allclose(outputs[0], outputs[1])


def test_configs_read_as_transformers_reads_them():
    qwen = _moe_config(num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3],
                       num_hidden_layers=6)
    # transformers: layer i routes unless listed in mlp_only_layers, when (i + 1) % step == 0
    assert qwen.experts.sparse_layers == (False, True, False, False, False, True)
    assert qwen.experts.num_local_experts == 8 and not qwen.experts.float32_weights
    assert qwen.qk_norm
    mixtral = _moe_config(architecture="MixtralForCausalLM", attention_bias=True)
    assert mixtral.experts.moe_intermediate_size == EXPERT_SIZE   # intermediate_size
    assert mixtral.experts.norm_topk_prob and mixtral.experts.float32_weights
    assert not (mixtral.qkv_bias or mixtral.o_proj_bias or mixtral.qk_norm)
    same = _moe_config(num_local_experts=6)   # transformers 5 writes either name
    assert same.experts.num_local_experts == 6
    with pytest.raises(ValueError, match="'num_experts' .* 'num_local_experts'.* disagree"):
        _moe_config(num_local_experts=4)
    with pytest.raises(ValueError, match="num_experts_per_tok .* at most num_local_experts"):
        _moe_config(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="unknown field"):
        _moe_config(first_k_dense_replace=1)   # a DeepSeek field, not read here
    assert ModelConfig.preset("llama3-8b").experts is None


@pytest.mark.parametrize("name, total, active", [
    # the published totals (30.5B, 46.7B; active 3.3B, 12.9B), the active ones worked by hand:
    # 48 x (attention 18,874,368 + q/k norms 256 + norms 4,096 + router 262,144 + 8 experts x
    # 4,718,592) + embeddings 2 x 311,164,928 + final norm 2,048; 32 x (41,943,040 + 8,192 +
    # 32,768 + 2 x 176,160,768) + 2 x 131,072,000 + 4,096
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248)])
def test_presets_build_at_their_real_size(name, total, active):
    config = ModelConfig.preset(name)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=jnp.bfloat16,
                                                    rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(leaf.size for leaf in leaves) == config.num_parameters() == total
    assert config.num_parameters(active=True) == active


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_parameters_counted_as_transformers_counts_them(hf_checkpoints, name):
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_checkpoints[name])
    _, config = load_model(hf_checkpoints[name], load_format="dummy")
    assert config.num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_dummy_weights_have_the_checkpoint_names_and_shapes(hf_checkpoints, name):
    real = checkpoint_tensors(load_model(hf_checkpoints[name])[0])
    dummy = checkpoint_tensors(load_model(hf_checkpoints[name], load_format="dummy")[0])
    assert {n: v.shape for n, v in dummy.items()} == {n: v.shape for n, v in real.items()}
    experts = [n for n in dummy if ".experts." in n]
    assert experts and all(float(np.std(np.asarray(dummy[n]))) > 0 for n in experts)


def _check_tokens_and_no_leak(run: dict, path: str):
    """A families_worker run: every block back in the pool, transformers' greedy tokens."""
    assert run["stats"]["num_free_blocks"] == run["stats"]["num_kv_blocks"] - 1
    for prompt, tokens in zip(families_worker.prompts(), run["tokens"]):
        assert tokens == _hf_greedy(path, tuple(prompt), families_worker.MAX_TOKENS)


@pytest.fixture(scope="module")
def split_runs(hf_checkpoints) -> dict:
    """tests/moe_worker.py's report on 2 forced CPU devices (XLA's optimisations off there:
    these runs check tokens and shardings, not speed)."""
    paths = [hf_checkpoints[name] for name in MOE_CHECKPOINTS]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    out = child_process.run([sys.executable, "-m", "tests.moe_worker", *paths], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return {"layer_errors": report["layer_errors"],
            **{name: report[path] for name, path in zip(MOE_CHECKPOINTS, paths)}}


@pytest.mark.parametrize("split, specs", [
    ("tensor", {"gate_up_proj": "(None, None, 'tp')", "down_proj": "(None, 'tp')"}),
    ("expert", {"gate_up_proj": "('tp',)", "down_proj": "('tp',)"})])
@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_split_over_two_devices_gives_transformers_tokens(hf_checkpoints, split_runs, name,
                                                          split, specs):
    """Each expert's intermediate dimension split (tensor), or whole experts per device
    (expert: enable_expert_parallel), with every engine feature at once: the tokens of one
    device, which are transformers'."""
    run = split_runs[name][split]
    assert run["specs"] == specs
    assert run["stats"]["num_preemptions"] > 0
    _check_tokens_and_no_leak(run, hf_checkpoints[name])


def test_split_layer_equals_one_device(split_runs):
    """One layer in float32, 8 experts top 3 over 2 devices, at 1, 3 and 40 tokens (one token
    leaves a device's experts without rows): the same output as on one device, to rounding
    (the tensor split sums two partial products)."""
    assert split_runs["layer_errors"]["expert"] <= 1e-6
    assert split_runs["layer_errors"]["tensor"] <= 1e-6


def test_splits_that_do_not_divide_are_refused_by_name(hf_checkpoints):
    config = load_model(hf_checkpoints["mixtral"], load_format="dummy")[1]   # 4 experts, F 32
    check_config(config, make_mesh(1))
    three = type("Mesh", (), {"shape": {"tp": 3}})()   # the size is all it reads
    with pytest.raises(ValueError, match="divide the experts' intermediate size 32"):
        check_config(config, three)
    experts = dataclasses.replace(config.experts, expert_parallel=True)
    with pytest.raises(ValueError, match="expert parallelism must divide num_local_experts=4"):
        check_config(dataclasses.replace(config, experts=experts), three)


@functools.cache
def _hf_greedy(path: str, prompt: tuple, max_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", MOE_CHECKPOINTS)
def test_engine_features_together_give_transformers_tokens(hf_checkpoints, name):
    """Prefix caching, recompute preemption, multi-step decode and chunked prefill at once."""
    run = families_worker.run(hf_checkpoints[name], 1)
    assert run["stats"]["num_preemptions"] > 0
    assert run["stats"]["prefix_cache_hit_rate"] > 0
    _check_tokens_and_no_leak(run, hf_checkpoints[name])


def test_qwen3_moe_renormalised_every_other_layer(tmp_path):
    """The Qwen3-MoE variants the fixture does not cover: norm_topk_prob on, experts on every
    second layer (decoder_sparse_step 2), swap preemption; greedy tokens and prompt logprobs
    against transformers."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.hf_fixtures import _COMMON, _save

    config = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                            norm_topk_prob=True, decoder_sparse_step=2,
                            **dict(_COMMON, num_hidden_layers=4))
    _save(Qwen3MoeForCausalLM, config, tmp_path, seed=18)
    assert json.loads((tmp_path / "config.json").read_text())["decoder_sparse_step"] == 2
    llm = LLM(str(tmp_path), num_kv_blocks=10, block_size=4, max_model_len=64, max_num_seqs=4,
              preemption_mode="swap", warmup=False)
    prompts = families_worker.prompts()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(str(tmp_path), tuple(prompt), 8)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0]
        expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1),
                                                 torch.tensor(prompt[1:])].numpy()
        got = [next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]]
        np.testing.assert_allclose(got, expected, atol=1e-4)
    assert VOCAB_SIZE == config.vocab_size
