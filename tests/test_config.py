"""ModelConfig reads Hugging Face config.json (old and transformers 5 style); errors name fields.
The engine options table (jpaged.options) checks every option by name and documents them all."""

import ast
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from jpaged import options
from jpaged.config import PRESETS_DIR, ModelConfig
from jpaged.rope_config import RopeConfig
from jpaged.options import OPTIONS, EngineConfig, OptionError, check_options

ROOT = Path(__file__).resolve().parent.parent

# Llama 3.1 8B's config.json as published on the Hub (old-style rope_theta + rope_scaling).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
NEW_STYLE_ROPE = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                      "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}}


def _llama(**changes):
    raw = {**LLAMA31_8B, **changes}
    return ModelConfig.from_dict({k: v for k, v in raw.items() if v is not None})


def test_llama31_hub_config():
    config = ModelConfig.from_dict(LLAMA31_8B)
    assert (config.head_dim, config.num_key_value_heads, config.torch_dtype) == (128, 8, "bfloat16")
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert config.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2
    assert config.num_parameters() == 8_030_261_248
    assert config.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)


def test_rope_parameters_and_rope_scaling_read_alike():
    old = ModelConfig.from_dict(LLAMA31_8B)
    new = _llama(rope_scaling=None, rope_theta=None, **NEW_STYLE_ROPE)
    assert new.rope == old.rope
    default = _llama(rope_scaling=None, rope_theta=1e6)
    assert default.rope == RopeConfig(theta=1e6)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "default", "rope_theta": 10000.0},
])
def test_inv_frequencies_match_transformers(rope):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                         rope_parameters=dict(rope))
    if rope["rope_type"] == "default":
        expected, scaling = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding \
            .compute_default_rope_parameters(hf_config)
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, None)
    assert scaling == 1.0
    config = _llama(rope_scaling=None, rope_theta=None, rope_parameters=rope)
    np.testing.assert_allclose(config.rope.inv_frequencies(64), expected.numpy(), rtol=1e-6)


def test_llama3_scaling_changes_only_low_frequencies():
    rope = ModelConfig.from_dict(LLAMA31_8B).rope
    plain = RopeConfig(theta=rope.theta).inv_frequencies(128)
    scaled = rope.inv_frequencies(128)
    np.testing.assert_allclose(scaled[:20], plain[:20])       # short wavelengths untouched
    np.testing.assert_allclose(scaled[-5:], plain[-5:] / 8)   # long ones divided by factor


@pytest.mark.parametrize("arch, extra, expected", [
    ("LlamaForCausalLM", {}, (False, False, False)),
    ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}, (True, True, True)),
    ("Qwen2ForCausalLM", {}, (True, False, False)),
    ("MistralForCausalLM", {"attention_bias": True}, (False, False, False)),
])
def test_bias_per_architecture(arch, extra, expected):
    config = _llama(architectures=[arch], **extra)
    assert (config.qkv_bias, config.o_proj_bias, config.mlp_bias) == expected


@pytest.mark.parametrize("arch, extra, window", [
    ("MistralForCausalLM", {"sliding_window": 4096}, 4096),
    ("MistralForCausalLM", {}, 4096),                   # transformers' MistralConfig default
    ("Qwen2ForCausalLM", {"sliding_window": 131072, "use_sliding_window": False}, None),
    ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True,
                          "max_window_layers": 28}, 4096),
    ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True,
                          "max_window_layers": 32}, None),
    ("Qwen2ForCausalLM", {"sliding_window": 4096,
                          "layer_types": ["full_attention"] * 32}, None),
    ("LlamaForCausalLM", {"sliding_window": 4096}, None),
])
def test_sliding_window_no_longer_caps_max_model_len(arch, extra, window):
    config = _llama(architectures=[arch], max_position_embeddings=32768, **extra)
    assert config.sliding_window == window
    assert config.max_model_len == 32768


def test_explicit_null_window_and_per_layer_windows():
    mistral = ModelConfig.from_dict({**LLAMA31_8B, "architectures": ["MistralForCausalLM"],
                                     "sliding_window": None})
    assert mistral.sliding_window is None and mistral.layer_window(0) is None
    qwen = _llama(architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                  use_sliding_window=True, max_window_layers=28)
    assert [qwen.layer_window(i) for i in (0, 27, 28, 31)] == [None, None, 4096, 4096]
    covering = _llama(architectures=["MistralForCausalLM"], sliding_window=131072)
    assert covering.layer_window(0) is None  # a window over every position excludes nothing


def test_explicit_and_derived_head_dim():
    assert _llama(head_dim=64).head_dim == 64
    assert _llama(head_dim=None).head_dim == 128


@pytest.mark.parametrize("eos, expected", [(None, ()), (2, (2,)), ([1, 2], (1, 2))])
def test_eos_token_id_forms(eos, expected):
    assert _llama(eos_token_id=eos).eos_token_ids == expected


@pytest.mark.parametrize("change, field", [
    ({"quantization_config": {"bits": 4}}, "quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 12}, "head_dim"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"}, "hidden_activation"),
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
     "use_bidirectional_attention"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {
        "type": "su", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}}, "short_factor"),
    ({"architectures": ["Gemma2ForCausalLM"], "layer_types": ["full_attention"] * 3},
     "layer_types"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"architectures": None}, "architectures"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"torch_dtype": "int4"}, "int4"),
    ({"layer_types": ["chunked_attention"] * 32, "architectures": ["MistralForCausalLM"]},
     "layer_types"),
])
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        _llama(**change)


def test_from_json_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31_8B, "hidden_act": "relu"}))
    with pytest.raises(ValueError, match=r"config.json.*hidden_act"):
        ModelConfig.from_json(tmp_path / "config.json")


def test_every_fixture_config_parses(hf_checkpoints):
    for name, directory in hf_checkpoints.items():
        config = ModelConfig.from_json(f"{directory}/config.json")
        assert config.num_hidden_layers == 2, name
    windows = {name: [ModelConfig.from_json(f"{hf_checkpoints[name]}/config.json")
                      .layer_window(i) for i in range(2)]
               for name in ("mistral", "mistral_window", "qwen2_window", "gemma2", "gemma3")}
    assert windows == {"mistral": [64, 64], "mistral_window": [8, 8], "qwen2_window": [None, 8],
                       "gemma2": [8, None], "gemma3": [8, None]}


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("no-such-model")


# ---- engine options: one table (jpaged.options), checked in one place ----------------------------
# One bad value per option; the test below fails when an option is added without one.
BAD_VALUES = {
    "dtype": "int4", "load_format": "pickle", "block_size": 0, "num_kv_blocks": 1,
    "gpu_memory_utilization": 1.5, "max_num_seqs": -2, "max_model_len": 1.5,
    "max_num_batched_tokens": True, "seed": -1, "attention_backend": "flash",
    "kv_cache_dtype": "int8", "num_scheduler_steps": 0, "async_scheduling": "yes",
    "batch_invariant": 1, "async_depth": 0, "warmup": 1, "strict_compilation": None,
    "compilation_cache_dir": 3,
    "enable_prefix_caching": "no", "preemption_mode": "evict", "swap_space": float("inf"),
    "tensor_parallel_size": 0, "devices": [], "data_parallel_size": 0,
    "logprobs_mode": "logits", "matmul_precision": "float32", "enable_expert_parallel": 1,
}


@pytest.mark.parametrize("name", [o.name for o in OPTIONS])
def test_every_option_refuses_a_bad_value_by_name(name):
    option = options.BY_NAME[name]
    with pytest.raises(OptionError, match=f"^{name} must") as info:
        check_options({name: BAD_VALUES[name]}, for_server=not option.is_keyword)
    assert info.value.option == name


def test_defaults_fill_in_and_unknown_or_misplaced_options_are_errors():
    keyword_defaults = {o.name: o.default for o in OPTIONS if o.is_keyword}
    assert check_options({}) == keyword_defaults
    assert check_options({"block_size": 8})["block_size"] == 8
    with pytest.raises(OptionError, match="unknown option.*block_sise"):
        check_options({"block_sise": 8})
    with pytest.raises(OptionError, match="data_parallel_size"):   # a server flag only
        check_options({"data_parallel_size": 2})
    with pytest.raises(OptionError, match="devices"):              # Python only
        check_options({"devices": ["gpu:0"]}, for_server=True)


@pytest.mark.parametrize("values, name, message", [
    (dict(strict_compilation=True, warmup=False), "strict_compilation", "needs warmup=True"),
    (dict(preemption_mode="swap", swap_space=0), "preemption_mode", "swap_space > 0"),
    (dict(preemption_mode="swap", tensor_parallel_size=2), "preemption_mode", "single-device"),
    (dict(preemption_mode="swap", devices=["d0"]), "preemption_mode", "single-device"),
])
def test_option_combinations_are_checked(values, name, message):
    with pytest.raises(OptionError, match=message) as info:
        check_options(values)
    assert info.value.option == name
    check_options(dict(strict_compilation=True))             # warmup None: decided at start
    check_options(dict(tensor_parallel_size=2))              # preemption "auto": recompute there


def test_engine_config_holds_only_decided_values():
    EngineConfig(num_kv_blocks=8)
    for name, placeholder in [("num_kv_blocks", None), ("max_model_len", None),
                              ("attention_backend", "auto"), ("warmup", None),
                              ("kv_dtype", "auto"), ("matmul_precision", "auto")]:
        with pytest.raises(ValueError, match="decided"):
            EngineConfig(**{"num_kv_blocks": 8, name: placeholder})
    with pytest.raises(OptionError, match="at least 2"):
        EngineConfig(num_kv_blocks=1)
    with pytest.raises(OptionError, match="warmup"):
        EngineConfig(num_kv_blocks=8, strict_compilation=True, warmup=False)
    option_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"kv_dtype", "interpret"}
    assert option_fields <= set(options.BY_NAME)   # same names as the table


def test_options_are_checked_before_a_model_loads(tmp_path):
    from jpaged.engine import LLMEngine
    from jpaged.engine.builder import build_engine_config

    with pytest.raises(OptionError, match="swap_space"):   # not FileNotFoundError
        LLMEngine.from_pretrained(tmp_path / "missing", swap_space=-1)
    with pytest.raises(OptionError, match="^matmul_precision must be one of") as info:
        LLMEngine.from_pretrained(tmp_path / "missing", matmul_precision="tf32")
    assert info.value.option == "matmul_precision"

    class Model:
        mesh = None

    with pytest.raises(OptionError, match="dtype.*when a model is loaded"):
        build_engine_config(Model(), dtype="bfloat16")


def test_readme_options_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    begin = readme.index("<!-- options table:")
    begin = readme.index("\n", begin) + 1
    end = readme.index("<!-- end of options table -->")
    assert readme[begin:end] == options.markdown_table(), \
        "README's options table drifted: paste jpaged.options.markdown_table() between the markers"


def test_llm_docstring_lists_every_keyword_option():
    from jpaged import LLM

    for option in OPTIONS:
        assert (f"\n    {option.name}: " in LLM.__doc__) == option.is_keyword, option.name


def test_options_module_is_a_low_layer():
    """jpaged.options imports no engine, scheduler, model or kernel code (nor jax), and the
    loader's load formats are the table's choices."""
    from jpaged.models.loader import LOAD_FORMATS

    tree = ast.parse((ROOT / "jpaged" / "options.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for a in node.names}
    assert {name for name in imported if name.split(".")[0] in ("jpaged", "jax",
                                                                "pallas_kernels")} \
        == {"jpaged.config"}
    assert LOAD_FORMATS == options.LOAD_FORMATS


def test_matmul_precisions_are_the_models():
    """The option's values are the model's precision names (and "auto"); EngineConfig holds a
    decided one, checked."""
    from jpaged.models.layers import DOT_PRECISIONS

    assert options.MATMUL_PRECISIONS == ("auto", *DOT_PRECISIONS)
    assert EngineConfig(num_kv_blocks=8, matmul_precision="high").matmul_precision == "high"
    with pytest.raises(OptionError, match="matmul_precision") as info:
        EngineConfig(num_kv_blocks=8, matmul_precision="HIGHEST")
    assert info.value.option == "matmul_precision"


@pytest.mark.parametrize("name, expected", [
    # parameter counts as published for these checkpoints (Gemma 3 12B: its text model only)
    ("qwen3-8b", dict(head_dim=128, qk_norm=True, num_parameters=8_190_735_360,
                      scale=128 ** -0.5, windows={None}, caps=(None, None))),
    ("phi-3-mini-4k", dict(head_dim=96, qk_norm=False, num_parameters=3_821_079_552,
                           scale=96 ** -0.5, windows={2047}, caps=(None, None))),
    ("gemma-2-9b", dict(head_dim=256, qk_norm=False, num_parameters=9_241_705_984,
                        scale=256 ** -0.5, windows={4096, None}, caps=(50.0, 30.0))),
    ("gemma-3-12b", dict(head_dim=256, qk_norm=True, num_parameters=11_766_034_176,
                         scale=256 ** -0.5, windows={1024, None}, caps=(None, None))),
])
def test_family_presets(name, expected):
    config = ModelConfig.preset(name)
    assert config.head_dim == expected["head_dim"] and config.qk_norm == expected["qk_norm"]
    assert config.num_parameters() == expected["num_parameters"]
    assert config.attention_scale == pytest.approx(expected["scale"])
    assert {config.layer_window(i) for i in range(config.num_hidden_layers)} == \
        expected["windows"]
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == expected["caps"]
    assert config.max_model_len == config.max_position_embeddings


def test_gemma_layer_patterns_and_ropes():
    gemma2 = ModelConfig.preset("gemma-2-9b")
    assert gemma2.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.is_gemma
    assert gemma2.tie_word_embeddings
    gemma3 = ModelConfig.preset("gemma-3-12b")
    full = [i for i in range(48) if gemma3.layer_window(i) is None]
    assert full == list(range(5, 48, 6))                     # every sixth layer is global
    assert gemma3.layer_rope(5) == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert gemma3.layer_rope(0) == RopeConfig(theta=1e4)      # rope_local_base_freq
    # transformers 5 writes one rope_parameters dict per layer type; both forms read alike
    new_style = {k: v for k, v in json.loads(
        (PRESETS_DIR / "gemma-3-12b.json").read_text()).items()
        if k not in ("rope_scaling", "rope_theta", "rope_local_base_freq")}
    new_style["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    assert ModelConfig.from_dict(new_style) == gemma3
    defaults = ModelConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], "vocab_size": 64,
                                      "hidden_size": 64, "intermediate_size": 64,
                                      "num_hidden_layers": 2, "num_attention_heads": 2})
    # an absent field takes transformers' Gemma2Config default, not the generic one
    assert (defaults.head_dim, defaults.attn_logit_softcapping,
            defaults.final_logit_softcapping, defaults.attention_scale) == (256, 50.0, 30.0,
                                                                            256 ** -0.5)


def test_phi3_longrope_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rng = np.random.default_rng(0)
    short, long = (1 + rng.random(12)).tolist(), (2 + 4 * rng.random(12)).tolist()
    raw = dict(architectures=["Phi3ForCausalLM"], vocab_size=64, hidden_size=128,
               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=4096, original_max_position_embeddings=256,
               partial_rotary_factor=0.75, rope_theta=10000.0,
               rope_scaling={"type": "su", "short_factor": short, "long_factor": long,
                             "original_max_position_embeddings": 256})
    rope = ModelConfig.from_dict(raw).rope
    hf_config = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    short_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None)
    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=257)
    assert rope.rope_type == "longrope" and rope.rotary_dim(32) == 24
    np.testing.assert_allclose(rope.inv_frequencies(32), short_freq.numpy(), rtol=1e-6)
    np.testing.assert_allclose(rope.long_inv_frequencies(32), long_freq.numpy(), rtol=1e-6)
    assert rope.attention_scaling == pytest.approx(attention_factor)
    assert attention_factor > 1.0


def test_multimodal_gemma3_serves_its_text_config():
    """gemma-3-12b-it's config.json (Gemma3ForConditionalGeneration): the text_config, with
    transformers' defaults for the fields it omits, and the top-level dtype and eos."""
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
           "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
           "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
           "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
           "text_config": {"hidden_size": 3840, "intermediate_size": 15360,
                           "model_type": "gemma3_text", "num_attention_heads": 16,
                           "num_hidden_layers": 48, "num_key_value_heads": 8,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}
    config = ModelConfig.from_dict(hub)
    assert config.checkpoint_prefix == "language_model."
    assert dataclasses.replace(config, architecture="Gemma3ForCausalLM") == \
        ModelConfig.preset("gemma-3-12b")
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({k: v for k, v in hub.items() if k != "text_config"})
