"""Runs in a subprocess for tests/test_update_weights.py, on forced CPU devices (the pytest
process's JAX backend started with one): weight updates of a tensor-parallel engine, and the
engine settings and greedy helper that test shares.

python -m tests.weights_worker CHECKPOINT_A CHECKPOINT_B TENSOR_PARALLEL_SIZE
    an engine on A over TENSOR_PARALLEL_SIZE devices: greedy tokens of A; after update_weights
    with B's host tensors; with B's tensors as jax arrays on one device; with A's own
    get_weights() (sharded jax arrays); the compilation count after each, and whether every
    parameter kept its sharding. Prints one JSON line.
"""

import json
import sys
from pathlib import Path

PROMPTS = [list(range(3, 40)), [7, 8, 9, 10, 11]]   # the first fills two blocks of 16
MAX_TOKENS = 6
ENGINE_OPTIONS = dict(num_kv_blocks=64, max_model_len=64, max_num_seqs=4,
                      enable_prefix_caching=True, warmup=False)


def greedy(llm) -> list[list[int]]:
    from jpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def warm_block_ops(llm):
    """Compile every block operation now (warm-up does so on an accelerator), so a compilation
    counted later is a step's."""
    from jpaged.blocks.ops import OPERATIONS

    for op in OPERATIONS:
        op.warm_up(llm.engine.executor)


def run(checkpoint_a: str, checkpoint_b: str, tensor_parallel_size: int) -> dict:
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from jpaged import LLM

    llm = LLM(checkpoint_a, tensor_parallel_size=tensor_parallel_size, **ENGINE_OPTIONS)
    warm_block_ops(llm)
    shardings = [leaf.sharding for leaf in llm.engine.executor.param_leaves]
    result = {"a": greedy(llm)}
    compilations = [llm.stats()["num_compilations"]]
    own = llm.get_weights()
    b_tensors = load_file(str(Path(checkpoint_b) / "model.safetensors"))
    for key, weights in (("b_numpy", b_tensors),
                         ("b_jax", {n: jnp.asarray(a) for n, a in b_tensors.items()}),
                         ("a_again", own)):
        llm.update_weights(weights)
        result[key] = greedy(llm)
        compilations.append(llm.stats()["num_compilations"])
    result["compilations"] = compilations
    result["sharded_like_before"] = all(
        leaf.sharding == sharding
        for leaf, sharding in zip(llm.engine.executor.param_leaves, shardings))
    return result


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
