"""Time to first token: jpaged's chunked prefill against one transformers SDPA forward, same weights.

A preset's shape (default llama3-8b) with random weights (load_format "dummy"'s draw), copied
into transformers' model (`attn_implementation="sdpa"`, `hf_backends.build_hf_model`, checked
equal). Cases: single prompts of 1k, 8k and 32k tokens and a batch of 16 prompts of 8k (random
ids); each at every --max-num-batched-tokens budget that is not already one step for a smaller
budget of the list (chunked prefill: a prompt longer than the budget takes several steps).
  jpaged  wall time from `add_request` (all of the case's prompts, max_tokens=1, greedy) to the
          step that returns the last of their first tokens; one engine per budget, no prefix
          caching, after an untimed run of the same case on other prompts (so nothing is
          compiled in the timed runs: the table says if anything was, from num_compilations).
  torch   wall time of the forward of the prompts (logits of the last position only, the KV
          cache kept, as generate's first step) and the argmax to the host; a batch runs in
          forwards of --hf-batch-size prompts, halved while out of memory (the table says what
          ran), after one untimed forward.
Median of --repeats runs each; ratio = jpaged / torch (below 1: jpaged is faster).
Usage: python benchmarks/ttft.py --jax-memory-fraction 0.5 --out FILE.md
       python benchmarks/ttft.py --model tiny --cases 1k --max-num-batched-tokens 256,1024
"""

import argparse
import os
import sys
from pathlib import Path

# JAX and torch share the GPU: JAX takes a fixed share. Must be set before jax is imported.
if "--jax-memory-fraction" in sys.argv:
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = sys.argv[sys.argv.index(
        "--jax-memory-fraction") + 1]
ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder heads sys.path, where benchmarks/kernels.py would shadow the
# `kernels` package transformers probes for at import: the repository root stands there instead.
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)

import dataclasses  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import hf_backends  # noqa: E402
from jpaged import LLMEngine, SamplingParams  # noqa: E402
from jpaged.config import PRESETS_DIR, ModelConfig  # noqa: E402
from jpaged.models import random_model  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    """`num_prompts` prompts of `prompt_len` tokens, all added at once."""
    name: str
    num_prompts: int
    prompt_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_prompts * self.prompt_len


CASES = {case.name: case for case in (Case("1k", 1, 1024), Case("8k", 1, 8192),
                                      Case("32k", 1, 32768), Case("16x8k", 16, 8192))}


def parse_case(name: str) -> Case:
    """A CASES name, or "<B>x<T>" / "<T>" with T in tokens (e.g. 2x64, 40)."""
    if name in CASES:
        return CASES[name]
    batch, _, length = name.rpartition("x")
    try:
        return Case(name, int(batch or 1), int(length))
    except ValueError:
        raise ValueError(f"case {name!r}: one of {sorted(CASES)} or <B>x<T>") from None


def budgets_for(case: Case, budgets) -> list[int]:
    """The budgets that schedule the case differently: each up to the first that holds it whole."""
    chosen = []
    for budget in sorted(budgets):
        chosen.append(budget)
        if budget >= case.num_tokens:
            break
    return chosen


def random_prompts(case: Case, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)     # ids >= 10: clear of special tokens
    return rng.integers(10, vocab_size, (case.num_prompts, case.prompt_len)).tolist()


def build_engine(model, cases, budget: int, block_size: int = 16) -> LLMEngine:
    """One engine for every case at one budget: a pool of exactly the largest case (+ sink)."""
    longest = max(case.prompt_len for case in cases) + 1
    blocks = max(case.num_prompts * -(-longest // block_size) for case in cases)
    return LLMEngine.from_model(
        model, None, block_size=block_size, num_kv_blocks=blocks + 1,
        max_num_seqs=max(case.num_prompts for case in cases), max_model_len=longest,
        max_num_batched_tokens=budget, enable_prefix_caching=False, warmup=False)


def jpaged_first_tokens(engine: LLMEngine, prompts) -> tuple[float, list[int]]:
    """(seconds from adding the prompts to the last first token, first tokens in order)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"p{index}", prompt_token_ids=prompt, params=params)
    first = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.outputs[0].token_ids:
                first.setdefault(output.request_id, output.outputs[0].token_ids[0])
    seconds = time.perf_counter() - start
    if len(first) != len(prompts):
        raise RuntimeError(f"{len(first)} of {len(prompts)} prompts got a first token")
    return seconds, [first[f"p{index}"] for index in range(len(prompts))]


def jpaged_ttft(engine: LLMEngine, case: Case, vocab_size: int, repeats: int) -> dict:
    """Median TTFT of the case on the engine after an untimed run; compilations during timing."""
    jpaged_first_tokens(engine, random_prompts(case, vocab_size, seed=10_000))
    compiled_before = engine.stats()["num_compilations"]
    runs, tokens = [], None
    for repeat in range(repeats):
        seconds, first = jpaged_first_tokens(engine, random_prompts(case, vocab_size, repeat))
        runs.append(seconds)
        tokens = tokens or first
    return dict(seconds=statistics.median(runs), runs=runs, first_tokens=tokens,
                compiled=engine.stats()["num_compilations"] - compiled_before)


def torch_first_tokens(model, prompts, batch_size: int, device: str) -> list[int]:
    """Forwards of batch_size prompts: the argmax of each prompt's last logits, on the host."""
    import torch
    tokens = []
    with torch.no_grad():
        for first in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[first:first + batch_size], device=device)
            logits = model(input_ids=ids, logits_to_keep=1).logits[:, -1]
            tokens += logits.argmax(-1).tolist()     # to the host: the forward is done
    return tokens


def torch_ttft(model, case: Case, vocab_size: int, repeats: int, batch_size: int,
               device: str) -> dict:
    """Median seconds of torch_first_tokens over the case's prompts; batch_size halves while a
    forward runs out of memory."""
    import torch
    batch_size = min(batch_size, case.num_prompts)
    while True:
        try:
            torch_first_tokens(model, random_prompts(case, vocab_size, 10_000), batch_size,
                               device)
            break
        except torch.cuda.OutOfMemoryError:
            if batch_size == 1:
                raise
        batch_size //= 2          # out of the except block: the failed forward's tensors are gone
        gc.collect()
        torch.cuda.empty_cache()
    runs, tokens = [], None
    for repeat in range(repeats):
        start = time.perf_counter()
        first = torch_first_tokens(model, random_prompts(case, vocab_size, repeat), batch_size,
                                   device)
        runs.append(time.perf_counter() - start)
        tokens = tokens or first
    return dict(seconds=statistics.median(runs), runs=runs, first_tokens=tokens,
                batch_size=batch_size)


def results_table(cases, budgets, ours: dict, theirs: dict, repeats: int) -> str:
    """ours: {(case name, budget): jpaged_ttft's dict or an error string}; theirs: {case name:
    torch_ttft's dict or an error string, absent if not run}."""
    lines = [f"| case | max_num_batched_tokens | jpaged TTFT ms (median of {repeats}) "
             f"| torch SDPA TTFT ms (median of {repeats}) | jpaged / torch | notes |",
             "|---|---:|---:|---:|---:|---|"]
    for case in cases:
        peer = theirs.get(case.name)
        for budget in budgets_for(case, budgets):
            result = ours.get((case.name, budget), "not run")
            notes = []
            if isinstance(result, dict):
                if result["compiled"]:
                    notes.append(f"COMPILED {result['compiled']} program(s) during timing")
                if isinstance(peer, dict):
                    same = sum(a == b for a, b in zip(result["first_tokens"],
                                                      peer["first_tokens"]))
                    notes.append(f"first tokens equal {same}/{case.num_prompts}")
            elif result is not None:
                notes.append(f"jpaged: {result}")
            if isinstance(peer, dict):
                if case.num_prompts > 1:
                    notes.append(f"torch: forwards of {peer['batch_size']} prompts")
            elif peer is not None:
                notes.append(f"torch: {peer}")
            ours_ms = _ms(result)
            theirs_ms = _ms(peer)
            ratio = (f"{result['seconds'] / peer['seconds']:.2f}"
                     if isinstance(result, dict) and isinstance(peer, dict) else "-")
            lines.append(f"| {case.name} ({case.num_prompts} x {case.prompt_len}) | {budget} "
                         f"| {ours_ms} | {theirs_ms} | {ratio} | {'; '.join(notes)} |")
    return "\n".join(lines) + "\n"


def _ms(result) -> str:
    return f"{result['seconds'] * 1e3:.1f}" if isinstance(result, dict) else "-"


def header(args) -> list[str]:
    return hf_backends.run_lines("ttft.py") + [
        f"model {args.model}, random {args.dtype} weights (identical in both frameworks); "
        "jpaged: TTFT from add_request to the last first token of the case (max_tokens=1, "
        "greedy), chunked prefill at max_num_batched_tokens, no prefix caching, warmed up on "
        "the same case; torch: transformers (attn_implementation=\"sdpa\") forward of the "
        "prompts, last-position logits, argmax on the host; ratio = jpaged / torch"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a preset name")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cases", default="1k,8k,32k,16x8k",
                        help=f"comma list: {', '.join(CASES)} or <B>x<T> (T tokens)")
    parser.add_argument("--max-num-batched-tokens", default="2048,8192,32768",
                        help="comma list of jpaged budgets (2048 is the engine's default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-batch-size", type=int, default=16,
                        help="prompts per torch forward (halved while out of memory)")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--deadline", type=float, default=1e9,
                        help="seconds: no new measurement starts after this")
    parser.add_argument("--jax-memory-fraction", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        args.case_list = [parse_case(name) for name in args.cases.split(",")]
    except ValueError as error:
        parser.error(str(error))
    args.budgets = sorted({int(b) for b in args.max_num_batched_tokens.split(",")})
    return args


def run_torch(model, args, config, device, is_past_deadline) -> dict:
    """torch_ttft of every case, each behind the deadline check; the torch model is freed."""
    from benchmarks.timing import or_error
    hf_model = hf_backends.build_hf_model(PRESETS_DIR / f"{args.model}.json", model,
                                          device=device, dtype_name=args.dtype,
                                          attn_implementation="sdpa")
    results = {}
    for case in args.case_list:
        if is_past_deadline():
            results[case.name] = "skipped: deadline"
            continue
        results[case.name] = or_error(lambda: torch_ttft(
            hf_model, case, config.vocab_size, args.repeats, args.hf_batch_size, device))
        print(f"torch {case.name}: {results[case.name]!s:.200}", flush=True)
    del hf_model
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()
    return results


def run_jpaged(model, args, config, is_past_deadline) -> dict:
    """jpaged_ttft of every (case, budget): one engine per budget, freed before the next."""
    from benchmarks.timing import or_error
    results = {}
    for budget in args.budgets:
        cases = [c for c in args.case_list if budget in budgets_for(c, args.budgets)]
        if not cases:
            continue
        engine = None
        for case in cases:
            if is_past_deadline():
                results[case.name, budget] = "skipped: deadline"
                continue
            engine = engine or build_engine(model, cases, budget)
            results[case.name, budget] = or_error(lambda: jpaged_ttft(
                engine, case, config.vocab_size, args.repeats))
            print(f"jpaged {case.name} at {budget}: {results[case.name, budget]!s:.200}",
                  flush=True)
        del engine
        gc.collect()
    return results


def main(argv=None) -> str:
    args = parse_args(argv)
    start = time.perf_counter()

    def is_past_deadline():
        return time.perf_counter() - start > args.deadline
    config = ModelConfig.preset(args.model)
    model = random_model(config, dtype=jnp.dtype(args.dtype))
    theirs = {} if args.no_hf else run_torch(model, args, config, hf_backends.torch_device(),
                                             is_past_deadline)
    ours = run_jpaged(model, args, config, is_past_deadline)
    return hf_backends.emit("\n".join(header(args)) + "\n\n" + results_table(
        args.case_list, args.budgets, ours, theirs, args.repeats), args.out)


if __name__ == "__main__":
    main()
