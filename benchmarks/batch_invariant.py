"""The batch-invariant mode on one GPU: what it costs, and whether its numbers repeat.

Cost, side by side in one process on one model (a preset with random weights), the default mode
against `batch_invariant=True`: the decode step's device time (part "steps":
roofline.time_decode_step, the one-iteration decode loop launched back to back) at a few batch
sizes, and the e2e trace at each K (part "e2e": benchmarks/e2e.py's jpaged run, all requests at
time 0, the second of two passes through one engine timed).

The matmuls alone (part "matmul"): each of the model's weight shapes (a layer's qkv, o, gate_up
and down projections, the logits' [V, E]) at --matmul-rows rows, as the default mode runs them
(XLA's dot over all rows), as the mode ran them before (XLA's dot in row tiles of 64) and as it
runs them now (the fixed-tiling Triton GEMM, one launch), medians over rotating weight copies
larger than the L2 cache.

Where the device time goes (part "profile"): one decode loop at each of --step-batches and one
prompt of --profile-prompt tokens in both modes under `jax.profiler`, the GPU's kernel time
grouped by kernel (names without their numeric suffixes), the heaviest first, and the number of
kernels each runs.

Determinism: the trace's first --det-requests requests (outputs capped at --det-max-tokens),
sampled (temperature 1, a seed per request, the sampled token's logprob), run --det-runs times
through fresh batch-invariant engines that differ in how they batch: K = 8, the same again,
K = 1, K = 8 with asynchronous scheduling, K = 8 with prompts in chunks of 256. Every token and
every logprob must be identical across the runs (`identical` in the table; a mismatch names the
first request that differs).

Usage: python benchmarks/batch_invariant.py --model llama3-8b --out-dir results/
"""

import argparse
import collections
import gc
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import e2e, hf_backends, multistep, roofline, timing  # noqa: E402
from jpaged import SamplingParams  # noqa: E402
from jpaged.models.row_tiles import COMPILER_OPTIONS  # noqa: E402
from pallas_kernels import batch_invariant  # noqa: E402
from pallas_kernels.gpu import matmul as triton_matmul  # noqa: E402

MODES = {"default": False, "batch-invariant": True}
# How each determinism run batches (engine options over the e2e budget's).
DETERMINISM_RUNS = (
    ("K=8", dict(num_scheduler_steps=8)),
    ("K=8 again", dict(num_scheduler_steps=8)),
    ("K=1", dict(num_scheduler_steps=1)),
    ("K=8 async", dict(num_scheduler_steps=8, async_scheduling=True)),
    ("K=8, chunks of 256", dict(num_scheduler_steps=8, max_num_batched_tokens=256)),
)


def e2e_cost(model, trace, prompts, args, log=print) -> list:
    """The trace at each K in both modes: one row each."""
    rows = []
    for k in args.ks:
        for mode, invariant in MODES.items():
            result, _ = e2e.run_jpaged(model, trace, prompts, args, block_size=16, num_steps=k,
                                       batch_invariant=invariant)
            rows.append(dict(mode=mode, k=k, tokens_per_s=result["output_tokens"]
                             / result["wall"], wall=result["wall"], note=result["note"],
                             steps=result["steps"]))
            log(f"e2e {mode} K={k}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
            gc.collect()
    return rows


def step_cost(model, args, log=print) -> list:
    """The decode step's device time at each of --step-batches in both modes."""
    rows = []
    for mode, invariant in MODES.items():
        engine = e2e.build_jpaged(model, args, block_size=16,
                                  max_num_seqs=max(args.step_batches), batch_invariant=invariant)
        for batch in args.step_batches:
            step = roofline.time_decode_step(engine, batch, max_context=args.step_context)
            rows.append(dict(mode=mode, **step))
            log(f"decode step {mode} batch {batch}: {step['seconds'] * 1e3:.2f} ms", flush=True)
        del engine
        gc.collect()
    return rows


def _kernel_times(fn) -> tuple[collections.Counter, collections.Counter]:
    """fn() run under `jax.profiler`: (seconds, count) per kernel group on the GPU's streams."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        fn()
        jax.profiler.stop_trace()
        lines = multistep.gpu_stream_lines(trace_dir)
    seconds, counts = collections.Counter(), collections.Counter()
    for line in lines or ():
        for event in line.events:
            group = re.sub(r"([._]\d+)+$", "", event.name)[:60]
            seconds[group] += (event.end_ns - event.start_ns) * 1e-9
            counts[group] += 1
    return seconds, counts


def kernel_profile(model, args, log=print) -> list:
    """Per mode and case (a decode loop at each batch, a prompt): kernel groups by device time,
    per loop or per prompt."""
    rows, rng = [], np.random.default_rng(0)
    prompt_len = args.profile_prompt
    for mode, invariant in MODES.items():
        engine = e2e.build_jpaged(model, args, block_size=16,
                                  max_num_seqs=max(args.step_batches), batch_invariant=invariant)

        def prompt():
            engine.add_request("profile", prompt_token_ids=rng.integers(
                0, model.config.vocab_size, prompt_len).tolist(),
                params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()

        cases = [(f"prompt of {prompt_len}", prompt, 1)]
        for batch in args.step_batches:
            steps = 3
            loops = 2 + 3 * steps       # time_decode_step's warm-up and its runs
            cases.append((f"decode batch {batch}", lambda batch=batch, steps=steps:
                          roofline.time_decode_step(engine, batch, max_context=args.step_context,
                                                    steps=steps), loops))
        for case, fn, per in cases:
            fn()                                             # compile outside the trace
            seconds, counts = _kernel_times(fn)
            total = sum(seconds.values()) / per
            rows.append(dict(mode=mode, case=case, total=total,
                             kernels=sum(counts.values()) / per,
                             top=[(group, seconds[group] / per, counts[group] / per)
                                  for group, _ in seconds.most_common(args.profile_top)]))
            log(profile_tables(rows[-1:]), flush=True)
        del engine
        gc.collect()
    return rows


def profile_tables(rows) -> str:
    text = "\nDevice time by kernel (per decode loop, per prompt):\n"
    for row in rows:
        lines = [f"\n{row['mode']}, {row['case']}: {row['total'] * 1e3:.2f} ms in "
                 f"{row['kernels']:.0f} kernels\n", "| kernel | ms | launches |",
                 "|---|---:|---:|"]
        lines += [f"| `{group}` | {seconds * 1e3:.3f} | {count:.0f} |"
                  for group, seconds, count in row["top"]]
        text += "\n".join(lines) + "\n"
    return text


def weight_shapes(config) -> dict:
    """name -> (weight shape, transposed) of one layer's projections and the logits."""
    heads = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {"qkv": ((hidden, heads), False),
            "o": ((config.num_attention_heads * config.head_dim, hidden), False),
            "gate_up": ((hidden, 2 * inner), False), "down": ((inner, hidden), False),
            "logits": ((config.vocab_size, hidden), True)}


MATMUL_WAYS = {   # name -> (jit options, batch_invariant.matmul's path or None for XLA's dot)
    "dot": ({}, None), "tiles of 64": (dict(compiler_options=COMPILER_OPTIONS), False),
    "GEMM": ({}, True)}


def matmul_ways(splits=()) -> dict:
    """`MATMUL_WAYS`, and the GEMM with its I axis in each of `splits` parts (a sweep)."""
    return {**MATMUL_WAYS, **{f"GEMM in {parts}": ({}, parts) for parts in splits}}


def _gemm_fn(transposed, out_dtype, kernel):
    """The function a way times: XLA's dot (kernel None), `batch_invariant.matmul` (False:
    tiles, True: the GEMM), or the GEMM in `kernel` parts of I (an int)."""
    if kernel is None:
        subscripts = "ti,oi->to" if transposed else "ti,io->to"
        return lambda x, w: jnp.einsum(subscripts, x, w, preferred_element_type=out_dtype)
    if isinstance(kernel, bool):
        return lambda x, w: batch_invariant.matmul(x, w, transposed=transposed,
                                                   out_dtype=out_dtype, kernel=kernel)
    return lambda x, w: triton_matmul.matmul(x, w, transposed=transposed, out_dtype=out_dtype,
                                             splits=kernel)


def matmul_cost(model, args, log=print) -> list:
    """Seconds of each weight shape's matmul at each of --matmul-rows rows, each way."""
    ways = matmul_ways(args.matmul_splits)
    rows, key = [], jax.random.PRNGKey(0)
    dtype = model.dtype
    for name, (shape, transposed) in weight_shapes(model.config).items():
        copies = max(2, -(-(64 << 20) // (np.prod(shape) * dtype.itemsize)) + 1)
        weights = [jax.random.normal(jax.random.fold_in(key, i), shape, dtype)
                   for i in range(copies)]
        out_dtype = jnp.float32 if transposed else dtype
        for count in args.matmul_rows:
            x = jax.random.normal(key, (count, shape[1] if transposed else shape[0]), dtype)
            row = dict(shape=name, rows=count, weight=shape)
            for way, (options, kernel) in ways.items():
                row[way] = timing.median_dispatch_seconds(
                    jax.jit(_gemm_fn(transposed, out_dtype, kernel), **options),
                    [(x, w) for w in weights], wait=jax.block_until_ready)
            rows.append(row)
            log(f"matmul {name} x {count}: " + ", ".join(
                f"{way} {row[way] * 1e6:.1f} us" for way in ways), flush=True)
        del weights
        gc.collect()
    return rows


def sample_trace(model, trace, prompts, args, options) -> list:
    """[(token ids, logprobs)] per request: the trace's requests sampled through a fresh
    batch-invariant engine built with `options`."""
    engine = e2e.build_jpaged(model, args, block_size=16,
                              **{"batch_invariant": True, **options})
    for index, (request, prompt) in enumerate(zip(trace, prompts)):
        engine.add_request(f"r{index}", prompt_token_ids=prompt, params=SamplingParams(
            temperature=1.0, seed=index, max_tokens=min(request.output_len, args.det_max_tokens),
            ignore_eos=True, logprobs=0))
    finished = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    results = []
    for index in range(len(trace)):
        completion = finished[f"r{index}"]
        results.append((list(completion.token_ids), np.array(
            [step[token] for step, token in zip(completion.logprobs, completion.token_ids)])))
    return results


def determinism(model, trace, prompts, args, log=print) -> list[dict]:
    """One row per run: its name, seconds, and whether it equals the first run bit for bit."""
    rows, first = [], None
    for name, options in DETERMINISM_RUNS[:args.det_runs]:
        start = time.perf_counter()
        results = sample_trace(model, trace[:args.det_requests], prompts[:args.det_requests],
                               args, options)
        seconds = time.perf_counter() - start
        differs = None
        if first is None:
            first = results
        else:
            for index, ((tokens, logprobs), (tokens0, logprobs0)) in enumerate(
                    zip(results, first, strict=True)):
                if tokens != tokens0 or not np.array_equal(logprobs, logprobs0):
                    differs = index
                    break
        rows.append(dict(run=name, seconds=seconds, differs=differs,
                         tokens=sum(len(t) for t, _ in results)))
        log(f"determinism {name}: {'identical' if differs is None else f'request {differs}'}",
            flush=True)
        gc.collect()
    return rows


def tables(e2e_rows, step_rows, det_rows, matmul_rows=(), tail_seqs=16) -> str:
    text = ""
    if matmul_rows:
        ways = [way for way in matmul_rows[0] if way not in ("shape", "rows", "weight")]
        lines = ["| weight | rows | " + " | ".join(f"{way} us" for way in ways)
                 + " | GEMM / dot | GEMM / tiles |", "|---|---:|" + "---:|" * (len(ways) + 2)]
        for row in matmul_rows:
            lines.append(f"| {row['shape']} {row['weight'][0]}x{row['weight'][1]} | "
                         f"{row['rows']} | " + " | ".join(f"{row[way] * 1e6:.1f}" for way in ways)
                         + f" | {row['GEMM'] / row['dot']:.2f}x"
                         f" | {row['GEMM'] / row['tiles of 64']:.2f}x |")
        text += "Matmuls, device time per call:\n\n" + "\n".join(lines) + "\n\n"
    if e2e_rows:
        lines = ["| K | default tokens/s | batch-invariant tokens/s | invariant / default time |",
                 "|---:|---:|---:|---:|"]
        for k in sorted({row["k"] for row in e2e_rows}):
            rate = {row["mode"]: row["tokens_per_s"] for row in e2e_rows if row["k"] == k}
            if len(rate) == 2:
                lines.append(f"| {k} | {rate['default']:.0f} | {rate['batch-invariant']:.0f} | "
                             f"{rate['default'] / rate['batch-invariant']:.2f}x |")
        text += "E2e trace, output tokens/s:\n\n" + "\n".join(lines) + "\n"
        text += "\nWhere each run's time went (timed pass):\n\n" + e2e.breakdown_table(
            {f"{row['mode']} K={row['k']}": row for row in e2e_rows}, tail_seqs) + "\n"
    if step_rows:
        lines = ["| batch | context | default ms | batch-invariant ms | ratio |",
                 "|---:|---:|---:|---:|---:|"]
        for batch in sorted({row["batch"] for row in step_rows}):
            ms = {row["mode"]: row["seconds"] * 1e3 for row in step_rows if row["batch"] == batch}
            context = next(row["context"] for row in step_rows if row["batch"] == batch)
            if len(ms) == 2:
                lines.append(f"| {batch} | {context} | {ms['default']:.2f} | "
                             f"{ms['batch-invariant']:.2f} | "
                             f"{ms['batch-invariant'] / ms['default']:.2f}x |")
        text += "\nDecode step, device time (one-iteration loop):\n\n" + "\n".join(lines) + "\n"
    if det_rows:
        lines = ["| run | output tokens | seconds | against the first run |", "|---|---:|---:|---|"]
        for row in det_rows:
            verdict = ("-" if row is det_rows[0] else "identical" if row["differs"] is None
                       else f"DIFFERS from request {row['differs']}")
            lines.append(f"| {row['run']} | {row['tokens']} | {row['seconds']:.1f} | {verdict} |")
        text += "\nDeterminism (batch-invariant, sampled, every token and logprob):\n\n" + \
            "\n".join(lines) + "\n"
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description="the batch-invariant mode's cost and determinism")
    e2e.add_trace_arguments(parser)
    parser.add_argument("--step-batches", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8, 64])
    parser.add_argument("--step-context", type=int, default=1024)
    parser.add_argument("--det-requests", type=int, default=64)
    parser.add_argument("--det-runs", type=int, default=len(DETERMINISM_RUNS))
    parser.add_argument("--det-max-tokens", type=int, default=1 << 20,
                        help="cap each determinism request's output (the trace's length else)")
    parser.add_argument("--matmul-rows", type=lambda s: [int(x) for x in s.split(",")],
                        default=[8, 64, 256, 2048])
    parser.add_argument("--matmul-splits", type=lambda s: [int(x) for x in s.split(",")],
                        default=[], help="also time the GEMM with I in each of these parts")
    parser.add_argument("--profile-prompt", type=int, default=2048)
    parser.add_argument("--profile-top", type=int, default=12)
    parser.add_argument("--parts", default="matmul,steps,e2e,determinism",
                        help="any of matmul, steps, e2e, determinism, profile")
    parser.add_argument("--tail-seqs", type=int, default=16)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    args.passes = 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _, model, trace, prompts = e2e.model_and_trace(args)
    parts = set(args.parts.split(","))
    matmul_rows = matmul_cost(model, args) if "matmul" in parts else []
    step_rows = step_cost(model, args) if "steps" in parts else []
    e2e_rows = e2e_cost(model, trace, prompts, args) if "e2e" in parts else []
    det_rows = determinism(model, trace, prompts, args) if "determinism" in parts else []
    profile_rows = kernel_profile(model, args) if "profile" in parts else []
    text = ("\n".join(hf_backends.run_lines("batch_invariant.py")) + "\n\n"
            + f"model {args.model}, random {args.dtype} weights, {args.trace} trace of {len(trace)} "
            f"requests, KV "
            f"budget {args.budget_seqs} x {args.max_model_len} tokens; {jax.devices()[0]}\n\n"
            + tables(e2e_rows, step_rows, det_rows, matmul_rows, args.tail_seqs)
            + (profile_tables(profile_rows) if profile_rows else ""))
    (out_dir / "batch_invariant.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
