"""llguidance (what jpaged uses) against xgrammar for structured outputs, on the host: building
each library's view of the tokenizer, compiling a JSON schema, and computing next-token masks
for one row and for a batch of rows, over the same token walk.

The tokenizer is a byte-level BPE (`--tokenizer`, e.g. the one `structured.py` trains, 128,256
tokens). For each schema of `structured.SCHEMAS` (plus plain unbounded strings), a batch of
matchers of each library walks forward together: at each step both compute the batch's masks,
every row takes a random token both allow, and the table counts the (row, step) masks that
differ between the two (llguidance allows only the canonical tokenization of text the grammar
forces, xgrammar any split of it; string contents differ too). Both compile compact
JSON (no whitespace between tokens). xgrammar is not a jpaged dependency (it needs torch and
triton): install it to run this (`pip install xgrammar`).

Usage: python benchmarks/grammar_backends.py --tokenizer TOKENIZER.json --out FILE.md
"""

import argparse
import copy
import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.structured import SCHEMAS  # noqa: E402


def schemas() -> dict:
    plain = copy.deepcopy(SCHEMAS["bounded strings"])
    del plain["properties"]["items"]["items"]["maxLength"]
    return {**SCHEMAS, "plain strings": plain}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size, eos):
        import llguidance

        self.lib, self.vocab_size = llguidance, vocab_size
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                                eos_token=eos)
        self.tokenizer_seconds = time.perf_counter() - start
        self.executor = llguidance.LLExecutor()
        self.words = -(-vocab_size // 32)

    def compile(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def copies(self, compiled, rows):
        return [compiled.deep_copy() for _ in range(rows)]

    def masks(self, matchers):
        out = np.zeros((len(matchers), self.words), np.int32)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              out.ctypes.data, self.words * 4, len(matchers))
        return out

    def one_mask(self, matcher):
        out = np.zeros(self.words, np.int32)
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def accept(self, matcher, token) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size, eos):
        import xgrammar

        self.lib, self.vocab_size = xgrammar, vocab_size
        vocab = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda p: p[1])
        start = time.perf_counter()
        info = xgrammar.TokenizerInfo([token for token, _ in vocab],
                                      xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.tokenizer_seconds = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema):
        return self.compiler.compile_json_schema(schema, any_whitespace=False,
                                                 separators=(",", ":"))

    def copies(self, compiled, rows):
        return [self.lib.GrammarMatcher(compiled) for _ in range(rows)]

    def masks(self, matchers):
        out = self.lib.allocate_token_bitmask(len(matchers), self.vocab_size)
        self.batch.batch_fill_next_token_bitmask(matchers, out)
        return out.numpy()

    def one_mask(self, matcher):
        out = self.lib.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(out)
        return out.numpy()[0]

    def accept(self, matcher, token) -> bool:
        return matcher.accept_token(token)


def median_ms(times) -> float:
    return float(np.median(times)) * 1e3


def measure(backends, schema, rows: int, steps: int, vocab_size: int) -> dict:
    """Cold compile, then `steps` steps of a batch of `rows` matchers per backend walking the
    same tokens (llguidance's choice), timing batch masks and one row's mask."""
    result, walkers = {}, {}
    for backend in backends:
        start = time.perf_counter()
        compiled = backend.compile(schema)
        result[backend.name] = dict(compile=time.perf_counter() - start, batch=[], one=[])
        walkers[backend.name] = backend.copies(compiled, rows)
    rng = np.random.default_rng(0)
    disagreements = 0
    for _ in range(steps):
        masks = {}
        for backend in backends:
            matchers = walkers[backend.name]
            start = time.perf_counter()
            masks[backend.name] = backend.masks(matchers)
            result[backend.name]["batch"].append(time.perf_counter() - start)
            start = time.perf_counter()
            backend.one_mask(matchers[0])
            result[backend.name]["one"].append(time.perf_counter() - start)
        bits = [np.unpackbits(np.ascontiguousarray(m).view(np.uint8), axis=-1,
                              bitorder="little")[:, :vocab_size] for m in masks.values()]
        disagreements += int(np.sum(np.any(bits[0] != bits[-1], axis=-1)))
        both = np.logical_and.reduce(bits)
        for row in range(rows):
            allowed = np.flatnonzero(both[row])
            if len(allowed) == 0:
                continue
            token = int(rng.choice(allowed))
            for backend in backends:
                assert backend.accept(walkers[backend.name][row], token), backend.name
    return dict(result, disagreements=disagreements)


def main(argv=None):
    parser = argparse.ArgumentParser(description="llguidance vs xgrammar on the host")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--eos", type=int, nargs="+", default=[128001, 128009])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    tokenizer = tokenizers.Tokenizer.from_file(args.tokenizer)
    backends = [Llguidance(tokenizer, args.vocab_size, args.eos)]
    try:
        backends.append(Xgrammar(tokenizer, args.vocab_size, args.eos))
    except ImportError:
        print("xgrammar is not installed: llguidance alone", file=sys.stderr)
    versions = ", ".join(f"{b.name} {importlib.metadata.version(b.name)}" for b in backends)
    lines = [f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
             f"Python {platform.python_version()}; {versions}",
             f"command: python benchmarks/grammar_backends.py --tokenizer {args.tokenizer} "
             f"--rows {args.rows} --steps {args.steps}", "",
             "tokenizer view built once per engine: " + ", ".join(
                 f"{b.name} {b.tokenizer_seconds:.2f} s" for b in backends), "",
             "| schema | library | compile, cold (ms) | masks of one row (ms) | masks of "
             f"{args.rows} rows at once (ms) | masks that differ (of rows x steps) |",
             "|---|---|---|---|---|---|"]
    for name, schema in schemas().items():
        result = measure(backends, schema, args.rows, args.steps, args.vocab_size)
        for backend in backends:
            r = result[backend.name]
            refused = ("-" if backend is backends[0]
                       else f"{result['disagreements']} of {args.rows * args.steps}")
            lines.append(f"| {name} | {backend.name} | {r['compile'] * 1e3:.1f} | "
                         f"{median_ms(r['one']):.3f} | {median_ms(r['batch']):.2f} | {refused} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
