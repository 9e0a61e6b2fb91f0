"""The grouped matmul's tile list found by `jnp.searchsorted`'s default device loop ("scan")
against one comparison of tiles with groups ("compare_all", the kernel's since 2026-12-07), at
Qwen3-30B-A3B's shapes: the tile list alone, the gate/up grouped matmul and the whole MoE layer
as the GPU backends run it.

One process per method: the method is forced for every `jnp.searchsorted` call in the process
(the tile list is the only caller in these programs) before anything is traced. Run the two
methods one after the other, alternating, and compare like rows.

Usage (on the GPU machine, from the repository root):
    PYTHONPATH=. python3 -P benchmarks/moe_tile_list.py --search scan --tokens 1,8,64
    PYTHONPATH=. python3 -P benchmarks/moe_tile_list.py --search compare_all --tokens 1,8,64

Prints one JSON line per token count (microseconds per call, `timing.median_dispatch_seconds`
over three rotating inputs for the layer) and a last RESULT line with all of them and whether
the tile list's program holds a while loop.
"""

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search", choices=("scan", "compare_all"), required=True)
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--model", default="qwen3-30b-a3b")
    args = parser.parse_args(argv)
    searchsorted = jnp.searchsorted

    def forced(*args_, method=None, **kwargs):    # whatever method the caller names
        return searchsorted(*args_, method=args.search, **kwargs)
    jnp.searchsorted = forced

    from flax import nnx

    from benchmarks import timing
    from jpaged.config import ModelConfig
    from jpaged.models.moe import SparseMoE
    from pallas_kernels.gpu import grouped_matmul as gm

    config = ModelConfig.preset(args.model)
    graphdef, state = nnx.split(SparseMoE(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    layer = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x, backend="pallas_gpu"))
    lowered = jax.jit(lambda sizes: gm.tile_list(sizes, 64)).lower(
        jnp.zeros(config.experts.num_local_experts, jnp.int32))
    report = {"search": args.search, "while_in_tile_list": "while" in lowered.as_text()}
    wait = jax.block_until_ready
    for num_tokens in [int(n) for n in args.tokens.split(",")]:
        inputs = [jax.random.normal(jax.random.key(i), (num_tokens, config.hidden_size),
                                    jnp.bfloat16) for i in range(3)]
        moe = nnx.merge(graphdef, state)
        expert_ids, _ = moe.route(inputs[0])
        flat = expert_ids.reshape(-1)
        rows = jnp.take(inputs[0], jnp.argsort(flat) // moe.top_k, axis=0)
        sizes = jnp.bincount(flat, length=moe.num_experts).astype(jnp.int32)
        tiles = jax.jit(functools.partial(gm.tile_list, num_rows=rows.shape[0]))
        gate_up = (rows, moe.experts.gate_up_proj[...], sizes)
        report[num_tokens] = {
            "tile_list_us": 1e6 * timing.median_dispatch_seconds(tiles, [(sizes,)], wait=wait),
            "gate_up_us": 1e6 * timing.median_dispatch_seconds(jax.jit(gm.grouped_matmul),
                                                               [gate_up], wait=wait),
            "layer_us": 1e6 * timing.median_dispatch_seconds(
                layer, [(state, x) for x in inputs], wait=wait)}
        print(json.dumps({num_tokens: report[num_tokens]}), flush=True)
    print("RESULT", json.dumps(report))


if __name__ == "__main__":
    main()
