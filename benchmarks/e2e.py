"""End to end on one GPU: jpaged against torch backends and against contiguous KV allocation.

One Llama-family model with random weights (a preset, e.g. llama3-8b, bfloat16), identical in
both frameworks (transformers' copy is made from jpaged's parameters and checked equal), runs
the 256-request ShareGPT-like trace (benchmarks/trace.py; all requests at time 0, EOS ignored)
with the same KV budget: `--budget-seqs` sequences of `--max-model-len` tokens. Backends:
  jpaged             paged KV, blocks of 16, at each --ks K, asynchronous scheduling (the
                     engine's default: the next loop dispatched before the host processes
                     the last) or synchronous or both side by side (--scheduling);
  jpaged contiguous  the same engine and kernels with one block of max_model_len tokens per
                     sequence: each request reserves a whole maximum-length region at
                     admission, the pre-PagedAttention design;
  hf static          transformers generate, static cache, batches of --hf-batch-size;
  hf continuous      transformers' continuous batching (its paged cache, paged|sdpa).
Reported per backend: requests/s, output tokens/s, largest number of concurrent sequences, KV
utilisation (token states over KV allocated to sequences, mean over steps); the torch backends
can be capped (--hf-static-batches, --hf-cb-seconds) and the table says when they were. jpaged's
numbers exclude compilation: by default the trace runs twice through one engine and the second
pass is timed (the first compiled what the trace needs; subtracting compile seconds from one pass
also takes out the device work that ran while each program compiled). The roofline part (benchmarks/roofline.py) reuses the K=1 engine's compiled steps.
Each jpaged run also says where its time went (`step_breakdown`): seconds on the host and
waiting for the device, tokens and tokens/s per step kind (prompt steps, single decode steps,
decode loops), the trace's tail (steps of at most --tail-seqs sequences) apart.
Usage: python benchmarks/e2e.py --model llama3-8b --out-dir results/
"""

import argparse
import os
import sys
from pathlib import Path

# JAX and torch share the GPU: JAX takes a fixed share (weights, two KV pools, activations),
# torch the rest. Must be set before jax is imported.
if "--jax-memory-fraction" in sys.argv:
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = sys.argv[sys.argv.index(
        "--jax-memory-fraction") + 1]

import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import hf_backends, roofline  # noqa: E402
from benchmarks.trace import ALPACA, SHAREGPT, make_trace  # noqa: E402
from jpaged import LLMEngine, SamplingParams  # noqa: E402
from jpaged.config import PRESETS_DIR, ModelConfig  # noqa: E402
from jpaged.models.llama import LlamaForCausalLM  # noqa: E402


def trace_prompts(trace, vocab_size):
    rng = np.random.default_rng(1)       # the prompts benchmarks/throughput.py feeds
    return [rng.integers(10, vocab_size, r.input_len).tolist() for r in trace]


def build_jpaged(model, args, *, block_size, num_steps=1, max_num_seqs=None, **options):
    """An engine with a pool of exactly the budget (plus its sink block); no prefix caching
    (the trace's prompts share nothing). options: engine options over these."""
    budget = args.budget_seqs * args.max_model_len
    return LLMEngine.from_model(model, None, **{**dict(
        block_size=block_size, num_kv_blocks=budget // block_size + 1,
        max_num_seqs=max_num_seqs or args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, num_scheduler_steps=num_steps,
        enable_prefix_caching=False, warmup=False), **options})


def run_jpaged(model, trace, prompts, args, *, block_size, num_steps, keep_engine=False,
               max_num_seqs=None, **options):
    """The trace through one engine (build_jpaged, with `options`); returns (result, engine if
    keep_engine).

    --passes 2 (the default): a first pass compiles every program the trace needs, untimed; the
    second, on the same engine, is timed and should compile nothing (any compile it does is
    subtracted and named in the note). --passes 1: one pass, timed minus its compile seconds,
    which also takes out the device work queued before each compile that ran while it
    compiled: an over-subtraction that grows with the number of programs compiled."""
    engine = build_jpaged(model, args, block_size=block_size, num_steps=num_steps,
                          max_num_seqs=max_num_seqs, **options)
    output_tokens = sum(r.output_len for r in trace)
    first_pass = None
    for pass_index in range(args.passes):
        for index, (request, prompt) in enumerate(zip(trace, prompts)):
            engine.add_request(f"p{pass_index}r{index}", prompt_token_ids=prompt,
                               params=SamplingParams(temperature=0.0, max_tokens=request.output_len,
                                                     ignore_eos=True))
        generated_before = engine.num_generated_tokens
        preemptions_before = engine.stats()["num_preemptions"]
        timed = _timed_pass(engine, block_size)
        if engine.num_generated_tokens - generated_before != output_tokens:
            raise RuntimeError(f"jpaged generated {engine.num_generated_tokens - generated_before}"
                               f" tokens, the trace asks for {output_tokens}")
        if pass_index < args.passes - 1:
            first_pass = timed
    wall, compile_seconds = timed["wall"], timed["compile_seconds"]
    if first_pass is None:
        note = f"one pass; compile {compile_seconds:.0f} s subtracted"
    else:
        note = (f"second pass (the first: {first_pass['wall']:.1f} s, compile "
                f"{first_pass['compile_seconds']:.0f} s)"
                + (f"; COMPILED {compile_seconds:.1f} s in the timed pass, subtracted"
                   if compile_seconds else "; nothing compiled"))
    result = dict(wall=wall - compile_seconds, wall_with_compile=wall,
                  compile_seconds=compile_seconds, requests=len(trace),
                  output_tokens=output_tokens, decoded_tokens=output_tokens,
                  max_concurrent=timed["max_running"], kv_utilisation=timed["kv_utilisation"],
                  preemptions=engine.stats()["num_preemptions"] - preemptions_before,
                  capped=False, steps=step_breakdown(engine.step_log, args.tail_seqs),
                  note=f"K={num_steps}, blocks of {block_size}, "
                       f"{engine.config.num_kv_blocks} blocks; {note}")
    return (result, engine) if keep_engine else (result, None)


def _timed_pass(engine, block_size: int) -> dict:
    """Step the engine until its requests finish: wall and compile seconds, the most sequences
    running at once, KV utilisation (token states over slots of allocated blocks, over steps)."""
    mirror, compile_before = engine.ledger.mirror, engine.executor.compile_seconds
    engine.step_log = []
    max_running, held, allocated = 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        running = [len(t) for t in mirror.tables if t]
        max_running = max(max_running, len(running))
        if running:
            held += sum(mirror.seq_lens)
            allocated += sum(running) * block_size
    return dict(wall=time.perf_counter() - start,
                compile_seconds=engine.executor.compile_seconds - compile_before,
                max_running=max_running, kv_utilisation=held / max(allocated, 1))


STEP_KINDS = ("prompt", "decode", "decode loop")


def step_kind(record) -> str:
    """A step record's kind: a step with prompt tokens (prefill chunks, possibly with decode
    rows mixed in), a single decode step, or a K-iteration decode loop."""
    if not record.is_decode:
        return "prompt"
    return "decode loop" if record.num_generated > record.num_seqs else "decode"


def step_breakdown(records, tail_seqs: int) -> list[dict]:
    """Where a run's time went: per step kind, and within it the tail of the trace (steps of at
    most tail_seqs sequences) apart from the rest; seconds on the host (scheduling, inputs,
    outputs) and waiting for the device (transfers, the compiled step; with async loops, the
    wait for a loop's results), tokens sampled, steps that compiled (their time is in here)."""
    rows = {}
    for record in records:
        phase = "tail" if record.num_seqs <= tail_seqs else "full"
        row = rows.setdefault((step_kind(record), phase), dict(
            kind=step_kind(record), phase=phase, steps=0, host_seconds=0.0, device_seconds=0.0,
            generated=0, seqs=0, compiled=0))
        row["steps"] += 1
        row["host_seconds"] += record.host_seconds
        row["device_seconds"] += record.device_seconds
        row["generated"] += record.num_generated
        row["seqs"] += record.num_seqs
        row["compiled"] += record.compiled
    order = {kind: index for index, kind in enumerate(STEP_KINDS)}
    return sorted(rows.values(), key=lambda row: (order[row["kind"]], row["phase"]))


def breakdown_table(results: dict, tail_seqs: int) -> str:
    """A markdown table of every jpaged run's step_breakdown."""
    lines = ["| run | steps of | phase | steps | wall s | share | host s | device s | "
             "tokens | tokens/s | mean seqs | compiled |", "|---" * 12 + "|"]
    for name, result in results.items():
        steps = result.get("steps")
        if not steps:
            continue
        total = sum(row["host_seconds"] + row["device_seconds"] for row in steps)
        for row in steps:
            wall = row["host_seconds"] + row["device_seconds"]
            lines.append(
                f"| {name} | {row['kind']} | {row['phase']} | {row['steps']} | {wall:.2f} | "
                f"{wall / max(total, 1e-9):.1%} | {row['host_seconds']:.2f} | "
                f"{row['device_seconds']:.2f} | {row['generated']} | "
                f"{row['generated'] / max(wall, 1e-9):.0f} | "
                f"{row['seqs'] / row['steps']:.1f} | {row['compiled']} |")
    return (f"Phase tail: steps of at most {tail_seqs} sequences. Wall includes first-call "
            "compilation (the compiled column counts such steps).\n\n" + "\n".join(lines) + "\n")


def header(args, bandwidth, flop_rate) -> list[str]:
    return hf_backends.run_lines("e2e.py") + [
        f"model {args.model}, random {args.dtype} weights (identical in both frameworks); KV "
        f"budget {args.budget_seqs} x {args.max_model_len} tokens for every backend; "
        "copy bandwidth " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in bandwidth.items())
        + f"; bf16 matmul {flop_rate / 1e12:.0f} TFLOP/s",
    ]


def results_table(results: dict) -> str:
    lines = ["| backend | requests/s | output tokens/s | max concurrent seqs | KV utilisation "
             "| requests run | time (s) | notes |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | - | - | - | - | - | - | failed: {r['error']} |")
            continue
        kv = "n/m" if r.get("kv_utilisation") is None else f"{r['kv_utilisation']:.1%}"
        waste = ""
        if r["decoded_tokens"] != r["output_tokens"]:
            waste = f"; {1 - r['output_tokens'] / r['decoded_tokens']:.0%} of decoded thrown away"
        lines.append(
            f"| {name} | {r['requests'] / r['wall']:.2f} | {r['output_tokens'] / r['wall']:.0f} "
            f"| {r['max_concurrent'] if r['max_concurrent'] is not None else 'n/m'} | {kv} | "
            f"{r['requests']} | {r['wall']:.1f} | {'CAPPED: ' if r['capped'] else ''}"
            f"{r['note']}{waste} |")
    return "\n".join(lines) + "\n"


def bar_chart(results: dict, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: v for k, v in results.items() if "error" not in v}
    names = list(ok)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "output_tokens", "output tokens/s"),
                           (axes[1], "requests", "requests/s")):
        values = [ok[n][key] / ok[n]["wall"] for n in names]
        bars = ax.bar(range(len(names)), values, color=["#2a9d8f" if n.startswith("jpaged")
                                                        else "#e76f51" for n in names])
        for bar, name, value in zip(bars, names, values):
            mark = "*" if ok[name]["capped"] else ""
            ax.annotate(f"{value:,.0f}{mark}" if value >= 10 else f"{value:.2f}{mark}",
                        (bar.get_x() + bar.get_width() / 2, value), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=7)
        ax.set_ylabel(label)
    fig.suptitle("same trace, same KV budget (* capped run: subset or time limit)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class Parts:
    """Runs the parts in order, each in its own try, logging to out_dir; skips a part once the
    deadline is too close."""

    def __init__(self, out_dir: Path, deadline: float):
        self.out_dir, self.deadline, self.results = out_dir, deadline, {}
        self.start = time.perf_counter()

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.start)

    def run(self, name, fn, *, needs: float):
        if self.left() < needs:
            self.results[name] = {"error": f"skipped: {self.left():.0f} s left, needs {needs:.0f}"}
            return None
        print(f"== {name} ({self.left():.0f} s left)", flush=True)
        try:
            value = fn()
        except Exception as err:  # one part's failure must not lose the others' results
            traceback.print_exc()
            self.results[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            return None
        if isinstance(value, tuple):
            self.results[name], extra = value
        else:
            self.results[name], extra = value, None
        with open(self.out_dir / "e2e.json", "w") as f:
            json.dump(self.results, f, indent=1, default=float)
        print(f"   {name}: {json.dumps(self.results[name], default=float)[:400]}", flush=True)
        return extra


def add_trace_arguments(parser):
    """The model, trace and jpaged engine arguments of a benchmark that runs the trace."""
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--trace", choices=("sharegpt", "alpaca"), default="sharegpt")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--budget-seqs", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])


def model_and_trace(args):
    """(config, random model, trace, prompts) of `add_trace_arguments`' arguments."""
    config = ModelConfig.preset(args.model)
    model = LlamaForCausalLM(config, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    trace = make_trace(args.num_requests, **(SHAREGPT if args.trace == "sharegpt" else ALPACA),
                       seed=0)
    return config, model, trace, trace_prompts(trace, config.vocab_size)


def main(argv=None):
    parser = argparse.ArgumentParser(description="jpaged vs torch backends on one trace")
    add_trace_arguments(parser)
    parser.add_argument("--contiguous-k", type=int, default=8)
    parser.add_argument("--scheduling", type=lambda s: s.split(","), default=["async"],
                        help="jpaged's runs: async (the engine's default), sync or sync,async "
                             "(side by side)")
    parser.add_argument("--roofline-batches", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(roofline.BATCHES))
    parser.add_argument("--roofline-context", type=int, default=1024)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-static-batches", type=int, default=None)
    parser.add_argument("--hf-static-compile", choices=("auto", "off"), default="auto",
                        help="off: no torch.compile of transformers' static-cache decode step")
    parser.add_argument("--hf-cb-seconds", type=float, default=None)
    parser.add_argument("--hf-cb-block-size", type=int, default=256)
    parser.add_argument("--parts", default="jpaged,roofline,contiguous,hf_static,hf_cb")
    parser.add_argument("--passes", type=int, choices=(1, 2), default=2,
                        help="2: time a second pass of the trace on the engine the first "
                             "compiled; 1: one pass, its compile seconds subtracted")
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds for all parts")
    parser.add_argument("--tail-seqs", type=int, default=16,
                        help="the step breakdown's tail: steps of at most this many sequences")
    parser.add_argument("--jax-memory-fraction", default=None)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts_wanted = set(args.parts.split(","))
    parts = Parts(out_dir, args.deadline)
    on_gpu = jax.default_backend() == "gpu"
    bandwidth = roofline.copy_bandwidth(4 << 30 if on_gpu else 64 << 20)
    flop_rate = roofline.matmul_rate(8192 if on_gpu else 512)
    config, model, trace, prompts = model_and_trace(args)
    print(f"trace: {len(trace)} requests, {sum(r.output_len for r in trace)} output tokens",
          flush=True)

    roofline_rows = []

    def run_roofline(engine):
        parts.run("roofline", lambda: ({"rows": roofline.roofline(
            engine, config, bandwidth["best"], flop_rate=flop_rate,
            batches=args.roofline_batches,
            max_context=args.roofline_context, dtype=args.dtype)}, None), needs=30)
        return parts.results.pop("roofline")["rows"] if "rows" in parts.results.get(
            "roofline", {}) else []

    if not set(args.scheduling) <= {"sync", "async"}:
        parser.error(f"--scheduling takes sync, async or both, got {','.join(args.scheduling)}")
    runs = [(k, mode) for k in args.ks for mode in args.scheduling]
    for k, mode in runs if "jpaged" in parts_wanted else []:
        keep = k == 1 and mode == args.scheduling[0] and "roofline" in parts_wanted
        engine = parts.run(f"jpaged K={k}" + (" async" if mode == "async" else ""),
                           lambda k=k, mode=mode, keep=keep: run_jpaged(
                               model, trace, prompts, args, block_size=16, num_steps=k,
                               keep_engine=keep, async_scheduling=mode == "async"), needs=60)
        if engine is not None:   # its decode loops are compiled: the roofline reuses them
            roofline_rows = run_roofline(engine)
        del engine
        gc.collect()
    if "roofline" in parts_wanted and not roofline_rows:
        roofline_rows = run_roofline(build_jpaged(model, args, block_size=16,
                                                  max_num_seqs=max(args.roofline_batches)))
        gc.collect()
    if "contiguous" in parts_wanted:  # one region per sequence: budget_seqs rows at most
        parts.run(f"jpaged contiguous K={args.contiguous_k}", lambda: run_jpaged(
            model, trace, prompts, args, block_size=args.max_model_len,
            num_steps=args.contiguous_k, max_num_seqs=args.budget_seqs), needs=60)
    gc.collect()
    hf_model = None
    if parts_wanted & {"hf_static", "hf_cb"}:
        device = "cuda" if on_gpu else "cpu"
        hf_model = parts.run("hf build", lambda: ({"seconds": 0}, hf_backends.build_hf_model(
            PRESETS_DIR / f"{args.model}.json", model, device=device)), needs=30)
        parts.results.pop("hf build", None)
    if hf_model is not None and "hf_static" in parts_wanted:
        parts.run(f"hf static, batch {args.hf_batch_size}", lambda: hf_backends.run_static(
            hf_model, trace, prompts, batch_size=args.hf_batch_size,
            max_batches=args.hf_static_batches, device=device,
            compile=args.hf_static_compile == "auto"), needs=40)
    if hf_model is not None and "hf_cb" in parts_wanted:
        budget = args.budget_seqs * args.max_model_len
        parts.run("hf continuous batching", lambda: hf_backends.run_continuous(
            hf_model, trace, prompts, num_blocks=budget // args.hf_cb_block_size,
            block_size=args.hf_cb_block_size, max_batch_tokens=args.max_num_batched_tokens,
            time_cap=args.hf_cb_seconds, warmup=on_gpu), needs=30)

    text = "\n".join(header(args, bandwidth, flop_rate)) + "\n\n" + results_table(parts.results)
    if any(result.get("steps") for result in parts.results.values()):
        text += "\n### Where jpaged's time went, by step\n\n" + breakdown_table(
            parts.results, args.tail_seqs)
    if roofline_rows:
        text += "\n### Decode step against its floor (roofline.py: the K=1 decode loop)\n\n" + \
            roofline.table(roofline_rows, bandwidth)
        roofline.plot(roofline_rows, out_dir / "roofline.png",
                      f"{args.model} decode step (device) vs floor", bandwidth["best"])
    (out_dir / "e2e.md").write_text(text)
    if any("error" not in r for r in parts.results.values()):
        bar_chart(parts.results, out_dir / "e2e.png")
    print(text)


if __name__ == "__main__":
    main()
