"""Tunix's model parameters as jpaged weights: the name and layout map for the decoder families
both libraries hold (Tunix's `Llama3`, `Qwen2`, `Qwen3` in `tunix.models.*`), jpaged's
`ModelConfig` of a Tunix model (`model_config`), and the check that a Tunix model config and
jpaged's `ModelConfig` describe the same network.

Tunix keeps projections as einsum weights: q/k/v `[E, H, D]` (E embed, H heads, D head dim),
o `[H, D, E]`, MLP kernels `[in, out]`, the unembedding `[E, V]`. Hugging Face stores every
projection `[out, in]`. The conversion is reshapes and transposes in one jitted program, so
parameters already on jpaged's devices never pass through the host.
"""

import functools
import re

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.config import ModelConfig

# Tunix path pattern -> (Hugging Face name template, layout kind).
_NAME_MAP = (
    (r"embedder\.input_embedding", "model.embed_tokens.weight", "same"),
    (r"final_norm\.w", "model.norm.weight", "same"),
    (r"lm_head\.w", "lm_head.weight", "transpose"),
    (r"layers\.(\d+)\.attn\.(q|k|v)_proj\.w", r"model.layers.\1.self_attn.\2_proj.weight",
     "heads_in"),
    (r"layers\.(\d+)\.attn\.o_proj\.w", r"model.layers.\1.self_attn.o_proj.weight", "heads_out"),
    (r"layers\.(\d+)\.attn\.(q|k|v)_bias", r"model.layers.\1.self_attn.\2_proj.bias", "flat"),
    (r"layers\.(\d+)\.attn\.(q|k)_norm\.w", r"model.layers.\1.self_attn.\2_norm.weight", "same"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.kernel", r"model.layers.\1.mlp.\2_proj.weight",
     "transpose"),
    (r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.w",
     r"model.layers.\1.\2.weight", "same"),
)

# Tunix class name -> (the Hugging Face architecture jpaged loads, whether its rope theta is the
# config's). Tunix 0.1.7's Llama3 and Qwen3 attention call `apply_rope` without a theta, so they
# rotate with its default 1e6 whatever `rope_theta` says; only Qwen2 passes the config's.
FAMILIES = {
    "Llama3": ("LlamaForCausalLM", False),
    "Qwen2": ("Qwen2ForCausalLM", True),
    "Qwen3": ("Qwen3ForCausalLM", False),
}
TUNIX_DEFAULT_ROPE_THETA = 1_000_000.0


def hf_name(path: str) -> tuple[str, str]:
    """(Hugging Face tensor name, layout kind) of a Tunix parameter path ('layers.0.attn.q_proj.w');
    ValueError for a parameter jpaged has no place for (LoRA adapters, MoE experts)."""
    for pattern, template, kind in _NAME_MAP:
        match = re.fullmatch(pattern, path)
        if match:
            return match.expand(template), kind
    raise ValueError(f"Tunix parameter {path} has no jpaged counterpart (supported: dense "
                     "Llama3 / Qwen2 / Qwen3 weights; merge LoRA adapters first)")


def _to_hf(kind: str, array: jax.Array) -> jax.Array:
    if kind == "transpose":
        return array.T
    if kind == "heads_in":      # [E, H, D] -> [H*D, E]
        return array.reshape(array.shape[0], -1).T
    if kind == "heads_out":     # [H, D, E] -> [E, H*D]
        return array.reshape(-1, array.shape[-1]).T
    if kind == "flat":          # a bias [H*D] (or [H, D]) -> [H*D]
        return array.reshape(-1)
    return array


@functools.partial(jax.jit, static_argnums=0)
def _convert(kinds: tuple, arrays: dict) -> dict:
    """kinds: ((name, layout kind), ...), static so one program serves every sync."""
    return {name: _to_hf(kind, arrays[name]) for name, kind in kinds}


def flat_params(state) -> dict[str, jax.Array]:
    """{'layers.0.attn.q_proj.w': array} of an nnx State (or any nested mapping of arrays)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    flat = {}
    for path, leaf in leaves:
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        keys = [k for k in keys if k not in ("value", "raw_value")]
        flat[".".join(keys)] = leaf
    return flat


def hf_weights(state, *, tie_word_embeddings: bool) -> dict[str, jax.Array]:
    """{Hugging Face name: array in the checkpoint's layout} from a Tunix model's Param state,
    converted where the arrays live (no host round trip). A tied model gets no lm_head."""
    kinds, arrays = [], {}
    for path, array in flat_params(state).items():
        name, kind = hf_name(path)
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        kinds.append((name, kind))
        arrays[name] = array
    return _convert(tuple(sorted(kinds)), arrays)


def model_config(tunix_model, *, max_model_len: int, eos_token_ids=()) -> ModelConfig:
    """jpaged's `ModelConfig` of the network a Tunix model computes: its family's architecture,
    its sizes, the RoPE theta it really rotates with, untied or tied embeddings, and the dtype
    of its parameters. Tunix models have no position limit: max_model_len is the engine's.
    ValueError naming what jpaged cannot compute (a family or a field it does not hold)."""
    family = _family(tunix_model)
    architecture, reads_theta = FAMILIES[family]
    tunix = tunix_model.config
    if getattr(tunix, "num_experts", None):
        raise ValueError(f"num_experts: the Tunix {family} model is a mixture of "
                         f"{tunix.num_experts} experts; the rollout holds dense models only")
    dtypes = {leaf.dtype for leaf in jax.tree_util.tree_leaves(nnx.state(tunix_model,
                                                                          nnx.Param))}
    if len(dtypes) != 1:
        raise ValueError(f"dtype: the Tunix {family} model's parameters mix "
                         f"{sorted(str(d) for d in dtypes)}; give the rollout one dtype "
                         "(its `dtype` option)")
    raw = {
        "architectures": [architecture],
        "num_hidden_layers": tunix.num_layers, "vocab_size": tunix.vocab_size,
        "hidden_size": tunix.embed_dim, "intermediate_size": tunix.hidden_dim,
        "num_attention_heads": tunix.num_heads, "num_key_value_heads": tunix.num_kv_heads,
        "head_dim": tunix.head_dim, "rms_norm_eps": float(tunix.norm_eps),
        "rope_theta": float(tunix.rope_theta) if reads_theta else TUNIX_DEFAULT_ROPE_THETA,
        "tie_word_embeddings": _is_tied(tunix), "hidden_act": "silu",
        "max_position_embeddings": int(max_model_len), "torch_dtype": str(dtypes.pop()),
        "eos_token_id": list(eos_token_ids),
    }
    config = ModelConfig.from_dict(raw, source=f"the Tunix {family} model's config")
    check_configs(tunix_model, config)
    return config


def _family(tunix_model) -> str:
    family = type(tunix_model).__name__
    if family not in FAMILIES:
        raise ValueError(f"Tunix model {family} is not supported (supported: "
                         f"{', '.join(FAMILIES)})")
    return family


def _is_tied(tunix) -> bool:
    return bool(getattr(tunix, "weight_tying", getattr(tunix, "use_tied_embedding", False)))


def check_configs(tunix_model, jpaged_config) -> None:
    """ValueError naming the first field where the Tunix model and jpaged's model differ: a
    rollout that computes another function than the trainer would make every logprob wrong."""
    family = _family(tunix_model)
    architecture, reads_theta = FAMILIES[family]
    tunix = tunix_model.config
    for field, ours, theirs in _field_pairs(tunix, jpaged_config, reads_theta, architecture):
        if ours != theirs:
            raise ValueError(f"{field}: jpaged's model has {ours!r}, the Tunix {family} model "
                             f"computes with {theirs!r}; rollout and trainer would disagree")


def _field_pairs(tunix, config, reads_theta: bool, architecture: str):
    theta = float(tunix.rope_theta) if reads_theta else TUNIX_DEFAULT_ROPE_THETA
    yield "architecture", config.architecture, architecture
    yield "num_hidden_layers", config.num_hidden_layers, tunix.num_layers
    yield "vocab_size", config.vocab_size, tunix.vocab_size
    yield "hidden_size", config.hidden_size, tunix.embed_dim
    yield "intermediate_size", config.intermediate_size, tunix.hidden_dim
    yield "num_attention_heads", config.num_attention_heads, tunix.num_heads
    yield "num_key_value_heads", config.num_key_value_heads, tunix.num_kv_heads
    yield "head_dim", config.head_dim, tunix.head_dim
    yield "rms_norm_eps", float(config.rms_norm_eps), float(tunix.norm_eps)
    yield "tie_word_embeddings", config.tie_word_embeddings, _is_tied(tunix)
    yield "rope_theta", float(config.rope.theta), theta
    # Tunix has no rope scaling (no llama3 / linear / longrope frequencies) and rotates every dim
    yield "rope_scaling", config.rope.rope_type, "default"
    yield "partial_rotary_factor", config.rope.partial_rotary_factor, 1.0
    yield "sliding_window", config.sliding_window, None
    yield "hidden_act", config.hidden_act, "silu"
    if getattr(tunix, "num_experts", None):
        yield "num_experts", None, tunix.num_experts
