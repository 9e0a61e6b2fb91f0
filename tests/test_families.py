"""The families beyond Llama (Qwen3, Phi-3, Gemma 2, Gemma 3) as the engine and the benchmarks
use them: presets built at their real size, dummy weights, and one engine per family that uses
tensor parallelism, prefix caching, preemption, multi-step decode and chunked prefill at once,
against transformers' greedy tokens. (Logit and greedy parity of each family, layer by layer
features included, is in tests/test_models.py.)"""

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

from jpaged.config import ModelConfig
from jpaged.models import LlamaForCausalLM, checkpoint_tensors, load_model
from tests import families_worker
from tests.hf_fixtures import NEW_FAMILIES
from tests import child_process

ROOT = Path(__file__).resolve().parent.parent
# The fused Phi-3 packing and Gemma 3's layer (q/k and (1 + weight) norms, two rotaries) at
# their real sizes; Qwen3 and Gemma 2 add nothing these two do not build.
PRESETS = ("phi-3-mini-4k", "gemma-3-12b")
TENSOR_PARALLEL_SIZE = 2


@pytest.mark.parametrize("name", PRESETS)
def test_preset_builds_at_its_real_size(name):
    """What benchmarks/e2e.py does with a preset (abstractly here): the parameters it builds
    are as many as the config counts."""
    config = ModelConfig.preset(name)
    model = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=jnp.bfloat16,
                                                    rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(leaf.size for leaf in leaves) == config.num_parameters()


@pytest.mark.parametrize("name", ["phi3", "gemma3"])   # fused parts; Gemma's zero norms
def test_dummy_weights_have_the_checkpoint_names_and_shapes(hf_checkpoints, name):
    real = checkpoint_tensors(load_model(hf_checkpoints[name])[0])
    model, config = load_model(hf_checkpoints[name], load_format="dummy")
    dummy = checkpoint_tensors(model)
    assert {n: v.shape for n, v in dummy.items()} == {n: v.shape for n, v in real.items()}
    assert sum(v.size for v in dummy.values()) == config.num_parameters()
    identity = 0.0 if config.is_gemma else 1.0     # Gemma norms scale by (1 + weight)
    norms = [n for n in dummy if n.endswith("norm.weight")]
    assert norms and all((np.asarray(dummy[n]) == identity).all() for n in norms)


@pytest.fixture(scope="module")
def engine_runs(hf_checkpoints) -> dict:
    """{family: the worker's result} from one subprocess on TENSOR_PARALLEL_SIZE CPU devices
    (XLA's optimisations off there: these runs check tokens, not speed)."""
    paths = [hf_checkpoints[name] for name in NEW_FAMILIES]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count="
               f"{TENSOR_PARALLEL_SIZE}", JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    out = child_process.run([sys.executable, "-m", "tests.families_worker",
                          str(TENSOR_PARALLEL_SIZE), *paths], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    return {name: results[path] for name, path in zip(NEW_FAMILIES, paths)}


@functools.cache
def _transformers(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _hf_greedy(path: str, prompt: tuple) -> list[int]:
    import torch

    with torch.no_grad():
        out = _transformers(path).generate(
            torch.tensor([prompt]), max_new_tokens=families_worker.MAX_TOKENS,
            min_new_tokens=families_worker.MAX_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_engine_features_together_give_transformers_tokens(hf_checkpoints, engine_runs, name):
    run = engine_runs[name]
    assert run["stats"]["num_preemptions"] > 0            # the pool was too small
    assert run["stats"]["prefix_cache_hit_rate"] > 0       # the shared prefix was reused
    assert run["stats"]["num_free_blocks"] == run["stats"]["num_kv_blocks"] - 1   # no leak
    for prompt, tokens in zip(families_worker.prompts(), run["tokens"]):
        assert tokens == _hf_greedy(hf_checkpoints[name], tuple(prompt)), name
