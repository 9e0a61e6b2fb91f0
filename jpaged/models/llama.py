"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3, and the mixtures of
experts Mixtral and Qwen3-MoE) over the paged KV cache.

One class serves every architecture; the config says which projections carry a bias, whether
the embeddings are tied, how RoPE is scaled, and which layers slide a window, norm their query
and key heads, soft-cap their scores or route tokens to experts (`jpaged.models.moe`). Gemma decoders (`ModelConfig.is_gemma`) differ in their
block (`GemmaDecoderLayer`: norms before and after attention and the MLP), their norms
((1 + weight)) and their scaled embeddings. Module attribute names mirror Hugging Face's parameter
names (`model.layers.3.self_attn.o_proj.weight`), except that q/k/v and gate/up are packed
(`qkv_proj`, `gate_up_proj`; see `jpaged.models.packing`), which the loader maps.
Every matmul (projections, MLP, logits, attention's) runs at the model's `matmul_precision`,
passed down each call: "highest" (full float32, a float32 model's default), "high" or "default".
Axis names: T tokens, E hidden size, V vocab, H query heads, K kv heads, C cache kv heads
(K, or one per shard when tensor-parallel shards outnumber K), D head dim, P shards.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged import kv_cache as kv
from jpaged import parallel
from jpaged.config import ModelConfig
from jpaged.models import packing, row_tiles
from jpaged.models.attention import AttentionMetadata, paged_attention
from jpaged.models.layers import (DOT_PRECISIONS, Embedding, GatedMLP, Linear, LMHead, Rotary,
                                  check_matmul_precision, default_matmul_precision, rms_norm)
from jpaged.models.moe import SparseMoE


class LlamaAttention(nnx.Module):
    """Project, (norm q/k,) rotate, write this step's K/V into layer `layer_index`'s pages,
    attend, project."""

    def __init__(self, config: ModelConfig, layer_index: int, *, dtype, rngs: nnx.Rngs,
                 mesh=None):
        self.layer_index = layer_index
        self.mesh = mesh
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_window(layer_index)
        self.logits_soft_cap = config.attn_logit_softcapping
        self.shards = parallel.mesh_size(mesh)
        self.num_cache_kv_heads = parallel.num_cache_kv_heads(self.num_kv_heads, mesh)
        qkv = packing.model_qkv_packing(config, self.shards)
        self.qkv_proj = Linear(config.hidden_size, len(qkv.rows), use_bias=config.qkv_bias,
                               dtype=dtype, rngs=rngs, packing=qkv)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size,
                             use_bias=config.o_proj_bias, dtype=dtype, rngs=rngs)
        has_norms = config.qk_norm
        self.q_norm = rms_norm(self.head_dim, config, dtype) if has_norms else None
        self.k_norm = rms_norm(self.head_dim, config, dtype) if has_norms else None

    def packed_heads(self, x, precision: str = "default", rows=row_tiles.WHOLE):
        """x [..., E] -> the packed projection as [..., P, H/P + 2C/P, D]: per shard, its query
        heads, then its cache kv heads' keys, then their values (`packing.qkv_packing`); query
        and key heads normed when the model norms them. precision: the projection's."""
        qkv = self.qkv_proj(x, precision, rows).reshape(
            *x.shape[:-1], self.shards, -1, self.head_dim)
        return qkv if self.q_norm is None else self._normed_heads(qkv, rows)

    def _normed_heads(self, qkv, rows):
        """Qwen3's per-head norms of q and k ([..., P, H/P + 2C/P, D] packed, v as it is)."""
        local_q, local_kv = self.num_heads // self.shards, self.num_cache_kv_heads // self.shards
        q, k, v = jnp.split(qkv, [local_q, local_q + local_kv], axis=-2)
        return jnp.concatenate([rows.norm(self.q_norm, q), rows.norm(self.k_norm, k), v],
                               axis=-2)

    def project_qkv(self, x, precision: str = "default"):
        """x [..., E] -> q [..., H, D], k and v [..., C, D], before rotation (for dense uses,
        e.g. tools/train_tiny.py; the paged step rotates and writes in one kernel)."""
        lead, shards = x.shape[:-1], self.shards
        local_q, local_kv = self.num_heads // shards, self.num_cache_kv_heads // shards
        qkv = self.packed_heads(x, precision)
        heads = lambda start, count: qkv[..., start:start + count, :].reshape(  # noqa: E731
            *lead, shards * count, self.head_dim)
        return heads(0, local_q), heads(local_q, local_kv), heads(local_q + local_kv, local_kv)

    def __call__(self, x, cos, sin, cache: kv.KVCache, metadata: AttentionMetadata,
                 precision: str, rows=row_tiles.WHOLE):
        """x [T, E], cos/sin [T, D] -> ([T, E], cache with this step's K/V written);
        precision: of the projections and attention's dots (a `DOT_PRECISIONS` name);
        rows: how the projections run over the tokens (`row_tiles.runner`)."""
        num_tokens = x.shape[0]
        qkv = self.packed_heads(x, precision, rows)
        q, cache = kv.rotate_and_write_layer(                                  # q [T, H, D]
            cache, self.layer_index, qkv, cos, sin,
            metadata.slot_mapping, backend=metadata.backend, interpret=metadata.interpret,
            mesh=self.mesh)
        out = paged_attention(q, cache.k_pages[self.layer_index], cache.v_pages[self.layer_index],
                              metadata, scale=self.scale, mesh=self.mesh,
                              sliding_window=self.sliding_window,
                              logits_soft_cap=self.logits_soft_cap, precision=precision)
        return self.o_proj(out.reshape(num_tokens, -1), precision, rows), cache


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig, layer_index: int, *, dtype, rngs: nnx.Rngs,
                 mesh=None):
        self.input_layernorm = rms_norm(config.hidden_size, config, dtype)
        self.self_attn = LlamaAttention(config, layer_index, dtype=dtype, rngs=rngs, mesh=mesh)
        self.post_attention_layernorm = rms_norm(config.hidden_size, config, dtype)
        self.mlp = _mlp(config, layer_index, dtype, rngs, mesh)

    def __call__(self, x, cos, sin, cache, metadata, precision, rows=row_tiles.WHOLE):
        attn_out, cache = self.self_attn(rows.norm(self.input_layernorm, x), cos, sin, cache,
                                         metadata, precision, rows)
        x = x + attn_out
        mlp_out = _run_mlp(self.mlp, rows.norm(self.post_attention_layernorm, x), metadata,
                           precision, rows)
        return x + mlp_out, cache


class GemmaDecoderLayer(nnx.Module):
    """Gemma 2/3's block, normed on both sides: x + post_attn(attn(input(x))), then
    h + post_ff(mlp(pre_ff(h))) (so `post_attention_layernorm` follows attention here)."""

    def __init__(self, config: ModelConfig, layer_index: int, *, dtype, rngs: nnx.Rngs,
                 mesh=None):
        self.input_layernorm = rms_norm(config.hidden_size, config, dtype)
        self.self_attn = LlamaAttention(config, layer_index, dtype=dtype, rngs=rngs, mesh=mesh)
        self.post_attention_layernorm = rms_norm(config.hidden_size, config, dtype)
        self.pre_feedforward_layernorm = rms_norm(config.hidden_size, config, dtype)
        self.mlp = _mlp(config, layer_index, dtype, rngs, mesh)
        self.post_feedforward_layernorm = rms_norm(config.hidden_size, config, dtype)

    def __call__(self, x, cos, sin, cache, metadata, precision, rows=row_tiles.WHOLE):
        attn_out, cache = self.self_attn(rows.norm(self.input_layernorm, x), cos, sin, cache,
                                         metadata, precision, rows)
        x = x + rows.norm(self.post_attention_layernorm, attn_out)
        mlp_out = _run_mlp(self.mlp, rows.norm(self.pre_feedforward_layernorm, x), metadata,
                           precision, rows)
        mlp_out = rows.norm(self.post_feedforward_layernorm, mlp_out)
        return x + mlp_out, cache


def _run_mlp(mlp, x, metadata, precision, rows):
    """A layer's MLP on x; a mixture of experts also takes the step's kernel choice (its grouped
    matmul follows metadata.backend, `jpaged.models.moe`)."""
    if isinstance(mlp, SparseMoE):
        return mlp(x, precision, rows, backend=metadata.backend, interpret=metadata.interpret)
    return mlp(x, precision, rows)


def _mlp(config: ModelConfig, layer_index: int, dtype, rngs, mesh) -> GatedMLP | SparseMoE:
    """Layer `layer_index`'s MLP: dense, or a mixture of experts (`ModelConfig.experts`)."""
    if config.is_sparse_layer(layer_index):
        return SparseMoE(config, dtype=dtype, rngs=rngs, mesh=mesh)
    shards = parallel.mesh_size(mesh)
    return GatedMLP(config.hidden_size, config.intermediate_size, use_bias=config.mlp_bias,
                    dtype=dtype, rngs=rngs, shards=shards, activation=config.hidden_act,
                    gate_up_packing=packing.model_gate_up_packing(config, shards))


class LlamaModel(nnx.Module):
    """Embedding, decoder layers, final norm (Hugging Face's `model.` prefix).

    rotaries: each distinct rotary embedding once (Gemma 3: one for sliding layers, one for the
    others); layer i rotates with rotaries[rotary_of_layer[i]], tables computed once per step.
    """

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh=None):
        layer_rotaries = [Rotary.from_config(config.layer_rope(i), config.head_dim)
                          for i in range(config.num_hidden_layers)]
        self.rotaries = tuple(dict.fromkeys(layer_rotaries))
        self.rotary_of_layer = tuple(self.rotaries.index(r) for r in layer_rotaries)
        # Gemma: embeddings times sqrt(E), rounded to the model dtype first (as transformers)
        self.embedding_scale = (float(np.float32(config.hidden_size ** 0.5))
                                if config.is_gemma else None)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                      rngs=rngs)
        layer_class = GemmaDecoderLayer if config.is_gemma else LlamaDecoderLayer
        self.layers = nnx.List([layer_class(config, i, dtype=dtype, rngs=rngs, mesh=mesh)
                                for i in range(config.num_hidden_layers)])
        self.norm = rms_norm(config.hidden_size, config, dtype)

    @property
    def inv_frequencies(self) -> tuple:
        """The first layer's inverse frequencies [D/2] (tools/train_tiny.py's dense rotation)."""
        return self.rotaries[self.rotary_of_layer[0]].inv_frequencies

    def __call__(self, token_ids, positions, cache, metadata, precision, rows=row_tiles.WHOLE):
        """rows: how row-wise parts run over the tokens (`row_tiles.runner`)."""
        x = self.embed_tokens(token_ids)                                # [T, E]
        if self.embedding_scale is not None:
            x = rows(lambda e: e * jnp.asarray(self.embedding_scale, e.dtype), x)
        tables = [rows(rotary.cos_sin, positions) for rotary in self.rotaries]  # [T, D] x 2
        for layer, rotary in zip(self.layers, self.rotary_of_layer):
            x, cache = layer(x, *tables[rotary], cache, metadata, precision, rows)
        return rows.norm(self.norm, x), cache


class LlamaForCausalLM(nnx.Module):
    """A Llama-family causal LM whose attention reads and writes the paged KV cache."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, mesh=None,
                 matmul_precision: str | None = None, batch_invariant: bool = False):
        """Random init (normal, std 0.02; norms the identity); `dtype` is the parameter dtype.

        mesh: the tensor-parallel mesh the parameters are (to be) sharded over (see
        `jpaged.parallel`); attention then runs its kernels per device. None: one device.
        matmul_precision: "highest", "high" or "default" (`layers.DOT_PRECISIONS`); None:
        "highest" for float32 parameters, else "default". A static attribute: it is part of the
        model's graph, so programs of two precisions are never one program.
        batch_invariant: run every row-wise part (projections, norms, MLP, logits) in fixed tiles
        of rows (`row_tiles`), so a token's numbers never depend on the batch; also static.
        """
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.matmul_precision = check_matmul_precision(
            default_matmul_precision(self.dtype) if matmul_precision is None
            else matmul_precision)
        self.batch_invariant = check_batch_invariant(config, batch_invariant)
        self.mesh = mesh
        self.final_logit_softcapping = config.final_logit_softcapping
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
        return self.model(token_ids, positions, kv_cache, metadata, self.matmul_precision,
                          self.rows)

    @property
    def rows(self) -> row_tiles.Rows:
        """How this model runs its row-wise parts (`row_tiles.runner`)."""
        return row_tiles.runner(self.batch_invariant, self.mesh)

    def compute_logits(self, hidden):
        """hidden [..., E] -> logits [..., V] in float32 (accumulated in float32), soft-capped
        by c * tanh(logits / c) when the model caps them (Gemma 2)."""
        rows = self.rows
        weight = (self.model.embed_tokens.weight if self.lm_head is None
                  else self.lm_head.weight)[...]                          # [V, E]
        logits = rows.matmul(hidden, weight, DOT_PRECISIONS[self.matmul_precision],
                             transposed=True, out_dtype=jnp.float32)
        cap = self.final_logit_softcapping
        return logits if cap is None else rows.flat(lambda z: cap * jnp.tanh(z / cap), logits)


def with_matmul_precision(model: LlamaForCausalLM, matmul_precision: str,
                          batch_invariant: bool | None = None) -> LlamaForCausalLM:
    """`model` computing at `matmul_precision` (and in the batch-invariant mode or not; None: as
    it does): the model itself when it already does, else a copy that shares its parameter
    arrays (the caller's model is left as it was)."""
    check_matmul_precision(matmul_precision)
    batch_invariant = model.batch_invariant if batch_invariant is None else batch_invariant
    if (model.matmul_precision, model.batch_invariant) == (matmul_precision, batch_invariant):
        return model
    copy = nnx.merge(*nnx.split(model))
    copy.matmul_precision = matmul_precision
    copy.batch_invariant = check_batch_invariant(model.config, batch_invariant)
    return copy


def check_batch_invariant(config: ModelConfig, batch_invariant) -> bool:
    """batch_invariant, checked: a bool, and off for a mixture of experts (its grouped expert
    matmuls group the batch's tokens by expert, so a token's numbers follow its neighbours')."""
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    if batch_invariant and config.experts is not None:
        raise ValueError("batch_invariant does not cover mixture-of-experts models: their "
                         "grouped expert matmuls depend on which tokens share a batch")
    return batch_invariant
