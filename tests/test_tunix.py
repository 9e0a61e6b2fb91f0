"""The Tunix rollout adapter: Tunix's parameters map onto jpaged's weights with identical
logprobs for every family both hold, a mismatched RoPE is refused, and Tunix's own GRPO learner
trains with jpaged as its rollout engine, whose logprobs match the trainer's after each sync."""

import functools
import json

import numpy as np
import pytest

pytest.importorskip("tunix.rl.rollout.base_rollout",
                    reason="google-tunix is not installed (make test installs it)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jpaged.config import ModelConfig  # noqa: E402
from jpaged.integrations import tunix_weights  # noqa: E402
from tests import hf_fixtures  # noqa: E402

TOLERANCE = 1e-4
LLM_OPTIONS = dict(dtype="float32", max_model_len=64, num_kv_blocks=32, max_num_seqs=8,
                   max_num_batched_tokens=64, swap_space=0)
_SHAPE = dict(vocab_size=hf_fixtures.VOCAB_SIZE, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e6, bos_token_id=0,
              eos_token_id=1, initializer_range=0.08)
# family -> (transformers classes, Tunix module, Tunix class, extra Hugging Face config)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", "llama3", "Llama3", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", "Qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", "Qwen3", {}),
}


def write_checkpoint(out_dir, family: str, **overrides):
    """A tiny random Hugging Face checkpoint of `family` (RoPE as Tunix computes it: theta 1e6,
    no scaling) with the fixtures' byte-level tokenizer."""
    import transformers
    config_name, model_name, _, _, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_SHAPE, **extra, **overrides})
    hf_fixtures._save(getattr(transformers, model_name), config, out_dir, seed=7)
    hf_fixtures.write_tokenizer(out_dir)
    return str(out_dir)


def tunix_model(family: str, hf_dir: str, seed: int = 0):
    """A Tunix model of the checkpoint's shape, randomly initialised (not from the checkpoint:
    the rollout must take its weights from the Tunix model, not from disk)."""
    import importlib
    _, _, module, cls, _ = FAMILIES[family]
    model_lib = importlib.import_module(f"tunix.models.{module}.model")
    raw = json.loads((__import__("pathlib").Path(hf_dir) / "config.json").read_text())
    tied = {"weight_tying": raw["tie_word_embeddings"]} if cls == "Llama3" else {
        "use_tied_embedding": raw["tie_word_embeddings"]}
    config = model_lib.ModelConfig(
        num_layers=raw["num_hidden_layers"], vocab_size=raw["vocab_size"],
        embed_dim=raw["hidden_size"], hidden_dim=raw["intermediate_size"],
        num_heads=raw["num_attention_heads"], head_dim=raw["head_dim"],
        num_kv_heads=raw["num_key_value_heads"], rope_theta=int(_SHAPE["rope_theta"]),
        norm_eps=raw["rms_norm_eps"], **tied)
    model = getattr(model_lib, cls)(config, rngs=nnx.Rngs(seed))
    _perturb_norms(model, seed)
    return model


def _perturb_norms(model, seed: int):
    """Norm weights and biases away from 1 and 0, so a misplaced one changes the logprobs."""
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        if name.endswith("norm.w") or name.endswith("_bias"):
            var.set_value(var.get_value() + 0.1 * jax.random.normal(next(keys), var.shape))
    nnx.update(model, state)


def tunix_logps(model, tokens: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """[T-1] logprobs of tokens[1:] under Tunix's own forward."""
    from tunix.rl import common
    graphdef, state = nnx.split(model)
    out = common.compute_per_token_logps(
        graphdef, state, prompt_tokens=jnp.asarray(tokens[None, :1]),
        completion_tokens=jnp.asarray(tokens[None, 1:]), pad_id=-1, eos_id=-1,
        temperature=temperature)
    return np.asarray(out[0])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tunix")
    checkpoints = {family: write_checkpoint(root / family, family) for family in FAMILIES}
    # one layer for the training test: Tunix compiles its train step layer by layer on the CPU
    checkpoints["llama3_small"] = write_checkpoint(root / "llama3_small", "llama3",
                                                   num_hidden_layers=1)
    return checkpoints


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tunix_params_map_onto_jpaged_with_equal_logprobs(checkpoints, family):
    from jpaged import LLM
    model = tunix_model(family, checkpoints[family])
    llm = LLM(checkpoints[family], **LLM_OPTIONS)
    tunix_weights.check_configs(model, llm.engine.model_config)
    mapped = tunix_weights.hf_weights(nnx.state(model, nnx.Param),
                                      tie_word_embeddings=llm.engine.model_config
                                      .tie_word_embeddings)
    before = llm.get_weights()
    assert set(mapped) == set(before)
    llm.update_weights(mapped)
    after = llm.get_weights()
    for name, array in mapped.items():  # the round trip is exact
        np.testing.assert_array_equal(np.asarray(after[name]), np.asarray(array), err_msg=name)
    tokens = np.random.default_rng(0).integers(2, hf_fixtures.VOCAB_SIZE, 24).astype(np.int32)
    temperature = 0.7 if family == "llama3" else 1.0   # one Tunix compilation per temperature
    ours = llm.score([tokens[:1].tolist()], [tokens[1:].tolist()], temperature=temperature)[0]
    np.testing.assert_allclose(ours, tunix_logps(model, tokens, temperature), atol=TOLERANCE)
    # and the checkpoint's own weights give different numbers: the comparison can fail
    llm.update_weights(before)
    ours = llm.score([tokens[:1].tolist()], [tokens[1:].tolist()], temperature=temperature)[0]
    assert np.abs(ours - tunix_logps(model, tokens, temperature)).max() > 10 * TOLERANCE


def _adapter(hf_dir: str):
    """Tunix's tokenizer adapter over the checkpoint's tokenizer, as RLCluster wraps it."""
    import transformers
    from tunix.generate.tokenizer_adapter import TokenizerAdapter
    return TokenizerAdapter(transformers.AutoTokenizer.from_pretrained(hf_dir))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rollout_built_from_the_actor_equals_the_checkpoint_built_one(checkpoints, family):
    """No checkpoint: the engine's config and weights come from the Tunix actor. Its seeded
    samples and their logprobs are those of a rollout built from a checkpoint of the same
    network and synced with the same actor, bit for bit, and its scores are Tunix's own."""
    from tunix.rl.rollout import base_rollout

    from jpaged.integrations.tunix import JpagedRollout

    hf_dir = checkpoints[family]
    actor = tunix_model(family, hf_dir, seed=5)
    tokenizer = _adapter(hf_dir)
    config = base_rollout.RolloutConfig(max_tokens_to_generate=6, max_prompt_length=8,
                                        kv_cache_size=64, temperature=0.8, seed=11,
                                        return_logprobs=True)
    from_actor = JpagedRollout(actor, tokenizer, None, config, **LLM_OPTIONS)
    from_checkpoint = JpagedRollout(actor, tokenizer, None, config, model=hf_dir,
                                    **LLM_OPTIONS)
    engine_config = from_actor.llm.engine.model_config
    assert engine_config.architecture == FAMILIES[family][1]
    assert engine_config.tie_word_embeddings == from_checkpoint.llm.engine.model_config \
        .tie_word_embeddings
    prompts = ["The quick brown fox", "Hello, world!", "ab"]
    ours, theirs = (rollout.generate(prompts, config) for rollout in (from_actor,
                                                                       from_checkpoint))
    for mine, other in zip(ours.tokens, theirs.tokens):
        np.testing.assert_array_equal(mine, other)
    for mine, other in zip(ours.logprobs, theirs.logprobs):
        np.testing.assert_array_equal(mine, other)
    tokens = np.asarray(tokenizer.encode("The quick brown fox jumps"), np.int32)
    scored = from_actor.llm.score([tokens[:1].tolist()], [tokens[1:].tolist()])[0]
    np.testing.assert_allclose(scored, tunix_logps(actor, tokens), atol=TOLERANCE)


def test_a_batch_invariant_rollout_samples_the_training_forwards_logprobs(checkpoints):
    """JpagedRollout(..., batch_invariant=True) from the actor: each sample's logprobs, as Tunix
    receives them, are bit for bit those jpaged's training forward (`sequence_logprobs`, what a
    trainer would differentiate) gives the prompt and sample, however the rollout batched them."""
    from tunix.rl.rollout import base_rollout

    from jpaged.integrations.tunix import JpagedRollout
    from jpaged.models import sequence_logprobs

    hf_dir = checkpoints["llama3"]
    tokenizer = _adapter(hf_dir)
    config = base_rollout.RolloutConfig(max_tokens_to_generate=6, max_prompt_length=8,
                                        kv_cache_size=64, temperature=1.0, seed=3,
                                        return_logprobs=True)
    rollout = JpagedRollout(tunix_model("llama3", hf_dir, seed=5), tokenizer, None, config,
                            batch_invariant=True, **LLM_OPTIONS)
    prompts = ["The quick brown fox", "Hello, world!", "ab"]
    out = rollout.generate(prompts, config)
    executor = rollout.llm.engine.executor
    model = executor.model_def.merge(executor.param_leaves)
    for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs, strict=True):
        prompt_ids = list(tokenizer.encode(prompt))
        if prompt_ids[:1] != [tokenizer.bos_id()]:
            prompt_ids = [tokenizer.bos_id()] + prompt_ids
        sequence = jnp.asarray([prompt_ids + tokens.tolist()], jnp.int32)
        forward = np.asarray(sequence_logprobs(model, sequence))[0, len(prompt_ids) - 1:]
        assert np.array_equal(forward, logprobs)


def test_the_rollout_decodes_several_steps_per_loop_with_the_same_samples(checkpoints):
    """A rollout runs SCHEDULER_STEPS decode steps per device loop unless told otherwise, and
    its seeded samples and logprobs are those of one step at a time."""
    from tunix.rl.rollout import base_rollout

    from jpaged.integrations.tunix import SCHEDULER_STEPS, JpagedRollout

    hf_dir = checkpoints["llama3"]
    actor = tunix_model("llama3", hf_dir, seed=5)
    config = base_rollout.RolloutConfig(max_tokens_to_generate=20, max_prompt_length=8,
                                        kv_cache_size=64, temperature=1.0, seed=3,
                                        return_logprobs=True)
    looped = JpagedRollout(actor, _adapter(hf_dir), None, config, **LLM_OPTIONS)
    stepped = JpagedRollout(actor, _adapter(hf_dir), None, config, num_scheduler_steps=1,
                            **LLM_OPTIONS)
    assert SCHEDULER_STEPS > 1
    assert looped.llm.engine.config.num_scheduler_steps == SCHEDULER_STEPS
    assert stepped.llm.engine.config.num_scheduler_steps == 1
    prompts = ["The quick brown fox", "Hello, world!", "ab", "x"]
    ours, theirs = (rollout.generate(prompts, config) for rollout in (looped, stepped))
    assert sum(len(tokens) for tokens in ours.tokens) > 2 * SCHEDULER_STEPS
    for mine, other in zip(ours.tokens, theirs.tokens, strict=True):
        np.testing.assert_array_equal(mine, other)
    for mine, other in zip(ours.logprobs, theirs.logprobs, strict=True):
        np.testing.assert_allclose(mine, other, atol=TOLERANCE)


def test_the_rollout_computes_matmuls_at_the_trainers_precision(checkpoints):
    """Tunix's models pass no matmul precision, so they compute at JAX's default (TF32 for
    float32 on a GPU): the rollout's engine takes that default, not the full float32 a plain
    float32 engine runs; JAX's setting is followed, an explicit option wins, and a dot algorithm
    the engine cannot match is refused by name."""
    import jax

    from jpaged.integrations.tunix import JpagedRollout, trainer_matmul_precision
    from jpaged.options import OptionError

    hf_dir = checkpoints["llama3"]
    actor = tunix_model("llama3", hf_dir, seed=5)

    def precision(**options):
        rollout = JpagedRollout(actor, _adapter(hf_dir), None, None, **LLM_OPTIONS, **options)
        return rollout.llm.engine.config.matmul_precision

    assert trainer_matmul_precision() == "default"
    assert precision() == "default"
    assert precision(matmul_precision="highest") == "highest"
    with jax.default_matmul_precision("float32"):
        assert precision() == "highest"
    with jax.default_matmul_precision("tensorfloat32"):
        assert trainer_matmul_precision() == "high"
    with jax.default_matmul_precision("BF16_BF16_F32_X3"):
        with pytest.raises(OptionError, match="jax_default_matmul_precision is 'BF16_BF16_F32_X3'"):
            trainer_matmul_precision()


def test_a_sampled_pad_token_ends_the_sample_as_tunixs_trainer_reads_it(checkpoints):
    """Tunix's trainer reads the pad id as padding wherever it stands. A token the model samples
    mid-way is made the pad id: with the same seeds the samples are the same up to it and end
    there, and Tunix's forward scores every sample as the rollout did (going on past the pad,
    the trainer would have scored the rest as another sequence)."""
    from tunix.rl import common
    from tunix.rl.rollout import base_rollout

    from jpaged.integrations.tunix import JpagedRollout

    hf_dir = checkpoints["llama3"]
    actor = tunix_model("llama3", hf_dir, seed=5)
    config = base_rollout.RolloutConfig(max_tokens_to_generate=12, max_prompt_length=8,
                                        kv_cache_size=64, temperature=1.0, seed=3,
                                        return_logprobs=True)
    prompts = ["The quick brown fox", "Hello, world!", "ab"]
    plain = JpagedRollout(actor, _adapter(hf_dir), None, config, **LLM_OPTIONS).generate(
        prompts, config)
    tokenizer = _adapter(hf_dir)
    in_prompts = {int(t) for row in plain.left_padded_prompt_tokens for t in row}
    row, at, pad = next((row, at, int(token)) for row, tokens in enumerate(plain.tokens)
                        for at, token in enumerate(tokens[:-1]) if at >= 2
                        and int(token) not in in_prompts | {tokenizer.eos_id()}
                        and int(token) not in tokens[:at])
    tokenizer._tokenizer.pad_token = tokenizer._tokenizer.convert_ids_to_tokens(pad)
    assert tokenizer.pad_id() == pad != tokenizer.eos_id()
    rollout = JpagedRollout(actor, tokenizer, None, config, **LLM_OPTIONS)
    out = rollout.generate(prompts, config)
    np.testing.assert_array_equal(out.tokens[row], plain.tokens[row][:at + 1])
    width = config.max_tokens_to_generate
    completions = np.full((len(prompts), width), pad, np.int32)
    sampled = np.zeros((len(prompts), width), np.float32)
    for i, (tokens, logprobs) in enumerate(zip(out.tokens, out.logprobs, strict=True)):
        assert pad not in tokens[:-1]
        completions[i, :len(tokens)], sampled[i, :len(tokens)] = tokens, logprobs
    graphdef, state = nnx.split(actor)
    expected = np.asarray(common.compute_per_token_logps(
        graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(completions), pad_id=pad, eos_id=tokenizer.eos_id(),
        temperature=config.temperature))
    is_real = completions != pad
    np.testing.assert_allclose(sampled[is_real], expected[is_real], atol=TOLERANCE)


def test_an_actor_jpaged_cannot_compute_is_refused_by_name(checkpoints):
    import dataclasses

    from jpaged.integrations.tunix import JpagedRollout
    from jpaged.options import OptionError

    actor = tunix_model("qwen3", checkpoints["qwen3"])
    with pytest.raises(OptionError, match="load_format"):
        JpagedRollout(actor, None, load_format="dummy", **LLM_OPTIONS)
    config = tunix_weights.model_config(actor, max_model_len=64, eos_token_ids=[1])
    assert (config.num_hidden_layers, config.rope.theta, config.torch_dtype,
            config.eos_token_ids) == (2, 1e6, "float32", (1,))
    actor.config = dataclasses.replace(actor.config, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts"):
        JpagedRollout(actor, None, **LLM_OPTIONS)
    bf16 = tunix_model("llama3", checkpoints["llama3"])
    state = nnx.state(bf16, nnx.Param)
    name, var = next(iter(nnx.to_flat_state(state)))
    var.set_value(var.get_value().astype(jnp.bfloat16))
    nnx.update(bf16, state)
    with pytest.raises(ValueError, match="dtype: .* mix"):
        tunix_weights.model_config(bf16, max_model_len=64)


def test_unmapped_parameters_are_named():
    assert tunix_weights.hf_name("layers.3.attn.o_proj.w") == (
        "model.layers.3.self_attn.o_proj.weight", "heads_out")
    with pytest.raises(ValueError, match="layers.0.attn.q_proj.lora_a"):
        tunix_weights.hf_name("layers.0.attn.q_proj.lora_a")


def test_rope_mismatch_is_refused(hf_checkpoints, checkpoints):
    """Tunix's Llama3 rotates with theta 1e6 and no llama3 scaling whatever its config says."""
    raw = json.loads((__import__("pathlib").Path(hf_checkpoints["llama_gqa"])
                      / "config.json").read_text())
    model = tunix_model("llama3", checkpoints["llama3"])
    with pytest.raises(ValueError, match="rope_theta"):
        tunix_weights.check_configs(model, ModelConfig.from_dict(raw))
    from jpaged.integrations.tunix import JpagedRollout
    with pytest.raises(ValueError, match="rope_theta: jpaged's model has 500000.0"):
        JpagedRollout(model, None, model=hf_checkpoints["llama_gqa"], **LLM_OPTIONS)
    raw_ok = json.loads((__import__("pathlib").Path(checkpoints["llama3"])
                         / "config.json").read_text())
    tunix_weights.check_configs(model, ModelConfig.from_dict(raw_ok))
    scaled = dict(raw_ok, rope_scaling=dict(rope_type="linear", factor=2.0), rope_theta=1e6)
    scaled.pop("rope_parameters", None)
    with pytest.raises(ValueError, match="rope_scaling"):
        tunix_weights.check_configs(model, ModelConfig.from_dict(scaled))



def recording_rollout_class():
    """JpagedRollout that, after each weight sync, samples and checks its sample logprobs (and
    its `get_per_token_logps`) against Tunix's forward of the trainer's model, which holds the
    weights just synced. (Tunix may generate a step's rollouts before the previous step's sync,
    so the check runs at the sync, not at Tunix's own generate calls.)"""
    from tunix.rl import common
    from tunix.rl.rollout import base_rollout
    from jpaged.integrations.tunix import JpagedRollout

    config = base_rollout.RolloutConfig(max_tokens_to_generate=8, max_prompt_length=8,
                                        temperature=0.9, return_logprobs=True)

    class RecordingRollout(JpagedRollout):
        records = []
        generated = []         # the prompts of each of Tunix's generate calls
        trainer_model = None   # set to a callable returning the trainer's model

        def __init__(self, rollout_actor, *args, **kwargs):
            self.actor = rollout_actor   # the trainer's model until the cluster is built
            super().__init__(rollout_actor, *args, **kwargs)
            with jax.transfer_guard("allow"):
                self.records.append(self._compare(self.actor))   # built from the actor

        def generate(self, prompts, rollout_config, **kwargs):
            self.generated.append([str(p) for p in prompts])
            return super().generate(prompts, rollout_config, **kwargs)

        def update_params(self, params, filter_types=None):
            super().update_params(params, filter_types)
            trainer = type(self).trainer_model() if type(self).trainer_model else self.actor
            with jax.transfer_guard("allow"):   # sampling inside Tunix's guarded sync
                self.records.append(self._compare(trainer))

        def _compare(self, trainer):
            out = JpagedRollout.generate(self, ["The quick brown fox", "Hello, world!"], config)
            completions = np.full((len(out.tokens), 8), self.pad_id(), np.int32)
            for row, tokens in enumerate(out.tokens):
                completions[row, :len(tokens)] = tokens
            graphdef, state = nnx.split(trainer)
            expected = np.asarray(common.compute_per_token_logps(
                graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
                completion_tokens=jnp.asarray(completions), pad_id=self.pad_id(),
                eos_id=self.eos_id(), temperature=config.temperature))
            rescored = np.asarray(self.get_per_token_logps(out.left_padded_prompt_tokens,
                                                           completions))
            is_real = completions != self.pad_id()
            sampled = np.zeros_like(expected)
            for row, values in enumerate(out.logprobs):
                sampled[row, :len(values)] = values
            return dict(sampled=np.abs(sampled - expected)[is_real].max(),
                        rescored=np.abs(rescored - expected)[is_real].max(),
                        real_tokens=int(is_real.sum()),
                        pads_are_zero=bool((rescored[~is_real] == 0).all()),
                        embed=np.asarray(self.llm.get_weights()["model.embed_tokens.weight"]))

    return RecordingRollout


def test_grpo_trains_with_jpaged_rollout(checkpoints):
    """Tunix's GRPO learner, two steps, jpaged as its rollout engine, built as RLCluster
    builds it: from the actor, no checkpoint named."""
    import optax
    import transformers
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    hf_dir = checkpoints["llama3_small"]
    actor = tunix_model("llama3", hf_dir, seed=3)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    rollout_cls = recording_rollout_class()
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=8, max_prompt_length=16, kv_cache_size=64, temperature=0.9,
        return_logprobs=True)
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, tokenizer=transformers.AutoTokenizer.from_pretrained(hf_dir),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role},
            rollout_engine=functools.partial(rollout_cls, **LLM_OPTIONS),
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.sgd(0.5), eval_every_n_steps=100, max_steps=2),
            rollout_config=rollout_config))
    rollout_cls.trainer_model = lambda: cluster.actor_trainer.model
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(num_generations=2, beta=0.0),
        reward_fns=[lambda prompts, completions, **_: [float(len(c)) for c in completions]])
    prompts = ["The quick brown fox", "Hello, world!"]
    # an array, as Tunix's data pipeline yields: Tunix repeats the batch's leaves G times
    learner.train([{"prompts": np.array(prompts)}, {"prompts": np.array(prompts[::-1])}])
    assert [sorted(step) for step in rollout_cls.generated] == [sorted(prompts * 2)] * 2
    records = rollout_cls.records
    assert len(records) == 3   # at construction, then after each of the two steps
    for record in records:
        assert record["real_tokens"] > 0 and record["pads_are_zero"]
        assert record["sampled"] < TOLERANCE and record["rescored"] < TOLERANCE, record
    # each sync brought weights the step before trained
    for before, after in zip(records, records[1:]):
        assert np.abs(after["embed"] - before["embed"]).max() > 0
