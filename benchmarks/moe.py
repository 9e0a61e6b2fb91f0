"""Times a mixture-of-experts MLP layer three ways at a preset's shapes: jpaged's grouped
matmuls (`jpaged.models.moe.SparseMoE`: tokens sorted by expert, one grouped matmul per
projection, the Pallas grouped matmul on a GPU as the engine's GPU backends run it, beside the
same layer on `jax.lax.ragged_dot`), the dense per-expert loop (every token through every expert,
weighted by its routing weight or zero), and the grouped gate/up matmul alone: `jax.lax.ragged_dot`
and the Pallas grouped matmul (`pallas_kernels.gpu.grouped_matmul`, on a GPU), against a plain
matmul of the same shape and against reading the routed experts' gate/up weights. On a GPU the
Pallas kernel is also timed at each number of parts of its reduction (`--splits`), both
projections, beside the number it chooses.

Usage (on the GPU machine, from the repository root):
    PYTHONPATH=. python3 benchmarks/moe.py --out /tmp/moe.md [--model qwen3-30b-a3b]
        [--tokens 1,8,64,256,2048,8192] [--dense-max-tokens 2048]

Method. bf16 weights drawn normal (std 0.02, the dummy load's) and a router of the same scale, so
tokens spread over the experts as they do at random. Per case and variant: fresh random inputs
(three rotating sets), each checked against a float32 per-expert computation of the same routing
(relative error of the layer's output) before it is timed; time per call = median over repeats of
(wall time of n dispatches, then one block) / n (`timing.median_dispatch_seconds`). Rates: the
ragged matmul's FLOPs (2 x T x k x E x 2F for gate/up) over its time, beside the same product as
one dense [T x k, E] x [E, 2F] matmul and an 8192^3 matmul measured in the same run. Bytes: each
expert a token was routed to has its three matrices read once; the layer's floor is those bytes
over the copy bandwidth measured in the same run (a 4 GiB XLA elementwise pass).
"""

import argparse
import datetime
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import roofline, timing  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.models.moe import SparseMoE  # noqa: E402
from pallas_kernels.gpu import grouped_matmul  # noqa: E402
from pallas_kernels.row_ops import ACTIVATIONS  # noqa: E402

ROTATIONS = 3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b",
                        help="a mixture-of-experts preset, or a config.json path")
    parser.add_argument("--tokens", default="1,8,64,256,2048,8192",
                        help="tokens per layer call, comma-separated")
    parser.add_argument("--dense-max-tokens", type=int, default=2048,
                        help="largest token count the dense per-expert loop is timed at")
    parser.add_argument("--splits", default=[1, 2, 4, 8],
                        type=lambda text: [int(parts) for parts in text.split(",")],
                        help="numbers of parts of the Pallas kernel's reduction to time (GPU)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    return parser.parse_args(argv)


def build_layer(config: ModelConfig, dtype) -> tuple:
    """(graphdef, state) of one SparseMoE layer with random weights."""
    layer = SparseMoE(config, dtype=dtype, rngs=nnx.Rngs(0))
    return nnx.split(layer)


def grouped(graphdef, backend: str):
    """The layer as a step of `backend` runs it (its grouped matmul: `SparseMoE.__call__`)."""
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, backend=backend))


def dense_loop(graphdef):
    """Every token through every expert, each output weighted by the token's routing weight
    for that expert (zero when not routed): X full-size products."""
    def run(state, x):
        layer = nnx.merge(graphdef, state)
        expert_ids, weights = layer.route(x)                               # [T, k]
        dense_weights = jnp.zeros((x.shape[0], layer.num_experts), weights.dtype)
        dense_weights = dense_weights.at[jnp.arange(x.shape[0])[:, None], expert_ids].set(
            weights)                                                       # [T, X]
        gate_up, down = layer.experts.gate_up_proj[...], layer.experts.down_proj[...]

        def one_expert(total, expert):
            gate, up = jnp.split(x @ gate_up[expert], 2, axis=-1)
            out = (ACTIVATIONS[layer.activation](gate) * up) @ down[expert]
            return total + (out * dense_weights[:, expert, None]).astype(x.dtype), None

        total, _ = jax.lax.scan(one_expert, jnp.zeros_like(x), jnp.arange(layer.num_experts))
        return total
    return jax.jit(run)


def reference(graphdef, state, x) -> np.ndarray:
    """The layer in float32 on the same routing, one expert at a time (numpy)."""
    layer = nnx.merge(graphdef, state)
    expert_ids, weights = (np.asarray(a, np.float32) for a in layer.route(x))
    expert_ids = expert_ids.astype(np.int64)
    x32 = np.asarray(x.astype(jnp.float32))
    gate_up = np.asarray(layer.experts.gate_up_proj[...].astype(jnp.float32))
    down = np.asarray(layer.experts.down_proj[...].astype(jnp.float32))
    out = np.zeros_like(x32)
    for expert in np.unique(expert_ids):
        tokens, slot = np.nonzero(expert_ids == expert)
        gate, up = np.split(x32[tokens] @ gate_up[expert], 2, axis=-1)
        hidden = gate / (1 + np.exp(-gate)) * up
        out[tokens] += (hidden @ down[expert]) * weights[tokens, slot, None]
    return out


def relative_error(got, expected) -> float:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32))
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


def ragged_only(graphdef, state, x):
    """(the gate/up ragged matmul jitted, its inputs): the rows sorted by expert as the layer
    sorts them."""
    layer = nnx.merge(graphdef, state)
    expert_ids, _ = layer.route(x)
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat)
    rows = jnp.take(x, order // layer.top_k, axis=0)
    sizes = jnp.bincount(flat, length=layer.num_experts).astype(jnp.int32)
    fn = jax.jit(lambda rows, weights, sizes: jax.lax.ragged_dot(rows, weights, sizes))
    return fn, (rows, layer.experts.gate_up_proj[...], sizes), int((np.asarray(sizes) > 0).sum())


def layer_down(graphdef, state):
    """The layer's down-projection weights [X, F, E]."""
    return nnx.merge(graphdef, state).experts.down_proj[...]


def split_sweep(ragged_args, down_proj, splits) -> dict:
    """{(projection, parts): seconds} of the Pallas grouped matmul on the sorted rows, gate/up
    and down (its rows: the first F columns of the gate/up rows' product, any values do), at
    each number of parts of the reduction and at the kernel's own choice (parts None)."""
    rows, gate_up_proj, sizes = ragged_args
    hidden = jnp.zeros((rows.shape[0], down_proj.shape[1]), rows.dtype) + rows[:, :1]
    cases = {"gate/up": (rows, gate_up_proj, sizes), "down": (hidden, down_proj, sizes)}
    out = {}
    for projection, operands in cases.items():
        for parts in (None, *splits):
            fn = jax.jit(lambda *a, parts=parts: grouped_matmul.grouped_matmul(*a, splits=parts))
            out[projection, parts] = timing.or_error(lambda: timing.median_dispatch_seconds(
                fn, [operands], wait=jax.block_until_ready))
        num_rows, num_in = operands[0].shape
        out[projection, "chosen"] = grouped_matmul.num_splits(
            num_rows, operands[1].shape[0], num_in, operands[1].shape[2])
    return out


def _time_cell(seconds) -> str:
    """A time in us, or the error that stood in for it."""
    return f"{timing.us(seconds)} us" if isinstance(seconds, float) else timing.us(seconds)


def split_table(rows, splits) -> str:
    """The split sweep's table: per token count and projection, time at each number of parts."""
    lines = ["", "The Pallas grouped matmul's reduction in parts: time per number of parts, and "
             "the kernel's own choice (`num_splits`).", "",
             "| tokens | projection | chosen parts | chosen | "
             + " | ".join(f"{parts} parts" for parts in splits) + " |",
             "|" + "---|" * (4 + len(splits))]
    for row in rows:
        for projection in ("gate/up", "down"):
            sweep = row["splits"]
            cells = [_time_cell(sweep[projection, parts]) for parts in (None, *splits)]
            lines.append(f"| {row['tokens']:,} | {projection} | {sweep[projection, 'chosen']} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_case(config, graphdef, state, num_tokens: int, args, dtype) -> dict:
    experts = config.experts
    hidden, inter, k = config.hidden_size, experts.moe_intermediate_size, experts.num_experts_per_tok
    keys = jax.random.split(jax.random.key(num_tokens), ROTATIONS)
    inputs = [jax.random.normal(key, (num_tokens, hidden), dtype) for key in keys]
    row = {"tokens": num_tokens}
    on_gpu = jax.default_backend() == "gpu"
    variants = {"grouped": grouped(graphdef, "pallas_gpu" if on_gpu else "reference")}
    if on_gpu:
        variants["ragged layer"] = grouped(graphdef, "reference")
    if num_tokens <= args.dense_max_tokens:
        variants["dense loop"] = dense_loop(graphdef)
    for name, fn in variants.items():
        expected = reference(graphdef, state, inputs[0])
        row[f"{name} error"] = relative_error(fn(state, inputs[0]), expected)
        row[f"{name} s"] = timing.or_error(lambda: timing.median_dispatch_seconds(
            fn, [(state, x) for x in inputs], wait=jax.block_until_ready))
    fn, ragged_args, used = ragged_only(graphdef, state, inputs[0])
    row["experts used"] = used
    row["ragged s"] = timing.median_dispatch_seconds(fn, [ragged_args],
                                                     wait=jax.block_until_ready)
    if jax.default_backend() == "gpu":   # the interpreter elsewhere: no timing to report
        sizes = ragged_args[2]
        pallas = jax.jit(grouped_matmul.grouped_matmul)
        defined = int(np.asarray(sizes).sum())
        out = timing.or_error(lambda: pallas(*ragged_args))
        if isinstance(out, str):   # it did not compile: the cell says why
            row["pallas s"] = out
        else:
            row["pallas error"] = relative_error(
                out[:defined], np.asarray(fn(*ragged_args)[:defined], np.float32))
            row["pallas s"] = timing.or_error(lambda: timing.median_dispatch_seconds(
                pallas, [ragged_args], wait=jax.block_until_ready))
        row["splits"] = split_sweep(ragged_args, layer_down(graphdef, state), args.splits)
    rows = num_tokens * k
    a = jax.random.normal(keys[0], (rows, hidden), dtype)
    b = jax.random.normal(keys[1], (hidden, 2 * inter), dtype)
    row["matmul s"] = timing.median_dispatch_seconds(jax.jit(jnp.matmul), [(a, b)],
                                                     wait=jax.block_until_ready)
    row["ragged flops"] = 2 * rows * hidden * 2 * inter
    row["weight bytes"] = used * 3 * hidden * inter * jnp.dtype(dtype).itemsize
    row["gate/up bytes"] = used * 2 * hidden * inter * jnp.dtype(dtype).itemsize
    return row


def _ragged_layer_cells(row) -> str:
    """The layer on ragged_dot (timed on a GPU, where the layer's own is the Pallas kernel)."""
    ragged, grouped_s = row.get("ragged layer s"), row["grouped s"]
    if not isinstance(ragged, float):
        return f"{timing.us(ragged) if ragged else '-'} | - |"
    ratio = f"{grouped_s / ragged:.2f}x" if isinstance(grouped_s, float) else "-"
    return f"{timing.us(ragged)} us | {ratio} |"


def table(rows, bandwidth: float, matmul_flops: float) -> str:
    header = ("| tokens | experts used | grouped | dense loop | grouped / dense | floor (weights "
              "read) | grouped / floor | ragged gate/up TFLOP/s | same as one matmul | error "
              "grouped / dense | layer on ragged_dot | grouped / ragged_dot |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        grouped_s, dense_s = row["grouped s"], row.get("dense loop s")
        floor = row["weight bytes"] / bandwidth
        ratio = (f"{grouped_s / dense_s:.2f}x" if isinstance(dense_s, float)
                 and isinstance(grouped_s, float) else "-")
        lines.append(
            f"| {row['tokens']:,} | {row['experts used']} | {timing.us(grouped_s)} us | "
            f"{timing.us(dense_s)}{' us' if isinstance(dense_s, float) else ''} | {ratio} | "
            f"{floor * 1e6:.1f} us | "
            f"{grouped_s / floor if isinstance(grouped_s, float) else float('nan'):.2f}x | "
            f"{row['ragged flops'] / row['ragged s'] / 1e12:.1f} | "
            f"{row['ragged flops'] / row['matmul s'] / 1e12:.1f} | "
            f"{row['grouped error']:.1e} / "
            f"{format(row['dense loop error'], '.1e') if 'dense loop error' in row else '-'} | "
            + _ragged_layer_cells(row))
    if any("pallas s" in row for row in rows):
        lines += ["", "The gate/up grouped matmul alone: `jax.lax.ragged_dot` against the Pallas "
                  "grouped matmul; floor: the routed experts' gate/up weights read once.", "",
                  "| tokens | ragged | Pallas | Pallas / ragged | floor | Pallas / floor | "
                  "Pallas TFLOP/s | Pallas error vs ragged |", "|---|---|---|---|---|---|---|---|"]
        for row in rows:
            pallas_s, floor = row.get("pallas s"), row["gate/up bytes"] / bandwidth
            if isinstance(pallas_s, float):
                over_ragged = f"{pallas_s / row['ragged s']:.2f}x"
                over_floor = f"{pallas_s / floor:.2f}x"
                rate = f"{row['ragged flops'] / pallas_s / 1e12:.1f}"
                pallas = f"{timing.us(pallas_s)} us"
            else:
                over_ragged = over_floor = rate = "-"
                pallas = timing.us(pallas_s)
            lines.append(
                f"| {row['tokens']:,} | {timing.us(row['ragged s'])} us | {pallas} | "
                f"{over_ragged} | {floor * 1e6:.1f} us | {over_floor} | {rate} | "
                f"{row.get('pallas error', float('nan')):.1e} |")
    splits = sorted({parts for row in rows for (_, parts) in row.get("splits", {})
                     if isinstance(parts, int)})
    if splits:
        lines.append(split_table([row for row in rows if "splits" in row], splits))
    lines.append(f"\nceilings in this run: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul "
                 f"{matmul_flops / 1e12:.0f} TFLOP/s")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    config = (ModelConfig.from_json(args.model) if args.model.endswith(".json")
              else ModelConfig.preset(args.model))
    if config.experts is None:
        raise SystemExit(f"{args.model} is not a mixture-of-experts preset")
    dtype = jnp.dtype(args.dtype)
    on_gpu = jax.default_backend() == "gpu"
    bandwidth = roofline.copy_bandwidth(4 << 30 if on_gpu else 64 << 20)["best"]
    matmul_flops = roofline.matmul_rate(8192 if on_gpu else 512)
    graphdef, state = build_layer(config, dtype)
    rows = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        rows.append(time_case(config, graphdef, state, num_tokens, args, dtype))
        print(rows[-1], flush=True)
    experts = config.experts
    text = "\n".join([
        f"# Mixture-of-experts layer, {args.model} shapes ({experts.num_local_experts} experts, "
        f"top {experts.num_experts_per_tok}, hidden {config.hidden_size}, expert size "
        f"{experts.moe_intermediate_size}), {dtype.name}",
        f"device {jax.devices()[0].device_kind}, {datetime.date.today()}, jax {jax.__version__}, "
        f"Python {platform.python_version()}",
        f"command: `PYTHONPATH=. python3 benchmarks/moe.py {' '.join(argv or sys.argv[1:])}`", "",
        table(rows, bandwidth, matmul_flops)])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
