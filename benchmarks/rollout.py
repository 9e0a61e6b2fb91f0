"""A GRPO-shaped rollout in one process: P prompts x n samples generated, then every completion
scored (prompt + completion: the reference / old-policy logprobs), jpaged against transformers.

A preset's shape with random weights (load_format "dummy"'s draw), identical in both frameworks
(`hf_backends.build_hf_model` copies jpaged's parameters and checks them equal). Prompts are
random token ids, all of --prompt-len tokens; EOS is ignored, so every sample has exactly
--max-tokens tokens. Reported per framework:
  generate   output tokens / wall (jpaged: one untimed warm-up rollout on other prompts with 4-token
             outputs first, and any compilation still left subtracted);
  score      scored tokens (P * n * (prompt_len + max_tokens)) / wall;
  prefill    share of the P * n * prompt_len prompt tokens jpaged did not prefill while
             generating (the n samples fork one prefilled prompt) and, while scoring, share of
             the P * n * (prompt_len + max_tokens) tokens it took from the prefix cache.
transformers: `generate` (sampling, num_return_sequences=n, min_new_tokens = max_new_tokens) over
batches of --hf-batch-size prompts, left-padded, then one forward over prompt + completion per
batch with a log_softmax gather; it scores jpaged's completions, so the table also gives the
largest difference between the two frameworks' logprobs. --hf-batches caps the batches run.
Usage: python benchmarks/rollout.py --model llama3-8b --out FILE.md
       python benchmarks/rollout.py --model tiny --prompts 4 --prompt-len 16 --n 2 --max-tokens 8
"""

import argparse
import os
import sys
from pathlib import Path

# JAX and torch share the GPU: JAX takes a fixed share. Must be set before jax is imported.
if "--jax-memory-fraction" in sys.argv:
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = sys.argv[sys.argv.index(
        "--jax-memory-fraction") + 1]

import dataclasses  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import hf_backends  # noqa: E402
from jpaged import LLM, LLMEngine, SamplingParams  # noqa: E402
from jpaged.config import PRESETS_DIR, ModelConfig  # noqa: E402
from jpaged.models import random_model  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shape:
    """The rollout: `prompts` prompts of `prompt_len` tokens, n samples of max_tokens each."""
    prompts: int
    prompt_len: int
    n: int
    max_tokens: int

    @property
    def num_samples(self) -> int:
        return self.prompts * self.n


def random_prompts(shape: Shape, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)     # ids >= 10: clear of special tokens
    return rng.integers(10, vocab_size, (shape.prompts, shape.prompt_len)).tolist()


def build_llm(model, shape: Shape, args) -> LLM:
    """`LLM` over an engine built from the in-memory model (`LLM()` itself loads a directory)."""
    engine = LLMEngine.from_model(
        model, None, max_num_seqs=min(args.max_num_seqs, shape.num_samples),
        max_model_len=shape.prompt_len + shape.max_tokens + 1,   # scoring: the pair + 1
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_scheduler_steps=args.num_scheduler_steps, enable_prefix_caching=True,
        warmup=False)
    llm = LLM.from_engine(engine)
    return llm


class Counters:
    """Deltas of the engine counters a phase is judged by: wall, compile seconds, tokens run
    through the model, prefix-cache hits."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.before = self.read()
        self.start = time.perf_counter()

    def read(self) -> np.ndarray:
        cache = self.engine.ledger.prefix_cache
        return np.array([self.engine.executor.compile_seconds,
                         self.engine.executor.num_real_tokens,
                         cache.num_hit_tokens if cache else 0], dtype=np.float64)

    def done(self) -> dict:
        wall = time.perf_counter() - self.start
        compile_seconds, real_tokens, hit_tokens = self.read() - self.before
        return dict(wall=wall - compile_seconds, compile_seconds=compile_seconds,
                    real_tokens=int(real_tokens), hit_tokens=int(hit_tokens))


def jpaged_rollout(llm: LLM, prompts, shape: Shape, seed: int) -> tuple[dict, list]:
    """Generate then score; returns (numbers, completions [P * n] in prompt-major order)."""
    params = SamplingParams(n=shape.n, temperature=1.0, max_tokens=shape.max_tokens,
                            ignore_eos=True, seed=seed)
    counters = Counters(llm.engine)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    generate = counters.done()
    completions = [list(sample.token_ids) for output in outputs for sample in output.outputs]
    if any(len(c) != shape.max_tokens for c in completions) or \
            len(completions) != shape.num_samples:
        raise RuntimeError("jpaged returned samples of the wrong number or length")
    repeated = [prompt for prompt in prompts for _ in range(shape.n)]
    counters = Counters(llm.engine)
    logprobs = llm.score(repeated, completions)
    score = counters.done()
    # Decode steps feed each sample's tokens but its last; the rest of the model's tokens are
    # prompt prefill (and recomputation after a preemption, which the table's count shows).
    prefilled = generate["real_tokens"] - shape.num_samples * (shape.max_tokens - 1)
    return dict(
        generate_tokens_per_s=shape.num_samples * shape.max_tokens / generate["wall"],
        score_tokens_per_s=scored_tokens(shape) / score["wall"],
        generate_seconds=generate["wall"], score_seconds=score["wall"],
        compile_seconds=generate["compile_seconds"] + score["compile_seconds"],
        prefill_saved=1 - prefilled / (shape.num_samples * shape.prompt_len),
        score_cache_share=score["hit_tokens"] / scored_tokens(shape),
        preemptions=llm.stats()["num_preemptions"]), (completions, logprobs)


def scored_tokens(shape: Shape) -> int:
    return shape.num_samples * (shape.prompt_len + shape.max_tokens)


def hf_batches(prompts, shape: Shape, batch_size: int, max_batches):
    """[(first prompt index, prompt ids [B, T] int64)], at most max_batches of them."""
    import torch
    starts = list(range(0, shape.prompts, batch_size))[:max_batches]
    return [(i, torch.tensor(prompts[i:i + batch_size])) for i in starts]


def hf_generate(model, batch, shape: Shape, device: str, seed: int):
    """[B * n, max_tokens] sampled completions of one batch of equal-length prompts (padding
    left, as generate expects, though these prompts need none)."""
    import torch
    torch.manual_seed(seed)
    ids = batch.to(device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             num_return_sequences=shape.n, max_new_tokens=shape.max_tokens,
                             min_new_tokens=shape.max_tokens, pad_token_id=0)
    if out.shape[1] != shape.prompt_len + shape.max_tokens:
        raise RuntimeError(f"generate stopped at {out.shape[1] - shape.prompt_len} tokens")
    return out[:, shape.prompt_len:]


def hf_score(model, batch, completions, shape: Shape, device: str):
    """float32 [B * n, max_tokens]: log p(completion[i] | prompt + completion[:i]), one forward
    over prompt + completion."""
    import torch
    prompts = batch.repeat_interleave(shape.n, dim=0)
    ids = torch.cat([prompts, completions.cpu()], dim=1).to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, shape.prompt_len - 1:-1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = torch.gather(logprobs, 2, ids[:, shape.prompt_len:, None])[..., 0]
    return chosen.cpu().numpy()


def synchronize(device: str):
    if device != "cpu":
        import torch
        torch.cuda.synchronize()


def hf_rollout(model, prompts, completions, shape: Shape, args, device: str) -> dict:
    """transformers' generate and scoring tokens/s over the batches; its scoring runs on
    jpaged's completions so the logprobs compare."""
    import torch
    batches = hf_batches(prompts, shape, args.hf_batch_size, args.hf_batches)
    hf_generate(model, batches[0][1][:1], dataclasses.replace(shape, max_tokens=2), device,
                args.seed)                      # untimed: first-call set-up
    generate_seconds = score_seconds = 0.0
    samples, largest_difference = 0, 0.0
    for first, batch in batches:
        start = time.perf_counter()
        hf_generate(model, batch, shape, device, args.seed + first)
        synchronize(device)
        generate_seconds += time.perf_counter() - start
        rows = slice(first * shape.n, (first + len(batch)) * shape.n)
        theirs = torch.tensor(completions[0][rows])
        start = time.perf_counter()
        logprobs = hf_score(model, batch, theirs, shape, device)
        score_seconds += time.perf_counter() - start
        ours = np.stack(completions[1][rows])
        largest_difference = max(largest_difference, float(np.abs(logprobs - ours).max()))
        samples += len(batch) * shape.n
    run = dataclasses.replace(shape, prompts=samples // shape.n)
    return dict(generate_tokens_per_s=samples * shape.max_tokens / generate_seconds,
                score_tokens_per_s=scored_tokens(run) / score_seconds,
                generate_seconds=generate_seconds, score_seconds=score_seconds,
                prompts_run=run.prompts, logprob_difference=largest_difference)


def header(args, shape: Shape) -> list[str]:
    return hf_backends.run_lines("rollout.py") + [
        f"model {args.model}, random {args.dtype} weights (identical in both frameworks); "
        f"{shape.prompts} prompts x {shape.prompt_len} tokens, n = {shape.n}, "
        f"{shape.max_tokens} output tokens each (EOS ignored), temperature 1",
    ]


def results_table(ours: dict, theirs: dict | None, shape: Shape) -> str:
    lines = ["| framework | generate tokens/s | score tokens/s | generate (s) | score (s) "
             "| notes |", "|---|---:|---:|---:|---:|---|",
             f"| jpaged | {ours['generate_tokens_per_s']:.0f} | {ours['score_tokens_per_s']:.0f} "
             f"| {ours['generate_seconds']:.2f} | {ours['score_seconds']:.2f} | prompt prefill "
             f"saved while generating {ours['prefill_saved']:.1%}; scored tokens from the prefix "
             f"cache {ours['score_cache_share']:.1%}; compile {ours['compile_seconds']:.1f} s "
             f"subtracted; {ours['preemptions']} preemptions |"]
    if theirs is None:
        return "\n".join(lines) + "\n"
    capped = theirs["prompts_run"] < shape.prompts
    lines.append(
        f"| transformers | {theirs['generate_tokens_per_s']:.0f} | "
        f"{theirs['score_tokens_per_s']:.0f} | {theirs['generate_seconds']:.2f} | "
        f"{theirs['score_seconds']:.2f} | {'CAPPED: ' if capped else ''}{theirs['prompts_run']} "
        f"of {shape.prompts} prompts; largest logprob difference to jpaged's scores "
        f"{theirs['logprob_difference']:.2e} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    parser.add_argument("--hf-batch-size", type=int, default=16, help="prompts per generate")
    parser.add_argument("--hf-batches", type=int, default=None, help="at most this many")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jax-memory-fraction", default=None)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> str:
    args = parse_args(argv)
    shape = Shape(args.prompts, args.prompt_len, args.n, args.max_tokens)
    config = ModelConfig.preset(args.model)
    model = random_model(config, dtype=jnp.dtype(args.dtype))
    llm = build_llm(model, shape, args)
    # Untimed: the same batch shapes on other prompts with short outputs compile most programs.
    warm = dataclasses.replace(shape, max_tokens=min(4, shape.max_tokens))
    jpaged_rollout(llm, random_prompts(warm, config.vocab_size, args.seed + 1), warm, args.seed)
    prompts = random_prompts(shape, config.vocab_size, args.seed)
    ours, completions = jpaged_rollout(llm, prompts, shape, args.seed)
    theirs = None
    if not args.no_hf:
        device = hf_backends.torch_device()
        hf_model = hf_backends.build_hf_model(PRESETS_DIR / f"{args.model}.json", model,
                                              device=device, dtype_name=args.dtype)
        theirs = hf_rollout(hf_model, prompts, completions, shape, args, device)
    return hf_backends.emit("\n".join(header(args, shape)) + "\n\n" +
                            results_table(ours, theirs, shape), args.out)


if __name__ == "__main__":
    main()
