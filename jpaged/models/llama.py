"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache.

One class serves every architecture; the config says which projections carry a bias, whether
the embeddings are tied and how RoPE is scaled. Module attribute names mirror Hugging Face's
parameter names (`model.layers.3.self_attn.o_proj.weight`), except that q/k/v and gate/up are
packed (`qkv_proj`, `gate_up_proj`; see `jpaged.models.packing`), which the loader maps.
Axis names: T tokens, E hidden size, V vocab, H query heads, K kv heads, C cache kv heads
(K, or one per shard when tensor-parallel shards outnumber K), D head dim, P shards.
"""

import jax.numpy as jnp
from flax import nnx

from jpaged import kv_cache as kv
from jpaged import parallel
from jpaged.config import ModelConfig
from jpaged.models import packing
from jpaged.models.attention import AttentionMetadata, paged_attention
from jpaged.models.layers import Embedding, GatedMLP, Linear, LMHead, RMSNorm, rotary_cos_sin


class LlamaAttention(nnx.Module):
    """Project, rotate, write this step's K/V into layer `layer_index`'s pages, attend, project."""

    def __init__(self, config: ModelConfig, layer_index: int, *, dtype, rngs: nnx.Rngs,
                 mesh=None):
        self.layer_index = layer_index
        self.mesh = mesh
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.shards = parallel.mesh_size(mesh)
        self.num_cache_kv_heads = parallel.num_cache_kv_heads(self.num_kv_heads, mesh)
        qkv = packing.qkv_packing(self.num_heads, self.num_kv_heads, self.head_dim, self.shards)
        self.qkv_proj = Linear(config.hidden_size, len(qkv.rows), use_bias=config.qkv_bias,
                               dtype=dtype, rngs=rngs, packing=qkv)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size,
                             use_bias=config.o_proj_bias, dtype=dtype, rngs=rngs)

    def packed_heads(self, x):
        """x [..., E] -> the packed projection as [..., P, H/P + 2C/P, D]: per shard, its query
        heads, then its cache kv heads' keys, then their values (`packing.qkv_packing`)."""
        return self.qkv_proj(x).reshape(*x.shape[:-1], self.shards, -1, self.head_dim)

    def project_qkv(self, x):
        """x [..., E] -> q [..., H, D], k and v [..., C, D], before rotation (for dense uses,
        e.g. tools/train_tiny.py; the paged step rotates and writes in one kernel)."""
        lead, shards = x.shape[:-1], self.shards
        local_q, local_kv = self.num_heads // shards, self.num_cache_kv_heads // shards
        qkv = self.packed_heads(x)
        heads = lambda start, count: qkv[..., start:start + count, :].reshape(  # noqa: E731
            *lead, shards * count, self.head_dim)
        return heads(0, local_q), heads(local_q, local_kv), heads(local_q + local_kv, local_kv)

    def __call__(self, x, cos, sin, cache: kv.KVCache, metadata: AttentionMetadata):
        """x [T, E], cos/sin [T, D] -> ([T, E], cache with this step's K/V written)."""
        num_tokens = x.shape[0]
        q, cache = kv.rotate_and_write_layer(                                  # q [T, H, D]
            cache, self.layer_index, self.packed_heads(x), cos, sin, metadata.slot_mapping,
            backend=metadata.backend, interpret=metadata.interpret, mesh=self.mesh)
        out = paged_attention(q, cache.k_pages[self.layer_index], cache.v_pages[self.layer_index],
                              metadata, scale=self.head_dim ** -0.5, mesh=self.mesh)
        return self.o_proj(out.reshape(num_tokens, -1)), cache


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer_index: int, *, dtype, rngs: nnx.Rngs,
                 mesh=None):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = LlamaAttention(config, layer_index, dtype=dtype, rngs=rngs, mesh=mesh)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            use_bias=config.mlp_bias, dtype=dtype, rngs=rngs,
                            shards=parallel.mesh_size(mesh))

    def __call__(self, x, cos, sin, cache, metadata):
        attn_out, cache = self.self_attn(self.input_layernorm(x), cos, sin, cache, metadata)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LlamaModel(nnx.Module):
    """Embedding, decoder layers, final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh=None):
        self.inv_frequencies = tuple(config.rope.inv_frequencies(config.head_dim).tolist())
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                      rngs=rngs)
        self.layers = nnx.List([LlamaDecoderLayer(config, i, dtype=dtype, rngs=rngs, mesh=mesh)
                                for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def __call__(self, token_ids, positions, cache, metadata):
        x = self.embed_tokens(token_ids)                                # [T, E]
        cos, sin = rotary_cos_sin(positions, self.inv_frequencies)     # [T, D], shared by layers
        for layer in self.layers:
            x, cache = layer(x, cos, sin, cache, metadata)
        return self.norm(x), cache


class LlamaForCausalLM(nnx.Module):
    """A Llama-family causal LM whose attention reads and writes the paged KV cache."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh=None):
        """Random init (normal, std 0.02; norms one); `dtype` is the parameter dtype.

        mesh: the tensor-parallel mesh the parameters are (to be) sharded over (see
        `jpaged.parallel`); attention then runs its kernels per device. None: one device.
        """
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.mesh = mesh
        self.model = LlamaModel(config, dtype=self.dtype, rngs=rngs, mesh=mesh)
        self.lm_head = None if config.tie_word_embeddings else LMHead(
            config.hidden_size, config.vocab_size, dtype=self.dtype, rngs=rngs)

    def __call__(self, token_ids, positions, kv_cache: kv.KVCache, metadata: AttentionMetadata):
        """One step over T tokens of any mix of sequences.

        token_ids [T] int32, positions [T] int32 (each token's position in its sequence; padded
        tokens may carry any position, their slot_mapping is -1). Writes every layer's K/V for
        these tokens into kv_cache, then attends through it.
        Returns (hidden [T, E] in the parameter dtype, after the final norm; the new KVCache).
        """
        return self.model(token_ids, positions, kv_cache, metadata)

    def compute_logits(self, hidden):
        """hidden [..., E] -> logits [..., V] in float32 (accumulated in float32)."""
        weight = (self.model.embed_tokens.weight if self.lm_head is None
                  else self.lm_head.weight)[...]                          # [V, E]
        return jnp.einsum("...e,ve->...v", hidden, weight, preferred_element_type=jnp.float32)
