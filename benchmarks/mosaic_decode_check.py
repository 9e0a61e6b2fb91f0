"""Checks the Mosaic GPU decode kernel (benchmarks/mosaic_decode.py) on a GPU: compiles it,
compares it with the reference and times it against the Triton kernel.

Usage (on the GPU machine, from the repository root):
    PYTHONPATH=. python3 benchmarks/mosaic_decode_check.py --out DIR [--budget-seconds 280]

Each stage (versions, correctness, timing) runs in a child process under a timeout, so a kernel that
faults or hangs costs its stage, not the whole run; every case inside a stage is wrapped too, so one
failure prints its error and the rest go on. Full tracebacks go to DIR/<stage>.log.
Timing reuses benchmarks/kernels.py: a jitted chain of CHAIN dependent calls, each on its own
block table over disjoint pages of a pool much larger than L2; time per call = median / CHAIN.
"""

import argparse
import functools
import os
import subprocess
import sys
import time
import traceback

NUM_KV_HEADS, HEAD_DIM = 8, 128  # the shapes of benchmarks/kernels.py (32 query heads)
TIMING_CASES = [(8, 1024), (64, 1024), (64, 4096), (256, 2048), (8, 32768)]
# Mosaic tilings timed next to its default: (tokens_per_step, num_stages, splits multiplier).
MOSAIC_VARIANTS = [(64, 2, 2), (64, 2, 4), (64, 3, 1), (64, 4, 1)]
STAGE_SHARE = {"versions": 0.08, "correctness": 0.42, "timing": 0.5}


class Log:
    """Prints short lines and keeps full details (tracebacks) in a file."""

    def __init__(self, path):
        self.file = open(path, "a", buffering=1)

    def line(self, text=""):
        print(text, flush=True)
        self.file.write(text + "\n")

    def error(self, what, error):
        self.line(f"FAIL {what}: {type(error).__name__}: {_first_line(error)}")
        self.file.write(traceback.format_exc() + "\n")


def _first_line(error):
    lines = [line for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:300]


def stage_versions(log):
    import jax
    import jaxlib
    log.line(f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, python {sys.version.split()[0]}")
    log.line(f"devices: {[d.device_kind for d in jax.devices()]} ({jax.default_backend()})")


def correctness_cases():
    """(name, problem kwargs, kernel kwargs, dtypes): lengths 1, S-1, S, S+1, long, 0 (padding)."""
    import jax.numpy as jnp
    import numpy as np
    lengths = [1, 15, 16, 17, 1000, 4096, 0, 33]
    random_lengths = [int(x) for x in np.random.default_rng(0).integers(1, 4097, 64)]
    base = dict(context_lens=lengths, num_heads=32, num_kv_heads=8, block_size=16)
    bf16 = (jnp.bfloat16,)
    cases = [("B8 H32/K8 S16", base, {}, (jnp.bfloat16, jnp.float32))]
    for block_size in (16, 64):
        for heads, kv_heads in ((32, 8), (8, 8), (8, 1)):
            if (block_size, heads, kv_heads) != (16, 32, 8):
                cases.append((f"B8 H{heads}/K{kv_heads} S{block_size}",
                              dict(base, num_heads=heads, num_kv_heads=kv_heads,
                                   block_size=block_size), {}, bf16))
    cases += [
        ("B1 ctx4096 H32/K8 S16", dict(base, context_lens=[4096]), {}, bf16),
        ("B1 ctx17 H8/K1 S64", dict(base, context_lens=[17], num_heads=8, num_kv_heads=1,
                                    block_size=64), {}, bf16),
        ("B64 random H32/K8 S16", dict(base, context_lens=random_lengths), {}, bf16),
        ("B64 random H8/K8 S64", dict(base, context_lens=random_lengths, num_heads=8,
                                      num_kv_heads=8, block_size=64), {}, bf16),
        ("B8 H32/K8 S32", dict(base, block_size=32), {}, bf16),
        ("B8 H32/K8 S128 (half-page steps)", dict(base, block_size=128), {}, bf16),
        ("B8 H32/K8 S16 splits=1", base, dict(num_splits=1), bf16),
        ("B8 H32/K8 S16 stages=3", base, dict(num_stages=3), bf16),
        ("B8 H32/K8 S16 stages=4", base, dict(num_stages=4), bf16),
    ]
    return cases


def stage_correctness(log):
    import jax.numpy as jnp
    import numpy as np
    from pallas_kernels import reference
    from benchmarks import mosaic_decode
    from pallas_kernels.testing import (TOLERANCE, make_problem, max_row_error,
                                        poison_unused_table_entries)
    log.line("| case | dtype | max row rel err | tolerance | result | seconds (incl. compile) |")
    log.line("|---|---|---|---|---|---|")
    for name, problem_kwargs, kernel_kwargs, dtypes in correctness_cases():
        for dtype in dtypes:
            start = time.perf_counter()
            try:
                problem = poison_unused_table_entries(make_problem(
                    0, head_dim=HEAD_DIM, dtype=dtype, **problem_kwargs))
                out = mosaic_decode.paged_attention_decode(*problem.decode_args, **kernel_kwargs)
                out = np.asarray(out.astype(jnp.float32))
                ref = reference.paged_attention_decode(*problem.decode_args)
                error = max_row_error(out, ref)
                tolerance = TOLERANCE[jnp.dtype(dtype)]
                verdict = "ok" if error < tolerance else "WRONG"
                log.line(f"| {name} | {jnp.dtype(dtype).name} | {error:.2e} | {tolerance:g} | "
                         f"{verdict} | {time.perf_counter() - start:.1f} |")
            except Exception as error:  # report and go on to the next case
                if dtype == jnp.float32 and isinstance(error, ValueError):  # WGMMA would be TF32
                    log.line(f"| {name} | float32 | - | - | rejected by the wrapper: "
                             f"{_first_line(error)[:100]} | - |")
                else:
                    log.error(f"{name} {jnp.dtype(dtype).name}", error)


def stage_timing(log):
    """The timing method of benchmarks/kernels.py (its chain, page sets and median), reused."""
    import jax
    from benchmarks.kernels import CHAIN, chained, decode_setup, median_seconds
    from pallas_kernels.gpu import decode as triton_decode
    from benchmarks import mosaic_decode
    log.line("| B | context | kernel | tiling | us/call | GB/s | vs Triton |")
    log.line("|---|---|---|---|---|---|---|")
    for batch, context in TIMING_CASES:
        try:
            arg_sets, num_bytes = decode_setup(jax.random.key(batch + context), batch, context,
                                               16)
        except Exception as error:
            log.error(f"setup B{batch} ctx{context}", error)
            continue
        default_splits = mosaic_decode.default_tiling(batch, NUM_KV_HEADS, context, 64)
        kernels = [("triton", "default", triton_decode.paged_attention_decode),
                   ("mosaic", f"default C64/st2/sp{default_splits}",
                    mosaic_decode.paged_attention_decode)]
        for step, stages, split_factor in MOSAIC_VARIANTS:
            splits = max(1, mosaic_decode.default_tiling(batch, NUM_KV_HEADS, context, step)
                         * split_factor)
            kernels.append(("mosaic", f"C{step}/st{stages}/sp{splits}", functools.partial(
                mosaic_decode.paged_attention_decode, tokens_per_step=step, num_stages=stages,
                num_splits=splits)))
        triton_seconds = None
        for name, tiling, kernel in kernels:
            try:
                seconds = median_seconds(chained(kernel), arg_sets) / CHAIN
            except Exception as error:
                log.error(f"B{batch} ctx{context} {name} {tiling}", error)
                continue
            triton_seconds = triton_seconds or (seconds if name == "triton" else None)
            ratio = f"{triton_seconds / seconds:.2f}x" if triton_seconds else "-"
            log.line(f"| {batch} | {context} | {name} | {tiling} | {seconds * 1e6:.1f} | "
                     f"{num_bytes / seconds / 1e9:.0f} | {ratio} |")
        del arg_sets


STAGES = {"versions": stage_versions, "correctness": stage_correctness, "timing": stage_timing}


def run_stages(out_dir, budget_seconds):
    """Each stage in a child process under its share of the budget."""
    log = Log(os.path.join(out_dir, "check.log"))
    deadline = time.time() + budget_seconds
    for stage, share in STAGE_SHARE.items():
        timeout = min(share * budget_seconds, deadline - time.time())
        log.line(f"\n## {stage} (timeout {timeout:.0f} s)")
        if timeout < 10:
            log.line("skipped: out of time")
            continue
        command = [sys.executable, __file__, "--stage", stage, "--out", out_dir]
        start = time.time()
        try:
            done = subprocess.run(command, timeout=timeout, capture_output=True, text=True)
            log.file.write(done.stdout + done.stderr)
            print(done.stdout, end="", flush=True)
            status = f"exit {done.returncode}"
            if done.returncode:
                print(done.stderr[-3000:], flush=True)
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (
                expired.stdout or "")
            print(output, end="", flush=True)
            log.file.write(output)
            status = "TIMED OUT (kernel hang or slow compiles)"
        log.line(f"[{stage}: {status}, {time.time() - start:.0f} s]")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--budget-seconds", type=float, default=280)
    parser.add_argument("--stage", choices=sorted(STAGES))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.stage is None:
        run_stages(args.out, args.budget_seconds)
        return
    log = Log(os.path.join(args.out, f"{args.stage}.log"))
    try:
        STAGES[args.stage](log)
    except Exception as error:
        log.error(f"stage {args.stage}", error)


if __name__ == "__main__":
    main()
