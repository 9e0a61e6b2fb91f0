"""Tiny random Hugging Face checkpoints, written with transformers (torch CPU) via save_pretrained.

Every builder writes one model directory and returns nothing; `build_all(root)` writes them all
under root and returns {name: directory}. Weights are random but every parameter is perturbed
(biases non-zero, norm weights away from one) so a mis-loaded tensor changes the logits.
"""

import json
from pathlib import Path

VOCAB_SIZE = 320
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.08,
               bos_token_id=0, eos_token_id=1)
_TOKENIZER_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "PagedAttention stores the KV cache in fixed-size blocks.",
    "JAX compiles the whole step; the scheduler stays on the host.",
    "Hello, world! Hello, jpaged. 0123456789",
]


def _perturb(model, seed: int):
    """Re-draw biases and norm weights so they matter (transformers inits them to 0 and 1)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))


def _save(model_cls, config, out_dir: Path, *, seed: int, dtype=None, **save_kwargs):
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _perturb(model, seed)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out_dir, **save_kwargs)


def build_llama_mha(out_dir: Path):
    """Llama 2 shape: multi-head attention (K == H), default RoPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **_COMMON)
    _save(LlamaForCausalLM, config, out_dir, seed=1)


def build_llama_gqa(out_dir: Path):
    """Llama 3.1 shape: GQA, llama3 RoPE scaling, eos list, and a byte-level BPE tokenizer.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=32)
    common = dict(_COMMON, eos_token_id=[1, 2])
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                         **common)
    _save(LlamaForCausalLM, config, out_dir, seed=2)
    write_tokenizer(out_dir)


def build_mistral(out_dir: Path):
    """Mistral: GQA, no biases, a sliding window shorter than max_position_embeddings."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(num_attention_heads=4, num_key_value_heads=2,
                           **dict(_COMMON, max_position_embeddings=128), sliding_window=64)
    _save(MistralForCausalLM, config, out_dir, seed=3)


def build_qwen2(out_dir: Path):
    """Qwen2: q/k/v bias (no o_proj bias), tied input/output embeddings."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         **_COMMON)
    _save(Qwen2ForCausalLM, config, out_dir, seed=4)


def build_llama_head_dim(out_dir: Path):
    """Explicit head_dim (32) != hidden_size / heads (16); Llama attention and MLP biases on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         attention_bias=True, mlp_bias=True, **_COMMON)
    _save(LlamaForCausalLM, config, out_dir, seed=5)


def build_llama_with_head_dim(out_dir: Path, head_dim: int):
    """A GQA Llama with the given head_dim (the GPU kernels' head-size grid)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         **_COMMON)
    _save(LlamaForCausalLM, config, out_dir, seed=head_dim)


def build_llama_sharded(out_dir: Path):
    """A Llama split over several safetensors files plus model.safetensors.index.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **_COMMON)
    _save(LlamaForCausalLM, config, out_dir, seed=6, max_shard_size="100KB")


def build_llama_bf16(out_dir: Path):
    """A GQA Llama saved in bfloat16 (config dtype bfloat16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **_COMMON)
    _save(LlamaForCausalLM, config, out_dir, seed=7, dtype=torch.bfloat16)


def build_llama_tp8(out_dir: Path):
    """GQA with 8 query heads and 2 kv heads, every split axis divisible by 8: the smallest Llama
    that tensor parallelism over 8 devices can split (each kv head repeated on 4 devices). Not in
    BUILDERS: only tests/test_parallel.py uses it, so the model tests do not run it too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_attention_heads=8, num_key_value_heads=2, **_COMMON)
    _save(LlamaForCausalLM, config, out_dir, seed=8)


def build_mistral_window(out_dir: Path):
    """Mistral whose sliding window (8) is shorter than the test prompts: the window binds."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                           **_COMMON)
    _save(MistralForCausalLM, config, out_dir, seed=9)


def build_qwen2_window(out_dir: Path):
    """Qwen2 with a sliding window (8) on layers from max_window_layers (1) on: layer 0 full,
    layer 1 sliding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=8, max_window_layers=1, **_COMMON)
    _save(Qwen2ForCausalLM, config, out_dir, seed=10)


def build_qwen3(out_dir: Path):
    """Qwen3: per-head q/k RMSNorm before RoPE, explicit head_dim (32 != 64 / 4)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         rope_theta=1e6, **_COMMON)
    _save(Qwen3ForCausalLM, config, out_dir, seed=11)


PHI3_ORIGINAL_MAX = 32  # longrope switches to its long factors at this position


def build_phi3(out_dir: Path):
    """Phi-3: fused qkv_proj / gate_up_proj tensors, head_dim 24 (not a power of two, like the
    real 96), GQA, longrope scaling (short factors below position 32, long from there, and an
    attention factor) and partial rotation (18 of 24 dims)."""
    import numpy as np
    from transformers import Phi3Config, Phi3ForCausalLM

    rng = np.random.default_rng(12)
    pairs = 9  # rotated dims / 2 = 24 * 0.75 / 2
    rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                short_factor=(1.0 + rng.random(pairs)).tolist(),
                long_factor=(2.0 + 4.0 * rng.random(pairs)).tolist())
    common = dict(_COMMON, hidden_size=96, max_position_embeddings=4 * PHI3_ORIGINAL_MAX)
    config = Phi3Config(num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                        original_max_position_embeddings=PHI3_ORIGINAL_MAX, pad_token_id=0,
                        **common)
    _save(Phi3ForCausalLM, config, out_dir, seed=12)


def build_gemma2(out_dir: Path):
    """Gemma 2: soft caps small enough to matter (scores 1.0, logits 3.0), sliding layer 0 and
    global layer 1 (window 8), GeGLU, sandwich (1 + weight) norms, scaled embeddings,
    query_pre_attn_scalar (24) != head_dim (32)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          query_pre_attn_scalar=24, sliding_window=8,
                          attn_logit_softcapping=1.0, final_logit_softcapping=3.0,
                          **dict(_COMMON, bos_token_id=2))
    _save(Gemma2ForCausalLM, config, out_dir, seed=13)


def build_gemma3(out_dir: Path):
    """Gemma 3 (text): q/k norms, a sliding layer (window 8, local rope base 100) then a global
    one (rope base 10^6, linear scaling x4), query_pre_attn_scalar 24."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {"sliding_attention": dict(rope_type="default", rope_theta=100.0),
            "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6)}
    config = Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              query_pre_attn_scalar=24, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters=rope, **dict(_COMMON, bos_token_id=2))
    _save(Gemma3ForCausalLM, config, out_dir, seed=14)


def build_gemma3_multimodal(out_dir: Path):
    """Gemma3ForConditionalGeneration (how Gemma 3 4B/12B/27B ship): the text model of
    build_gemma3 under `language_model.`, beside a tiny SigLIP tower that is never read."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                              SiglipVisionConfig)

    text = Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            query_pre_attn_scalar=24, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"],
                            **dict(_COMMON, bos_token_id=2))
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=VOCAB_SIZE - 3, eoi_token_index=VOCAB_SIZE - 2,
                          image_token_index=VOCAB_SIZE - 1, eos_token_id=[1, 2])
    _save(Gemma3ForConditionalGeneration, config, out_dir, seed=15)



def build_mixtral(out_dir: Path):
    """Mixtral: 4 experts of intermediate size 32, top 2 (renormalised, weights in float32),
    GQA, a sliding window (8) shorter than the test prompts."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=8,
                           **dict(_COMMON, intermediate_size=32))
    _save(MixtralForCausalLM, config, out_dir, seed=16)


def build_qwen3_moe(out_dir: Path):
    """Qwen3-MoE: 8 experts of intermediate size 32, top 3 (not renormalised: a token's three
    outputs summed in expert order matter), q/k norms, head_dim 32; layer 1 dense
    (`mlp_only_layers`, intermediate size 128)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                            norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1e6,
                            **_COMMON)
    _save(Qwen3MoeForCausalLM, config, out_dir, seed=17)


# ---- float32 parity models (tests/test_float32_parity.py; not in BUILDERS, so the model tests do
# not run them too): one per family, each a different mix of MQA (K = 1), a head size that is not
# a power of two (48; Phi-3's 24) and the family's RoPE variant, sized so that a 40-token prompt
# plus the generated tokens stay inside max_position_embeddings (and, for Phi-3, below the
# longrope switch: transformers picks a whole sequence's factors from its length, jpaged each
# token's from its position, and both agree below original_max_position_embeddings).
_PARITY_COMMON = dict(_COMMON, max_position_embeddings=512)
_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=32)


def _parity_llama2(out_dir: Path):
    """Llama 2: multi-head attention, default RoPE, head_dim 48."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=4, head_dim=48,
                         **_PARITY_COMMON)
    _save(LlamaForCausalLM, config, out_dir, seed=21)


def _parity_llama3(out_dir: Path):
    """Llama 3.1: MQA, head_dim 48, llama3 RoPE scaling (the H200's TF32 divergence)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=48,
                         rope_parameters=_LLAMA3_ROPE, **_PARITY_COMMON)
    _save(LlamaForCausalLM, config, out_dir, seed=22)


def _parity_mistral(out_dir: Path):
    """Mistral: MQA, head_dim 48, a sliding window (16) that binds on a 40-token prompt."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=48,
                           sliding_window=16, **_PARITY_COMMON)
    _save(MistralForCausalLM, config, out_dir, seed=23)


def _parity_qwen2(out_dir: Path):
    """Qwen2: MQA, q/k/v bias, tied embeddings (logits from the embedding table)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                         **_PARITY_COMMON)
    _save(Qwen2ForCausalLM, config, out_dir, seed=24)


def _parity_qwen3(out_dir: Path):
    """Qwen3: q/k RMSNorm, GQA, head_dim 48."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                         rope_theta=1e6, **_PARITY_COMMON)
    _save(Qwen3ForCausalLM, config, out_dir, seed=25)


def _parity_gemma2(out_dir: Path):
    """Gemma 2: MQA, head_dim 48, soft caps (scores 5, logits 3), sliding layer 0 (window 16)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(num_attention_heads=4, num_key_value_heads=1, head_dim=48,
                          query_pre_attn_scalar=32, sliding_window=16,
                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                          **dict(_PARITY_COMMON, bos_token_id=2))
    _save(Gemma2ForCausalLM, config, out_dir, seed=26)


def _parity_gemma3(out_dir: Path):
    """Gemma 3: q/k norms, GQA, head_dim 48, a sliding layer (window 16, local rope base 100)
    then a global one (linear RoPE scaling x4)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {"sliding_attention": dict(rope_type="default", rope_theta=100.0),
            "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6)}
    config = Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                              query_pre_attn_scalar=32, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters=rope, **dict(_PARITY_COMMON, bos_token_id=2))
    _save(Gemma3ForCausalLM, config, out_dir, seed=27)


def _parity_phi3(out_dir: Path):
    """Phi-3: fused projections, MQA, head_dim 24, longrope with partial rotation (18 of 24)."""
    import numpy as np
    from transformers import Phi3Config, Phi3ForCausalLM

    rng = np.random.default_rng(28)
    rope = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                short_factor=(1.0 + rng.random(9)).tolist(),
                long_factor=(2.0 + 4.0 * rng.random(9)).tolist())
    config = Phi3Config(num_attention_heads=4, num_key_value_heads=1, rope_parameters=rope,
                        original_max_position_embeddings=128, pad_token_id=0,
                        **dict(_PARITY_COMMON, hidden_size=96))
    _save(Phi3ForCausalLM, config, out_dir, seed=28)


PARITY_BUILDERS = {"llama2": _parity_llama2, "llama3": _parity_llama3,
                   "mistral": _parity_mistral, "qwen2": _parity_qwen2, "qwen3": _parity_qwen3,
                   "gemma2": _parity_gemma2, "gemma3": _parity_gemma3, "phi3": _parity_phi3}

def write_tokenizer(out_dir: Path, extra_special_tokens: tuple[str, ...] = ()):
    """Train a byte-level BPE (VOCAB_SIZE tokens, <s>=0, </s>=1, then extra_special_tokens from
    2 on, e.g. tool-call markers) and write tokenizer.json.

    Encoding prepends <s>, as Llama tokenizers do; tokenizer_config.json names the specials.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE,
                                  special_tokens=[BOS_TOKEN, EOS_TOKEN, *extra_special_tokens],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_TOKENIZER_TEXTS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, 0)])
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
         "tokenizer_class": "PreTrainedTokenizerFast"}))


BUILDERS = {
    "llama_mha": build_llama_mha,
    "llama_gqa": build_llama_gqa,
    "mistral": build_mistral,
    "qwen2": build_qwen2,
    "llama_head_dim": build_llama_head_dim,
    "llama_sharded": build_llama_sharded,
    "llama_bf16": build_llama_bf16,
    "mistral_window": build_mistral_window,
    "qwen2_window": build_qwen2_window,
    "qwen3": build_qwen3,
    "phi3": build_phi3,
    "gemma2": build_gemma2,
    "gemma3": build_gemma3,
    "gemma3_multimodal": build_gemma3_multimodal,
    "mixtral": build_mixtral,
    "qwen3_moe": build_qwen3_moe,
}
# The families added to the Llama ones, and the checkpoints whose attention slides a window or
# soft-caps its scores (arguments the Pallas kernels may not take yet)
NEW_FAMILIES = ("qwen3", "phi3", "gemma2", "gemma3")
MOE_CHECKPOINTS = ("mixtral", "qwen3_moe")
WINDOWED = ("mistral_window", "qwen2_window", "gemma2", "gemma3")
FLOAT32_CHECKPOINTS = tuple(name for name in BUILDERS if name != "llama_bf16")


def build_all(root) -> dict[str, str]:
    """Write every checkpoint under root/<name>; returns {name: directory path}."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    paths = {}
    for name, build in BUILDERS.items():
        out_dir = Path(root) / name
        out_dir.mkdir(parents=True, exist_ok=True)
        build(out_dir)
        paths[name] = str(out_dir)
    return paths
