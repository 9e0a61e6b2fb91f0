"""Host overhead of decoding: K decode iterations per device loop, K = 1..16, batch 1..256.

For each model (random bfloat16 weights) and batch size, B requests with 16-token prompts decode
128 tokens each (EOS ignored). Over the decode steps (the prefill step excluded) it reports:
  host us per token-step: host time (scheduling, input building, output processing) over the
      tokens generated;
  GPU idle: 1 - device time / wall time, device time being each step's transfer-in, compiled
      loop and transfer-out;
  tokens/s against the device-only rate (the same steps' device time): the target is K = 8 within
      10% at batch 64 on the 1B-shaped model.
One engine per model; each K's loop (K is its static trip count) is compiled by a short run
first. Usage: python benchmarks/multistep.py --models llama3.2-1b,llama3-8b --out FILE
"""

import argparse
import dataclasses
import datetime
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged import LLMEngine, SamplingParams  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.models.llama import LlamaForCausalLM  # noqa: E402


def run_once(engine, batch, k, decode_tokens, rng, async_scheduling=False):
    engine.config = dataclasses.replace(engine.config, num_scheduler_steps=k,
                                        async_scheduling=async_scheduling)
    vocab = engine.model_config.vocab_size
    for index in range(batch):
        engine.add_request(f"b{batch}k{k}r{index}", prompt_token_ids=rng.integers(
            10, vocab, 16).tolist(), params=SamplingParams(
            temperature=0.0, max_tokens=decode_tokens, ignore_eos=True))
    engine.step_log = []
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    decode = [r for r in engine.step_log if r.is_decode]
    compiled = any(r.compiled for r in decode)
    tokens = sum(r.num_generated for r in decode)
    device = sum(r.device_seconds for r in decode)
    host = sum(r.host_seconds for r in decode)
    prefill = sum(r.device_seconds + r.host_seconds for r in engine.step_log if not r.is_decode)
    return dict(batch=batch, k=k, tokens=tokens, wall=device + host, device=device, host=host,
                steps=len(decode), compiled=compiled, elapsed=elapsed - prefill)


def main(argv=None):
    parser = argparse.ArgumentParser(description="multi-step decode host overhead")
    parser.add_argument("--models", default="llama3.2-1b,llama3-8b")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--ks", default="1,2,4,8,16")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    lines = [f"device: {getattr(device, 'device_kind', device.platform)}, date "
             f"{datetime.date.today()}, jax {jax.__version__}, python {platform.python_version()}",
             f"command: python benchmarks/multistep.py --models {args.models} --batches "
             f"{args.batches} --ks {args.ks} --decode-tokens {args.decode_tokens}",
             "16-token prompts, 128 greedy tokens each; a row marked * includes a compile "
             "(first use of that batch bucket) and is not comparable", "",
             "Synchronous runs give the device-only time (transfer in, loop, transfer out, per "
             "step); async runs overlap the host with the next loop, so their wall time is "
             "compared with the synchronous run's device time.", "",
             "| model | batch | K | steps | tokens/s | device-only tokens/s | wall / device | "
             "host us per token-step | GPU idle | async tokens/s | async wall / device |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    results = []
    for name in args.models.split(","):
        config = ModelConfig.preset(name)
        model = LlamaForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        engine = LLMEngine.from_model(model, None, max_num_seqs=max(batches), max_model_len=512,
                                      max_num_batched_tokens=4096, warmup=False,
                                      num_scheduler_steps=max(ks))
        for batch in batches:
            for k in ks:  # compile this batch's loop for every K first (K is its trip count)
                run_once(engine, batch, k, 8, rng)
                run_once(engine, batch, k, 8, rng, async_scheduling=True)
            for k in ks:
                r = run_once(engine, batch, k, args.decode_tokens, rng) | dict(model=name)
                a = run_once(engine, batch, k, args.decode_tokens, rng, async_scheduling=True)
                r["async_elapsed"] = a["elapsed"]
                results.append(r)
                mark = "*" if r["compiled"] else ""
                lines.append(
                    f"| {name} | {batch} | {k}{mark} | {r['steps']} | "
                    f"{r['tokens'] / r['wall']:.0f} | {r['tokens'] / r['device']:.0f} | "
                    f"{r['wall'] / r['device']:.3f} | {1e6 * r['host'] / r['tokens']:.1f} | "
                    f"{100 * (1 - r['device'] / r['wall']):.1f}% | "
                    f"{r['tokens'] / r['async_elapsed']:.0f} | "
                    f"{r['async_elapsed'] / r['device']:.3f} |")
                print(lines[-1], flush=True)
        del engine, model
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.plot:
        plot(results, args.plot)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        for batch in sorted({r["batch"] for r in results if r["model"] == name}):
            rows = [r for r in results if r["model"] == name and r["batch"] == batch]
            ax.plot([r["k"] for r in rows], [100 * (1 - r["device"] / r["wall"]) for r in rows],
                    marker="o", label=f"batch {batch}")
            ax.plot([r["k"] for r in rows],
                    [100 * max(0.0, 1 - r["device"] / r["async_elapsed"]) for r in rows],
                    marker="x", linestyle="--", color=ax.lines[-1].get_color(),
                    label=f"batch {batch}, async")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("K (decode iterations per device loop)")
        ax.set_ylabel("GPU idle (% of wall time; dashed: async scheduling)")
        ax.set_title(name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
