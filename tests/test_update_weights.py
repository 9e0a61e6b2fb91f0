"""In-place weight updates (`LLM.update_weights` / `get_weights`): an engine built on checkpoint
A, given checkpoint B's tensors (from numpy, jax arrays or a directory), gives transformers'
greedy tokens of B with no new compilation and no stale prefix; a bad tensor changes nothing;
every family's tensors round-trip through the loader's map; tensor parallelism in a worker."""

import functools
import json
import os
import shutil
import sys
import types
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jpaged import LLM
from jpaged.engine import device_step
from jpaged.engine.device_step import split_model
from jpaged.models import load_model
from jpaged.models.weights import checkpoint_weights, new_parameters, parameter_names
from tests.weights_worker import ENGINE_OPTIONS, MAX_TOKENS, PROMPTS, greedy, warm_block_ops
from tests import child_process

ROOT = Path(__file__).resolve().parent.parent
BASE = "llama_gqa"
FAMILIES = ("llama_gqa", "qwen2", "llama_head_dim", "qwen3", "phi3", "gemma2", "gemma3",
            "gemma3_multimodal", "mixtral", "qwen3_moe")
TENSOR_PARALLEL_SIZE = 2


def perturbed_copy(source: str, out_dir: Path, seed: int) -> Path:
    """Checkpoint B: A's config and tokenizer, every tensor moved by noise of A's scale."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in Path(source).iterdir():
        if item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy(item, out_dir / item.name)
    rng = np.random.default_rng(seed)
    tensors = load_file(str(Path(source) / "model.safetensors"))
    save_file({name: (array + 0.5 * array.std() * rng.standard_normal(array.shape))
               .astype(array.dtype) for name, array in tensors.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@functools.cache
def hf_greedy(path: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def dirs(hf_checkpoints, tmp_path_factory) -> dict[str, str]:
    base = hf_checkpoints[BASE]
    return {"a": base, "b": str(perturbed_copy(base, tmp_path_factory.mktemp("b"), seed=1))}


@pytest.fixture(scope="module")
def llm(dirs):
    """One engine on A for the module, prefix caching on; every block operation compiled up
    front (warm-up does so on an accelerator), so any compilation a test sees is a step's."""
    engine = LLM(dirs["a"], **ENGINE_OPTIONS)
    warm_block_ops(engine)
    assert greedy(engine) == hf_greedy(dirs["a"])   # compiled before any update
    return engine


def program_cache_sizes() -> int:
    """Executables jit holds for the step and decode-loop programs (a recompile adds one)."""
    programs = [*device_step._STEP_PROGRAMS.values(), *device_step._DECODE_LOOPS.values()]
    return sum(program._cache_size() for program in programs)


def tensors(path: str) -> dict[str, np.ndarray]:
    return load_file(str(Path(path) / "model.safetensors"))


@pytest.fixture(scope="module")
def compiled_at_start(llm) -> tuple[int, int]:
    """(num_compilations, executables) once the engine has run, before any update."""
    return llm.stats()["num_compilations"], program_cache_sizes()


@pytest.fixture
def on_a(llm, dirs):
    """The engine serves A when the test starts (and its prefix cache holds A's prompts)."""
    llm.update_weights(dirs["a"])
    assert greedy(llm) == hf_greedy(dirs["a"])
    return llm


def _pinned(arrays: dict) -> dict:
    """The arrays as jax arrays in pinned host memory (a trainer's offloaded copy)."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    return {name: jax.device_put(array, host) for name, array in arrays.items()}


@pytest.mark.parametrize("source", ["numpy", "jax", "pinned_host", "directory"])
def test_update_gives_b_tokens_without_compiling_or_stale_prefix(compiled_at_start, on_a, dirs,
                                                                 source):
    llm = on_a
    assert llm.stats()["num_cached_blocks"] > 0          # A's prompt blocks are cached
    weights = {"numpy": lambda: tensors(dirs["b"]),
               "jax": lambda: {n: jnp.asarray(a) for n, a in tensors(dirs["b"]).items()},
               "pinned_host": lambda: _pinned(tensors(dirs["b"])),
               "directory": lambda: dirs["b"]}[source]()
    assert llm.update_weights(weights) is None
    assert llm.stats()["num_cached_blocks"] == 0
    assert greedy(llm) == hf_greedy(dirs["b"]) != hf_greedy(dirs["a"])
    # the same programs as before the first update: none compiled again (even for a new
    # commitment of the parameters to their devices, which jit keys its cache on)
    assert (llm.stats()["num_compilations"], program_cache_sizes()) == compiled_at_start
    got = llm.get_weights()
    for name, array in tensors(dirs["b"]).items():
        np.testing.assert_array_equal(np.asarray(got[name]), array, err_msg=name)
        assert got[name].sharding.memory_kind == "device", name


def test_get_weights_round_trips_on_the_engine(on_a, dirs):
    llm = on_a
    own = llm.get_weights()           # jax arrays on the engine's device(s)
    llm.update_weights(dirs["b"])
    llm.update_weights(own)
    assert greedy(llm) == hf_greedy(dirs["a"])
    reference = tensors(dirs["a"])
    assert set(own) == set(reference)
    for name, array in llm.get_weights().items():
        np.testing.assert_array_equal(np.asarray(array), reference[name], err_msg=name)


def _missing(weights):
    del weights["model.layers.1.mlp.up_proj.weight"]
    return "model.layers.1.mlp.up_proj.weight"


def _extra(weights):
    weights["model.layers.2.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"]
    return "model.layers.2.mlp.up_proj.weight"


def _shape(weights):
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float32)
    return "model.layers.0.self_attn.k_proj.weight"


def _dtype(weights):
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.int32)
    return "model.norm.weight"


@pytest.mark.parametrize("spoil", [_missing, _extra, _shape, _dtype])
def test_bad_tensor_is_named_and_changes_nothing(on_a, dirs, spoil):
    llm = on_a
    weights = tensors(dirs["b"])      # good tensors but one: none of them may land
    name = spoil(weights)
    cached = llm.stats()["num_cached_blocks"]
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        llm.update_weights(weights)
    assert llm.stats()["num_cached_blocks"] == cached
    assert greedy(llm) == hf_greedy(dirs["a"])
    reference = tensors(dirs["a"])
    for got_name, array in llm.get_weights().items():
        np.testing.assert_array_equal(np.asarray(array), reference[got_name], err_msg=got_name)


def test_request_in_flight_continues_with_the_new_weights(on_a, dirs):
    """Updated between steps: the prompt was prefilled by A, every later token comes from B
    (so the tokens differ from both A's and B's alone, and the first one is A's)."""
    from jpaged import SamplingParams

    engine = on_a.engine
    engine.add_request("r", prompt_token_ids=PROMPTS[0],
                       params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                             ignore_eos=True))
    first = engine.step()
    assert first[0].outputs[0].token_ids == hf_greedy(dirs["a"])[0][:1]
    engine.update_weights(dirs["b"])
    while engine.has_unfinished():
        outputs = engine.step()
    tokens = outputs[0].outputs[0].token_ids
    assert len(tokens) == MAX_TOKENS and tokens[0] == hf_greedy(dirs["a"])[0][0]
    assert tokens != hf_greedy(dirs["a"])[0]
    assert engine.stats()["num_cached_blocks"] == 0     # its stale blocks were not indexed


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_round_trips_through_the_names(hf_checkpoints, name):
    """checkpoint_weights gives the safetensors file back exactly, and new_parameters from that
    file rebuilds every parameter bit for bit, with its sharding (tied embeddings, fused and
    packed projections, Gemma's prefixed multimodal names)."""
    model, _ = load_model(hf_checkpoints[name])
    reference = tensors(hf_checkpoints[name])
    got = checkpoint_weights(model)
    prefix = model.config.checkpoint_prefix
    ignorable = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(got) == {n for n in reference
                        if n.startswith(prefix) and n[len(prefix):] not in ignorable}
    for tensor_name, array in got.items():
        np.testing.assert_array_equal(np.asarray(array), reference[tensor_name],
                                      err_msg=tensor_name)
    model_def, leaves = split_model(model)
    current = dict(zip(parameter_names(model_def.treedef), leaves))
    rebuilt = dict(new_parameters(model, {n: reference[n] for n in got}, current))
    assert set(rebuilt) == set(current)
    for param_name, value in rebuilt.items():
        assert value.sharding == current[param_name].sharding
        np.testing.assert_array_equal(np.asarray(value), np.asarray(current[param_name]))


def test_tensor_parallel_update(dirs):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count="
               f"{TENSOR_PARALLEL_SIZE}", JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    out = child_process.run([sys.executable, "-m", "tests.weights_worker", dirs["a"], dirs["b"],
                          str(TENSOR_PARALLEL_SIZE)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["a"] == hf_greedy(dirs["a"])
    assert run["b_numpy"] == run["b_jax"] == hf_greedy(dirs["b"])
    assert run["a_again"] == hf_greedy(dirs["a"])
    assert run["compilations"][0] == run["compilations"][-1]
    assert run["sharded_like_before"]


def test_update_behind_decode_loops_in_flight(dirs):
    """With async scheduling, loops already dispatched finish with the old weights; the cached
    blocks' releases land behind them, the mirror stays equal to the device (no error, no leaked
    block), nothing computed before the update is cached, and new requests get B's tokens."""
    from jpaged import LLMEngine, SamplingParams

    engine = LLMEngine.from_pretrained(dirs["a"], **ENGINE_OPTIONS, num_scheduler_steps=4,
                                       async_scheduling=True)
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("cached", prompt_token_ids=PROMPTS[0], params=long)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["num_cached_blocks"] > 0
    engine.add_request("x", prompt_token_ids=PROMPTS[0], params=long)
    engine.add_request("y", prompt_token_ids=PROMPTS[1], params=long)
    while not engine.pipeline.loops:
        engine.step()
    engine.update_weights(dirs["b"])
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["num_cached_blocks"] == 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"] - 1     # every block back
    short = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"new{index}", prompt_token_ids=prompt, params=short)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step()
                         if o.finished})
    assert [finished[f"new{i}"] for i in range(len(PROMPTS))] == hf_greedy(dirs["b"])


def test_replaced_parameters_are_freed_before_the_update_ends(hf_checkpoints):
    """From host float32 tensors into a bfloat16 model: each new value equals the tensors cast
    (on the device) and packed, and once every new value has been taken, while the update has
    not yet finished, no old parameter is still held by it (device memory never holds the old
    model and the new one whole)."""
    model, _ = load_model(hf_checkpoints[BASE], dtype="bfloat16")
    reference = tensors(hf_checkpoints[BASE])
    model_def, leaves = split_model(model)
    names = parameter_names(model_def.treedef)
    old_refs = [weakref.ref(leaf) for leaf in leaves]
    expected = {name: np.asarray(leaf) for name, leaf in zip(names, leaves)}
    spec = types.SimpleNamespace(config=model.config, dtype=model.dtype, mesh=model.mesh)
    values = new_parameters(spec, reference, dict(zip(names, leaves)))
    del model, leaves
    new = dict(next(values) for _ in names)
    assert [ref for ref in old_refs if ref() is not None] == []
    assert next(values, None) is None
    assert set(new) == set(expected)
    for name, value in new.items():
        assert value.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(value), expected[name], err_msg=name)
