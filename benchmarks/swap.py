"""Swap preemption measured on one device: transfer rates, the swap/recompute
crossover, and throughput under growing overload.

1. Ceiling: one large bf16 array to JAX's `pinned_host` memory and back (`jax.device_put`).
2. Swap transfers as the engine does them (`jpaged.blocks.swap.SwapStore`: one jitted gather of a
   victim's blocks into pinned host memory, one host-to-device transfer plus one jitted scatter
   into the donated cache), for n random blocks of a Llama-3-8B-shaped bf16 cache, against a
   block-by-block loop (one gather + transfer per block). GB/s counts K and V bytes of the blocks.
3. Crossover: time to prefill one sequence of L tokens through the model (what recompute costs)
   against a swap round trip of its ceil(L / S) blocks (out + in); recompute wins below the
   crossover. Also prints the rates the engine's "auto" policy measured at start-up.
4. Overload: a ShareGPT-like trace (shorter outputs) of growing size on a fixed KV pool, in
   recompute, swap and auto mode: output tokens/s, preemptions, swapped blocks, recomputed tokens.
Usage: python benchmarks/swap.py --model llama3-8b --out benchmarks/results/swap_h200.md
"""

import argparse
import datetime
import gc
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import median_seconds  # noqa: E402
from benchmarks.trace import make_trace  # noqa: E402
from jpaged import LLMEngine, SamplingParams  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.models.llama import LlamaForCausalLM  # noqa: E402
from jpaged.blocks.swap import scatter_program  # noqa: E402


def pinned_ceiling(num_bytes: int) -> tuple[float, float]:
    """(device->pinned host, pinned host->device) bytes per second of one large array."""
    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device)
    x = jax.block_until_ready(jnp.ones(num_bytes // 2, jnp.bfloat16))
    host = jax.block_until_ready(jax.device_put(x, pinned))
    out = median_seconds(lambda: jax.block_until_ready(jax.device_put(x, pinned)))
    back = median_seconds(lambda: jax.block_until_ready(jax.device_put(host, on_device)))
    return num_bytes / out, num_bytes / back


def batched_swap(engine, blocks) -> tuple[float, float]:
    """(out, in) seconds of one SwapStore swap-out and swap-in of `blocks`."""
    runner, store = engine.executor, engine.executor.swap_store

    def out():
        store.swap_out(runner.cache, 0, blocks)
        jax.block_until_ready(store.stored[0])

    def back():
        out()
        start = time.perf_counter()
        runner.cache = store.swap_in(runner.cache, 0, blocks)
        jax.block_until_ready(runner.cache)
        return time.perf_counter() - start

    t_out = median_seconds(out)
    store.drop(0)
    back()
    t_in = float(np.median([back() for _ in range(5)]))
    return t_out, t_in


def block_by_block(engine, blocks) -> tuple[float, float]:
    """(out, in) seconds moving the same blocks one transfer per block."""
    runner, store = engine.executor, engine.executor.swap_store
    one = np.zeros(1, np.int32)

    def out():
        held = []
        for block in blocks:
            one[0] = block
            held.append(store.gather_program(runner.cache, one.copy()))
        jax.block_until_ready(held)
        return held

    held = out()
    t_out = median_seconds(out, repeats=3)

    def back():
        for block, (k_blocks, v_blocks) in zip(blocks, held):
            k_dev, v_dev = jax.device_put((k_blocks, v_blocks), store.device_sharding)
            runner.cache = scatter_program(runner.cache, np.array([block], np.int32), k_dev,
                                           v_dev)
        jax.block_until_ready(runner.cache)

    return t_out, median_seconds(back, repeats=3)


def prefill_seconds(engine, length: int) -> float:
    """Seconds to prefill one length-token prompt (and sample its first token) through the
    engine, prefix caching off: what recomputing a preempted sequence of that length costs."""
    rng = np.random.default_rng(length)

    def run():
        engine.add_request(f"p{length}-{time.perf_counter_ns()}", prompt_token_ids=rng.integers(
            10, engine.model_config.vocab_size, length).tolist(),
            params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()

    return median_seconds(run, repeats=3)


def overload_run(model, mode, num_requests, args) -> dict:
    engine = LLMEngine.from_model(
        model, None, num_kv_blocks=args.overload_blocks, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=mode, swap_space=args.swap_space, warmup=False)
    trace = make_trace(num_requests, input_mean=161.0, output_mean=args.output_mean, seed=0)
    rng = np.random.default_rng(1)
    for index, request in enumerate(trace):
        engine.add_request(f"r{index}", prompt_token_ids=rng.integers(
            10, engine.model_config.vocab_size, request.input_len).tolist(),
            params=SamplingParams(temperature=0.0, max_tokens=request.output_len,
                                  ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    stats = engine.stats()
    need = sum(-(-(r.input_len + r.output_len) // engine.config.block_size) for r in trace)
    row = dict(mode=mode, requests=num_requests, load=need / (args.overload_blocks - 1),
               tokens_per_s=stats["num_generated_tokens"] / wall, wall=wall,
               tokens_per_s_run=stats["num_generated_tokens"] / max(
                   wall - stats["compile_seconds"], 1e-9),
               compile=stats["compile_seconds"], preemptions=stats["num_preemptions"],
               swapped_blocks=stats["num_swapped_out_blocks"],
               recomputed=stats["num_recomputed_tokens"], rates=engine.executor.swap_rates)
    del engine
    gc.collect()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description="swap preemption benchmark")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--blocks", default="16,64,256,1024")
    parser.add_argument("--per-block", type=int, default=256,
                        help="largest block count for the block-by-block loop")
    parser.add_argument("--lengths", default="16,64,256,1024,4096")
    parser.add_argument("--requests", default="32,64,128,256")
    parser.add_argument("--overload-blocks", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--output-mean", type=float, default=128.0)
    parser.add_argument("--swap-space", type=float, default=16.0)
    parser.add_argument("--ceiling-bytes", type=int, default=1 << 30)
    parser.add_argument("--only-overload", action="store_true",
                        help="skip parts 1-3 (transfers, crossover)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    if args.only_overload:
        return overload_only(args)

    config = ModelConfig.preset(args.model)
    model = LlamaForCausalLM(config, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    d2h, h2d = pinned_ceiling(args.ceiling_bytes)
    print(f"pinned ceiling: device->host {d2h / 1e9:.1f} GB/s, host->device {h2d / 1e9:.1f} GB/s",
          flush=True)
    block_counts = [int(x) for x in args.blocks.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = LLMEngine.from_model(
        model, None, num_kv_blocks=max(block_counts) * 2 + 1, max_model_len=max(lengths) + 16,
        max_num_seqs=8, max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode="auto", swap_space=args.swap_space, warmup=False,
        enable_prefix_caching=False)
    per_block_bytes = engine.executor.bytes_per_block
    rng = np.random.default_rng(0)
    transfer_rows = []
    for count in block_counts:
        blocks = (rng.permutation(engine.config.num_kv_blocks - 1)[:count] + 1).tolist()
        t_out, t_in = batched_swap(engine, blocks)
        loop = block_by_block(engine, blocks) if count <= args.per_block else (None, None)
        transfer_rows.append((count, t_out, t_in, *loop))
        print(f"{count} blocks: out {t_out * 1e3:.2f} ms, in {t_in * 1e3:.2f} ms", flush=True)
    cross_rows = []
    for length in lengths:
        blocks = (rng.permutation(engine.config.num_kv_blocks - 1)[:-(-length // 16)] + 1)
        t_out, t_in = batched_swap(engine, blocks.tolist())
        cross_rows.append((length, prefill_seconds(engine, length), t_out + t_in))
        print(f"L={length}: recompute {cross_rows[-1][1] * 1e3:.2f} ms, swap "
              f"{cross_rows[-1][2] * 1e3:.2f} ms", flush=True)
    rates = engine.executor.swap_rates
    del engine
    gc.collect()
    overload_rows = []
    for num_requests in [int(x) for x in args.requests.split(",")]:
        for mode in ("recompute", "swap", "auto"):
            overload_rows.append(overload_run(model, mode, num_requests, args))
            print(overload_rows[-1], flush=True)
    text = report(args, config, d2h, h2d, per_block_bytes, transfer_rows, cross_rows, rates,
                  overload_rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.plot:
        plot(args.plot, d2h, h2d, per_block_bytes, transfer_rows, cross_rows, overload_rows)


def overload_only(args):
    """Part 4 alone, after one untimed run of the smallest size that compiles every shape."""
    config = ModelConfig.preset(args.model)
    model = LlamaForCausalLM(config, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    sizes = [int(x) for x in args.requests.split(",")]
    for mode in ("recompute", "swap", "auto"):
        print("warm-up", overload_run(model, mode, sizes[0], args), flush=True)
    rows = []
    for num_requests in sizes:
        for mode in ("recompute", "swap", "auto"):
            rows.append(overload_run(model, mode, num_requests, args))
            print(rows[-1], flush=True)
    lines = [f"device: {jax.devices()[0].device_kind}; date: "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; jax "
             f"{jax.__version__}, python {platform.python_version()}",
             f"command: python benchmarks/swap.py {' '.join(sys.argv[1:])}", "",
             f"overload after a warm-up run: pool of {args.overload_blocks - 1} blocks, "
             f"max_num_seqs {args.max_num_seqs}, outputs ~{args.output_mean:.0f} tokens", "",
             "| requests | load | mode | output tok/s | wall s | compile s | preemptions | "
             "swapped-out blocks | recomputed tokens |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['requests']} | {row['load']:.1f}x | {row['mode']} | "
                     f"{row['tokens_per_s']:.0f} | {row['wall']:.1f} | {row['compile']:.1f} | "
                     f"{row['preemptions']} | {row['swapped_blocks']} | {row['recomputed']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def crossover(cross_rows):
    """Context length where recompute time meets swap time (log-linear interpolation)."""
    for (l0, r0, s0), (l1, r1, s1) in zip(cross_rows, cross_rows[1:]):
        if (r0 - s0) * (r1 - s1) <= 0 and r0 != s0:
            f = (r0 - s0) / ((r0 - s0) - (r1 - s1))
            return float(np.exp(np.log(l0) + f * (np.log(l1) - np.log(l0))))
    return None


def report(args, config, d2h, h2d, per_block, transfer_rows, cross_rows, rates, overload_rows):
    gb = lambda count, seconds: count * per_block / seconds / 1e9  # noqa: E731
    lines = [
        f"device: {jax.devices()[0].device_kind}; date: "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; jax {jax.__version__}, "
        f"python {platform.python_version()}",
        f"command: python benchmarks/swap.py {' '.join(sys.argv[1:])}",
        f"model: {args.model} shape, {args.dtype}, random weights; block size 16, "
        f"{per_block / 2**20:.2f} MiB per block (K and V, all layers)", "",
        f"pinned host bandwidth (one {args.ceiling_bytes / 2**30:.1f} GiB array): device->host "
        f"{d2h / 1e9:.1f} GB/s, host->device {h2d / 1e9:.1f} GB/s", "",
        "| blocks | MiB | swap-out ms | out GB/s | % of D2H | swap-in ms | in GB/s | % of H2D "
        "| per-block out ms | per-block in ms | per-block us/block (out+in) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for count, t_out, t_in, loop_out, loop_in in transfer_rows:
        loop = (f"{loop_out * 1e3:.1f} | {loop_in * 1e3:.1f} | "
                f"{(loop_out + loop_in) / count * 1e6:.0f}" if loop_out else "- | - | -")
        lines.append(
            f"| {count} | {count * per_block / 2**20:.0f} | {t_out * 1e3:.2f} | "
            f"{gb(count, t_out):.1f} | {gb(count, t_out) * 1e9 / d2h:.0%} | {t_in * 1e3:.2f} | "
            f"{gb(count, t_in):.1f} | {gb(count, t_in) * 1e9 / h2d:.0%} | {loop} |")
    lines += ["", "| context tokens | recompute (prefill) ms | swap out+in ms | cheaper |",
              "|---:|---:|---:|---|"]
    for length, recompute, swap in cross_rows:
        lines.append(f"| {length} | {recompute * 1e3:.2f} | {swap * 1e3:.2f} | "
                     f"{'recompute' if recompute < swap else 'swap'} |")
    point = crossover(cross_rows)
    lines += ["", f"crossover (recompute cheaper below): "
              f"{f'{point:.0f} tokens' if point else 'none in the measured range'}",
              f"start-up rates of the auto policy: swap fixed {rates['swap_fixed_seconds'] * 1e3:.2f}"
              f" ms + {rates['swap_seconds_per_block'] * 1e6:.1f} us/block; prefill "
              f"{rates['prefill_seconds_per_token'] * 1e6:.1f} us/token", "",
              f"overload: pool of {args.overload_blocks - 1} blocks, max_num_seqs "
              f"{args.max_num_seqs}, trace inputs ~161 / outputs ~{args.output_mean:.0f} tokens "
              "(lognormal), greedy, EOS ignored; load = blocks the trace needs / pool",
              "", "| requests | load | mode | output tok/s | tok/s without compile | wall s | "
              "of which compile s | preemptions | swapped-out blocks | recomputed tokens |",
              "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in overload_rows:
        lines.append(f"| {row['requests']} | {row['load']:.1f}x | {row['mode']} | "
                     f"{row['tokens_per_s']:.0f} | {row['tokens_per_s_run']:.0f} | "
                     f"{row['wall']:.1f} | {row['compile']:.1f} | "
                     f"{row['preemptions']} | {row['swapped_blocks']} | {row['recomputed']} |")
    return "\n".join(lines) + "\n"


def plot(path, d2h, h2d, per_block, transfer_rows, cross_rows, overload_rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    counts = [r[0] for r in transfer_rows]
    ax = axes[0]
    ax.plot(counts, [c * per_block / r[1] / 1e9 for c, r in zip(counts, transfer_rows)], "o-",
            label="swap-out (batched)")
    ax.plot(counts, [c * per_block / r[2] / 1e9 for c, r in zip(counts, transfer_rows)], "s-",
            label="swap-in (batched)")
    loop = [(c, r) for c, r in zip(counts, transfer_rows) if r[3]]
    ax.plot([c for c, _ in loop], [c * per_block / r[3] / 1e9 for c, r in loop], "o--",
            label="out, block by block")
    ax.plot([c for c, _ in loop], [c * per_block / r[4] / 1e9 for c, r in loop], "s--",
            label="in, block by block")
    ax.axhline(d2h / 1e9, color="gray", ls=":", label="pinned D2H ceiling")
    ax.axhline(h2d / 1e9, color="black", ls=":", label="pinned H2D ceiling")
    ax.set(xscale="log", xlabel="blocks per swap", ylabel="GB/s", title="swap transfers")
    ax.legend(fontsize=7)
    ax = axes[1]
    lengths = [r[0] for r in cross_rows]
    ax.plot(lengths, [r[1] * 1e3 for r in cross_rows], "o-", label="recompute (prefill)")
    ax.plot(lengths, [r[2] * 1e3 for r in cross_rows], "s-", label="swap out + in")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="ms",
           title="preempting one sequence")
    ax.legend(fontsize=8)
    ax = axes[2]
    for mode in ("recompute", "swap", "auto"):
        rows = [r for r in overload_rows if r["mode"] == mode]
        ax.plot([r["load"] for r in rows], [r["tokens_per_s_run"] for r in rows], "o-",
                label=mode)
    ax.set(xlabel="KV demand / pool", ylabel="output tokens/s (compile excluded)",
           title="throughput under overload")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
