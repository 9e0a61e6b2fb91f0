"""Start-up time: time to ready and to the first token, cold (empty compilation cache) and warm
(a second process, same cache), each run in a fresh subprocess.

Cases: builtin (`LLM()` on the built-in model, default options), hf (`LLM(path)` on a 2-layer
Llama checkpoint written by transformers), serve_builtin (`python -m jpaged.serve`, what `make
run` starts: ready = /health answers, first token = the README's curl with max_tokens 1) and
serve_8b (the server on the Llama-3-8B shape with dummy weights), llm_8b (`LLM(path,
load_format="dummy")` on that shape: the server's engine start without the HTTP server, for a
machine without FastAPI) and checkpoint_8b (`LLM(path)` on a safetensors checkpoint of that
shape, written once to local disk before the two starts: the checkpoint's size and the disk's
read rate, measured on its files with their page cache dropped, are printed under the table; the
cold start reads from disk, the warm one finds the files in the page cache). `--preset` sets the
shape of the 8B cases. The `LLM` cases then answer a burst of BURST requests (8 tokens each: a batch
larger than the first request's) right after the first token: where warm-up compiles
behind ready (GPU), it shows whether they wait behind the programs queued before theirs.
Prints a markdown table; `--out FILE` writes it with the device, date,
versions and the command.

    python benchmarks/startup.py [--cases builtin,hf,serve_builtin] [--preset llama3-8b]
        [--out FILE]
"""

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

START = time.perf_counter()   # before jax and jpaged are imported: a worker's start
ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder heads sys.path, where benchmarks/kernels.py would shadow the
# `kernels` package transformers probes for at import: the repository root stands there instead.
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)
CASES = ("builtin", "hf", "serve_builtin", "serve_8b", "llm_8b", "checkpoint_8b")
READ_CHUNK = 64 << 20
PROMPT = "import os\n\n\ndef "
BURST = 40   # requests of the LLM cases' burst after the first token
PROGRESS = re.compile(r"compiled (\d+)/(\d+) programs \((\d+) from the compilation cache, "
                      r"([\d.]+) s compiling")


# ---- one measurement, in its own process --------------------------------------------------------
def run_llm(model: str | None, cache_dir: str, **options) -> dict:
    """LLM(model, **options), otherwise default options: seconds to ready and to the first
    token."""
    import jpaged

    llm = jpaged.LLM(model, compilation_cache_dir=cache_dir, **options)
    ready = time.perf_counter() - START
    began = time.perf_counter()
    llm.generate([PROMPT], jpaged.SamplingParams(max_tokens=1, temperature=0.7),
                 use_tqdm=False)
    first_token = time.perf_counter() - began
    engine = llm.engine
    stats = engine.stats()
    compiling_at_ready = stats["num_compiling"]
    began = time.perf_counter()   # a burst right behind it: a bucket no first request needs
    llm.generate([f"{PROMPT}f{index}(" for index in range(BURST)],
                 jpaged.SamplingParams(max_tokens=8, temperature=0.7, seed=0), use_tqdm=False)
    burst = time.perf_counter() - began
    engine.wait_for_compilation()
    stats = engine.stats()
    return dict(ready_s=ready, first_token_s=first_token, burst_s=burst,
                programs=stats["num_compilations"],
                compiling_at_ready=compiling_at_ready, compile_s=stats["compile_seconds"],
                cache_hits=stats["num_compilation_cache_hits"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def run_server(flags: list[str], cache_dir: str, timeout: float) -> dict:
    """python -m jpaged.serve: seconds from launch to /health answering, then to the first
    token of one completion; programs and cache hits from its progress line."""
    port = _free_port()
    log = tempfile.TemporaryFile()
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "jpaged.serve", "--port", str(port),
                               "--compilation-cache-dir", cache_dir, *flags],
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None or time.perf_counter() - start > timeout:
                log.seek(0)
                raise RuntimeError(f"server did not become ready:\n{log.read().decode()[-3000:]}")
            try:
                _get(url + "/health", timeout=5)
                break
            except OSError:
                time.sleep(0.05)
        ready = time.perf_counter() - start
        model = json.loads(_get(url + "/v1/models"))["data"][0]["id"]
        began = time.perf_counter()
        _get(url + "/v1/completions", dict(model=model, prompt=PROMPT, max_tokens=1,
                                          temperature=0.7))
        first_token = time.perf_counter() - began
    finally:
        server.terminate()
        server.wait(60)
    log.seek(0)
    found = PROGRESS.findall(log.read().decode(errors="replace"))
    done, total, hits, seconds = found[-1] if found else ("-", "-", "-", "nan")
    return dict(ready_s=ready, first_token_s=first_token, programs=done,
                compiling_at_ready=(int(total) - int(done)) if found else "-",
                compile_s=float(seconds), cache_hits=hits)


def worker(case: str, cache_dir: str, model_dir: str, timeout: float) -> dict:
    if case == "builtin":
        return run_llm(None, cache_dir)
    if case == "hf":
        return run_llm(model_dir, cache_dir)
    if case == "llm_8b":
        return run_llm(model_dir, cache_dir, load_format="dummy")
    if case == "checkpoint_8b":
        return run_llm(model_dir, cache_dir)
    if case == "serve_builtin":
        return run_server([], cache_dir, timeout)
    return run_server(["--model", model_dir, "--load-format", "dummy"], cache_dir, timeout)


# ---- the driver ---------------------------------------------------------------------------------
def write_hf_checkpoint(directory: Path) -> str:
    """A 2-layer, 64-wide random Llama saved by transformers (safetensors + a tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = ROOT / "jpaged" / "assets" / "default_model" / "tokenizer.json"
    (directory / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    return str(directory)


def write_checkpoint(preset: str, directory: Path) -> None:
    """A safetensors checkpoint of the preset's shape and dtype (the dummy load's weights), one
    file per layer plus one for the rest, with its index; drawn on the device and written one
    file at a time, so the host holds one layer at most. Run in a process of its own."""
    import numpy as np
    from safetensors.numpy import save_file

    from benchmarks.serve_bench import write_model_dir
    from jpaged.models import checkpoint_tensors, load_model

    write_model_dir(preset, directory)
    tensors = checkpoint_tensors(load_model(directory, load_format="dummy")[0])
    groups: dict[str, list[str]] = {}
    for name in sorted(tensors):
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(f"layer{int(layer.group(1)):05d}" if layer else "other", []).append(name)
    weight_map, total = {}, 0
    for index, (group, names) in enumerate(sorted(groups.items())):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        arrays = {name: np.asarray(tensors.pop(name)) for name in names}
        save_file(arrays, str(directory / file))
        total += sum(array.nbytes for array in arrays.values())
        weight_map.update(dict.fromkeys(names, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def disk_read(directory: Path) -> dict:
    """Bytes of the directory's safetensors files and the rate they read at from the disk: each
    file's page cache dropped first (posix_fadvise), then read through in large chunks. The
    pages are dropped again after, so the next start reads from the disk too."""
    files = sorted(directory.glob("*.safetensors"))
    size, start = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while chunk := handle.read(READ_CHUNK):
                size += len(chunk)
    seconds = time.perf_counter() - start
    for path in files:
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return dict(files=len(files), gigabytes=size / 1e9, read_gb_per_s=size / 1e9 / seconds)


def model_dir_for(case: str, scratch: Path, preset: str, timeout: float) -> str:
    if case == "hf":
        return write_hf_checkpoint(scratch / "hf_llama_2_layers")
    if case in ("serve_8b", "llm_8b"):
        sys.path.insert(0, str(ROOT))
        from benchmarks.serve_bench import write_model_dir

        return str(write_model_dir(preset, scratch / f"{preset}_dummy"))
    if case == "checkpoint_8b":
        directory = scratch / f"{preset}_checkpoint"
        done = subprocess.run([sys.executable, __file__, "--write-checkpoint", preset,
                               "--model-dir", str(directory)], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT,
                              env=os.environ | {"PYTHONPATH": str(ROOT)})
        if done.returncode:
            raise RuntimeError(f"writing the checkpoint failed:\n{done.stderr[-3000:]}")
        return str(directory)
    return ""


def measure(case: str, scratch: Path, timeout: float, preset: str) -> list[dict]:
    """Cold then warm runs of one case, each a fresh process sharing one new cache directory
    (the checkpoint case's rows also carry its `disk_read`)."""
    model_dir = model_dir_for(case, scratch, preset, timeout)
    cache_dir = scratch / f"cache_{case}"
    disk = disk_read(Path(model_dir)) if case == "checkpoint_8b" else {}
    rows = []
    for start in ("cold", "warm"):
        command = [sys.executable, __file__, "--worker", case, "--cache-dir", str(cache_dir),
                   "--model-dir", model_dir, "--timeout", str(timeout)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 120,
                              cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
        if done.returncode:
            raise RuntimeError(f"{case} {start} failed:\n{done.stderr[-3000:]}")
        rows.append(dict(case=case, start=start, disk=disk,
                         **json.loads(done.stdout.splitlines()[-1])))
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"| case | start | ready (s) | first token (s) | then {BURST} requests (s) | "
             "programs | compiling at ready | compile (s, summed over threads) | cache hits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        burst = f"{row['burst_s']:.2f}" if "burst_s" in row else "-"
        lines.append(f"| {row['case']} | {row['start']} | {row['ready_s']:.1f} | "
                     f"{row['first_token_s']:.2f} | {burst} | {row['programs']} | "
                     f"{row['compiling_at_ready']} | {row['compile_s']:.1f} | "
                     f"{row['cache_hits']} |")
    for row in rows:
        disk = row.get("disk")
        if disk and row["start"] == "cold":
            lines.append(f"\n{row['case']}: {disk['gigabytes']:.3g} GB in {disk['files']} "
                         f"safetensors files; the disk reads them at {disk['read_gb_per_s']:.3g} "
                         "GB/s (page cache dropped); checkpoint over ready time: "
                         + ", ".join(f"{other['start']} {disk['gigabytes'] / other['ready_s']:.3g}"
                                     for other in rows if other["case"] == row["case"])
                         + " GB/s")
    return "\n".join(lines) + "\n"


def header(argv: list[str]) -> str:
    import jax
    import jaxlib

    device = jax.devices()[0]
    return (f"# Start-up time\n\nDevice: {device.device_kind} ({jax.default_backend()}), "
            f"{os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} at the end: "
            f"other processes share them). Date: {datetime.date.today().isoformat()}. "
            f"Python {platform.python_version()}, jax {jax.__version__}, jaxlib "
            f"{jaxlib.__version__}.\n\nCommand: `python benchmarks/startup.py "
            f"{' '.join(argv)}`\n\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="builtin,hf,serve_builtin",
                        help=f"comma-separated, of {CASES}")
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    parser.add_argument("--preset", default="llama3-8b", help="the shape of the 8B cases")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--write-checkpoint", metavar="PRESET", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_checkpoint:
        write_checkpoint(args.write_checkpoint, Path(args.model_dir))
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker, args.cache_dir, args.model_dir, args.timeout)))
        return 0
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; the cases are {CASES}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jpaged-startup-") as scratch:
        for case in cases:
            rows += measure(case, Path(scratch), args.timeout, args.preset)
            print(table(rows[-2:]), end="", flush=True)
    text = header(argv) + table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
