"""`make run`: the main job on the built-in default model (for now: the KV-cache arithmetic demo
plus a functional block-manager walk-through, until the engine lands)."""

import sys

import jax.numpy as jnp

from jpaged import memory
from jpaged.config import ModelConfig
from jpaged.kv_cache import kv_footprint


def main() -> int:
    for name in ("llama3-8b", "llama3-70b"):
        numbers = kv_footprint(ModelConfig.preset(name), tokens=4096, block_size=16,
                               dtype="bfloat16", users=128, shared_prefix=1000)
        print(f"{name}: {numbers['bytes_per_token']:,} B/token, "
              f"{numbers['bytes_per_block']:,} B/block, "
              f"{numbers['blocks_per_sequence']} blocks for 4096 tokens, 128 users sharing a "
              f"1000-token prompt: {numbers['prefix_bytes_unshared'] / 1e9:.1f} GB unshared vs "
              f"{numbers['prefix_bytes_shared'] / 1e9:.2f} GB shared")
    state = memory.init_state(num_blocks=9, block_size=16, max_seqs=4, max_blocks_per_seq=4)
    state, result = memory.allocate_prompt(state, jnp.array([0]), jnp.array([40]),
                                           max_prompt_len=64)
    state = memory.fork_seqs(state, jnp.array([0, 0]), jnp.array([1, 2]))
    state, _, copies, ok = memory.append_one(state, jnp.array([0, 1, 2]))
    print(f"40-token prompt forked into 3 samples, one decode step each: ok={bool(ok)}, "
          f"copy-on-write copies {[tuple(c) for c in copies.tolist() if c[0] >= 0]}, "
          f"{int(state.num_free)} of 8 blocks free")
    return 0


if __name__ == "__main__":
    sys.exit(main())
