"""The prefill part of benchmarks/kernels.py: every prefill kernel beside torch SDPA (cuDNN) on
the same cases, in TFLOP/s, and a sweep of the Triton kernel's static tilings.

A case is one ragged batch (query chunks after cached prefixes, decode rows mixed in) on a
random shuffled page pool (H=32, K=8, D=128, bf16, S=16). Each kernel is jitted alone and timed
as kernels.py times everything (median over repeats of n dispatches then one block); torch SDPA
runs on contiguous copies of the same pages (`sdpa_prefill`), so the outputs are compared too.
FLOPs are causal: 4 * D * H * (sum over query rows of the keys each row sees), a row i of a chunk
after p cached tokens seeing p + i + 1 keys (QK^T and PV, 2 FLOPs per multiply-add each).
Kernels by name (--prefill-backends): "triton" is `pallas_kernels.paged_attention_prefill_gpu`;
any other name is a backend of `pallas_kernels.paged_attention_prefill` (`pallas_kernels.BACKENDS`),
skipped with its reason when unknown or when `unsupported_reason` refuses the shape.
"""

import functools
import gc
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks import sdpa_prefill, torch_peers
from benchmarks.timing import median_dispatch_seconds, or_error, us

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, jnp.bfloat16  # Llama-3-8B-like
BLOCK_SIZE = 16
PREFILL_CASES = [("1 x 512, no prefix", [512], [512]),
                 ("1 x 2048, no prefix", [2048], [2048]),
                 ("4 x 512 after 1536 cached", [512] * 4, [2048] * 4),
                 ("512 chunk + 64 decodes at 2048", [512] + [1] * 64, [512] + [2048] * 64),
                 ("1 x 8192, no prefix", [8192], [8192]),
                 ("1 x 32768, no prefix", [32768], [32768]),
                 ("8 x 2048 after 8192 cached", [2048] * 8, [10240] * 8)]
REFERENCE_MAX_TOKENS = 1024  # the jnp reference materializes every sequence's keys in float32
# --prefill-tilings sweep: Triton tilings around the default (block_q 16, i.e. 64 rows at G = 4;
# 64 keys per step; 4 warps; 2 stages).
TILING_SWEEP = ("bq16/c64/w4/st3", "bq16/c32/w4/st3", "bq16/c128/w8/st2", "bq32/c64/w8/st2",
                "bq32/c64/w8/st3", "bq32/c32/w4/st3", "bq64/c64/w8/st2", "bq8/c64/w4/st3")
_TILING = re.compile(r"bq(\d+)/c(\d+)/w(\d+)/st(\d+)")


def causal_flops(query_lens, context_lens, num_heads=NUM_HEADS, head_dim=HEAD_DIM) -> int:
    """4 * D * H * sum over query rows of the keys each row sees (its prefix and itself)."""
    visible = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(query_lens, context_lens))
    return 4 * head_dim * num_heads * visible


def prefill_case(key, query_lens, context_lens, *, num_heads=NUM_HEADS,
                 num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE):
    """Random pool and one ragged batch: (q [T, H, D], k_pages, v_pages [K, N, S, D] with block 0
    unused, block_tables [B, M] shuffled, context_lens [B], query_start_loc [B+1])."""
    query_lens, context_lens = np.asarray(query_lens), np.asarray(context_lens)
    blocks = -(-context_lens // BLOCK_SIZE)
    num_blocks = 1 + int(blocks.sum())
    shape = (num_kv_heads, num_blocks, BLOCK_SIZE, head_dim)
    k_key, v_key, q_key = jax.random.split(key, 3)
    tables = np.zeros((len(blocks), blocks.max()), np.int32)
    physical = np.random.default_rng(0).permutation(np.arange(1, num_blocks))
    for seq, offset in enumerate(np.concatenate([[0], np.cumsum(blocks)[:-1]])):
        tables[seq, :blocks[seq]] = physical[offset:offset + blocks[seq]]
    q = jax.random.normal(q_key, (int(query_lens.sum()), num_heads, head_dim), dtype)
    return (q, jax.random.normal(k_key, shape, dtype), jax.random.normal(v_key, shape, dtype),
            jnp.asarray(tables), jnp.asarray(context_lens, jnp.int32),
            jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]), jnp.int32))


def parse_tiling(name: str) -> dict:
    """"bq16/c64/w4/st2" -> the Triton prefill kernel's block_q, tokens_per_step, num_warps,
    num_stages."""
    match = _TILING.fullmatch(name)
    if match is None:
        raise ValueError(f"tiling {name!r} is not bq<block_q>/c<tokens_per_step>/w<num_warps>/"
                         "st<num_stages>, e.g. bq16/c64/w4/st2")
    return dict(zip(("block_q", "tokens_per_step", "num_warps", "num_stages"),
                    map(int, match.groups())))


def tilings_from_option(value: str) -> list[str]:
    """--prefill-tilings: "" (none), "sweep" (TILING_SWEEP) or a comma list of tiling names."""
    names = [] if not value else list(TILING_SWEEP) if value == "sweep" else value.split(",")
    for name in names:
        parse_tiling(name)
    return names


def default_backends() -> list[str]:
    """The engine's GPU prefill kernel ("triton") plus any Mosaic GPU prefill backend."""
    return ["triton"] + [name for name in pk.BACKENDS if "mosaic" in name]


def resolve_kernels(names, *, interpret=False, head_dim=HEAD_DIM, dtype=DTYPE):
    """({name: kernel(*case args, **tiling)}, [skip reasons]) for --prefill-backends."""
    kernels, skipped = {}, []
    platform_ok = interpret or jax.default_backend() in ("gpu", "cuda", "rocm")
    for name in names:
        backend = "pallas_gpu" if name == "triton" else name
        if backend not in pk.BACKENDS:
            skipped.append(f"{name}: not a pallas_kernels backend ({', '.join(pk.BACKENDS)})")
            continue
        try:
            reason = pk.unsupported_reason(backend, head_dim=head_dim, dtype=dtype,
                                           block_size=BLOCK_SIZE)
        except Exception as error:  # noqa: BLE001 (a backend's own check failing: skip it)
            reason = f"unsupported_reason raised {type(error).__name__}: {error}"
        if reason is None and backend != "reference" and not platform_ok:
            reason = f"needs a GPU, this is {jax.default_backend()}"
        if reason is not None:
            skipped.append(f"{name}: {reason}")
            continue
        if name == "triton":
            kernels[name] = functools.partial(pk.paged_attention_prefill_gpu, interpret=interpret)
        else:
            kernels[name] = functools.partial(pk.paged_attention_prefill, backend=backend,
                                              interpret=interpret)
    return kernels, skipped


def _time_kernel(kernel, args, repeats, **tiling):
    """(seconds per call, output) of jit(kernel) on one case."""
    fn = jax.jit(functools.partial(kernel, **tiling))
    out = jax.block_until_ready(fn(*args))
    return median_dispatch_seconds(fn, [args], wait=jax.block_until_ready,
                                   repeats=repeats), out


def case_row(index, case, kernels, tilings, *, with_torch=True, repeats=5, heads=None):
    """One case: each kernel's seconds, the tilings' seconds, torch SDPA's, and the largest
    difference between each kernel's output and SDPA's."""
    name, query_lens, context_lens = case
    heads = heads or {}
    args = prefill_case(jax.random.key(index), query_lens, context_lens, **heads)
    row = {"case": name, "T": int(sum(query_lens)), "kernels": {}, "tilings": {},
           "flops": causal_flops(query_lens, context_lens, args[0].shape[1], args[0].shape[2])}
    outs = {}
    for kernel_name, kernel in kernels.items():
        if kernel_name == "reference" and row["T"] > REFERENCE_MAX_TOKENS:
            row["kernels"][kernel_name] = f"skipped: T > {REFERENCE_MAX_TOKENS}"
            continue
        result = or_error(lambda: _time_kernel(kernel, args, repeats))
        row["kernels"][kernel_name] = result[0] if isinstance(result, tuple) else result
        if isinstance(result, tuple):
            outs[kernel_name] = result[1]
    for tiling in tilings if "triton" in kernels else []:
        result = or_error(lambda: _time_kernel(kernels["triton"], args, repeats,
                                               **parse_tiling(tiling)))
        row["tilings"][tiling] = result[0] if isinstance(result, tuple) else result
    if with_torch:
        peer = or_error(lambda: sdpa_prefill.run_case(args, query_lens, context_lens,
                                                      repeats=repeats))
        row["sdpa"] = peer
        if isinstance(peer, dict):
            theirs = peer.pop("out")
            row["difference"] = {k: sdpa_prefill.max_difference(out, theirs)
                                 for k, out in outs.items()}
    return row


def _free_between_cases():
    gc.collect()
    if torch_peers.torch_available()[0]:
        import torch
        torch.cuda.empty_cache()


def prefill_rows(deadline, kernels, tilings, *, cases=PREFILL_CASES, with_torch=True,
                 repeats=5, heads=None, log=print):
    """case_row over the cases until the deadline (time.time()); each printed as it is done."""
    rows = []
    for index, case in enumerate(cases):
        if time.time() > deadline:
            log(f"(budget reached: prefill cases from {case[0]!r} on skipped)")
            break
        rows.append(case_row(index, case, kernels, tilings, with_torch=with_torch,
                             repeats=repeats, heads=heads))
        _free_between_cases()
        log(format_prefill(rows[-1:], list(kernels)).splitlines()[-1])
    return rows


def _rate(row, seconds):
    return f"{row['flops'] / seconds / 1e12:.1f}" if isinstance(seconds, float) else "-"


def format_prefill(rows, kernel_names) -> str:
    """| case | T | GFLOP | per kernel: us, TFLOP/s, time / SDPA's, max diff | SDPA ... |"""
    header = ["case", "T", "GFLOP"]
    for name in kernel_names:
        header += [f"{name} us", f"{name} TFLOP/s", f"{name} / SDPA", f"{name} max diff"]
    header += ["SDPA us", "SDPA TFLOP/s", "SDPA backend"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        peer = row.get("sdpa")
        sdpa_seconds = peer["seconds"] if isinstance(peer, dict) else None
        cells = [row["case"], str(row["T"]), f"{row['flops'] / 1e9:.1f}"]
        for name in kernel_names:
            seconds = row["kernels"].get(name)
            ratio = (f"{seconds / sdpa_seconds:.2f}"
                     if isinstance(seconds, float) and sdpa_seconds else "-")
            difference = row.get("difference", {}).get(name)
            cells += [us(seconds), _rate(row, seconds), ratio,
                      "-" if difference is None else f"{difference:.1e}"]
        if isinstance(peer, dict):
            cells += [us(sdpa_seconds), _rate(row, sdpa_seconds),
                      f"{peer['backend']} ({peer['method']})"]
        else:
            cells += [us(peer), "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_tilings(rows) -> str:
    """Per case: the default tiling, the fastest of the sweep, and every tiling fastest first."""
    lines = ["| case | default us (TFLOP/s) | best tiling | best us (TFLOP/s) | best / default "
             "| all, fastest first |", "|---|---|---|---|---|---|"]
    for row in rows:
        default = row["kernels"].get("triton")
        timed = {k: v for k, v in row["tilings"].items() if isinstance(v, float)}
        if isinstance(default, float):
            timed["default"] = default
        order = sorted(timed, key=timed.get)
        best = order[0] if order else None
        failed = [f"{k}: {v}" for k, v in row["tilings"].items() if not isinstance(v, float)]
        cells = [row["case"], f"{us(default)} ({_rate(row, default)})", best or "-",
                 f"{us(timed[best])} ({_rate(row, timed[best])})" if best else "-",
                 f"{timed[best] / default:.2f}" if best and isinstance(default, float) else "-",
                 ", ".join(f"{k} {us(timed[k])}" for k in order)
                 + "".join(f"; {f}" for f in failed)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(skipped, rows) -> str:
    """The table's notes: what is counted and what ran."""
    lines = ["- TFLOP/s count causal FLOPs: 4 * D * H * (sum over query rows of the keys each row "
             "sees); a row i of a chunk after p cached tokens sees p + i + 1 keys.",
             "- SDPA: torch scaled_dot_product_attention on contiguous [B, K, C, D] copies of the "
             "same pages, one call per group of equal (query_len, context_len), cuDNN forced "
             "where it runs (else flash, memory-efficient, math; the column names the backend "
             "that ran); max diff: largest |kernel - SDPA| over the output.",
             "- kernel / SDPA: the kernel's time over SDPA's (below 1: the kernel is faster)."]
    lines += [f"- skipped kernel {reason}" for reason in skipped]
    for row in rows:
        peer = row.get("sdpa")
        if isinstance(peer, dict) and peer["failed"]:
            lines.append(f"- {row['case']}: SDPA backends tried first: "
                         + "; ".join(peer["failed"]))
    return "\n".join(lines)


def prefill_sections(backend_names, tilings, deadline, *, cases=PREFILL_CASES, log=print):
    """kernels.py's prefill part: the markdown sections (table, notes, tilings if asked)."""
    kernels, skipped = resolve_kernels(backend_names)
    for reason in skipped:
        log(f"prefill kernel skipped: {reason}")
    has_torch, torch_version = torch_peers.torch_available()
    rows = prefill_rows(deadline, kernels, tilings, cases=cases, with_torch=has_torch, log=log)
    text = notes(skipped, rows)
    if not has_torch:
        text += f"\n- SDPA not run: {torch_version}"
    with_torch = f"; torch {torch_version}" if has_torch else ""
    sections = [f"## Prefill (H={NUM_HEADS}, K={NUM_KV_HEADS}, D={HEAD_DIM}, bf16, "
                f"S={BLOCK_SIZE}{with_torch})", format_prefill(rows, list(kernels)),
                text]
    if tilings and "triton" in kernels:
        sections += ["## Triton prefill tilings (bq: block_q query tokens per tile, c: "
                     "tokens_per_step, w: num_warps, st: num_stages)", format_tilings(rows)]
    return sections
