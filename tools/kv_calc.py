"""KV-cache calculator: per-token/per-block bytes, blocks per sequence, shared-prefix savings.

    python tools/kv_calc.py --model llama3-70b --tokens 4096 --dtype bf16 --users 128 \
        --shared-prefix 1000
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged.config import ModelConfig, normalize_dtype  # noqa: E402
from jpaged.kv_cache import kv_footprint  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b",
                        help="a preset under configs/models/ (e.g. llama3-70b) or a config.json "
                             "path or a Hugging Face model directory")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in one sequence")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--dtype", default="bfloat16", help="KV dtype: bfloat16/bf16, float16, float32")
    parser.add_argument("--users", type=int, default=1, help="sequences sharing the prefix")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens of the shared prompt")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return parser.parse_args(argv)


def load_config(model: str) -> ModelConfig:
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return ModelConfig.from_json(path)
    return ModelConfig.preset(model)


def format_report(model: str, dtype: str, numbers: dict, args) -> str:
    gb = 1e9
    return "\n".join([
        f"model {model}, KV dtype {dtype}, block size {args.block_size}",
        f"  per token          {numbers['bytes_per_token']:>16,d} B",
        f"  per block          {numbers['bytes_per_block']:>16,d} B",
        f"  blocks for {args.tokens} tokens: {numbers['blocks_per_sequence']:,d} "
        f"({numbers['sequence_bytes_paged'] / gb:.3f} GB)",
        f"  {args.users} users x {args.shared_prefix}-token prefix: "
        f"{numbers['prefix_bytes_unshared'] / gb:.2f} GB unshared, "
        f"{numbers['prefix_bytes_shared'] / gb:.2f} GB shared "
        f"({numbers['prefix_bytes_shared_paged'] / gb:.2f} GB in whole blocks)",
        f"  weights ({numbers['weight_dtype']}) {numbers['weight_bytes'] / gb:.2f} GB, "
        f"{numbers['active_weight_bytes'] / gb:.2f} GB read per token"
        + (" (its routed experts only)" if numbers["num_experts"] else ""),
    ] + ([f"  {numbers['sliding_layers']} layers slide a {numbers['sliding_window']}-token "
          "window; the cache still holds every token in every layer"]
         if numbers["sliding_layers"] else []))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.model)
        dtype = normalize_dtype(args.dtype)
        numbers = kv_footprint(config, tokens=args.tokens, block_size=args.block_size,
                               dtype=dtype, users=args.users, shared_prefix=args.shared_prefix)
        numbers.update(sliding_layers=config.num_sliding_layers,
                       sliding_window=config.sliding_window if config.num_sliding_layers else None,
                       weight_dtype=config.torch_dtype, weight_bytes=config.weight_bytes(),
                       active_weight_bytes=config.weight_bytes(active=True),
                       num_experts=0 if config.experts is None
                       else config.experts.num_local_experts)
    except (ValueError, FileNotFoundError) as err:
        print(f"kv_calc: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(numbers, indent=2) if args.json else
          format_report(args.model, dtype, numbers, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
