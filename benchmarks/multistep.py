"""Host overhead of decoding: K decode iterations per device loop, K = 1..16, batch 1..256.

For each model (random bfloat16 weights) and batch size, B requests with 16-token prompts decode
128 tokens each (EOS ignored), asking for their outputs only when finished (`--output-kind
final_only`, as `LLM.generate` does; `cumulative` builds every request's output every step). Over the decode steps (the prefill step excluded) it reports:
  tokens/s, synchronous and with async scheduling (wall clock);
  GPU-busy tokens/s: the same tokens over the time the GPU was executing something (the union of
      kernel and copy intervals on its streams, from a `jax.profiler` trace of a third, identical
      async run): the device-only rate of the same steps;
  wall / busy for both modes: the targets are K = 8 within 1.10 at batch 64 on the
      1B-shaped model and K = 1 with async scheduling within 1.25;
  host us per token-step: the synchronous run's host time (scheduling, input building, output
      processing: everything outside dispatch-to-fetched-result) over the tokens generated.
One engine per model; each K's loop (K is its static trip count) is compiled by a short run
first. Usage: python benchmarks/multistep.py --models llama3.2-1b,llama3-8b --out FILE

`--kernels N` adds, per row, the N GPU kernels (and copies) that took the most of the traced
run, in microseconds per decode iteration: where a decode step's time goes. `--override
field=value,...` changes the presets' Hugging Face config fields (e.g. a smaller model of the
same family), `--dtype` the weights' dtype (bfloat16 by default), `--matmul-precision` the
model's matmul precision.
"""

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged import LLMEngine, RequestOutputKind, SamplingParams  # noqa: E402
from jpaged.config import PRESETS_DIR, ModelConfig  # noqa: E402
from jpaged.models.llama import LlamaForCausalLM  # noqa: E402


def gpu_stream_lines(trace_dir: str) -> list | None:
    """The stream lines (kernels and copies) of the first GPU's plane in a `jax.profiler` trace,
    or None when the trace has no GPU (a CPU run). Derived lines such as "XLA Ops", which span
    whole programs, are left out."""
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    if not planes:
        return None
    return [line for line in min(planes, key=lambda p: p.name).lines
            if line.name.startswith("Stream")]


def busy_seconds(lines) -> float:
    """Seconds during which any of these lines ran an event (the union of their intervals)."""
    intervals = sorted((e.start_ns, e.end_ns) for line in lines for e in line.events)
    busy, end = 0, None
    for start, stop in intervals:
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy * 1e-9


def kernel_totals(lines) -> list[tuple[str, float, int]]:
    """(name, seconds, count) of each kernel or copy name on these lines, most time first."""
    totals: dict[str, list] = {}
    for line in lines:
        for event in line.events:
            entry = totals.setdefault(event.name, [0, 0])
            entry[0] += event.end_ns - event.start_ns
            entry[1] += 1
    return sorted(((name, ns * 1e-9, count) for name, (ns, count) in totals.items()),
                  key=lambda item: -item[1])


def kernel_table(totals, iterations: int, busy: float, top: int) -> list[str]:
    """Markdown rows: the `top` kernels of `totals` per decode iteration, and the rest."""
    rows = ["| kernel or copy | us per iteration | calls per iteration | share of busy |",
            "|---|---:|---:|---:|"]
    shown, rest = totals[:top], totals[top:]
    for name, seconds, count in shown + [("(all others)", sum(t[1] for t in rest),
                                          sum(t[2] for t in rest))] * bool(rest):
        label = name if len(name) <= 80 else name[:77] + "..."
        rows.append(f"| `{label}` | {1e6 * seconds / iterations:.1f} | "
                    f"{count / iterations:.1f} | {seconds / busy:.1%} |")
    return rows


def gpu_busy_seconds(trace_dir: str) -> tuple[float, list[str], list]:
    """Seconds during which any stream of the first GPU ran a kernel or a copy, the lines
    used, and the kernel totals (`kernel_totals`)."""
    lines = gpu_stream_lines(trace_dir)
    if lines is None:
        raise RuntimeError("the trace has no GPU plane")
    return busy_seconds(lines), [line.name for line in lines], kernel_totals(lines)


def model_config(name: str, overrides: str) -> ModelConfig:
    """The preset `name` with Hugging Face config fields replaced: "field=value,..." (values
    read as JSON: numbers, true/false, quoted strings)."""
    if not overrides:
        return ModelConfig.preset(name)
    ModelConfig.preset(name)   # an unknown name is refused with the known ones
    raw = json.loads((PRESETS_DIR / f"{name}.json").read_text())
    for item in overrides.split(","):
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise ValueError(f"--override {item!r}: expected field=value")
        raw[field.strip()] = json.loads(value)
    return ModelConfig.from_dict(raw, source=f"preset {name} with {overrides}")


def run_once(engine, batch, k, decode_tokens, rng, async_scheduling=False, trace_dir=None,
             output_kind=RequestOutputKind.FINAL_ONLY):
    engine.config = dataclasses.replace(engine.config, num_scheduler_steps=k,
                                        async_scheduling=async_scheduling)
    vocab = engine.model_config.vocab_size
    for index in range(batch):
        engine.add_request(f"b{batch}k{k}r{index}", prompt_token_ids=rng.integers(
            10, vocab, 16).tolist(), params=SamplingParams(
            temperature=0.0, max_tokens=decode_tokens, ignore_eos=True,
            output_kind=output_kind))
    engine.step_log = []
    shapes_before = engine.executor.num_compilations
    engine.step()   # the prompts' prefill (all of them fit one step)
    assert not engine.step_log[0].is_decode and engine.step_log[0].num_seqs == batch
    if trace_dir:
        jax.profiler.start_trace(trace_dir)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    if trace_dir:
        jax.profiler.stop_trace()
    decode = engine.step_log[1:]
    return dict(batch=batch, k=k, tokens=sum(r.num_generated for r in decode),
                iterations=len(decode) * k,   # a loop runs all K iterations (static trip count)
                host=sum(r.host_seconds for r in decode), steps=len(decode),
                compiled=engine.executor.num_compilations > shapes_before, elapsed=elapsed)


def measure(engine, batch, k, decode_tokens, rng, output_kind) -> dict:
    run = functools.partial(run_once, engine, batch, k, decode_tokens, rng,
                            output_kind=output_kind)
    for _ in range(3):  # again if anything compiled (e.g. a block operation's new size)
        sync = run()
        overlapped = run(async_scheduling=True)
        with tempfile.TemporaryDirectory() as trace_dir:
            traced = run(async_scheduling=True, trace_dir=trace_dir)
            busy, lines, kernels = gpu_busy_seconds(trace_dir)
        compiled = sync["compiled"] or overlapped["compiled"] or traced["compiled"]
        if not compiled:
            break
    assert traced["tokens"] == sync["tokens"] == overlapped["tokens"]
    return sync | dict(async_elapsed=overlapped["elapsed"], busy=busy, lines=lines,
                       kernels=kernels, iterations=traced["iterations"], compiled=compiled)


def main(argv=None):
    parser = argparse.ArgumentParser(description="multi-step decode host overhead")
    parser.add_argument("--models", default="llama3.2-1b,llama3-8b")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--ks", default="1,2,4,8,16")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--output-kind", default="final_only",
                        choices=[kind.name.lower() for kind in RequestOutputKind],
                        help="what engine.step returns per request (LLM.generate: final_only)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--matmul-precision", default=None,
                        choices=["highest", "high", "default"],
                        help="the model's matmul precision (absent: its dtype's default)")
    parser.add_argument("--override", default="",
                        help="Hugging Face config fields replaced in every preset: field=value,...")
    parser.add_argument("--kernels", type=int, default=0,
                        help="per row, the N GPU kernels that took the most time")
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
             f"{args.batches} --ks {args.ks} --decode-tokens {args.decode_tokens} "
             f"--output-kind {args.output_kind} --dtype {args.dtype}"
             + (f" --matmul-precision {args.matmul_precision}" if args.matmul_precision else "")
             + (f" --override {args.override}" if args.override else "")
             + (f" --kernels {args.kernels}" if args.kernels else ""),
             "16-token prompts, greedy, EOS ignored, outputs built as --output-kind asks; "
             "a row whose runs compiled anything (a loop, a block operation's new size) is "
             "measured again, up to 3 times; one marked * still included a compile and is "
             "not comparable", "",
             "GPU-busy: the union of the GPU's kernel and copy intervals during a traced, "
             "otherwise identical async run; wall / busy = 1 means the GPU never waited.", "",
             "| model | batch | K | steps | tokens/s | async tokens/s | GPU-busy tokens/s | "
             "wall / busy | async wall / busy | host us per token-step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    results = []
    for name in args.models.split(","):
        config = model_config(name, args.override)
        label = f"{name}, overridden" if args.override else name
        model = LlamaForCausalLM(config, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0),
                                 matmul_precision=args.matmul_precision)
        engine = LLMEngine.from_model(model, None, max_num_seqs=max(batches), max_model_len=512,
                                      max_num_batched_tokens=max(4096, 16 * max(batches)),
                                      warmup=False, num_scheduler_steps=max(ks))
        for batch in batches:
            for k in ks:  # compile this batch's loop for every K first (K is its trip count)
                run_once(engine, batch, k, 8, rng)
                run_once(engine, batch, k, 8, rng, async_scheduling=True)
            for k in ks:
                r = measure(engine, batch, k, args.decode_tokens, rng,
                            RequestOutputKind[args.output_kind.upper()]) | dict(model=label)
                results.append(r)
                mark = "*" if r["compiled"] else ""
                lines.append(
                    f"| {label} | {batch} | {k}{mark} | {r['steps']} | "
                    f"{r['tokens'] / r['elapsed']:.0f} | {r['tokens'] / r['async_elapsed']:.0f} | "
                    f"{r['tokens'] / r['busy']:.0f} | {r['elapsed'] / r['busy']:.3f} | "
                    f"{r['async_elapsed'] / r['busy']:.3f} | "
                    f"{1e6 * r['host'] / r['tokens']:.1f} |")
                print(lines[-1], flush=True)
        del engine, model
    for r in results if args.kernels else ():
        lines += ["", f"{r['model']}, batch {r['batch']}, K = {r['k']}: GPU time per decode "
                  f"iteration ({r['iterations']} iterations traced, busy "
                  f"{1e6 * r['busy'] / r['iterations']:.0f} us per iteration)", ""]
        lines += kernel_table(r["kernels"], r["iterations"], r["busy"], args.kernels)
    lines += ["", f"GPU trace lines counted: {', '.join(results[0]['lines'])}"]
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
            ax.plot([r["k"] for r in rows],
                    [100 * max(0.0, 1 - r["busy"] / r["elapsed"]) for r in rows],
                    marker="o", label=f"batch {batch}")
            ax.plot([r["k"] for r in rows],
                    [100 * max(0.0, 1 - r["busy"] / r["async_elapsed"]) for r in rows],
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
