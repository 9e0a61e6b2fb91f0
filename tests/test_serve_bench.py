"""benchmarks/serve_bench.py against a real `python -m jpaged.serve --load-format dummy` (the
tiny preset, in a directory written by serve_bench itself) on a free loopback port."""

import asyncio
import json
import math

import httpx
import pytest

from benchmarks import serve_bench
from tests.server_process import running_server

SERVER_FLAGS = ["--block-size=16", "--max-num-seqs=4", "--max-num-batched-tokens=128",
                "--max-model-len=256", "--uvicorn-log-level=warning"]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """Random weights of the tiny preset with serve_bench's synthetic tokenizer, served on
    127.0.0.1 in a subprocess, as the H200 run serves the Llama-3-8B shape."""
    root = tmp_path_factory.mktemp("serve_bench")
    assert serve_bench.main(["--write-model-dir", str(root / "model"), "--preset", "tiny"]) == 0
    with running_server(["--model", str(root / "model"), "--load-format", "dummy",
                         *SERVER_FLAGS], root / "server.log") as url:
        yield url


def test_bench_completes_every_request_with_ordered_percentiles(server_url, tmp_path):
    argv = ["--base-url", server_url, "--request-rate", "20", "--num-requests", "8",
            "--input-mean", "16", "--output-mean", "8", "--max-input-len", "48",
            "--max-output-len", "12", "--timeout", "60", "--out", str(tmp_path / "t.md"),
            "--plot", str(tmp_path / "p.png")]
    args = serve_bench.parse_args(argv)
    seen = []
    (row,) = asyncio.run(serve_bench.benchmark(args, on_row=lambda rows: seen.append(len(rows))))
    assert args.model and seen == [1]  # model fetched from /v1/models; one call per rate
    assert (row["completed"], row["failed"]) == (8, 0), row["errors"]
    assert row["output_tokens_per_s"] > 0 and row["request_throughput"] > 0
    for metric in ("ttft", "tpot", "e2e"):
        p50, p90, p99 = (row[f"{metric}_p{q}"] for q in serve_bench.PERCENTILES)
        assert not math.isnan(p50) and 0 < p50 <= p90 <= p99, metric
    assert row["ttft_p99"] <= row["e2e_p99"]
    # the whole entry point: table and plot files
    assert serve_bench.main(argv) == 0
    text = (tmp_path / "t.md").read_text()
    assert server_url in text and "| 20 | 8 | 0 |" in text
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_output_tokens_come_from_usage(server_url):
    """ignore_eos and max_tokens hold, so the usage count is exactly the requested length."""
    async def one():
        async with httpx.AsyncClient(base_url=server_url, timeout=60) as http:
            model = await serve_bench.fetch_model(http)
            body = serve_bench.request_body(model, [5, 6, 7], 9)
            return await serve_bench.send(http, body, 60)

    result = asyncio.run(one())
    assert result.ok, result.error
    assert result.output_tokens == 9 and result.tpot > 0


def test_rates_parse_and_lengths_do_not_depend_on_rate():
    assert serve_bench.parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]
    args = serve_bench.parse_args(["--num-requests", "5", "--max-output-len", "7"])
    args.model = "m"
    slow, burst = serve_bench.build_requests(args, 1.0), serve_bench.build_requests(args, math.inf)
    assert [b for _, b in slow] == [b for _, b in burst]
    assert all(t == 0 for t, _ in burst) and all(b["max_tokens"] <= 7 for _, b in slow)
    assert [t for t, _ in slow] == sorted(t for t, _ in slow) and slow[-1][0] > 0


def test_model_dir_holds_the_preset_and_a_tokenizer_over_its_vocabulary(tmp_path):
    from tokenizers import Tokenizer

    directory = serve_bench.write_model_dir("llama3-8b", tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    assert config == json.loads((serve_bench.PRESETS_DIR / "llama3-8b.json").read_text())
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"] == 128256
    assert tokenizer.decode([0, 7, 128255]) == "t0 t7 t128255"
    with pytest.raises(ValueError, match="no-such-model"):
        serve_bench.write_model_dir("no-such-model", tmp_path / "x")
