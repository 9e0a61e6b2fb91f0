"""Structured outputs on one GPU: decode throughput of a batch with 0%, 25% and 100% of its rows
constrained by a JSON schema, against the unconstrained batch at K = 8 and at K = 1, and what a
constraint costs on the host (compiling it, a step's token masks), for two schemas (SCHEMAS).
Each constrained batch runs twice: its constrained rows inside the K-step decode loop (their
matchers advanced by the loop, the engine's way) and with the batch stepping one token at a
time whenever it holds a constrained row (the way before constrained rows could loop).

The model is a preset (llama3-8b by default) with random weights; its tokenizer is a byte-level
BPE of the preset's vocabulary size trained on the Python standard library's source
(`--tokenizer` reuses one written before): the masks llguidance computes walk a trie of that
size, as they would a real tokenizer's. Every request has a 128-token random prompt and may
generate --max-tokens tokens: unconstrained rows ignore EOS and generate all of them;
constrained rows follow a schema (an object holding an array of exactly 32 items, so they run
long) and end when it is complete. Each batch runs twice through one engine and the second
pass is timed (the first compiled what it needs). Reported per batch: generated tokens,
seconds, tokens/s, the ratio to the unconstrained batch, and the unconstrained rows' own rate
(their tokens over the time the last of them finished) against that of the unconstrained
batch: what constrained rows beside them cost them.

Usage: python benchmarks/structured.py --model llama3-8b --out-dir results/
"""

import argparse
import dataclasses
import gc
import json
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jpaged import LLMEngine, SamplingParams, StructuredOutputsParams  # noqa: E402
from jpaged.config import ModelConfig  # noqa: E402
from jpaged.models.llama import LlamaForCausalLM  # noqa: E402
from jpaged.structured_outputs import ConstraintCompiler, allowed_masks  # noqa: E402

SCHEMAS = {
    # Enum items: masks llguidance computes from its precomputed token classes (fast).
    "enum": {"type": "object", "additionalProperties": False, "required": ["id", "items"],
             "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                            "items": {"type": "array", "minItems": 32, "maxItems": 32,
                                      "items": {"enum": ["red", "green", "blue", "cyan"]}}}},
    # Strings of at most 6 characters: inside one, every token's length is checked (a walk of
    # the whole vocabulary per mask).
    "bounded strings": {"type": "object", "additionalProperties": False,
                        "required": ["id", "items"],
                        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                       "items": {"type": "array", "minItems": 32,
                                                 "maxItems": 32,
                                                 "items": {"type": "string", "minLength": 1,
                                                           "maxLength": 6}}}}}


def train_tokenizer(vocab_size: int, path: Path) -> tokenizers.Tokenizer:
    """A byte-level BPE of vocab_size tokens (the last one EOS) trained on the standard
    library's .py files, written to path."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = (path.read_bytes().decode("utf-8", "replace") for path in files)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|end_of_text|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:   # a corpus too small for every merge: reserved tokens fill the vocabulary
        tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    path.write_text(tokenizer.to_str())
    return tokenizer


def run_batch(engine, prompts, params_list, tag) -> dict:
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"{tag}-{index}", prompt_token_ids=prompt, params=params)
    before = engine.num_generated_tokens
    compile_before = engine.executor.compile_seconds
    start = time.perf_counter()
    texts, finish, ended, counts = {}, {}, {}, {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                texts[output.request_id] = output.outputs[0].text
                finish[output.request_id] = output.outputs[0].finish_reason
                ended[output.request_id] = time.perf_counter() - start
                counts[output.request_id] = len(output.outputs[0].token_ids)
    wall = time.perf_counter() - start
    plain = [i for i, params in enumerate(params_list) if params.structured_outputs is None]
    plain_rate = (sum(counts[f"{tag}-{i}"] for i in plain)
                  / max(ended[f"{tag}-{i}"] for i in plain)) if plain else None
    return dict(tokens=engine.num_generated_tokens - before, wall=wall,
                compile=engine.executor.compile_seconds - compile_before, texts=texts,
                finish=finish, plain_rate=plain_rate)


def host_costs(tokenizer, vocab_size: int, eos_ids, schema: dict, rows: int) -> dict:
    """Compile time of schema (cold, then cached) and the mask time of `rows` rows at once,
    the rows walked forward with allowed tokens."""
    compiler = ConstraintCompiler(tokenizer, vocab_size, eos_ids)
    params = StructuredOutputsParams(json=schema)
    start = time.perf_counter()
    compiler.constraint(StructuredOutputsParams(regex="a"))   # the tokenizer's one-time build
    tokenizer_seconds = time.perf_counter() - start
    start = time.perf_counter()
    compiler.constraint(params)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    constraints = [compiler.constraint(params) for _ in range(rows)]
    cached = (time.perf_counter() - start) / rows
    rng = np.random.default_rng(0)
    times = []
    for _ in range(30):
        start = time.perf_counter()
        masks = allowed_masks(constraints)
        times.append(time.perf_counter() - start)
        for constraint, mask in zip(constraints, masks):
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]
            constraint.consume([int(rng.choice(np.flatnonzero(bits)))])
    return dict(tokenizer=tokenizer_seconds, cold=cold, cached=cached,
                masks=float(np.median(times)))


def batch_inputs(config, batch: int, max_tokens: int):
    """(a random bf16 model of config, `batch` random 128-token prompts, the unconstrained
    rows' params: temperature 1, max_tokens, EOS ignored)."""
    model = LlamaForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, config.vocab_size - 1, 128).tolist() for _ in range(batch)]
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    return model, prompts, plain


def constrained_params(plain: SamplingParams, schema: dict) -> SamplingParams:
    """plain constrained by a JSON schema. EOS stays ignored: the trained tokenizer's tokens at
    the preset's EOS ids are ordinary text, which a constrained row could sample inside a
    string; it ends when the schema is complete."""
    return dataclasses.replace(plain, structured_outputs=StructuredOutputsParams(json=schema))


def build_engine(model, tokenizer, args, num_steps: int):
    return LLMEngine.from_model(
        model, tokenizer, max_num_seqs=args.batch, max_model_len=1024,
        max_num_batched_tokens=2048, num_scheduler_steps=num_steps,
        enable_prefix_caching=False, warmup=False)


def timed_row(engine, prompts, params, name, count, *, constrained_loop: bool = True) -> dict:
    """The batch twice through engine; the second pass's numbers. constrained_loop: whether
    constrained rows decode inside the loop (else their batch steps one token at a time)."""
    engine.scheduler.loops_take_constraints = constrained_loop
    run_batch(engine, prompts, params, f"warm-{name}")
    result = run_batch(engine, prompts, params, f"timed-{name}")
    engine.scheduler.loops_take_constraints = True
    valid = sum(_is_valid(result["texts"][f"timed-{name}-{i}"]) for i in range(count))
    row = dict(name=name, constrained=count, valid=valid, tokens=result["tokens"],
               wall=result["wall"], compile=result["compile"], plain_rate=result["plain_rate"])
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description="structured outputs' decode cost")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-scheduler-steps", type=int, default=8)
    parser.add_argument("--fractions", default="0.25,1")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json to use")
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.preset(args.model)
    if args.tokenizer:
        tokenizer = tokenizers.Tokenizer.from_file(args.tokenizer)
    else:
        tokenizer = train_tokenizer(config.vocab_size, out_dir / "tokenizer.json")
    costs = {name: host_costs(tokenizer, config.vocab_size, config.eos_token_ids, schema,
                              args.batch) for name, schema in SCHEMAS.items()}
    print(json.dumps(costs), flush=True)
    model, prompts, plain = batch_inputs(config, args.batch, args.max_tokens)
    rows = []
    engine = build_engine(model, tokenizer, args, 1)
    rows.append(timed_row(engine, prompts, [plain] * args.batch, "none, K=1", 0))
    del engine
    gc.collect()
    engine = build_engine(model, tokenizer, args, args.num_scheduler_steps)
    rows.insert(0, timed_row(engine, prompts, [plain] * args.batch,
                             f"none, K={args.num_scheduler_steps}", 0))
    for schema_name, schema in SCHEMAS.items():
        constrained = constrained_params(plain, schema)
        for fraction in map(float, args.fractions.split(",")):
            count = round(fraction * args.batch)
            params = [constrained] * count + [plain] * (args.batch - count)
            for is_loop, how in ((True, "in the loop"), (False, "single steps")):
                rows.append(timed_row(engine, prompts, params,
                                      f"{schema_name}, {fraction:.0%}, {how}", count,
                                      constrained_loop=is_loop))
    base = rows[0]["tokens"] / rows[0]["wall"]
    k = args.num_scheduler_steps
    lines = [f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; model "
             f"{args.model} (random bf16 weights), batch {args.batch}, max_tokens "
             f"{args.max_tokens}, engine K={k}",
             "", "| batch | constrained rows | valid JSON | tokens | seconds | tokens/s | "
             f"vs none at K={k} | unconstrained rows' tokens/s, vs none at K={k} |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        rate = row["tokens"] / row["wall"]
        plain_rate = row["plain_rate"]
        plain_cell = ("-" if plain_rate is None
                      else f"{plain_rate:,.0f}, {plain_rate / rows[0]['plain_rate']:.2f}x")
        lines.append(f"| {row['name']} | {row['constrained']} | {row['valid']} / "
                     f"{row['constrained']} | {row['tokens']} | {row['wall']:.2f} | "
                     f"{rate:,.0f} | {rate / base:.2f}x | {plain_cell} |")
    lines.append("")
    for name, cost in costs.items():
        lines.append(f"host, {name}: llguidance tokenizer build {cost['tokenizer']:.2f} s; "
                     f"schema compile {cost['cold'] * 1e3:.1f} ms cold, "
                     f"{cost['cached'] * 1e6:.0f} us cached (a copy); masks of {args.batch} "
                     f"rows at once {cost['masks'] * 1e3:.2f} ms (median of 30 steps)")
    (out_dir / "structured.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _is_valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and len(value.get("items", ())) == 32


if __name__ == "__main__":
    main()
