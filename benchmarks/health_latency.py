"""How fast /health answers while the server works: the wall-clock claims the test suite makes
no more (its tests show /health answering in each case; how fast belongs here).

Starts `python -m jpaged.serve` on the built-in model (or uses --base-url) and polls GET /health
on one connection, back to back, while each case runs:
  idle          nothing else
  body_10mb     a 10 MB chunked body streaming in (answered 413 at the 4 MiB limit)
  stop_strings  a 200-token greedy request carrying the largest stop set a request may have
                (MAX_STOP_STRINGS strings of MAX_STOP_LENGTH characters, none of which occurs)
  burst         64 concurrent 64-token requests
Each row: polls, median, p99 and max latency in milliseconds, and the case's own wall time.

    python benchmarks/health_latency.py [--base-url URL] [--out FILE]
"""

import argparse
import asyncio
import datetime
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jpaged.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS  # noqa: E402

SERVER_FLAGS = ["--max-model-len=256", "--max-num-seqs=64", "--uvicorn-log-level=warning"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running server (default: start the built-in one)")
    parser.add_argument("--out", help="write the table, with machine, date and command, here")
    parser.add_argument("--start-timeout", type=float, default=600)
    return parser.parse_args(argv)


async def _ten_megabyte_body(http: httpx.AsyncClient):
    body = b'{"prompt": "' + b"a" * 10_000_000 + b'"}'

    async def chunks():
        for start in range(0, len(body), 1 << 16):
            yield body[start:start + (1 << 16)]

    return await http.post("/v1/completions", content=chunks(),
                           headers={"Content-Type": "application/json"})


async def _most_stop_strings(http: httpx.AsyncClient):
    stops = [chr(0x4E00 + i) * MAX_STOP_LENGTH for i in range(MAX_STOP_STRINGS)]
    return await http.post("/v1/completions", json=dict(
        prompt="x = ", max_tokens=200, ignore_eos=True, stop=stops, temperature=0))


async def _burst(http: httpx.AsyncClient):
    return await asyncio.gather(*(http.post("/v1/completions", json=dict(
        prompt=f"def f{i}(", max_tokens=64, ignore_eos=True, temperature=0.8, seed=i))
        for i in range(64)))


async def _idle(_http: httpx.AsyncClient):
    await asyncio.sleep(2.0)


CASES = {"idle": _idle, "body_10mb": _ten_megabyte_body, "stop_strings": _most_stop_strings,
         "burst": _burst}


async def measure(base_url: str, work) -> dict:
    """/health latencies (seconds) polled back to back while `work(client)` runs."""
    limits = httpx.Limits(max_connections=128)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http, \
            httpx.AsyncClient(base_url=base_url, timeout=600) as poller:
        await poller.get("/health")   # the poller's connection is open before the work starts
        start = time.perf_counter()
        task = asyncio.ensure_future(work(http))
        latencies = []
        while not task.done():
            sent = time.perf_counter()
            assert (await poller.get("/health")).status_code == 200
            latencies.append(time.perf_counter() - sent)
        await task
        return dict(latencies=np.array(latencies), seconds=time.perf_counter() - start)


def table(results: dict) -> str:
    lines = ["| case | polls | median ms | p99 ms | max ms | case s |",
             "|---|---|---|---|---|---|"]
    for name, result in results.items():
        ms = result["latencies"] * 1e3
        lines.append(f"| {name} | {len(ms)} | {np.median(ms):.1f} | "
                     f"{np.percentile(ms, 99):.1f} | {ms.max():.1f} | {result['seconds']:.2f} |")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(timeout: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "jpaged.serve", "--host", "127.0.0.1",
                                f"--port={port}", *SERVER_FLAGS], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"the server did not answer /health within {timeout} s")


def main(argv=None) -> str:
    args = parse_args(argv)
    process, url = (None, args.base_url) if args.base_url else _start_server(args.start_timeout)
    try:
        asyncio.run(measure(url, _burst))   # compile the shapes the cases use, untimed
        results = {name: asyncio.run(measure(url, work)) for name, work in CASES.items()}
    finally:
        if process is not None:
            process.terminate()
            process.wait()
    text = table(results)
    print(text)
    if args.out:
        import jax

        header = [f"# /health latency while the server works ({datetime.date.today()})", "",
                  f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))}"
                  f" cores, jax {jax.__version__} ({jax.default_backend()}), python "
                  f"{platform.python_version()}",
                  f"command: python benchmarks/health_latency.py {' '.join(sys.argv[1:])}",
                  f"server: python -m jpaged.serve {' '.join(SERVER_FLAGS)} (the built-in model)"
                  if not args.base_url else f"server: {args.base_url}", "", ""]
        Path(args.out).write_text("\n".join(header) + text + "\n")
    return text


if __name__ == "__main__":
    main()
