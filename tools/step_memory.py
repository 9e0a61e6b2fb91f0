"""XLA's memory analysis of the compiled step programs for a model preset with random weights.

Prints, for a decode loop and a mixed step, the argument, output, aliased (donated) and
temporary bytes next to the KV pool and weight sizes, to check that the donated cache is updated
in place and that KV sizing leaves room for the temporaries.
    python tools/step_memory.py --model llama3-8b --num-kv-blocks 4096 --batch 64 --tokens 512
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged.engine import device_step  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.engine.builder import build_engine_config  # noqa: E402
from jpaged.engine.executor import Executor  # noqa: E402
from jpaged.models.llama import LlamaForCausalLM  # noqa: E402
from jpaged.sampling import SamplingRow  # noqa: E402
from jpaged.sampling_params import SamplingParams  # noqa: E402


def analyse(lowered, label, kv_bytes, weight_bytes):
    stats = lowered.compile().memory_analysis()
    gb = 1e9
    print(f"{label}: arguments {stats.argument_size_in_bytes / gb:.2f} GB, outputs "
          f"{stats.output_size_in_bytes / gb:.2f} GB, aliased {stats.alias_size_in_bytes / gb:.2f}"
          f" GB, temporaries {stats.temp_size_in_bytes / gb:.2f} GB (KV pool {kv_bytes / gb:.2f}"
          f" GB, weights {weight_bytes / gb:.2f} GB)", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args(argv)
    config = ModelConfig.preset(args.model)
    model = LlamaForCausalLM(config, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    config = build_engine_config(model, num_kv_blocks=args.num_kv_blocks, block_size=16,
                                 max_num_seqs=args.batch, max_model_len=args.max_model_len,
                                 max_num_batched_tokens=args.tokens, kv_cache_dtype=args.dtype,
                                 attention_backend=args.attention_backend,
                                 preemption_mode="recompute")
    backend, interpret = config.attention_backend, config.interpret
    runner = Executor(model, config)
    kv_bytes = sum(x.nbytes for x in runner.cache.k_pages + runner.cache.v_pages)
    weight_bytes = sum(x.nbytes for x in runner.param_leaves)
    pad = SamplingRow(SamplingParams(temperature=0.0), 0, 0, 0)
    packed, layout = device_step.pack(runner._build_inputs([(-1, [0] * args.tokens)],
                                                           [(0, pad)])[0])
    static = dict(model_def=runner.model_def, backend=backend, interpret=interpret)
    analyse(device_step.step_program(args.tokens).lower(
        runner.param_leaves, runner.manager, runner.cache, jax.device_put(packed),
        layout=layout, is_decode=False, num_logprobs=0, **static),
        f"mixed step, {args.tokens} tokens", kv_bytes, weight_bytes)
    launched = runner.launch_decode([(-1, 0)] * args.batch, [pad] * args.batch,
                                    [0] * args.batch, [[]] * args.batch, 1, 8,
                                    args.max_model_len, 0)
    analyse(device_step.decode_loop(args.batch).lower(
        runner.param_leaves, runner.manager, runner.cache, launched.packed,
        layout=launched.layout, **launched.static, **static),
        f"decode loop, batch {args.batch}", kv_bytes, weight_bytes)


if __name__ == "__main__":
    main()
