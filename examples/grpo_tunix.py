"""A few GRPO steps of a tiny random Llama with Tunix, jpaged as the rollout engine (CPU, about a
minute): the reward favours completions of 12 characters.

    python examples/grpo_tunix.py [--steps 3] [--workdir DIR]

Needs the tunix extra (README, "RL with Tunix"). The checkpoint is random: this shows the
plumbing (rollout, weight sync, logprobs), not learning anything useful.
"""

import argparse
import functools
import json
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax
import transformers
from tunix.models.llama3 import model as llama3_lib
from tunix.models.llama3 import params as llama3_params
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from jpaged.integrations.tunix import JpagedRollout

PROMPTS = ["The quick brown fox", "Hello, world!", "PagedAttention stores", "JAX compiles"]
TARGET_CHARS = 12


def write_tiny_llama(out_dir: Path) -> None:
    """A random 2-layer Llama whose RoPE is what Tunix's Llama3 computes (theta 1e6, no
    scaling), with a byte-level BPE tokenizer trained on the prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=1e6, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(out_dir)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(PROMPTS * 4, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                             special_tokens=[("<s>", 0)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}))


def tunix_actor(hf_dir: Path) -> llama3_lib.Llama3:
    raw = json.loads((hf_dir / "config.json").read_text())
    config = llama3_lib.ModelConfig(
        num_layers=raw["num_hidden_layers"], vocab_size=raw["vocab_size"],
        embed_dim=raw["hidden_size"], hidden_dim=raw["intermediate_size"],
        num_heads=raw["num_attention_heads"], head_dim=raw["head_dim"],
        num_kv_heads=raw["num_key_value_heads"], rope_theta=1_000_000,
        norm_eps=raw["rms_norm_eps"], weight_tying=raw["tie_word_embeddings"])
    return llama3_params.create_model_from_safe_tensors(str(hf_dir), config)


def length_reward(prompts, completions, **_):
    return [-abs(len(text) - TARGET_CHARS) / TARGET_CHARS for text in completions]


def main(steps: int, workdir: Path) -> None:
    hf_dir = workdir / "tiny_llama"
    write_tiny_llama(hf_dir)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    cluster = rl_cluster_lib.RLCluster(
        actor=tunix_actor(hf_dir),
        tokenizer=transformers.AutoTokenizer.from_pretrained(hf_dir),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
            rollout_engine=functools.partial(
                JpagedRollout, max_num_seqs=16, num_kv_blocks=64, swap_space=0),
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(3e-3), eval_every_n_steps=1000, max_steps=steps),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=16, max_prompt_length=16, kv_cache_size=64,
                temperature=0.9)))
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(num_generations=4, beta=0.0),
        reward_fns=[length_reward])
    # an array, not a list: Tunix repeats each batch's leaves G times, and each string of a
    # list would be a leaf of its own
    learner.train([{"prompts": np.array(PROMPTS)}] * steps)
    sample = cluster.generate(PROMPTS)
    for prompt, text in zip(PROMPTS, sample.text):
        print(f"{prompt!r} -> {text!r} (reward {length_reward([prompt], [text])[0]:+.2f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    if args.workdir is None:
        with tempfile.TemporaryDirectory() as tmp:
            main(args.steps, Path(tmp))
    else:
        main(args.steps, args.workdir)
