"""Tunix's GRPO learner with jpaged as its rollout engine against Tunix's own vanilla rollout:
the same random Llama 3 (Tunix's model, random init), prompts, reward and seeds, one run each.

    python benchmarks/grpo.py --out FILE [--steps 20] [--layers 16] [--width 1024]
        [--engines jpaged,vanilla]

Per step: seconds (from one rollout's start to the next's), rollout seconds and completion
tokens/s, the mean reward of the step's samples, and the gap between the rollout's logprobs and
the trainer's: the rollout samples a fixed probe batch and Tunix's learner forward
(`compute_per_token_logps` on the trainer's model) scores the same tokens, after every weight
sync for jpaged (the trainer holds the weights just synced) and after every rollout for the
vanilla one (it samples from the trainer's own model, so Tunix syncs nothing); the gap is the
mean and max |difference| over the sampled tokens. The reward is a toy verifiable one:
completions of TARGET_CHARS characters score best.
The first step compiles for both engines: the summary counts the steps after it.
"""

import argparse
import datetime
import functools
import importlib.metadata
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = ["def parse(", "import os\n", "class Cache:", "for key in", "return sorted(",
           "with open(", "if value is None:", "raise ValueError("]
PROBE = ["def main(", "while True:"]
TARGET_CHARS = 24
SPECIAL = ["<|end_of_text|>", "<|pad|>", "<|begin_of_text|>"]


def write_tokenizer(directory: Path, vocab_size: int, max_files: int):
    """A byte-level BPE of vocab_size tokens trained on the standard library's first .py
    files, with EOS, pad and BOS tokens; returned as a transformers tokenizer."""
    import sysconfig

    import tokenizers
    import transformers

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:max_files]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.train_from_iterator(
        (path.read_bytes().decode("utf-8", "replace") for path in files),
        tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), eos_token=SPECIAL[0],
        pad_token=SPECIAL[1], bos_token=SPECIAL[2])


def tunix_model(args, seed: int):
    from tunix.models.llama3 import model as llama3_lib

    config = llama3_lib.ModelConfig(
        num_layers=args.layers, vocab_size=args.vocab, embed_dim=args.width,
        hidden_dim=4 * args.width, num_heads=args.heads, head_dim=args.width // args.heads,
        num_kv_heads=args.kv_heads, rope_theta=1_000_000, norm_eps=1e-5)
    return llama3_lib.Llama3(config, rngs=nnx.Rngs(seed))


def length_reward(prompts, completions, **_):
    return [-abs(len(text) - TARGET_CHARS) / TARGET_CHARS for text in completions]


class Recorder:
    """What one run measures, filled by the rollout class `recording` makes."""

    def __init__(self):
        self.rollouts = []   # (start, seconds, completion tokens)
        self.prompts = []    # the prompts of each generate call
        self.gaps = []       # (mean, max) per sync
        self.rewards = []    # mean reward per reward call (one per step)
        self.trainer = None  # callable: the trainer's model

    def reward(self, prompts, completions, **kwargs):
        values = length_reward(prompts, completions)
        self.rewards.append(float(np.mean(values)))
        return values


def recording(base, recorder: Recorder, probe_config, *, shares_weights: bool):
    """`base` (a rollout class) that times its generate calls and measures its logprob gap to
    the trainer on the probe batch: after each weight sync, or after each generate for a
    rollout that shares the trainer's model (Tunix syncs nothing to it)."""
    from tunix.rl import common

    class Recording(base):
        def generate(self, prompts, rollout_config, **kwargs):
            start = time.perf_counter()
            out = super().generate(prompts, rollout_config, **kwargs)
            seconds = time.perf_counter() - start
            recorder.rollouts.append((start, seconds, sum(len(t) for t in out.tokens)))
            recorder.prompts.append([str(p) for p in prompts])
            if shares_weights:
                recorder.gaps.append(self._gap(recorder.trainer()))
            return out

        def update_params(self, params, filter_types=None):
            super().update_params(params, filter_types)
            with jax.transfer_guard("allow"):
                recorder.gaps.append(self._gap(recorder.trainer()))

        def _gap(self, trainer) -> tuple[float, float]:
            out = base.generate(self, PROBE, probe_config)
            width = probe_config.max_tokens_to_generate
            completions = np.full((len(out.tokens), width), self.pad_id(), np.int32)
            sampled = np.zeros((len(out.tokens), width), np.float32)
            for row, (tokens, logprobs) in enumerate(zip(out.tokens, out.logprobs)):
                completions[row, :len(tokens)] = np.asarray(tokens)
                sampled[row, :len(tokens)] = np.asarray(logprobs)
            graphdef, state = nnx.split(trainer)
            expected = np.asarray(common.compute_per_token_logps(
                graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
                completion_tokens=jnp.asarray(completions), pad_id=self.pad_id(),
                eos_id=self.eos_id(), temperature=probe_config.temperature))
            is_real = completions != self.pad_id()
            gap = np.abs(sampled - expected)[is_real]
            if gap.max() > 1e-2:
                _report_worst(out.tokens, completions, sampled, expected, is_real)
            return float(gap.mean()), float(gap.max())

    return Recording


def _report_worst(tokens, completions, sampled, expected, is_real):
    """To stderr: the probe token whose rollout logprob is furthest from the trainer's, with
    its sample, for a gap past what float rounding explains."""
    difference = np.where(is_real, np.abs(sampled - expected), 0.0)
    row, position = np.unravel_index(np.argmax(difference), difference.shape)
    print(f"logprob gap {difference[row, position]:.3g} at probe sample {row}, position "
          f"{position} of {len(tokens[row])}: token {completions[row, position]}, rollout "
          f"{sampled[row, position]:.4f}, trainer {expected[row, position]:.4f}; sample "
          f"{np.asarray(tokens[row]).tolist()}", file=sys.stderr, flush=True)


def vanilla_class():
    """Tunix's vanilla rollout with the constructor RLCluster calls a rollout class with."""
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    class Vanilla(vanilla_rollout.VanillaRollout):
        def __init__(self, rollout_actor, tokenizer, mesh=None, rollout_config=None):
            config = rollout_actor.config
            super().__init__(rollout_actor, tokenizer, base_rollout.CacheConfig(
                cache_size=rollout_config.kv_cache_size, num_layers=config.num_layers,
                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim))

        def generate(self, prompts, rollout_config, **kwargs):
            # Tunix hands numpy strings, which a transformers tokenizer refuses
            return super().generate([str(p) for p in prompts], rollout_config, **kwargs)

    return Vanilla


def training_batches(steps: int) -> list[dict]:
    """One batch of all PROMPTS per step, as an array: Tunix maps its repeat over the batch as
    a pytree, so a list would be taken as one leaf per prompt, each repeated into an array that
    the rollout then sees as one prompt (the str() of G copies)."""
    return [{"prompts": np.array(PROMPTS)}] * steps


def rollout_options(engine: str) -> dict:
    """"jpaged": the rollout's default options; "jpaged:K": K decode steps per scheduler step."""
    name, _, steps = engine.partition(":")
    if name != "jpaged" or (steps and not steps.isdigit()):
        raise ValueError(f"engine {engine!r}: expected jpaged, jpaged:K or vanilla")
    return {"num_scheduler_steps": int(steps)} if steps else {}


def run(engine: str, args, tokenizer) -> dict:
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from jpaged.integrations.tunix import JpagedRollout

    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_tokens, max_prompt_length=16,
        kv_cache_size=16 + args.max_tokens + 16, temperature=0.9, seed=args.seed,
        return_logprobs=True)
    recorder = Recorder()
    if engine == "vanilla":
        rollout = recording(vanilla_class(), recorder, rollout_config, shares_weights=True)
    else:   # rollout_options refuses any other name
        rollout = functools.partial(
            recording(JpagedRollout, recorder, rollout_config, shares_weights=False),
            dtype=args.dtype, max_num_seqs=len(PROMPTS) * args.generations,
            **rollout_options(engine))
    actor = tunix_model(args, args.seed)
    if args.dtype != "float32":
        state = nnx.state(actor, nnx.Param)
        nnx.update(actor, jax.tree.map(lambda x: x.astype(args.dtype), state))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, tokenizer=tokenizer, cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster_lib.Role}, rollout_engine=rollout,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adam(args.learning_rate), eval_every_n_steps=10 ** 6,
                max_steps=args.steps),
            rollout_config=rollout_config))
    recorder.trainer = lambda: cluster.actor_trainer.model
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(
            num_generations=args.generations, beta=0.0), reward_fns=[recorder.reward])
    start = time.perf_counter()
    learner.train(training_batches(args.steps))
    total = time.perf_counter() - start
    starts = [start for start, _, _ in recorder.rollouts]
    return dict(engine=engine, total_s=total, rollouts=recorder.rollouts,
                step_s=list(np.diff(starts)), gaps=recorder.gaps, rewards=recorder.rewards,
                prompts=recorder.prompts)


def _after_first(result: dict) -> list:
    """The run's rollouts after the first (which compiles), or the first alone."""
    return result["rollouts"][1:] or result["rollouts"]


def _rollout_seconds(result: dict) -> float:
    return float(np.mean([seconds for _, seconds, _ in _after_first(result)]))


def summary(results: list[dict]) -> str:
    lines = ["| rollout | steps | seconds / step (after the first) | rollout s / step | "
             "rollout tokens/s | logprob gap, worst mean / max | reward, first -> last |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in results:
        later = _after_first(r)
        rollout_s = _rollout_seconds(r)
        rate = sum(t for _, _, t in later) / sum(s for _, s, _ in later)
        step = float(np.mean(r["step_s"][1:] or r["step_s"] or [r["total_s"]]))
        gap_mean = max((g[0] for g in r["gaps"]), default=float("nan"))
        gap_max = max((g[1] for g in r["gaps"]), default=float("nan"))
        rewards = r["rewards"]
        lines.append(f"| {r['engine']} | {len(r['rollouts'])} | {step:.3f} | {rollout_s:.3f} | "
                     f"{rate:,.0f} | {gap_mean:.1e} / {gap_max:.1e} | "
                     f"{rewards[0]:+.3f} -> {rewards[-1]:+.3f} |")
    vanilla = [r for r in results if r["engine"] == "vanilla"]
    if vanilla:
        lines.append("")
        for r in results:
            if r["engine"] != "vanilla":
                lines.append(f"rollout seconds per step, vanilla / {r['engine']}: "
                             f"{_rollout_seconds(vanilla[0]) / _rollout_seconds(r):.2f}x")
    return "\n".join(lines) + "\n"


def per_step(results: list[dict]) -> str:
    """One row per step: each engine's rollout seconds, mean reward and logprob gap (mean / max
    |rollout - trainer| over the probe's sampled tokens; the gap measured in that step)."""
    head = "| step | " + " | ".join(
        f"{r['engine']} rollout s | {r['engine']} reward | {r['engine']} gap mean / max"
        for r in results) + " |"
    lines = [head, "|---:|" + "---:|---:|---|" * len(results)]
    for step in range(max(len(r["rollouts"]) for r in results)):
        cells = []
        for r in results:
            rollout = r["rollouts"][step] if step < len(r["rollouts"]) else None
            reward = r["rewards"][step] if step < len(r["rewards"]) else None
            gap = r["gaps"][step] if step < len(r["gaps"]) else None
            cells += [f"{rollout[1]:.4f}" if rollout else "",
                      f"{reward:+.3f}" if reward is not None else "",
                      f"{gap[0]:.1e} / {gap[1]:.1e}" if gap else ""]
        lines.append(f"| {step + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="jpaged,vanilla",
                        help="comma-separated: vanilla, jpaged (the rollout's defaults), or "
                             "jpaged:K for K decode steps per scheduler step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--tokenizer-files", type=int, default=400,
                        help="standard-library files the tokenizer trains on")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/jpaged-grpo"))
    parser.add_argument("--out", default=None, help="also write the results here (markdown)")
    return parser.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    tokenizer = write_tokenizer(args.workdir / "tokenizer", args.vocab, args.tokenizer_files)
    params = sum(x.size for x in jax.tree_util.tree_leaves(
        nnx.state(nnx.eval_shape(lambda: tunix_model(args, 0)), nnx.Param)))
    results = [run(engine, args, tokenizer) for engine in args.engines.split(",")]
    command = " ".join(sys.argv[1:] if argv is None else argv)
    text = (f"# GRPO with Tunix: jpaged against the vanilla rollout\n\n"
            f"device {jax.devices()[0].device_kind}, {datetime.date.today().isoformat()}, "
            f"jax {jax.__version__}, google-tunix {importlib.metadata.version('google-tunix')}, "
            f"Python {platform.python_version()}\n"
            f"command: `python benchmarks/grpo.py {command}`\n"
            f"model: Tunix Llama3, {params:,} parameters ({args.dtype}), "
            f"{len(PROMPTS)} prompts x {args.generations} samples, up to {args.max_tokens} "
            f"tokens\n\n" + summary(results)
            + "\nper step:\n\n" + per_step(results))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
