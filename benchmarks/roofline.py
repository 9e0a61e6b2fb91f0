"""Decode step time of jpaged against its memory floor, batch 1 to 512.

"Decode step time" is the device time of one iteration of the engine's jitted decode program
(the one-iteration decode loop a K=1 engine runs: model, sampling, on-device block allocation):
loops are launched back to back without fetching their results (each launch builds and sends
its packed inputs; the KV cache and block manager are donated from one loop to the next, so the
loops run one after another on the device). Runs of `steps` and 2 x `steps` loops are timed from
the first launch to the last result, and the step is their difference over `steps`: the first
launch, which the device waits for, and the last fetch cancel out (dividing one run by its
length, as this file did before 2026-12-01, spreads the first launch's 2-3 ms of host time over
the run's steps). The host time of a launch (median of a run's first five, before the queue
fills) is reported beside it: while it stays below the step time, the device, not the host, set
the pace. Batches below the engine's smallest bucket (4) run padded to it, as the engine runs
them.

The floor is the bytes the step must read over the copy bandwidth measured in the same run (the
best of an XLA elementwise pass and a torch device copy, bytes read + written per second): every
weight except the embedding table, the B embedding rows gathered, and the K/V of every context
token of every sequence.
From batch 256 on the 8B shape the weights' FLOPs at the measured matmul rate take longer than
their bytes, so the floor cannot be reached; the table then also gives the bound of a step whose
layers run their projections and their attention one after the other: max(weight bytes / copy
BW, FLOPs / matmul rate) + KV bytes / copy BW.
Usage: python benchmarks/roofline.py --model llama3-8b [--out FILE.md] [--plot FILE.png]
"""

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import median_seconds  # noqa: E402
from jpaged.sampling import SamplingRow  # noqa: E402
from jpaged.sampling_params import SamplingParams  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def copy_bandwidth(num_bytes: int, repeats: int = 10) -> dict:
    """Bytes read + written per second: an XLA elementwise pass over a float32 array, and (on a
    GPU, when torch is installed) torch's device-to-device copy; medians of `repeats`."""
    rates = {"xla": 2 * num_bytes / _xla_pass_seconds(num_bytes, repeats)}
    if jax.default_backend() == "gpu":
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            src = torch.empty(num_bytes // 4, dtype=torch.float32, device="cuda").uniform_()
            dst = torch.empty_like(src)

            def copy():
                dst.copy_(src)
                torch.cuda.synchronize()
            rates["torch"] = 2 * num_bytes / median_seconds(copy, repeats)
            del src, dst
            torch.cuda.empty_cache()
    rates["best"] = max(rates.values())
    return rates


def _xla_pass_seconds(num_bytes, repeats):
    """Median seconds of x + 1 over a float32 array of num_bytes (freed on return)."""
    x = jax.jit(lambda: jax.lax.iota(jnp.float32, num_bytes // 4))()
    add_one = jax.jit(lambda a: a + 1.0)
    return median_seconds(lambda: jax.block_until_ready(add_one(x)), repeats)


def floor_bytes(config, *, batch: int, context_tokens: float, dtype,
                experts: str = "most") -> tuple[float, float]:
    """(weight bytes, KV bytes) one decode step must read; context_tokens summed over the
    batch. A mixture of experts reads, in each sparse layer, the experts its tokens chose:
    experts "most" counts min(X, batch x k) of them (the tokens spread over the experts, the
    usual case), "fewest" k (every token chose the same ones: a true lower bound)."""
    itemsize = jnp.dtype(dtype).itemsize
    embedding = config.vocab_size * config.hidden_size
    weights = read_parameters(config, batch, experts) - (
        0 if config.tie_word_embeddings else embedding)
    weight_bytes = (weights + batch * config.hidden_size) * itemsize
    return weight_bytes, context_tokens * config.kv_bytes_per_token(jnp.dtype(dtype).name)


def read_parameters(config, batch: int, experts: str) -> int:
    """Parameters a decode step of `batch` tokens reads (`floor_bytes`' experts)."""
    if experts not in ("most", "fewest"):
        raise ValueError(f"experts must be 'most' or 'fewest', got {experts!r}")
    if config.experts is None:
        return config.num_parameters()
    moe = config.experts
    chosen = (moe.num_experts_per_tok if experts == "fewest"
              else min(moe.num_local_experts, batch * moe.num_experts_per_tok))
    sparse = sum(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    per_expert = 3 * config.hidden_size * moe.moe_intermediate_size
    return config.num_parameters(active=True) + sparse * (
        chosen - moe.num_experts_per_tok) * per_expert


def step_flops(config, *, batch: int, context_tokens: float) -> float:
    """Floating-point operations of one decode step: 2 per weight per sequence (every weight
    but the embedding table; of a mixture of experts, the experts the token chose), and 4 per
    query head x head dim per context token per layer (scores and weighted values)."""
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    linear = config.num_parameters(active=True) - embedding
    attention = 4 * context_tokens * config.num_attention_heads * config.head_dim \
        * config.num_hidden_layers
    return 2 * linear * batch + attention


def matmul_rate(size: int = 8192, repeats: int = 10) -> float:
    """bf16 FLOP/s of one size^3 matrix product on random data (median of `repeats`)."""
    a, b = (jax.random.normal(jax.random.key(i), (size, size), jnp.bfloat16) for i in (0, 1))
    product = jax.jit(jnp.matmul)
    return 2 * size ** 3 / median_seconds(lambda: jax.block_until_ready(product(a, b)), repeats)


def time_decode_step(engine, batch: int, *, max_context: int, steps: int = 20) -> dict:
    """Device time of one decode iteration at `batch` sequences of (up to) max_context tokens,
    on an idle engine; the context shrinks so the batch fits the engine's pool.

    The program timed is the engine's decode loop with one iteration (what a K=1 engine runs
    for a decode batch: model, sampling, on-device block allocation), launched back to back
    without fetching results in between (`launch_decode`: the same packed inputs built and sent
    each time, the KV cache and block manager donated from one loop to the next). Two runs, of
    `steps` and of 2 x `steps` loops, each timed from its first launch to its last result; the
    step is their difference over `steps`, so the fixed costs of a run (the first launch, which
    the device waits for, and the last fetch) cancel. The sequences get their (unwritten)
    context blocks from the ledger, which afterwards replays the loops' appends and frees them,
    so the device allocator and the mirror stay in step."""
    runner, ledger = engine.executor, engine.ledger
    size, warm = ledger.block_size, 2
    if engine.has_unfinished():
        raise RuntimeError("time_decode_step needs an idle engine")
    loops = warm + 3 * steps
    blocks_each = (ledger.num_free // batch) - (-(-loops // size))
    context = min(max_context, blocks_each * size)
    if context < 1:
        raise ValueError(f"batch {batch} does not fit the pool of {ledger.num_blocks} blocks")
    slots = ledger.take_slots(batch)
    ledger.append_unwritten([(slot, context) for slot in slots])
    runner.apply(ledger.take_ops())
    greedy = SamplingRow(SamplingParams(temperature=0.0), 0, 0, context)

    def launch():
        return runner.launch_decode([(slot, 1) for slot in slots], [greedy] * batch,
                                    [1 << 20] * batch, [[]] * batch, 1, 1,
                                    engine.config.max_model_len, 0)

    def run(count):
        """(seconds from the first launch to the last result, median seconds of the first five
        launches, the batch bucket) of count loops. Later launches can wait for the device
        once enough loops are queued, so only the first ones time the host's own work."""
        start = time.perf_counter()
        launch_seconds = []
        for _ in range(count):
            launch_start = time.perf_counter()
            launched = launch()
            launch_seconds.append(time.perf_counter() - launch_start)
        jax.block_until_ready(launched.result)
        seconds = time.perf_counter() - start
        result = runner.fetch_decode(launched, batch)
        if bool(result.out_of_blocks) or int(np.max(result.done_at)) >= 0:
            raise RuntimeError("a timed decode loop ran out of blocks or stopped a sequence")
        return seconds, float(np.median(launch_seconds[:5])), int(launched.batch[0])

    first_start = time.perf_counter()
    for _ in range(warm):
        runner.fetch_decode(launch(), batch)
    first_seconds = time.perf_counter() - first_start
    short, dispatched, _ = run(steps)
    long, _, padded = run(2 * steps)
    ledger.replay_decode_loop(slots, [True] * batch, [-1] * batch, loops, first_planned=False)
    ledger.free(slots)
    ledger.return_slots(slots)
    runner.apply(ledger.take_ops())
    if int(runner.manager.num_free) != ledger.num_free:
        raise RuntimeError("device block manager and host mirror disagree after the roofline")
    # iteration j (0-based, the warm ones included) attends over context + j + 1 tokens
    mean_context = float(np.mean([context + j + 1 for j in range(warm, loops)]))
    return dict(batch=batch, bucket=padded, context=context,
                seconds=(long - short) / steps, dispatch_seconds=dispatched,
                context_tokens=batch * mean_context, first_calls_seconds=first_seconds)


def roofline(engine, config, bandwidth: float, *, flop_rate=None, batches=BATCHES,
             max_context=1024, steps=20, dtype="bfloat16", log=print) -> list[dict]:
    """Time each batch's decode step; its floor is bytes over `bandwidth`, and with `flop_rate`
    each row also carries the compute time of its FLOPs (`compute_floor`)."""
    rows = []
    for batch in batches:
        row = time_decode_step(engine, batch, max_context=max_context, steps=steps)
        weights, kv = floor_bytes(config, batch=batch, context_tokens=row["context_tokens"],
                                  dtype=dtype)
        row.update(weight_bytes=weights, kv_bytes=kv, floor=(weights + kv) / bandwidth)
        if config.experts is not None:   # the lower bound too: every token chose the same k
            fewest, _ = floor_bytes(config, batch=batch, context_tokens=row["context_tokens"],
                                    dtype=dtype, experts="fewest")
            row["floor_fewest"] = (fewest + kv) / bandwidth
        if flop_rate:
            row["compute_floor"] = step_flops(
                config, batch=batch, context_tokens=row["context_tokens"]) / flop_rate
        rows.append(row)
        log(f"roofline batch {batch}: {1e3 * row['seconds']:.2f} ms, floor "
            f"{1e3 * row['floor']:.2f} ms, ratio {row['seconds'] / row['floor']:.2f}")
    return rows


def sequential_bound(row, bandwidth: float) -> float:
    """Seconds of a step whose projections (bound by their weight bytes or their FLOPs, which
    `compute_floor` counts) and attention (bound by its KV bytes) run one after the other."""
    return max(row["weight_bytes"] / bandwidth, row["compute_floor"]) \
        + row["kv_bytes"] / bandwidth


def table(rows, bandwidth: dict) -> str:
    """Markdown rows; compute columns (FLOPs time, the sequential bound, step / bound) when the
    rows carry `compute_floor`."""
    compute = all("compute_floor" in row for row in rows)
    fewest = all("floor_fewest" in row for row in rows)   # a mixture of experts
    lines = ["copy bandwidth (read + write): " + ", ".join(
                 f"{name} {rate / 1e12:.2f} TB/s" for name, rate in bandwidth.items()),
             "", "| batch (bucket) | context / seq | step, device (ms) | host launch (ms) | "
             "weights (GB) | KV (GB) | floor (ms) | step / floor | "
             + ("floor, the same k experts for every token (ms) | " if fewest else "")
             + ("FLOPs at the matmul rate (ms) | max(weights, FLOPs) + KV (ms) | "
                "step / that | " if compute else "") + "tokens/s |",
             "|---|" + "---:|" * (8 + fewest + 3 * compute)]
    for row in rows:
        bound = sequential_bound(row, bandwidth["best"]) if compute else 0.0
        lines.append(
            f"| {row['batch']} ({row['bucket']}) | {row['context']} | "
            f"{1e3 * row['seconds']:.2f} | {1e3 * row['dispatch_seconds']:.2f} | "
            f"{row['weight_bytes'] / 1e9:.2f} | {row['kv_bytes'] / 1e9:.2f} | "
            f"{1e3 * row['floor']:.2f} | {row['seconds'] / row['floor']:.2f} | "
            + (f"{1e3 * row['floor_fewest']:.2f} | " if fewest else "")
            + (f"{1e3 * row['compute_floor']:.2f} | {1e3 * bound:.2f} | "
               f"{row['seconds'] / bound:.2f} | " if compute else "")
            + f"{row['batch'] / row['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows, path, title, bandwidth=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [1e3 * r["seconds"] for r in rows], "o-", label="decode step (device)")
    ax.plot(batches, [1e3 * r["floor"] for r in rows], "k--", label="floor: bytes / copy BW")
    ax.plot(batches, [1.25e3 * r["floor"] for r in rows], ":", color="gray",
            label="1.25 x floor")
    if bandwidth and all("compute_floor" in r for r in rows):
        ax.plot(batches, [1e3 * sequential_bound(r, bandwidth) for r in rows], "-.",
                color="tab:red", label="max(weights, FLOPs) + KV")
    for r in rows:
        ax.annotate(f"{r['seconds'] / r['floor']:.2f}x", (r["batch"], 1e3 * r["seconds"]),
                    textcoords="offset points", xytext=(0, 6), fontsize=7, ha="center")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    from jpaged import LLMEngine
    from jpaged.config import ModelConfig
    from jpaged.models.llama import LlamaForCausalLM
    from flax import nnx

    parser = argparse.ArgumentParser(description="jpaged decode step against its floor")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(BATCHES))
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--num-kv-blocks", type=int, default=8193)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    bandwidth = copy_bandwidth(4 << 30 if jax.default_backend() == "gpu" else 64 << 20)
    config = ModelConfig.preset(args.model)
    model = LlamaForCausalLM(config, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    engine = LLMEngine.from_model(model, None, max_num_seqs=max(args.batches),
                                  max_model_len=args.max_model_len,
                                  num_kv_blocks=args.num_kv_blocks, warmup=False)
    rows = roofline(engine, config, bandwidth["best"], batches=args.batches,
                    max_context=args.max_context, steps=args.steps, dtype=args.dtype)
    # measured after the steps: a minute of 8192^3 products just before them heats the GPU
    rate = matmul_rate(8192 if jax.default_backend() == "gpu" else 512)
    for row in rows:
        row["compute_floor"] = step_flops(config, batch=row["batch"],
                                          context_tokens=row["context_tokens"]) / rate
    header = (f"device: {jax.devices()[0].device_kind}, date {datetime.date.today()}, jax "
              f"{jax.__version__}, python {platform.python_version()}\ncommand: python "
              f"benchmarks/roofline.py {' '.join(sys.argv[1:])}\nmodel {args.model}, random "
              f"{args.dtype} weights, attention {engine.executor.attention_backend}; bf16 "
              f"matmul rate {rate / 1e12:.0f} TFLOP/s\n\n")
    text = header + table(rows, bandwidth)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.plot:
        plot(rows, args.plot, f"{args.model} decode step vs floor", bandwidth["best"])


if __name__ == "__main__":
    main()
