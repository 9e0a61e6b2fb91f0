"""Frozen model configuration read from Hugging Face `config.json` field names, plus presets."""

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

PRESETS_DIR = Path(__file__).resolve().parent / "presets"   # package data: works from a wheel

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float": "float32"}

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
}
_READ = {
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "eos_token_id", "rope_parameters", "rope_scaling", "rope_theta",
    "partial_rotary_factor", "attention_bias", "mlp_bias", "tie_word_embeddings", "torch_dtype",
    "dtype", "hidden_act", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types",
}


def normalize_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16' etc.; raise ValueError naming the value if unknown."""
    name = _DTYPE_ALIASES.get(str(name), str(name))
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `rope_type` is 'default', 'linear' or 'llama3'."""
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported "
                             "(supported: default, linear, llama3)")

    def inv_frequencies(self, head_dim: int) -> np.ndarray:
        """Per-pair inverse frequencies [D/2], float64, with the configured scaling applied."""
        inv_freq = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        if self.rope_type == "linear":
            return inv_freq / self.factor
        if self.rope_type == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * np.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return np.where(is_medium, smoothed, scaled)
        return inv_freq


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder, in Hugging Face's field names where they exist.

    Which projections carry a bias depends on the architecture, not only on `attention_bias`:
    Llama biases q, k, v and o when `attention_bias` is set, Qwen2 always biases q, k, v and never
    o, Mistral has none. `qkv_bias` / `o_proj_bias` / `mlp_bias` hold the resolved answer.

    `sliding_window` (None = full attention in every layer): attention here is always full causal,
    which equals sliding-window attention while a sequence holds at most `sliding_window` tokens,
    so `max_model_len` is capped there instead of rejecting such models (Mistral 7B v0.1).
    """
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"
    eos_token_ids: tuple = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architectures: {self.architecture!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        normalize_dtype(self.torch_dtype)

    @property
    def model_type(self) -> str:
        return {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2"}[self.architecture]

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) this model computes exactly."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    def kv_bytes_per_token(self, dtype: str) -> int:
        """2 (K and V) x layers x kv heads x head dim x element bytes."""
        return (2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
                * DTYPE_BYTES[normalize_dtype(dtype)])

    def num_parameters(self) -> int:
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        attn = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        attn += (q_out + 2 * kv_out) * self.qkv_bias + self.hidden_size * self.o_proj_bias
        mlp = 3 * self.hidden_size * self.intermediate_size
        mlp += (2 * self.intermediate_size + self.hidden_size) * self.mlp_bias
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_hidden_layers * per_layer + embed + head + self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face config dict; unknown keys are errors naming the key."""
        raw = dict(raw)
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{source}: field 'architectures' is missing")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{source}: field 'architectures' names {arch!r}, which is not "
                             f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        for key in required:
            if raw.get(key) is None:
                raise ValueError(f"{source}: required field {key!r} is missing")
        unknown = sorted(set(raw) - _READ - _KNOWN_UNUSED)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: field 'hidden_act' is {raw['hidden_act']!r}; "
                             "only 'silu' is supported")
        heads = int(raw["num_attention_heads"])
        qkv_bias, o_proj_bias, mlp_bias = _read_biases(raw, arch)
        try:
            return cls(
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
                rope=_read_rope(raw, source),
                qkv_bias=qkv_bias, o_proj_bias=o_proj_bias, mlp_bias=mlp_bias,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                sliding_window=_read_sliding_window(raw, arch, source),
                torch_dtype=normalize_dtype(raw.get("torch_dtype") or raw.get("dtype")
                                            or "float32"),
                eos_token_ids=read_eos_token_ids(raw.get("eos_token_id")),
            )
        except ValueError as err:
            if source in str(err):
                raise
            raise ValueError(f"{source}: {err}") from err

    @classmethod
    def from_json(cls, path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from err
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A config shipped in the package, jpaged/presets/<name>.json (e.g. 'llama3-70b')."""
        path = PRESETS_DIR / f"{name}.json"
        if not path.is_file():
            known = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))
            raise ValueError(f"unknown model preset {name!r}; known: {known}")
        return cls.from_json(path)


def read_eos_token_ids(value) -> tuple:
    """`eos_token_id` as Hugging Face writes it (None, an int or a list) -> tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _read_biases(raw: dict, arch: str) -> tuple[bool, bool, bool]:
    """(qkv_bias, o_proj_bias, mlp_bias) as each transformers architecture builds its Linears."""
    if arch == "Qwen2ForCausalLM":
        return True, False, False
    if arch == "MistralForCausalLM":
        return False, False, False
    attention_bias = bool(raw.get("attention_bias", False))
    return attention_bias, attention_bias, bool(raw.get("mlp_bias", False))


def _read_sliding_window(raw: dict, arch: str, source: str) -> int | None:
    """The window of any sliding-window layer, or None when every layer attends fully."""
    if arch == "LlamaForCausalLM":
        return None  # transformers' Llama has no sliding window, whatever the config says
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{source}: field 'layer_types' has unsupported types {unknown}")
        is_sliding = "sliding_attention" in layer_types
    elif arch == "Qwen2ForCausalLM":
        is_sliding = bool(raw.get("use_sliding_window", False)) and int(
            raw.get("max_window_layers", 28)) < int(raw["num_hidden_layers"])
    else:
        is_sliding = True
    return int(window) if is_sliding and window is not None else None


def _read_rope(raw: dict, source: str) -> RopeConfig:
    """Read both transformers 5 `rope_parameters` and the older `rope_theta` + `rope_scaling`."""
    if float(raw.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(f"{source}: field 'partial_rotary_factor' must be 1.0, "
                         f"got {raw['partial_rotary_factor']}")
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    try:
        return RopeConfig(
            theta=theta, rope_type=rope_type,
            factor=float(merged.get("factor", 1.0)),
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", 8192)),
        )
    except ValueError as err:
        raise ValueError(f"{source}: field 'rope_scaling': {err}") from err
