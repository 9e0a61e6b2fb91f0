"""The `matmul_precision` option: a float32 model's matmuls and attention run in full float32
(HIGHEST) unless asked otherwise, a bfloat16 model's programs carry no precision they did not
carry before the option, and two precisions never share a compiled or stored program.

(Greedy parity with transformers in float32, which TF32 matmuls break on a GPU:
tests/test_float32_parity.py.)"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jpaged.config import ModelConfig
from jpaged.engine import LLMEngine
from jpaged.engine.device_step import step_impl
from jpaged.engine.executable_store import Store
from jpaged.engine.programs import argument_specs
from jpaged.models import LlamaForCausalLM, with_matmul_precision
from jpaged.sampling import SamplingRow
from jpaged.sampling_params import SamplingParams
from pallas_kernels.testing import dot_precisions

# One layer of the tiny preset: every kind of dot (q/k/v, attention, o, MLP, logits) once.
CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), num_hidden_layers=1, layer_types=None)
ENGINE_OPTIONS = dict(num_kv_blocks=8, block_size=16, max_model_len=64, max_num_seqs=2,
                      max_num_batched_tokens=32, warmup=False, compilation_cache_dir=False)


@functools.cache
def _model(dtype: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(CONFIG, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def _engine(dtype: str, **options) -> LLMEngine:
    return LLMEngine.from_model(_model(dtype), **ENGINE_OPTIONS, **options)


def _prefill_call(engine: LLMEngine):
    """(program, args, static arguments) of a prefill step of one 5-token prompt."""
    row = SamplingRow(SamplingParams(temperature=0.0), 0, 0, 5)
    _, program, args, static = engine.executor.step_call([(0, [3, 4, 5, 6, 7])], [(0, row)], 0)
    return program, args, static


def _lowered_text(engine: LLMEngine) -> str:
    program, args, static = _prefill_call(engine)
    return program.lower(*args, **static).as_text()


def test_precision_follows_the_model_dtype_unless_asked():
    assert _model("float32").matmul_precision == "highest"
    assert _model("bfloat16").matmul_precision == "default"
    assert _engine("float32").config.matmul_precision == "highest"
    assert _engine("bfloat16").config.matmul_precision == "default"
    assert _engine("float32", matmul_precision="high").config.matmul_precision == "high"
    with pytest.raises(ValueError, match="^matmul_precision must be one of"):
        _engine("float32", matmul_precision="tensorfloat32")
    with pytest.raises(ValueError, match="matmul_precision"):
        LlamaForCausalLM(CONFIG, dtype=jnp.float32, rngs=nnx.Rngs(0), matmul_precision="fp32")


@pytest.mark.parametrize("backend", ["reference", "pallas_gpu"])
def test_float32_step_runs_every_dot_at_highest(backend):
    """Projections, MLP, logits and attention (the reference's einsums, or the Pallas kernels'
    dots, interpreted here): each dot of the lowered float32 step asks for HIGHEST."""
    text = _lowered_text(_engine("float32", attention_backend=backend))
    num_dots = text.count("stablehlo.dot_general")
    assert num_dots >= 6 and text.count("precision = [HIGHEST, HIGHEST]") == num_dots


def test_bfloat16_step_asks_for_no_precision():
    """A bfloat16 model on the GPU kernels (interpreted here): no dot of its lowered step asks
    for HIGHEST (or HIGH), and in its jaxpr the model's own dots ask for nothing (None, as
    before the option) and the kernels' for DEFAULT."""
    engine = _engine("bfloat16", attention_backend="pallas_gpu")
    text = _lowered_text(engine)
    assert text.count("stablehlo.dot_general") >= 6
    assert "HIGHEST" not in text and "HIGH," not in text
    _, args, static = _prefill_call(engine)
    dots = dot_precisions(functools.partial(step_impl, **static), *args)
    assert set(dots) == {None, jax.lax.Precision.DEFAULT}
    assert dots.count(None) == 5    # the layer's q/k/v, o, gate/up and down; the logits


def test_asked_precision_reaches_every_dot():
    text = _lowered_text(_engine("float32", matmul_precision="default",
                                 attention_backend="pallas_gpu"))
    assert "HIGHEST" not in text
    text = _lowered_text(_engine("float32", matmul_precision="high", attention_backend="reference"))
    assert text.count("precision = [HIGH, HIGH]") == text.count("stablehlo.dot_general")


def test_precisions_never_share_a_program(tmp_path):
    """The precision is a static attribute of the model's graph: engines of two precisions have
    different model structures, so different jit entries and different stored-program keys;
    the caller's model keeps its own precision."""
    model = _model("float32")
    highest, default = _engine("float32"), _engine("float32", matmul_precision="default")
    assert model.matmul_precision == "highest"
    assert highest.executor.model_def != default.executor.model_def
    assert highest.executor.model_def.fingerprint != default.executor.model_def.fingerprint
    store = Store(tmp_path, "context")
    keys = set()
    for engine in (highest, default):
        program, args, static = _prefill_call(engine)
        keys.add(store.key(program, argument_specs(args), static))
    assert len(keys) == 2
    again = _engine("float32", matmul_precision="highest")
    assert again.executor.model_def == highest.executor.model_def


def test_with_matmul_precision_copies_only_when_it_must():
    model = _model("float32")
    assert with_matmul_precision(model, "highest") is model
    copy = with_matmul_precision(model, "high")
    assert copy.matmul_precision == "high" and model.matmul_precision == "highest"
    assert copy.lm_head.weight[...] is model.lm_head.weight[...]   # parameters are shared
    with pytest.raises(ValueError, match="matmul_precision"):
        with_matmul_precision(model, "auto")
