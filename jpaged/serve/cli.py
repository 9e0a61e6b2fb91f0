"""`python -m jpaged.serve`: flags (vLLM's names), engine construction and the uvicorn loop.

The engine runs on its own thread (`async_engine.AsyncEngine`); `app.build_app` holds the routes.
"""

import argparse
import json
from pathlib import Path

from jpaged.engine import LLMEngine
from jpaged.engine.builder import ATTENTION_BACKENDS, PREEMPTION_MODES, default_model_dir
from jpaged.models.loader import LOAD_FORMATS
from jpaged.serve.app import build_app, model_info
from jpaged.serve.async_engine import AsyncEngine
from jpaged.serve.data_parallel import DataParallelEngine

DEFAULT_MODEL_NAME = "jpaged-default"


# ---- flags -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jpaged.serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                    "/health, /metrics) over the jpaged engine. Flags use vLLM's names.")
    add = parser.add_argument
    add("--model", default=None,
        help="model directory: config.json, tokenizer.json and safetensors or an orbax "
             "checkpoint/ folder. Omitted: the built-in default model, a tiny byte-level Llama "
             "trained on the Python standard library (docs/default_model.md)")
    add("--served-model-name", default=None,
        help=f"name clients send as 'model' (default: the --model path, or {DEFAULT_MODEL_NAME})")
    add("--host", default="127.0.0.1", help="address to bind")
    add("--port", type=int, default=8000, help="port to bind")
    add("--block-size", type=int, default=16, help="tokens per KV-cache block")
    add("--num-kv-blocks", type=int, default=None,
        help="KV blocks in the pool (overrides --gpu-memory-utilization sizing)")
    add("--gpu-memory-utilization", type=float, default=0.9,
        help="fraction of accelerator memory for weights + KV cache + activations")
    add("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    add("--max-model-len", type=int, default=None,
        help="longest prompt + output (default: the model's limit)")
    add("--max-num-batched-tokens", type=int, default=None,
        help="most tokens in one step (default: max(2048, block size))")
    add("--preemption-mode", default="auto", choices=PREEMPTION_MODES,
        help="when KV blocks run out, a victim's blocks are swapped to host memory (swap), "
             "dropped and prefilled again later (recompute), or whichever the start-up measured "
             "transfer and prefill rates say is cheaper for that victim (auto)")
    add("--swap-space", type=float, default=4.0,
        help="GiB of host memory for swapped-out KV blocks (0: never swap)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV blocks of prompt prefixes already computed (automatic prefix "
             "caching)")
    add("--load-format", default="auto", choices=LOAD_FORMATS,
        help="auto: the weights in --model; dummy: random weights of the config's shapes "
             "(the directory needs only config.json, plus tokenizer.json for text), for "
             "benchmarks")
    add("--dtype", default="auto", help="weight dtype: auto (the config's), float32, bfloat16, "
                                        "float16")
    add("--kv-cache-dtype", default="auto", help="KV-cache dtype (auto: the weight dtype)")
    add("--seed", type=int, default=0, help="seed for requests that give none")
    add("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
        help="auto: Pallas on GPU/TPU, the jnp reference on CPU")
    add("--num-scheduler-steps", type=int, default=1,
        help="decode steps run on the device per scheduler step (multi-step decoding)")
    add("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
        help="start the next decode loop while the host processes the last one's tokens")
    add("--async-depth", type=int, default=2,
        help="with --async-scheduling, decode loops kept in flight behind the host")
    add("--tensor-parallel-size", type=int, default=1,
        help="devices each engine splits the model and KV cache over (Megatron-style heads and "
             "MLP columns; see docs/parallelism.md)")
    add("--data-parallel-size", type=int, default=1,
        help="independent engine replicas on disjoint groups of --tensor-parallel-size devices; "
             "each request goes to the replica with the most free KV blocks")
    add("--compilation-cache-dir", default=None,
        help="persist compiled steps here so a restart skips compiling (process-wide JAX cache)")
    add("--uvicorn-log-level", default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse flags; a value the engine cannot use exits with an error naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.swap_space < float("inf"):
        parser.error(f"argument --swap-space: must be a non-negative number of GiB, got "
                     f"{args.swap_space}")
    if args.preemption_mode == "swap" and args.swap_space == 0:
        parser.error("argument --preemption-mode: 'swap' needs --swap-space > 0")
    for flag in ("tensor_parallel_size", "data_parallel_size"):
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be at least 1")
    return args


def engine_options(args: argparse.Namespace) -> dict:
    """The LLMEngine.from_pretrained options the flags set."""
    return dict(dtype=args.dtype, load_format=args.load_format, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                num_scheduler_steps=args.num_scheduler_steps,
                async_scheduling=args.async_scheduling, async_depth=args.async_depth,
                compilation_cache_dir=args.compilation_cache_dir,
                preemption_mode=args.preemption_mode, swap_space=args.swap_space,
                enable_prefix_caching=args.enable_prefix_caching,
                tensor_parallel_size=args.tensor_parallel_size)


def build_engine(args: argparse.Namespace, name: str) -> AsyncEngine | DataParallelEngine:
    """One engine, or --data-parallel-size replicas behind one interface."""
    if args.data_parallel_size == 1:
        return AsyncEngine(LLMEngine.from_pretrained(args.model, **engine_options(args)), name)
    return DataParallelEngine.from_pretrained(args.model, name,
                                              data_parallel_size=args.data_parallel_size,
                                              **engine_options(args))


# ---- entry point --------------------------------------------------------------------------------
def banner(host: str, port: int, model_name: str) -> str:
    url = f"http://{host}:{port}"
    body = json.dumps({"model": model_name, "prompt": "import os\n\n\ndef ", "max_tokens": 64,
                       "temperature": 0.7})
    return (f"jpaged: serving {model_name} at {url}  (OpenAI API under {url}/v1)\n"
            f"  try:  curl {url}/v1/completions -H 'Content-Type: application/json' "
            f"-d '{body}'\n"
            f"  also: {url}/v1/chat/completions, {url}/v1/models, {url}/health, {url}/metrics")


def main(argv=None) -> int:
    import uvicorn

    args = parse_args(argv)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    print(banner(args.host, args.port, name), flush=True)
    model_dir = default_model_dir() if args.model is None else Path(args.model)
    async_engine = build_engine(args, name)
    app = build_app(async_engine, model_info(async_engine.engine, model_dir, name))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0

