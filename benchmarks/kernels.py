"""Times the paged-attention kernels on a GPU: decode GB/s against the copy bandwidth, prefill TFLOP/s.

Usage (on the GPU machine, from the repository root):
    PYTHONPATH=. python3 benchmarks/kernels.py --out /tmp/kernels.md [--budget-seconds 300]
        [--parts cases,decode,sweep,cudnn,torch,prefill,write] [--chain 16]
        [--prefill-backends triton,mosaic_gpu] [--prefill-tilings sweep] [--prefill-cases 0,5]

Method. Every timed function is jitted with CHAIN kernel calls inside (--chain; 16 hides the
Python dispatch of small cases, 4 does not), each call's output feeding the next call's queries
(so none can be hoisted or skipped), each call on its own block table: the tables of one rotation
use disjoint pages of one large pool, so a call finds little of its K/V in L2.
Time per call = median over repeats of (wall time of n dispatches, then one block) / (n * CHAIN).
Peers: JAX's bundled Pallas paged attention, the jnp reference (XLA gather + einsum), cuDNN on a
contiguous cache, and torch SDPA on a contiguous cache and after a gather of our pages
(`torch_peers.py`, CUDA-graphed). Cache writes: XLA's scatter against the Pallas kernel.
Decode bytes = K and V bytes of the cached tokens actually read + q and out. Ceilings measured in
the same run: a 2 GiB bf16 elementwise pass (bytes read + written) and an 8192^3 bf16 matmul.
The prefill part (`kernels_prefill.py`) times each prefill kernel once per dispatch beside torch
SDPA (cuDNN forced where it runs) on contiguous copies of the same pages, in causal TFLOP/s.
"""

import argparse
import datetime
import functools
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks import kernels_prefill, timing, torch_peers
from benchmarks.kernels_prefill import PREFILL_CASES
from benchmarks.timing import or_error, us
from pallas_kernels import reference
from pallas_kernels._compat import bundled_gpu_paged_attention
from pallas_kernels.gpu import cache_write
from pallas_kernels.gpu.decode import default_tiling

CHAIN = 4
WRITE_CHAIN = 16  # cache writes per jitted call in cache_write_rows (each one is tiny)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, jnp.bfloat16  # Llama-3-8B-like
DECODE_GRID = [(b, c) for b in (1, 8, 64, 256) for c in (512, 2048, 8192)]
# The (B, context) decode cases timed against every peer and swept.
DECODE_CASES = [(8, 1024), (64, 1024), (64, 4096), (256, 2048), (8, 32768)]
# Tiling overrides of the decode kernel's default; {} is the default tiling ("ours").
DECODE_VARIANTS = [{}, dict(tokens_per_step=128), dict(num_stages=3), dict(num_warps=8)]
PAGE_SIZE_CASE = (64, 4096)  # (B, context) also timed at S = 32, 64, 128
REFERENCE_MAX_TOKENS = 64 * 2048  # the jnp reference materializes [B, K, M*S, D] in float32


def median_seconds(fn, arg_sets, min_seconds=0.02, repeats=5):
    """Median seconds per dispatch of fn over rotating arg sets (compiled and warmed first)."""
    return timing.median_dispatch_seconds(fn, arg_sets, wait=jax.block_until_ready,
                                          min_seconds=min_seconds, repeats=repeats)


def chained(kernel):
    """jit(q, k_pages, v_pages, context_lens, *tables) applying kernel CHAIN times, q -> out."""
    def run(q, k_pages, v_pages, context_lens, *tables):
        for table in tables:
            q = kernel(q, k_pages, v_pages, table, context_lens).astype(q.dtype)
        return q
    return jax.jit(run)


def decode_setup(key, batch, context, block_size):
    """A pool of disjoint random page sets (enough that a chain's working set is >> the 50 MB L2);
    returns the per-dispatch argument tuples and the bytes one call must move."""
    blocks_per_seq = context // block_size
    set_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * jnp.dtype(DTYPE).itemsize
    num_sets = 1 if set_bytes >= 2 ** 28 else CHAIN if set_bytes >= 2 ** 25 else 4 * CHAIN
    num_blocks = 1 + num_sets * batch * blocks_per_seq
    k_key, v_key, q_key = jax.random.split(key, 3)
    shape = (NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM)
    k_pages = jax.random.normal(k_key, shape, DTYPE)
    v_pages = jax.random.normal(v_key, shape, DTYPE)
    q = jax.random.normal(q_key, (batch, NUM_HEADS, HEAD_DIM), DTYPE)
    physical = np.random.default_rng(batch + context).permutation(np.arange(1, num_blocks))
    tables = list(jnp.asarray(physical.reshape(num_sets, batch, blocks_per_seq).astype(np.int32)))
    context_lens = jnp.full((batch,), context, jnp.int32)
    arg_sets = [(q, k_pages, v_pages, context_lens,
                 *(tables[(i + j) % num_sets] for j in range(CHAIN)))
                for i in range(0, max(num_sets, CHAIN), CHAIN)]
    return arg_sets, set_bytes + 2 * q.size * q.dtype.itemsize


def contiguous_setup(key, batch, context):
    """Two contiguous [B, C, K, D] K/V copies for cuDNN through jax.nn.dot_product_attention."""
    keys = jax.random.split(key, 5)
    shape = (batch, context, NUM_KV_HEADS, HEAD_DIM)
    kv = [(jax.random.normal(keys[i], shape, DTYPE), jax.random.normal(keys[i + 2], shape, DTYPE))
          for i in range(2)]
    q = jax.random.normal(keys[4], (batch, 1, NUM_HEADS, HEAD_DIM), DTYPE)

    def run(q, *kv_flat):
        for i in range(CHAIN):
            k, v = kv_flat[2 * (i % 2)], kv_flat[2 * (i % 2) + 1]
            q = jax.nn.dot_product_attention(q, k, v, implementation="cudnn").astype(q.dtype)
        return q
    return jax.jit(run), [(q, *kv[0], *kv[1])]


def decode_row(key, batch, context, block_size, ceiling, variants, with_peers):
    arg_sets, num_bytes = decode_setup(key, batch, context, block_size)
    max_context = context
    row = {"B": batch, "context": context, "S": block_size}
    for overrides in variants:
        tiling = {**default_tiling(batch, NUM_KV_HEADS, max_context, HEAD_DIM, DTYPE),
                  "num_warps": 4, **overrides}
        name = "ours " + _tiling_name(tiling) if overrides else "ours"
        fn = chained(functools.partial(pk.paged_attention_decode_gpu, **tiling))
        row[name] = or_error(lambda: median_seconds(fn, arg_sets) / CHAIN)  # a tiling may not fit
        row.setdefault("tilings", {})[name] = tiling
    if with_peers:
        bundled = bundled_gpu_paged_attention()
        if bundled is not None:
            row["jax bundled"] = or_error(lambda: median_seconds(chained(bundled), arg_sets) / CHAIN)
        if batch * context <= REFERENCE_MAX_TOKENS:
            row["reference"] = or_error(lambda: median_seconds(
                chained(reference.paged_attention_decode), arg_sets[:1]) / CHAIN)
    row["bytes"] = num_bytes
    row["ceiling"] = ceiling
    return row


def sweep_variants(batch, context):
    """--parts sweep: the tilings tried per decode case (split counts only where the default
    splits)."""
    if default_tiling(batch, NUM_KV_HEADS, context, HEAD_DIM, DTYPE)["num_splits"] == 1:
        return [dict(tokens_per_step=step, num_stages=stages, num_warps=warps)
                for step, stages in ((64, 3), (64, 4), (64, 5), (128, 2), (128, 3))
                for warps in (4, 8)]
    return [dict(tokens_per_step=step, num_splits=splits, num_stages=stages, num_warps=warps)
            for step, stages in ((128, 3), (128, 4), (256, 2)) for splits in (2, 3)
            for warps in (4, 8)]


def format_sweep(rows):
    lines = ["| B | context | tiling | us |", "|---|---|---|---|"]
    for row in rows:
        by_time = sorted(row["tilings"].items(), key=lambda item: _sort_key(row[item[0]]))
        for name, tiling in by_time:
            lines.append(f"| {row['B']} | {row['context']} | {_tiling_name(tiling)} "
                         f"| {us(row[name])} |")
    return "\n".join(lines)


def cache_write_rows(num_tokens_cases=(64, 256, 2048), num_blocks=32768, block_size=16):
    """XLA scatter (reference.write_to_pages) against the Pallas kernel, pages donated, per call.

    One layer's pool of NUM_KV_HEADS x num_blocks x block_size x HEAD_DIM bf16 (1 GiB each for K
    and V); T tokens at distinct random slots, shifted by one block per write of the chain.
    """
    shape = (NUM_KV_HEADS, num_blocks, block_size, HEAD_DIM)
    rows = []
    for num_tokens in num_tokens_cases:
        key = jax.random.key(num_tokens)
        slots = jnp.asarray(np.random.default_rng(num_tokens).permutation(
            np.arange(block_size, (num_blocks - WRITE_CHAIN) * block_size))[:num_tokens]
            .astype(np.int32))
        slots = slots.reshape(1, -1) + block_size * jnp.arange(WRITE_CHAIN)[:, None]
        new = jax.random.normal(key, (2, num_tokens, NUM_KV_HEADS, HEAD_DIM), DTYPE)
        row = {"T": num_tokens}
        for name, write in (("xla scatter", reference.write_to_pages),
                            ("pallas", cache_write.write_to_pages)):
            def chain(k, v, new, slots, write=write):  # WRITE_CHAIN writes at shifted slots
                for i in range(WRITE_CHAIN):
                    k, v = write(k, v, new[0], new[1], slots[i])
                return k, v
            fn = jax.jit(chain, donate_argnums=(0, 1))
            pages = [jnp.zeros(shape, DTYPE), jnp.zeros(shape, DTYPE)]

            def run(n):
                start = time.perf_counter()
                for _ in range(n):
                    pages[:] = fn(*pages, new, slots)
                jax.block_until_ready(pages)
                return time.perf_counter() - start
            run(2)
            n = 1
            while run(n) < 0.02 and n < 4096:
                n *= 2
            row[name] = statistics.median(run(n) / n for _ in range(5)) / WRITE_CHAIN
            del pages
        rows.append(row)
    lines = ["| T tokens | XLA scatter us | Pallas us | Pallas / XLA |", "|---|---|---|---|"]
    lines += [f"| {r['T']} | {r['xla scatter'] * 1e6:.1f} | {r['pallas'] * 1e6:.1f} "
              f"| {r['pallas'] / r['xla scatter']:.2f} |" for r in rows]
    return "\n".join(lines)


def _sort_key(seconds):
    return seconds if isinstance(seconds, float) else float("inf")


def _tiling_name(tiling):
    return "C{tokens_per_step}/sp{num_splits}/w{num_warps}/st{num_stages}".format(**tiling)


def copy_bandwidth():
    x = jax.random.normal(jax.random.key(0), (2 ** 30,), jnp.bfloat16)  # 2 GiB
    seconds = median_seconds(jax.jit(lambda x: x + 1), [(x,)])
    return 2 * x.size * x.dtype.itemsize / seconds


def matmul_rate():
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    return 2 * 8192 ** 3 / median_seconds(jax.jit(jnp.dot), [(a, b)])


def format_decode(rows, bandwidth):
    lines = ["| B | context | S | ours us | ours GB/s | % copy BW | best tiling | best us | best % "
             "| jax bundled us | reference us |", "|" + "---|" * 11]
    for row in rows:
        timings = {k: v for k, v in row.items() if k.startswith("ours") and isinstance(v, float)}
        best = min(timings, key=timings.get)
        gbps = row["bytes"] / row["ours"] / 1e9
        lines.append(
            f"| {row['B']} | {row['context']} | {row['S']} | {row['ours'] * 1e6:.1f} | {gbps:.0f} "
            f"| {100 * gbps * 1e9 / bandwidth:.0f}% | {_tiling_name(row['tilings'][best])} "
            f"| {timings[best] * 1e6:.1f} "
            f"| {100 * row['bytes'] / timings[best] / bandwidth:.0f}% "
            f"| {us(row.get('jax bundled'))} | {us(row.get('reference'))} |")
    return "\n".join(lines)


def versions():
    import jaxlib
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = jax.devices()[0]
    return (f"device: {device.device_kind} ({jax.default_backend()}); date: "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; jax {jax.__version__}, "
            f"jaxlib {jaxlib.__version__}, triton {triton_version}, python {platform.python_version()}")


PARTS = ("cases", "decode", "sweep", "cudnn", "torch", "prefill", "write")


def decode_plan(parts):
    plan = []
    if "sweep" in parts:
        plan += [(b, c, 16, [{}] + sweep_variants(b, c), True)
                 for b, c in DECODE_CASES]
    if "cases" in parts and not {"decode", "sweep"} & set(parts):  # default tiling only
        plan += [(b, c, 16, DECODE_VARIANTS[:1], True) for b, c in DECODE_CASES]
    if "decode" in parts:
        if "sweep" not in parts:
            plan += [(b, c, 16, DECODE_VARIANTS, True) for b, c in DECODE_CASES]
        plan += [(b, c, 16, DECODE_VARIANTS[:1], True) for b, c in DECODE_GRID
                 if (b, c) not in DECODE_CASES]
        plan += [(*PAGE_SIZE_CASE, s, DECODE_VARIANTS[:1], False) for s in (32, 64, 128)]
    return plan


def cudnn_table(bandwidth, deadline):
    cells = []
    for batch, context in DECODE_CASES:
        if time.time() > deadline:
            break
        fn, arg_sets = contiguous_setup(jax.random.key(7), batch, context)
        seconds = or_error(lambda: median_seconds(fn, arg_sets) / CHAIN)
        num_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
        cells.append(f"| {batch} | {context} | " + (
            f"{seconds * 1e6:.1f} us, {100 * num_bytes / seconds / bandwidth:.0f}%"
            if isinstance(seconds, float) else seconds) + " |")
        del arg_sets
    return "| B | context | time, % copy BW |\n|---|---|---|\n" + "\n".join(cells)


def main():
    global CHAIN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown tables here")
    parser.add_argument("--budget-seconds", type=float, default=300,
                        help="stop starting new cases after this long (tables stay partial)")
    parser.add_argument("--chain", type=int, default=4,
                        help="dependent kernel calls per jitted dispatch (amortizes host dispatch)")
    parser.add_argument("--parts", default="decode,cudnn,torch,prefill,write",
                        help=f"comma-separated subset of {PARTS}; cases: DECODE_CASES at the "
                             "default tiling; sweep: many tilings per decode case")
    parser.add_argument("--prefill-backends", default=None,
                        help="comma list of prefill kernels to time side by side: triton, or a "
                             "pallas_kernels backend name (default: "
                             f"{','.join(kernels_prefill.default_backends())}); one that cannot "
                             "run here is skipped with its reason")
    parser.add_argument("--prefill-tilings", default="",
                        help="also time Triton prefill tilings per case and report the best: "
                             "'sweep' (kernels_prefill.TILING_SWEEP) or a comma list like "
                             "bq16/c64/w4/st3 (block_q, tokens_per_step, num_warps, num_stages)")
    parser.add_argument("--prefill-cases", default=",".join(
                            map(str, range(len(kernels_prefill.PREFILL_CASES)))),
                        help="comma list of indices into kernels_prefill.PREFILL_CASES")
    args = parser.parse_args()
    CHAIN = args.chain
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    try:
        prefill_tilings = kernels_prefill.tilings_from_option(args.prefill_tilings)
    except ValueError as error:
        parser.error(str(error))
    try:
        prefill_cases = [kernels_prefill.PREFILL_CASES[int(i)]
                         for i in args.prefill_cases.split(",")]
    except (ValueError, IndexError):
        parser.error(f"--prefill-cases: indices below {len(kernels_prefill.PREFILL_CASES)}")
    prefill_backends = (args.prefill_backends.split(",") if args.prefill_backends
                        else kernels_prefill.default_backends())
    deadline = time.time() + args.budget_seconds
    sections = [versions()]
    bandwidth, matmul_flops = copy_bandwidth(), matmul_rate()
    sections.append(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s; "
                    f"bf16 matmul 8192^3: {matmul_flops / 1e12:.0f} TFLOP/s")
    print("\n".join(sections), flush=True)
    decode_rows = []
    for batch, context, block_size, variants, with_peers in decode_plan(parts):
        if time.time() > deadline:
            sections.append(f"(budget reached: decode cases after B={batch} context={context} skipped)")
            break
        row = decode_row(jax.random.key(batch * context), batch, context, block_size, bandwidth,
                         variants, with_peers)
        decode_rows.append(row)
        print(format_decode([row], bandwidth).splitlines()[-1], flush=True)
    if decode_rows:
        sections += ["## Decode (H=32, K=8, D=128, bf16; S=16 unless noted)",
                     format_decode(decode_rows, bandwidth)]
    sections.insert(1, f"{CHAIN} dependent calls per jitted dispatch")
    if "sweep" in parts:
        sections += ["## Decode tiling sweep (decode cases, fastest first)",
                     format_sweep(decode_rows[:len(DECODE_CASES)])]
    if "cudnn" in parts:
        sections += ["## cuDNN decode on a contiguous cache (jax.nn.dot_product_attention)",
                     cudnn_table(bandwidth, deadline)]
    if "torch" in parts:
        available, version = torch_peers.torch_available()
        sections += [f"## torch peers in the same process (torch {version})",
                     torch_peers.peer_table(DECODE_CASES, PREFILL_CASES) if available
                     else f"(not run: {version})"]
    if "write" in parts:
        sections += ["## Cache write, one layer (K=8, D=128, bf16, 32768 blocks of 16)",
                     cache_write_rows()]
    if "prefill" in parts:
        sections += kernels_prefill.prefill_sections(prefill_backends, prefill_tilings,
                                                     deadline + 60, cases=prefill_cases)
    text = "\n\n".join(sections)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
