"""Offline throughput of jpaged on the standard trace, with decode steps against their floor.

A Llama-family model with random weights (a preset under configs/models/, e.g. llama3-8b, in
bfloat16) generates the 256-request ShareGPT-like trace (benchmarks/trace.py), EOS ignored so
every request produces its drawn length. Reported:
  - output tokens/s and requests/s over the whole run, and excluding first-call compile time;
  - decode step time against its floor: (weight bytes + KV bytes read that step) over the copy
    bandwidth measured in this run (`roofline.copy_bandwidth`: the faster of an XLA pass over
    a float32 array and, on a GPU with torch installed, torch's device copy); with
    --tensor-parallel-size N, one device's share (weights / N, its kv heads), so the gap to the
    floor includes the all-reduces;
  - host time per step (scheduling and output processing, outside the device step);
  - compilations, preemptions, largest number of concurrent sequences.
Interrupted (SIGINT, e.g. `timeout -s INT`), it still reports the steps it ran, marked
incomplete, with rates over the tokens generated so far.
Usage: python benchmarks/throughput.py --model llama3-8b [--num-requests 256]
       [--tensor-parallel-size N] [--out FILE]
Random weights are drawn on the device, already split over the tensor-parallel devices (a 70B
model never exists whole on one GPU or on the host).
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

from benchmarks import roofline  # noqa: E402
from benchmarks.trace import SHAREGPT, make_trace  # noqa: E402
from jpaged import LLMEngine, SamplingParams, parallel  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.models import random_model  # noqa: E402


def build_engine(args):
    config = ModelConfig.preset(args.model)
    mesh = parallel.make_mesh(args.tensor_parallel_size)
    model = random_model(config, dtype=jnp.dtype(args.dtype), mesh=mesh, seed=0)
    engine = LLMEngine.from_model(
        model, None, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        attention_backend=args.attention_backend, gpu_memory_utilization=0.9,
        num_scheduler_steps=args.num_scheduler_steps, warmup=args.warmup,
        tensor_parallel_size=args.tensor_parallel_size)
    return engine, config


def run_trace(engine, trace):
    rng = np.random.default_rng(1)
    vocab = engine.model_config.vocab_size
    for index, request in enumerate(trace):
        engine.add_request(f"r{index}", prompt_token_ids=rng.integers(
            10, vocab, request.input_len).tolist(), params=SamplingParams(
            temperature=0.0, max_tokens=request.output_len, ignore_eos=True))
    engine.step_log = []
    max_running = 0
    start = time.perf_counter()
    is_complete = True
    try:
        while engine.has_unfinished():
            engine.step()
            if len(engine.step_log) % 200 == 0:
                print(f"step {len(engine.step_log)}: {engine.num_generated_tokens} tokens, "
                      f"{time.perf_counter() - start:.1f} s, "
                      f"{engine.stats()['num_compilations']} compilations", flush=True)
            max_running = max(max_running, sum(len(r.live_sequences)
                                               for r in engine.scheduler.running))
    except KeyboardInterrupt:  # a time limit: report what ran
        is_complete = False
    return time.perf_counter() - start, max_running, is_complete


def report(args, engine, config, trace, wall, max_running, bandwidth, compile_before,
           is_complete=True) -> str:
    stats = engine.stats()
    log = engine.step_log
    trace_tokens = sum(r.output_len for r in trace)
    output_tokens = trace_tokens if is_complete else engine.num_generated_tokens
    incomplete = [] if is_complete else [
        f"INCOMPLETE: interrupted after {wall:.1f} s with {output_tokens} of {trace_tokens} "
        "output tokens; the rates below are over the tokens generated"]
    weight_bytes = config.num_parameters() * jnp.dtype(args.dtype).itemsize
    tp = args.tensor_parallel_size
    kv_per_token = config.kv_bytes_per_token(engine.config.kv_dtype)
    kv_per_device = (kv_per_token * parallel.num_cache_kv_heads(config.num_key_value_heads,
                                                                engine.executor.mesh)
                     // config.num_key_value_heads // tp)
    decode = [r for r in log if r.is_decode and not r.compiled]
    floors = [(weight_bytes / tp + r.context_tokens * kv_per_device) / bandwidth
              for r in decode]
    decode_time = sum(r.device_seconds for r in decode)
    compile_s = stats["compile_seconds"] - compile_before
    device = jax.devices()[0]
    lines = [
        f"device: {device.device_kind}, date {datetime.date.today()}, jax {jax.__version__}, "
        f"python {platform.python_version()}",
        f"command: python benchmarks/throughput.py --model {args.model} --dtype {args.dtype} "
        f"--max-model-len {args.max_model_len} --num-requests "
        f"{args.num_requests} --max-num-seqs {args.max_num_seqs} --max-num-batched-tokens "
        f"{args.max_num_batched_tokens} --attention-backend {args.attention_backend} "
        f"--num-scheduler-steps {args.num_scheduler_steps} --tensor-parallel-size {tp}"
        f"{' --warmup' * args.warmup}",
        f"model {args.model} ({config.num_parameters() / 1e9:.2f} B params, random "
        f"{args.dtype} weights, {weight_bytes / 1e9:.2f} GB), tensor parallel over {tp} x "
        f"{device.device_kind}, KV pool {stats['num_kv_blocks']} blocks of "
        f"{engine.config.block_size}, attention {stats['attention_backend']}",
        f"trace: {len(trace)} requests, mean input "
        f"{np.mean([r.input_len for r in trace]):.0f}, mean output "
        f"{np.mean([r.output_len for r in trace]):.0f} tokens, {trace_tokens} output tokens",
        f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)",
        *incomplete,
        "",
        "| metric | value |", "|---|---:|",
        f"| wall time (s) | {wall:.1f} |",
        f"| warm-up before the run (s) | {stats['warmup_seconds']:.1f} |",
        f"| compile time inside the run (s) | {compile_s:.1f} |",
        f"| output tokens/s | {output_tokens / wall:.0f} |",
        f"| output tokens/s excluding compile | {output_tokens / max(wall - compile_s, 1e-9):.0f} |",
        f"| requests/s | {len(trace) / wall:.2f} |",
        f"| steps (decode without compile / all) | {len(decode)} / {len(log)} |",
        f"| mean decode step, device (ms) | {1e3 * decode_time / max(len(decode), 1):.2f} |",
        f"| mean decode floor (ms) | {1e3 * sum(floors) / max(len(floors), 1):.2f} |",
        f"| decode time / floor | {decode_time / max(sum(floors), 1e-12):.2f} |",
        f"| mean host time per step (ms) | "
        f"{1e3 * np.mean([r.host_seconds for r in log if not r.compiled]):.2f} |",
        f"| compilations | {stats['num_compilations']} |",
        f"| preemptions | {stats['num_preemptions']} |",
        f"| max concurrent sequences | {max_running} |",
        f"| padding waste (padded / real tokens) | {stats['padding_waste']:.2f} |",
    ]
    by_batch = {}
    for record, floor in zip(decode, floors):
        bucket = 1 << max(record.num_seqs - 1, 0).bit_length()
        by_batch.setdefault(bucket, []).append((record.device_seconds, floor))
    lines += ["", "| decode batch bucket | steps | mean step (ms) | mean floor (ms) | ratio |",
              "|---:|---:|---:|---:|---:|"]
    for bucket, rows in sorted(by_batch.items()):
        step, floor = np.mean(rows, axis=0)
        lines.append(f"| {bucket} | {len(rows)} | {1e3 * step:.2f} | {1e3 * floor:.2f} | "
                     f"{step / floor:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description="jpaged offline throughput on the trace")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="devices the model and KV cache are split over")
    parser.add_argument("--warmup", action="store_true",
                        help="compile every shape before the timed run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    bandwidth = roofline.copy_bandwidth(
        4 << 30 if jax.default_backend() == "gpu" else 256 << 20)["best"]
    engine, config = build_engine(args)
    trace = make_trace(args.num_requests, **SHAREGPT, seed=0)
    compile_before = engine.executor.compile_seconds
    wall, max_running, is_complete = run_trace(engine, trace)
    text = report(args, engine, config, trace, wall, max_running, bandwidth, compile_before,
                  is_complete)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
