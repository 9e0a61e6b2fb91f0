"""Frozen model configuration read from Hugging Face `config.json` field names, plus presets.
Reading a config.json is in `hf_config`; the rotary embedding and mixture-of-experts parts are
in `rope_config` and `experts_config`."""

import dataclasses
import json
from pathlib import Path
from typing import Any

from jpaged.experts_config import ExpertsConfig
from jpaged.hf_config import (ACTIVATIONS, DTYPE_BYTES, GEMMA_ARCHITECTURES, LAYER_TYPES,
                              MODEL_TYPES, SUPPORTED_ARCHITECTURES, normalize_dtype,
                              read_config_fields)
from jpaged.rope_config import RopeConfig

PRESETS_DIR = Path(__file__).resolve().parent / "presets"   # package data: works from a wheel


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder of the Llama family (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3), in Hugging
    Face's field names where they exist.

    Which projections carry a bias depends on the architecture, not only on `attention_bias`:
    Llama biases q, k, v and o when `attention_bias` is set (Qwen3 and Gemma too), Qwen2 always
    biases q, k, v and never o, Mistral and Phi-3 have none. `qkv_bias` / `o_proj_bias` /
    `mlp_bias` hold the resolved answer.

    Attention per layer: `layer_types[i]` is "full_attention" or "sliding_attention" (a query at
    position p sees keys k with p - sliding_window < k <= p); layer_types None means every layer
    slides when `sliding_window` is set. `local_rope` (Gemma 3) rotates the sliding layers, `rope`
    the others. `qk_norm`: RMSNorm over each query and key head before the rotation (Qwen3,
    Gemma 3). `query_pre_attn_scalar` sets the attention scale (its -1/2 power; default head_dim);
    `attn_logit_softcapping` / `final_logit_softcapping` replace a score or logit s by
    c * tanh(s / c). Gemma decoders (`is_gemma`) also scale embeddings by sqrt(hidden_size), use
    RMSNorm with (1 + weight) and norm both before and after attention and the MLP.
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
    layer_types: tuple | None = None
    local_rope: RopeConfig | None = None
    hidden_act: str = "silu"
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    experts: ExpertsConfig | None = None

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
        if self.head_dim % 8:  # the kernels tile the head dim in multiples of 8
            raise ValueError(f"head_dim must be a multiple of 8, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive or None, got {getattr(self, name)}")
        self._normalize_layer_types()
        self._check_rope(self.rope, "rope_scaling")
        if self.local_rope is not None:
            self._check_rope(self.local_rope, "rope_local_base_freq")
            if self.local_rope.partial_rotary_factor != self.rope.partial_rotary_factor:
                raise ValueError("rope_local_base_freq: the sliding layers' rope must rotate "
                                 "as many dims as the others' (one packed head layout)")
        normalize_dtype(self.torch_dtype)
        if self.experts is not None and len(self.experts.sparse_layers) != self.num_hidden_layers:
            raise ValueError(f"experts: {len(self.experts.sparse_layers)} layer flags for "
                             f"{self.num_hidden_layers} layers")

    def _normalize_layer_types(self):
        layer_types = self.layer_types
        if layer_types is None:
            layer_types = (LAYER_TYPES[self.sliding_window is not None],) * self.num_hidden_layers
        object.__setattr__(self, "layer_types", tuple(layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types has unsupported types {unknown}")

    def _check_rope(self, rope: RopeConfig, field: str):
        rotary_dim = rope.rotary_dim(self.head_dim)
        if rotary_dim % 2 or (self.head_dim - rotary_dim) % 2:
            raise ValueError(f"head_dim ({self.head_dim}) and its rotated dims ({rotary_dim}) "
                             "must be even for rotary embeddings")
        if rope.partial_rotary_factor != 1.0 and self.qk_norm:
            raise ValueError("partial_rotary_factor < 1 with q/k norms is not supported")
        if rope.rope_type == "longrope" and len(rope.short_factor) != rotary_dim // 2:
            raise ValueError(f"{field}: short_factor and long_factor need {rotary_dim // 2} "
                             f"entries (rotated dims / 2), got {len(rope.short_factor)}")

    @property
    def model_type(self) -> str:
        return MODEL_TYPES[self.architecture]

    @property
    def is_gemma(self) -> bool:
        """Gemma 2/3 decoder: (1 + weight) RMSNorms before and after attention and the MLP,
        embeddings scaled by sqrt(hidden_size)."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def has_fused_checkpoint(self) -> bool:
        """The checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`."""
        return self.architecture == "Phi3ForCausalLM"

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (`experts`)."""
        return self.experts is not None and self.experts.sparse_layers[layer]

    @property
    def checkpoint_prefix(self) -> str:
        """Where the checkpoint keeps the served model's tensors (its other tensors, a vision
        tower's, are not read): Gemma 3's multimodal checkpoints nest the text model."""
        return "language_model." if self.architecture == "Gemma3ForConditionalGeneration" else ""

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it attends to every earlier token
        (also for a window covering max_position_embeddings, which excludes nothing)."""
        window = self.sliding_window
        if (self.layer_types[layer] != "sliding_attention" or window is None
                or window >= self.max_position_embeddings):
            return None
        return window

    @property
    def window_of_every_layer(self) -> int | None:
        """The window when every layer slides the same one (a sequence's blocks behind it are
        never read again), else None."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def num_sliding_layers(self) -> int:
        """Layers whose attention a sliding window bounds (`layer_window`)."""
        return sum(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.layer_types[layer] == "sliding_attention" and self.local_rope is not None:
            return self.local_rope
        return self.rope

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) this model computes exactly."""
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: str) -> int:
        """2 (K and V) x layers x kv heads x head dim x element bytes."""
        return (2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
                * DTYPE_BYTES[normalize_dtype(dtype)])

    def num_parameters(self, *, active: bool = False) -> int:
        """Parameters of the model; active: those one token reads (a mixture of experts' chosen
        experts only; the same as all of them for a dense model)."""
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        attn = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        attn += (q_out + 2 * kv_out) * self.qkv_bias + self.hidden_size * self.o_proj_bias
        attn += 2 * self.head_dim * self.qk_norm
        norms = (4 if self.is_gemma else 2) * self.hidden_size
        layers = sum(attn + norms + self._mlp_parameters(i, active=active)
                     for i in range(self.num_hidden_layers))
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return layers + embed + head + self.hidden_size

    def weight_bytes(self, *, active: bool = False) -> int:
        """Bytes of the weights in the checkpoint's dtype (`torch_dtype`); active: those one
        token reads (`num_parameters`)."""
        return self.num_parameters(active=active) * DTYPE_BYTES[self.torch_dtype]

    def _mlp_parameters(self, layer: int, *, active: bool) -> int:
        """Layer `layer`'s MLP parameters: a dense MLP's, or the router's and its experts' (the
        experts one token runs when `active`)."""
        if self.is_sparse_layer(layer):
            experts = self.experts
            count = experts.num_experts_per_tok if active else experts.num_local_experts
            return (experts.num_local_experts * self.hidden_size
                    + count * 3 * self.hidden_size * experts.moe_intermediate_size)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return mlp + (2 * self.intermediate_size + self.hidden_size) * self.mlp_bias

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face config dict; unknown keys are errors naming the key."""
        fields = read_config_fields(raw, source)
        try:
            return cls(**fields)
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
