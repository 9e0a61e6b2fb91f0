"""Reading a Hugging Face `config.json`: the architectures, field names, defaults and value
vocabularies transformers uses, turned into `ModelConfig`'s fields (`read_config_fields`)."""

from typing import Any

from jpaged.experts_config import canonical_expert_count, read_experts
from jpaged.rope_config import read_ropes

# architecture -> Hugging Face model_type
MODEL_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text", "Gemma3ForConditionalGeneration": "gemma3",
    "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM",) + GEMMA3_ARCHITECTURES
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float": "float32"}

# The defaults transformers' config classes apply to an absent field, where they differ from
# the generic reading below (a Gemma 2 config.json without `attn_logit_softcapping` soft-caps
# at 50 in transformers, so it must here too).
_GEMMA_DEFAULTS = {"head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256,
                   "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"}
_DEFAULTS = {
    "MistralForCausalLM": {"sliding_window": 4096},
    "Qwen2ForCausalLM": {"sliding_window": 4096, "max_window_layers": 28},
    "Qwen3ForCausalLM": {"head_dim": 128, "sliding_window": 4096, "max_window_layers": 28},
    "Phi3ForCausalLM": {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    "MixtralForCausalLM": {"max_position_embeddings": 4096 * 32, "rope_theta": 1e6,
                           "num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen3MoeForCausalLM": {"sliding_window": 4096, "num_experts": 128,
                            "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "Gemma2ForCausalLM": {**_GEMMA_DEFAULTS, "max_position_embeddings": 8192,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {**_GEMMA_DEFAULTS, "max_position_embeddings": 131072,
                          "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                          "sliding_window_pattern": 6, "vocab_size": 262208,
                          "hidden_size": 2304, "intermediate_size": 9216,
                          "num_hidden_layers": 26, "num_attention_heads": 8,
                          "num_key_value_heads": 4},
}
_DEFAULTS["Gemma3ForConditionalGeneration"] = _DEFAULTS["Gemma3ForCausalLM"]
# Gemma3ForConditionalGeneration: its text model is served; these top-level fields describe the
# vision side (ignored) or apply to the text model (dtype, eos, tied embeddings)
_MULTIMODAL_FIELDS = {"text_config", "vision_config", "boi_token_index", "eoi_token_index",
                      "image_token_index", "mm_tokens_per_image"}
_TEXT_FIELDS_AT_TOP = ("torch_dtype", "dtype", "eos_token_id", "tie_word_embeddings")

# config.json keys that are read elsewhere or do not change the computation (training, export and
# generation settings). Anything not here and not read below is an error naming the key.
_KNOWN_UNUSED = {
    "_name_or_path", "transformers_version", "use_cache", "pretraining_tp", "initializer_range",
    "bos_token_id", "pad_token_id", "attention_dropout", "use_mrope", "output_attentions",
    "model_type", "return_dict", "output_hidden_states", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "tokenizer_class", "task_specific_params", "cross_attention_hidden_size", "prefix",
    "sep_token_id", "decoder_start_token_id", "tf_legacy_loss", "pruned_heads", "torchscript",
    "finetuning_task", "num_labels", "use_bfloat16", "qkv_bias",
    "embd_pdrop", "resid_pdrop", "auto_map", "cache_implementation", "_sliding_window_pattern",
    "sliding_window_size", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
}
_READ = {
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "eos_token_id", "rope_parameters", "rope_scaling", "rope_theta",
    "partial_rotary_factor", "attention_bias", "mlp_bias", "tie_word_embeddings", "torch_dtype",
    "dtype", "hidden_act", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "original_max_position_embeddings", "hidden_activation",
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "rope_local_base_freq", "sliding_window_pattern", "use_bidirectional_attention",
    "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
}


def normalize_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16' etc.; raise ValueError naming the value if unknown."""
    name = _DTYPE_ALIASES.get(str(name), str(name))
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    return name


def read_config_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """ModelConfig's fields from a Hugging Face config dict, as transformers reads each
    architecture's config; unknown keys, unsupported values and missing required fields are
    ValueErrors naming the source and the field."""
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{source}: field 'architectures' is missing")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{source}: field 'architectures' names {arch!r}, which is not "
                         f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch == "Gemma3ForConditionalGeneration":
        raw = _text_config(raw, source)
    unknown = sorted(set(raw) - _READ - _KNOWN_UNUSED)
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {unknown}")
    raw = {**_DEFAULTS.get(arch, {}), **canonical_expert_count(raw, source)}
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    for key in required:
        if raw.get(key) is None:
            raise ValueError(f"{source}: required field {key!r} is missing")
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: field 'use_bidirectional_attention' is set; only "
                         "causal decoders are supported")
    heads = int(raw["num_attention_heads"])
    qkv_bias, o_proj_bias, mlp_bias = _read_biases(raw, arch)
    sliding_window, layer_types = _read_layer_types(raw, arch, source)
    rope, local_rope = read_ropes(raw, source, is_gemma3=arch in GEMMA3_ARCHITECTURES,
                                  is_phi3=arch == "Phi3ForCausalLM")
    is_gemma = arch in GEMMA_ARCHITECTURES
    activation_field = "hidden_activation" if is_gemma else "hidden_act"
    try:   # a value of the wrong kind (int('x'), an unknown dtype) names the source too
        return dict(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            rope=rope, local_rope=local_rope,
            qkv_bias=qkv_bias, o_proj_bias=o_proj_bias, mlp_bias=mlp_bias,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=sliding_window, layer_types=layer_types,
            torch_dtype=normalize_dtype(raw.get("torch_dtype") or raw.get("dtype")
                                        or "float32"),
            eos_token_ids=read_eos_token_ids(raw.get("eos_token_id")),
            hidden_act=_read_activation(raw, activation_field, source),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") + GEMMA3_ARCHITECTURES,
            query_pre_attn_scalar=_optional_float(raw, "query_pre_attn_scalar", is_gemma),
            # Gemma 3's attention never soft-caps in transformers, whatever its config says
            attn_logit_softcapping=_optional_float(raw, "attn_logit_softcapping",
                                                   arch == "Gemma2ForCausalLM"),
            final_logit_softcapping=_optional_float(raw, "final_logit_softcapping",
                                                    is_gemma),
            experts=read_experts(raw, arch),
        )
    except ValueError as err:
        if source in str(err):
            raise
        raise ValueError(f"{source}: {err}") from err


def read_eos_token_ids(value) -> tuple:
    """`eos_token_id` as Hugging Face writes it (None, an int or a list) -> tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _text_config(raw: dict, source: str) -> dict:
    """A multimodal config's text model as a config of its own (top-level dtype, eos and tied
    embeddings apply to it, as in transformers)."""
    unknown = sorted(set(raw) - _MULTIMODAL_FIELDS - set(_TEXT_FIELDS_AT_TOP) - _KNOWN_UNUSED
                     - {"architectures"})
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {unknown}")
    if not isinstance(raw.get("text_config"), dict):
        raise ValueError(f"{source}: field 'text_config' is missing")
    text = {**raw["text_config"], **{k: raw[k] for k in _TEXT_FIELDS_AT_TOP if k in raw}}
    return {**text, "architectures": raw["architectures"]}


def _optional_float(raw: dict, field: str, is_read: bool) -> float | None:
    """raw[field] as a float where this architecture reads it (None when absent or null)."""
    value = raw.get(field) if is_read else None
    return None if value is None else float(value)


def _read_activation(raw: dict, field: str, source: str) -> str:
    activation = raw.get(field) or "silu"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{source}: field {field!r} is {activation!r}; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    return activation


def _read_biases(raw: dict, arch: str) -> tuple[bool, bool, bool]:
    """(qkv_bias, o_proj_bias, mlp_bias) as each transformers architecture builds its Linears."""
    if arch == "Qwen2ForCausalLM":
        return True, False, False
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        return False, False, False
    attention_bias = bool(raw.get("attention_bias", False))
    mlp_bias = arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False))
    return attention_bias, attention_bias, mlp_bias


def _read_layer_types(raw: dict, arch: str, source: str) -> tuple[int | None, tuple]:
    """(sliding_window, layer_types) as each transformers architecture builds its masks."""
    layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{source}: field 'layer_types' has unsupported types {unknown}")
        if len(layer_types) != layers:
            raise ValueError(f"{source}: field 'layer_types' has {len(layer_types)} entries for "
                             f"{layers} layers")
    window = raw.get("sliding_window")
    if arch == "LlamaForCausalLM":
        window = None  # transformers' Llama has no sliding window, whatever the config says
    elif arch in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        layer_types = None  # one window for every layer (transformers ignores layer_types)
    elif arch == "Qwen3MoeForCausalLM":  # every layer slides when use_sliding_window is set
        window = window if raw.get("use_sliding_window", False) else None
        layer_types = None
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = window if raw.get("use_sliding_window", False) else None
        first_sliding = int(raw["max_window_layers"])
        layer_types = layer_types or [LAYER_TYPES[i >= first_sliding] for i in range(layers)]
    else:  # Gemma 2 alternates from a sliding first layer; Gemma 3 slides 5 layers in 6
        pattern = int(raw["sliding_window_pattern"]) if "Gemma3" in arch else 2
        layer_types = layer_types or [LAYER_TYPES[bool((i + 1) % pattern)]
                                      for i in range(layers)]
    if window is None or (layer_types is not None and LAYER_TYPES[1] not in layer_types):
        return None, None
    return int(window), None if layer_types is None else tuple(layer_types)
