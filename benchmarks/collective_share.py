"""The all-reduce share of a tensor-parallel decode step, from a `jax.profiler` trace.

One model (random weights, a preset, optionally cut to its first --num-layers layers) is split
over --tensor-parallel-size devices. --batch requests with --prompt-len-token prompts are
prefilled in one step, then decode (EOS ignored, K = 1, synchronous) until two steps in a row
compile nothing; the next --steps decode steps run under the profiler. From the
streams of the first GPU in the trace:
  busy:        the union of its kernel and copy intervals (`multistep.gpu_busy_seconds`);
  all-reduce:  summed durations of kernels whose names say all-reduce (NCCL's `AllReduce`
               kernels, or XLA's own `all-reduce`/`all_reduce` kernels);
  collectives: the same over every collective kernel, all-reduces included (anything NCCL,
               all-gather, ...). A generic NCCL kernel whose name names no operation counts
               only here; the other collectives of a TP decode step are the embedding's and
               the logits' all-gathers, so this is an upper bound on the all-reduce time.
Shares are over busy time. A collective kernel's time includes waiting for the slowest device:
NCCL's kernel starts when this GPU reaches it and ends when every GPU has contributed.
On a CPU the trace has no GPU plane, and the shares are reported as null ("n/a").
Usage: python benchmarks/collective_share.py --model llama3-8b --tensor-parallel-size 2
       [--batch 64] [--prompt-len 128] [--steps 10] [--num-layers N] [--out FILE.json]
"""

import argparse
import dataclasses
import datetime
import json
import platform
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.multistep import busy_seconds, gpu_stream_lines  # noqa: E402
from jpaged import LLMEngine, SamplingParams, parallel  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.models import random_model  # noqa: E402

# Matched against lower-cased kernel names; "(^|[^a-z])" keeps e.g. "small_reduce" out.
ALL_REDUCE = re.compile(r"(^|[^a-z])all[-_]?reduce")
COLLECTIVE = re.compile(r"nccl|(^|[^a-z])(all[-_]?(reduce|gather|to[-_]?all)|reduce[-_]?scatter"
                        r"|collective[-_]?permute)")
MAX_WARM_STEPS = 8   # decode until two steps in a row compiled nothing
BLOCK_SIZE = 16


def build_engine(args) -> LLMEngine:
    """An engine whose pool holds exactly the batch at its longest, with no warm-up."""
    config = ModelConfig.preset(args.model)
    if args.num_layers:
        config = dataclasses.replace(config, num_hidden_layers=args.num_layers)
    mesh = parallel.make_mesh(args.tensor_parallel_size)
    model = random_model(config, dtype=jnp.dtype(args.dtype), mesh=mesh, seed=0)
    max_len = args.prompt_len + MAX_WARM_STEPS + args.steps + 2
    blocks_per_seq = -(-max_len // BLOCK_SIZE)
    return LLMEngine.from_model(
        model, None, max_num_seqs=args.batch, max_model_len=blocks_per_seq * BLOCK_SIZE,
        max_num_batched_tokens=max(args.batch * args.prompt_len, 2048),
        num_kv_blocks=args.batch * blocks_per_seq * 11 // 10 + 2,  # the admission watermark
        block_size=BLOCK_SIZE,
        attention_backend=args.attention_backend, warmup=False,
        tensor_parallel_size=args.tensor_parallel_size)


def decode_under_profile(engine, args, trace_dir: str) -> list:
    """Prefill the batch, warm its decode program, then profile args.steps decode steps; returns
    the profiled steps' records."""
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    for index in range(args.batch):
        engine.add_request(f"r{index}", prompt_token_ids=rng.integers(
            10, vocab, args.prompt_len).tolist(), params=SamplingParams(
            temperature=0.0, max_tokens=MAX_WARM_STEPS + args.steps + 2, ignore_eos=True))
    engine.step_log = []
    engine.step()
    assert not engine.step_log[0].is_decode and engine.step_log[0].num_seqs == args.batch, \
        "the prompts must prefill in one step"
    warm = 0
    while warm < 2 and len(engine.step_log) <= MAX_WARM_STEPS:
        engine.step()
        record = engine.step_log[-1]
        warm = warm + 1 if record.is_decode and not record.compiled else 0
    engine.step_log = []
    jax.profiler.start_trace(trace_dir)
    for _ in range(args.steps):
        engine.step()
    jax.profiler.stop_trace()
    records = engine.step_log
    assert all(r.is_decode and not r.compiled and r.num_seqs == args.batch for r in records), \
        f"a profiled step was not a warm decode step of the whole batch: {records}"
    return records


def kernel_kind(name: str) -> str | None:
    """"all_reduce", "collective" (another collective) or None for a GPU kernel's name."""
    name = name.lower()
    return ("all_reduce" if ALL_REDUCE.search(name) else
            "collective" if COLLECTIVE.search(name) else None)


def kernel_seconds(trace_dir: str) -> dict | None:
    """Busy, all-reduce and collective seconds on the first GPU, and the collective kernels'
    names with their seconds; None when the trace has no GPU (a CPU run)."""
    lines = gpu_stream_lines(trace_dir)
    if lines is None:
        return None
    by_name = Counter()
    for line in lines:
        for event in line.events:
            if kernel_kind(event.name):
                by_name[event.name] += event.duration_ns * 1e-9
    busy = busy_seconds(lines)
    all_reduce = sum(s for name, s in by_name.items() if kernel_kind(name) == "all_reduce")
    return dict(busy=busy, all_reduce=all_reduce, collectives=sum(by_name.values()),
                kernels=dict(by_name.most_common(5)))


def measure(args) -> dict:
    engine = build_engine(args)
    config = engine.model_config
    with tempfile.TemporaryDirectory() as trace_dir:
        records = decode_under_profile(engine, args, trace_dir)
        times = kernel_seconds(trace_dir)
    steps = len(records)
    per_step = (lambda key: None if times is None else 1e3 * times[key] / steps)
    share = (lambda key: None if times is None else times[key] / max(times["busy"], 1e-12))
    device = jax.devices()[0]
    return dict(
        model=args.model, tensor_parallel_size=args.tensor_parallel_size,
        num_layers=config.num_hidden_layers,
        full_num_layers=ModelConfig.preset(args.model).num_hidden_layers,
        batch=args.batch, prompt_len=args.prompt_len, steps=steps,
        mean_context=sum(r.context_tokens for r in records) / steps / args.batch,
        step_ms=1e3 * sum(r.device_seconds for r in records) / steps,
        busy_ms=per_step("busy"), all_reduce_ms=per_step("all_reduce"),
        collectives_ms=per_step("collectives"), all_reduce_share=share("all_reduce"),
        collectives_share=share("collectives"),
        kernels=None if times is None else times["kernels"],
        device=getattr(device, "device_kind", device.platform), date=str(datetime.date.today()),
        jax=jax.__version__, python=platform.python_version(),
        attention_backend=engine.config.attention_backend,
        command="python benchmarks/collective_share.py " + " ".join(sys.argv[1:]))


def describe(result: dict) -> str:
    layers = (f"{result['num_layers']} of {result['full_num_layers']} layers"
              if result["num_layers"] != result["full_num_layers"] else "all layers")
    head = (f"{result['model']} ({layers}) at TP={result['tensor_parallel_size']}, batch "
            f"{result['batch']}, mean context {result['mean_context']:.0f}: timed step "
            f"{result['step_ms']:.2f} ms")
    if result["busy_ms"] is None:
        return head + "; no GPU in the trace, all-reduce share n/a"
    return (head + f", GPU busy {result['busy_ms']:.2f} ms, all-reduce "
            f"{result['all_reduce_ms']:.2f} ms ({100 * result['all_reduce_share']:.1f}%), all "
            f"collectives {result['collectives_ms']:.2f} ms "
            f"({100 * result['collectives_share']:.1f}%) per step; kernels {result['kernels']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description="all-reduce share of a TP decode step")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    parser.add_argument("--num-layers", type=int, default=0,
                        help="keep only the first N decoder layers (0: all)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--out", default=None, help="JSON file")
    args = parser.parse_args(argv)
    result = measure(args)
    print(describe(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
