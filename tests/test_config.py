"""ModelConfig reads Hugging Face config.json (old and transformers 5 style); errors name fields."""

import json

import numpy as np
import pytest

from jpaged.config import ModelConfig, RopeConfig

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
    ("MistralForCausalLM", {"sliding_window": None}, None),
    ("Qwen2ForCausalLM", {"sliding_window": 131072, "use_sliding_window": False}, None),
    ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True,
                          "max_window_layers": 28}, 4096),
    ("Qwen2ForCausalLM", {"sliding_window": 4096, "use_sliding_window": True,
                          "max_window_layers": 32}, None),
    ("Qwen2ForCausalLM", {"sliding_window": 4096,
                          "layer_types": ["full_attention"] * 32}, None),
    ("LlamaForCausalLM", {"sliding_window": 4096}, None),
])
def test_sliding_window_caps_max_model_len(arch, extra, window):
    config = _llama(architectures=[arch], max_position_embeddings=32768, **extra)
    assert config.sliding_window == window
    assert config.max_model_len == (window or 32768)


def test_explicit_and_derived_head_dim():
    assert _llama(head_dim=64).head_dim == 64
    assert _llama(head_dim=None).head_dim == 128


@pytest.mark.parametrize("eos, expected", [(None, ()), (2, (2,)), ([1, 2], (1, 2))])
def test_eos_token_id_forms(eos, expected):
    assert _llama(eos_token_id=eos).eos_token_ids == expected


@pytest.mark.parametrize("change, field", [
    ({"quantization_config": {"bits": 4}}, "quantization_config"),
    ({"hidden_act": "gelu"}, "hidden_act"),
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
    mistral = ModelConfig.from_json(f"{hf_checkpoints['mistral']}/config.json")
    assert mistral.max_model_len == 64


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("no-such-model")
