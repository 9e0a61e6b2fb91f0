"""Fragmentation study (CPU): how much of one KV pool holds real token states, per allocator.

The same Poisson-arrival trace (benchmarks/trace.py: lognormal lengths matching the vLLM paper's
ShareGPT, about 161 input / 338 output tokens, and Alpaca, about 19 / 58) is replayed against
contiguous maximum-length reservation, contiguous final-length first-fit, and jpaged's paged
allocator at several block sizes, all with the same pool (benchmarks/kv_replay.py says how each
slot is classified). Reported: the pool's mean split into useful / reserved / internal /
external / idle / other over the steps where a request waits (the allocator is the limit there),
preemptions, sequences in flight; a stacked plot over time per allocator.
Usage: python benchmarks/fragmentation.py [--out results/fragmentation.md] [--plot FILE.png]
"""

import argparse
import datetime
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kv_replay import (CATEGORIES, replay_contiguous, replay_paged,  # noqa: E402
                                  summarize)
from benchmarks.trace import ALPACA, SHAREGPT, make_trace  # noqa: E402

TRACES = {"sharegpt": SHAREGPT, "alpaca": ALPACA}


def allocators(block_sizes):
    """(label, replay function of (trace, capacity, max_model_len)) in report order."""
    yield "contiguous, max length", lambda trace, capacity, max_len: (replay_contiguous(
        trace, capacity=capacity, max_model_len=max_len, reserve_max=True), 0)
    yield "contiguous, final length (first-fit)", lambda trace, capacity, max_len: (
        replay_contiguous(trace, capacity=capacity, max_model_len=max_len, reserve_max=False), 0)
    for size in block_sizes:
        yield f"paged, block {size}", lambda trace, capacity, max_len, size=size: replay_paged(
            trace, capacity=capacity, block_size=size, max_model_len=max_len)


def run_study(args) -> dict:
    """{trace name: [(label, records, summary, preemptions)]}."""
    results = {}
    for name in args.traces:
        rate = args.sharegpt_rate if name == "sharegpt" else args.alpaca_rate
        count = args.sharegpt_requests if name == "sharegpt" else args.alpaca_requests
        trace = make_trace(count, **TRACES[name], seed=args.seed, request_rate=rate)
        rows = []
        for label, replay in allocators(args.block_sizes):
            records, preemptions = replay(trace, args.capacity, args.max_model_len)
            rows.append((label, records, summarize(records), preemptions))
            print(f"{name}: {label}: useful {rows[-1][2]['useful']:.1%}", flush=True)
        results[name] = rows
    return results


def report(args, results) -> str:
    lines = [
        f"device: CPU ({platform.processor() or platform.machine()}), date "
        f"{datetime.date.today()}, python {platform.python_version()}",
        "command: python benchmarks/fragmentation.py " + " ".join(sys.argv[1:]),
        f"pool: {args.capacity} token slots for every allocator (Llama-3-8B bf16: "
        f"{args.capacity * 131072 / 2**30:.1f} GiB), max_model_len {args.max_model_len}; "
        "time in scheduler steps; means over the steps where a request waits",
    ]
    for name, rows in results.items():
        rate = args.sharegpt_rate if name == "sharegpt" else args.alpaca_rate
        count = len(rows[0][1]) and (args.sharegpt_requests if name == "sharegpt"
                                     else args.alpaca_requests)
        lines += ["", f"### {name}: {count} requests, Poisson {rate} requests/step, "
                  f"lognormal lengths (mean input {TRACES[name]['input_mean']:.0f}, output "
                  f"{TRACES[name]['output_mean']:.0f})", "",
                  "| allocator | " + " | ".join(CATEGORIES) + " | loaded / all steps | "
                  "mean / max in flight | preemptions |",
                  "|---|" + "---:|" * (len(CATEGORIES) + 3)]
        for label, _, summary, preemptions in rows:
            lines.append(f"| {label} | " + " | ".join(f"{summary[c]:.1%}" for c in CATEGORIES)
                         + f" | {summary['loaded_steps']} / {summary['steps']} | "
                         f"{summary['mean_in_flight']:.0f} / {summary['max_in_flight']} | "
                         f"{preemptions} |")
    return "\n".join(lines) + "\n"


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(useful="#2a9d8f", reserved="#e9c46a", internal="#f4a261", external="#e76f51",
                  idle="#d9d9d9", other="#6d597a")
    columns = max(len(rows) for rows in results.values())
    fig, axes = plt.subplots(len(results), columns, figsize=(3.2 * columns, 3 * len(results)),
                             squeeze=False)
    for row_axes, (name, rows) in zip(axes, results.items()):
        for ax, (label, records, summary, _) in zip(row_axes, rows):
            capacity = records[0].total
            steps = range(len(records))
            ax.stackplot(steps, *[[getattr(r, c) / capacity for r in records]
                                  for c in CATEGORIES],
                         labels=CATEGORIES, colors=[colors[c] for c in CATEGORIES])
            twin = ax.twinx()
            twin.plot(steps, [r.in_flight for r in records], color="black", lw=0.8)
            twin.tick_params(labelsize=6)
            ax.set_title(f"{name}: {label}\nuseful {summary['useful']:.1%}", fontsize=7)
            ax.set_ylim(0, 1)
            ax.set_xlabel("step", fontsize=7)
            ax.tick_params(labelsize=6)
    axes[0][0].legend(loc="lower left", fontsize=5)
    axes[0][-1].text(1.02, 1.0, "black line: sequences in flight (right axis)",
                     transform=axes[0][-1].transAxes, fontsize=6, rotation=90, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description="KV fragmentation of contiguous vs paged")
    parser.add_argument("--traces", type=lambda s: s.split(","), default=["sharegpt", "alpaca"])
    parser.add_argument("--capacity", type=int, default=131072,
                        help="token slots in the pool (64 sequences of 2048: e2e.py's budget)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8, 16, 32, 128])
    parser.add_argument("--sharegpt-requests", type=int, default=2000)
    parser.add_argument("--sharegpt-rate", type=float, default=2.0, help="requests per step")
    parser.add_argument("--alpaca-requests", type=int, default=20000)
    parser.add_argument("--alpaca-rate", type=float, default=60.0, help="requests per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    results = run_study(args)
    text = report(args, results)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
