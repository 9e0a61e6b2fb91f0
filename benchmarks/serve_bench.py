"""Online serving benchmark: Poisson arrivals against any OpenAI-compatible /v1/completions URL.

Requests follow the standard ShareGPT-like trace (benchmarks/trace.py). Each sends its prompt as
`input_len` random token ids (OpenAI completions and jpaged accept a list of ints as `prompt`, so
the prompt length does not depend on the server's tokenizer), `max_tokens` = output_len,
`ignore_eos: true` (so every request generates its drawn length), temperature 0, `stream: true`
with `stream_options.include_usage` (the output token count comes from the final usage chunk;
without one, text chunks are counted). Measured per request: TTFT (first chunk with text), TPOT
((end - first text) / (tokens - 1)), end-to-end latency. Every request is bounded by --timeout
after it is sent, so a run ends by itself. Defaults target loopback only. The table (--out) is
rewritten after every rate, so an interrupted sweep keeps the rates it finished.

A random-weight model to serve: `--write-model-dir DIR --preset llama3-8b` writes the preset
(configs/models/) as DIR/config.json plus a synthetic tokenizer.json, one word per token id, then
exits; serve it with `python -m jpaged.serve --model DIR --load-format dummy`. The tokenizer is
there because without one the server's completions carry no text, so a stream has no text chunk
whose arrival gives TTFT; with it every token streams as text, as with a real model.

Usage: python benchmarks/serve_bench.py --request-rate 1,4,16,inf --num-requests 256
           [--base-url http://127.0.0.1:8000] [--model NAME] [--out FILE] [--plot FILE]
       python benchmarks/serve_bench.py --write-model-dir DIR [--preset NAME]
"""

import argparse
import asyncio
import dataclasses
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PRESETS_DIR = ROOT / "configs" / "models"
sys.path.insert(0, str(ROOT))

from benchmarks.trace import SHAREGPT, make_trace  # noqa: E402

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class Result:
    """One request's outcome; latencies in seconds, None where not measured."""
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    output_tokens: int = 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    add("--model", default=None, help="model name in the body; default: first of GET /v1/models")
    add("--request-rate", default="inf",
        help="requests/s, Poisson arrivals; a comma list sweeps; inf sends all at once")
    add("--num-requests", type=int, default=256)
    add("--input-mean", type=float, default=SHAREGPT["input_mean"])
    add("--output-mean", type=float, default=SHAREGPT["output_mean"])
    add("--max-input-len", type=int, default=None, help="cap drawn prompt lengths")
    add("--max-output-len", type=int, default=None, help="cap drawn output lengths")
    add("--max-token-id", type=int, default=256,
        help="prompt token ids are drawn from [0, this); keep it below the server's vocabulary")
    add("--seed", type=int, default=0)
    add("--timeout", type=float, default=600.0, help="seconds per request, from its send")
    add("--num-warmup", type=int, default=1, help="short unmeasured requests sent first")
    add("--out", default=None, help="write the markdown table here")
    add("--plot", default=None, help="write a latency-vs-rate PNG here")
    add("--plot-title", default="", help="title of the plot")
    add("--write-model-dir", default=None, metavar="DIR",
        help="write --preset's config.json and a synthetic tokenizer.json into DIR (for "
             "`jpaged.serve --load-format dummy`) and exit; sends no request")
    add("--preset", default="llama3-8b", help="a configs/models/ name, for --write-model-dir")
    return parser.parse_args(argv)


def write_model_dir(preset: str, directory) -> Path:
    """DIR/config.json = configs/models/<preset>.json; DIR/tokenizer.json = a word-level
    tokenizer whose token id i is the word "t<i>" (decoded tokens are joined by spaces), covering
    the whole vocabulary. Returns DIR."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    source = PRESETS_DIR / f"{preset}.json"
    if not source.is_file():
        known = sorted(path.stem for path in PRESETS_DIR.glob("*.json"))
        raise ValueError(f"unknown preset {preset!r}; known: {known}")
    config = json.loads(source.read_text())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {f"t{token_id}": token_id for token_id in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def parse_rates(text: str) -> list[float]:
    return [float("inf") if item.strip() == "inf" else float(item) for item in text.split(",")]


def build_requests(args, rate: float) -> list[tuple[float, dict]]:
    """(arrival time, body) per request; lengths depend on the seed only, not on the rate."""
    trace = make_trace(args.num_requests, input_mean=args.input_mean,
                       output_mean=args.output_mean, seed=args.seed,
                       request_rate=None if rate == float("inf") else rate)
    rng = np.random.default_rng(args.seed + 1)
    requests = []
    for item in trace:
        input_len = min(item.input_len, args.max_input_len or item.input_len)
        output_len = min(item.output_len, args.max_output_len or item.output_len)
        prompt = rng.integers(0, args.max_token_id, input_len).tolist()
        requests.append((item.arrival_time, request_body(args.model, prompt, output_len)))
    return requests


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def send(http: httpx.AsyncClient, body: dict, timeout: float) -> Result:
    result = Result()
    try:
        await asyncio.wait_for(_stream(http, body, result), timeout)
    except asyncio.TimeoutError:
        result.ok, result.error = False, f"timeout after {timeout} s"
    except (httpx.HTTPError, ValueError) as err:
        result.ok, result.error = False, f"{type(err).__name__}: {err}"
    return result


async def _stream(http: httpx.AsyncClient, body: dict, result: Result):
    """Fills `result` from one streamed completion."""
    start = time.perf_counter()
    first = None
    text_chunks, usage_tokens, is_done = 0, None, False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                is_done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = str(chunk["error"])[:200]
                return
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                first = first or time.perf_counter()
                text_chunks += 1
            if chunk.get("usage"):
                usage_tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if not is_done or first is None:
        result.error = "stream ended without [DONE]" if not is_done else "no text received"
        return
    tokens = usage_tokens if usage_tokens is not None else text_chunks
    result.ok, result.output_tokens = True, tokens
    result.ttft, result.e2e = first - start, end - start
    result.tpot = (end - first) / (tokens - 1) if tokens > 1 else None


async def run_rate(http: httpx.AsyncClient, args, rate: float) -> dict:
    """Sends the trace at `rate`; returns the summary row."""
    requests = build_requests(args, rate)
    start = time.perf_counter()

    async def at(arrival: float, body: dict) -> Result:
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        return await send(http, body, args.timeout)

    results = await asyncio.gather(*(at(arrival, body) for arrival, body in requests))
    return summarize(rate, results, time.perf_counter() - start)


def summarize(rate: float, results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    row = {"rate": rate, "completed": len(done), "failed": len(results) - len(done),
           "duration_s": duration, "request_throughput": len(done) / duration,
           "output_tokens_per_s": sum(r.output_tokens for r in done) / duration,
           "errors": sorted({r.error for r in results if not r.ok})[:3]}
    for metric in ("ttft", "tpot", "e2e"):
        values = [getattr(r, metric) for r in done if getattr(r, metric) is not None]
        for q in PERCENTILES:
            row[f"{metric}_p{q}"] = float(np.percentile(values, q)) if values else float("nan")
    return row


async def fetch_model(http: httpx.AsyncClient) -> str:
    reply = await http.get("/v1/models")
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


async def benchmark(args, on_row=None) -> list[dict]:
    """One summary row per rate in args.request_rate (sets args.model if it was None);
    `on_row(rows so far)` is called after each rate."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits) as http:
        args.model = args.model or await fetch_model(http)
        for _ in range(args.num_warmup):
            await send(http, request_body(args.model, [1, 2, 3, 4], 4), args.timeout)
        rows = []
        for rate in parse_rates(args.request_rate):
            rows.append(await run_rate(http, args, rate))
            if on_row is not None:
                on_row(rows)
        return rows


def table(rows: list[dict], args, argv: list[str]) -> str:
    ms = lambda seconds: f"{seconds * 1e3:.1f}"  # noqa: E731
    lines = [f"# serve_bench: {datetime.datetime.now().isoformat(timespec='seconds')}", "",
             f"- target: {args.base_url}", f"- model: {args.model}",
             f"- command: `python benchmarks/serve_bench.py {shlex.join(argv)}`",
             f"- requests per rate: {args.num_requests}; prompts are random token ids; "
             "ignore_eos, temperature 0, streamed", "",
             "| rate (req/s) | completed | failed | req/s | output tok/s | TTFT p50/p90/p99 (ms) "
             "| TPOT p50/p90/p99 (ms) | E2E p50/p90/p99 (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [" / ".join(ms(row[f"{m}_p{q}"]) for q in PERCENTILES) for m in ("ttft", "tpot")]
        e2e = " / ".join(f"{row[f'e2e_p{q}']:.2f}" for q in PERCENTILES)
        lines.append(f"| {row['rate']:g} | {row['completed']} | {row['failed']} | "
                     f"{row['request_throughput']:.2f} | {row['output_tokens_per_s']:.1f} | "
                     f"{cells[0]} | {cells[1]} | {e2e} |")
    errors = sorted({e for row in rows for e in row["errors"]})
    if errors:
        lines += ["", "Failures (first kinds): " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str, title: str = ""):
    """TTFT, TPOT and end-to-end latency (p50 / p90 / p99) against the request rate."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = range(len(rows))  # evenly spaced: the rates are roughly geometric, and inf
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("ttft", "TTFT (ms)", 1e3), ("tpot", "TPOT (ms)", 1e3), ("e2e", "end-to-end (s)", 1))
    for ax, (metric, label, scale) in zip(axes, panels):
        for q in PERCENTILES:
            ax.plot(positions, [row[f"{metric}_p{q}"] * scale for row in rows], marker="o",
                    label=f"p{q}")
        ax.set_xticks(list(positions), [f"{row['rate']:g}" for row in rows])
        ax.set(xlabel="request rate (req/s)", ylabel=label, title=label.split(" (")[0])
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.LogFormatter())  # 20, not 2x10^1
        ax.yaxis.set_minor_formatter(matplotlib.ticker.LogFormatter(minor_thresholds=(2, 0.5)))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.write_model_dir:
        print(f"wrote {write_model_dir(args.preset, args.write_model_dir)}")
        return 0

    def on_row(rows):
        print(f"rate {rows[-1]['rate']:g}: {json.dumps(rows[-1])}", flush=True)
        if args.out:
            Path(args.out).write_text(table(rows, args, argv))

    rows = asyncio.run(benchmark(args, on_row))
    text = table(rows, args, argv)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.plot:
        plot(rows, args.plot, args.plot_title)
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
