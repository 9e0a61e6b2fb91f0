"""KV blocks a sliding window gives back (CPU, no model): the engine's scheduler and block
ledger alone (they decide every block the device allocator takes, block for block) serve long
requests of a model whose every layer slides one window, once keeping every block and once
letting go of the blocks behind the window. Reported: the most blocks the requests held at once,
their KV bytes for the model's shape, and how many such requests a pool of that size serves.
Usage: python benchmarks/window_blocks.py --model mistral-7b --window 4096 --prompt-len 30720
       --output-len 2048 --num-requests 4 [--out results/window_blocks.md]
"""

import argparse
import dataclasses
import datetime
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged.blocks.ledger import BlockLedger  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.engine.scheduler import Scheduler  # noqa: E402
from jpaged.request import Request  # noqa: E402
from jpaged.sampling_params import SamplingParams  # noqa: E402


def most_blocks_held(args, window: int | None) -> int:
    """Serve args.num_requests requests to the end (a made-up token per sample); the most
    blocks held at once."""
    max_blocks = -(-(args.prompt_len + args.output_len) // args.block_size)
    num_blocks = args.num_requests * max_blocks + 1
    ledger = BlockLedger(num_blocks, args.block_size, args.num_requests, max_blocks)
    scheduler = Scheduler(ledger, max_num_seqs=args.num_requests,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          sliding_window=window)
    for index in range(args.num_requests):
        prompt = [(index * 7 + i) % 30000 for i in range(args.prompt_len)]
        scheduler.add(Request(f"r{index}", None, prompt,
                              SamplingParams(max_tokens=args.output_len), 0, index))
    most = 0
    while scheduler.num_unfinished:
        rows = scheduler.schedule().rows
        most = max(most, num_blocks - 1 - ledger.num_free)
        for row in rows:
            if not row.sample_indices:
                continue
            row.seq.token_ids.append(1)
            if len(row.seq.output_token_ids) >= args.output_len:
                row.seq.finish_reason = "length"
                ledger.release([row.seq])
                scheduler.retire(row.request)
    return most


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mistral-7b")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=30720)
    parser.add_argument("--output-len", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    config = dataclasses.replace(ModelConfig.preset(args.model), sliding_window=args.window,
                                 layer_types=None)
    window = config.window_of_every_layer
    assert window == args.window, "every layer must slide the window"
    block_bytes = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                   * 2 * args.block_size)                       # K and V, bfloat16
    kept, trimmed = most_blocks_held(args, None), most_blocks_held(args, window)
    rows = [("every block kept", kept), ("blocks behind the window given back", trimmed)]
    lines = [
        f"# KV blocks a sliding window gives back ({args.model} shape, window {window})", "",
        f"date {datetime.date.today()}, python {platform.python_version()}; host-side scheduler "
        "and block ledger only (they decide the device allocator's every block)",
        "command: python benchmarks/window_blocks.py " + " ".join(sys.argv[1:] if argv is None
                                                                   else argv), "",
        f"{args.num_requests} requests of {args.prompt_len} prompt + {args.output_len} output "
        f"tokens, blocks of {args.block_size} ({block_bytes / 2**20:.1f} MiB each in bfloat16), "
        f"chunked prefill of {args.max_num_batched_tokens} tokens.", "",
        "| blocks | most blocks held | per request | KV GiB held | requests per 64 GiB |",
        "|---|---:|---:|---:|---:|"]
    for label, most in rows:
        per_request = most / args.num_requests
        lines.append(f"| {label} | {most} | {per_request:.0f} | {most * block_bytes / 2**30:.2f} "
                     f"| {int(64 * 2**30 / block_bytes // per_request)} |")
    lines += ["", f"Saved: {kept - trimmed} blocks ({1 - trimmed / kept:.1%})."]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
