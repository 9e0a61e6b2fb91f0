"""Runs in a subprocess for tests/test_families.py, on forced CPU devices (the pytest process's
JAX backend started with one): each checkpoint's greedy tokens from one engine that uses every
engine feature at once.

python -m tests.families_worker TENSOR_PARALLEL_SIZE [--expert-parallel] CHECKPOINT...
    per checkpoint: tensor parallelism over TENSOR_PARALLEL_SIZE devices, prefix caching (the
    prompts share a 12-token prefix), recompute preemption (a pool too small for the batch),
    multi-step decode (4 steps per loop) and chunked prefill (a 16-token budget), blocks of 4
    tokens (windows of 8 span blocks). Prints one JSON line: {checkpoint: {"tokens", "stats"}}.
"""

import json
import sys

import numpy as np

MAX_TOKENS = 8
ENGINE_OPTIONS = dict(num_kv_blocks=12, block_size=4, max_model_len=64, max_num_seqs=4,
                      max_num_batched_tokens=16, num_scheduler_steps=4,
                      enable_prefix_caching=True, preemption_mode="recompute", warmup=False)
STATS = ("num_preemptions", "prefix_cache_hit_rate", "num_free_blocks", "num_kv_blocks")


def prompts(vocab_size: int = 320) -> list[list[int]]:
    """Four prompts of 13 to 21 tokens sharing their first 12 (all within Phi-3's fixture's
    original_max_position_embeddings with MAX_TOKENS generated)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(2, vocab_size, 12).tolist()
    return [shared + rng.integers(2, vocab_size, n).tolist() for n in (3, 9, 6, 1)]


def run(checkpoint: str, tensor_parallel_size: int, expert_parallel: bool = False) -> dict:
    from jpaged import LLM, SamplingParams

    llm = LLM(checkpoint, tensor_parallel_size=tensor_parallel_size,
              enable_expert_parallel=expert_parallel, **ENGINE_OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts(), sampling_params=params, use_tqdm=False)
    stats = llm.stats()
    return {"tokens": [o.outputs[0].token_ids for o in outputs],
            "stats": {name: stats[name] for name in STATS}}


def main(argv) -> None:
    tensor_parallel_size, checkpoints = int(argv[0]), argv[1:]
    expert_parallel = checkpoints[:1] == ["--expert-parallel"]
    checkpoints = checkpoints[expert_parallel:]
    print(json.dumps({path: run(path, tensor_parallel_size, expert_parallel)
                      for path in checkpoints}))


if __name__ == "__main__":
    main(sys.argv[1:])
