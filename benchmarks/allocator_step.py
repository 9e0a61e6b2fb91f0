"""One batched append step (one new token per sequence) through the jitted functional block
manager, against the plain-Python host allocator (`HostBlockMirror`) doing the same work.

Sequences start at random lengths, so about 1 in S crosses a block boundary per step, as in
steady-state decoding. Three timings per batch size:
  jit/step      a Python loop calling the jitted append (dispatch included: the engine's cost
                when it calls the manager once per step);
  in-loop/step  `steps` appends inside one `lax.fori_loop` (the device cost alone: the
                multi-step decode loop's cost);
  python/step   HostBlockMirror.append on the host.
Usage: python benchmarks/allocator_step.py [--out benchmarks/results/allocator_step_cpu.md]
"""

import argparse
import datetime
import functools
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged.blocks import allocator  # noqa: E402
from jpaged.blocks.mirror import HostBlockMirror  # noqa: E402

BLOCK_SIZE, MAX_BLOCKS = 16, 64


def setup(batch: int, steps: int, seed: int = 0):
    """Device state and host mirror with `batch` sequences of random length, room for `steps`."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, (MAX_BLOCKS - 1) * BLOCK_SIZE - steps, size=batch)
    num_blocks = int(np.sum(-(-(lens + steps) // BLOCK_SIZE))) + 2
    state = allocator.init_state(num_blocks, BLOCK_SIZE, batch, MAX_BLOCKS)
    seq_ids = np.arange(batch, dtype=np.int32)
    state, result = jax.jit(functools.partial(allocator.allocate_prompt,
                                              max_prompt_len=MAX_BLOCKS * BLOCK_SIZE))(
        state, jnp.asarray(seq_ids), jnp.asarray(lens, dtype=jnp.int32))
    assert bool(result.ok)
    mirror = HostBlockMirror(num_blocks, BLOCK_SIZE, batch, MAX_BLOCKS)
    mirror.append(list(zip(seq_ids.tolist(), lens.tolist())))
    return state, mirror, jnp.asarray(seq_ids)


@jax.jit
def append_step(state, seq_ids):
    state, slots, copies, ok = allocator.append_one(state, seq_ids)
    return state, slots, ok


@functools.partial(jax.jit, static_argnums=2)
def append_loop(state, seq_ids, steps):
    def body(_, carry):
        new_state, _, _, ok = allocator.append_one(carry[0], seq_ids)
        return new_state, carry[1] & ok
    return jax.lax.fori_loop(0, steps, body, (state, jnp.bool_(True)))


def time_jit(batch, steps):
    state, _, seq_ids = setup(batch, steps + 1)
    jax.block_until_ready(append_step(state, seq_ids))  # compile
    start = time.perf_counter()
    for _ in range(steps):
        state, slots, ok = append_step(state, seq_ids)
    jax.block_until_ready((state, slots))
    assert bool(ok)
    return (time.perf_counter() - start) / steps


def time_loop(batch, steps):
    state, _, seq_ids = setup(batch, steps)
    jax.block_until_ready(append_loop(state, seq_ids, steps))  # compile
    start = time.perf_counter()
    _, ok = jax.block_until_ready(append_loop(state, seq_ids, steps))
    assert bool(ok)
    return (time.perf_counter() - start) / steps


def time_python(batch, steps):
    _, mirror, seq_ids = setup(batch, steps)
    rows = [(int(s), 1) for s in seq_ids]
    start = time.perf_counter()
    for _ in range(steps):
        ok, _, _ = mirror.append(rows)
    assert ok
    return (time.perf_counter() - start) / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description="batched append step: jitted vs host Python")
    parser.add_argument("--batches", default="1,4,16,64,256,1024")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    lines = [
        f"device: {getattr(device, 'device_kind', device.platform)} ({jax.default_backend()}), "
        f"date {datetime.date.today()}, jax {jax.__version__}, python {platform.python_version()}",
        f"command: python benchmarks/allocator_step.py --batches {args.batches} "
        f"--steps {args.steps}",
        f"block size {BLOCK_SIZE}, {args.steps} steps per timing, time per append step in us",
        "",
        "| batch | jit/step (us) | in-loop/step (us) | python/step (us) | python / in-loop |",
        "|---:|---:|---:|---:|---:|",
    ]
    for batch in (int(b) for b in args.batches.split(",")):
        jit_s, loop_s, py_s = (time_jit(batch, args.steps), time_loop(batch, args.steps),
                               time_python(batch, args.steps))
        lines.append(f"| {batch} | {jit_s * 1e6:.1f} | {loop_s * 1e6:.1f} | {py_s * 1e6:.1f} | "
                     f"{py_s / loop_s:.1f}x |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
