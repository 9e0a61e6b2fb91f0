"""Tensor-parallel scaling: throughput and all-reduce share per (model, TP size).

For every (model, TP) of --runs that the visible devices allow, one process each:
  throughput: benchmarks/throughput.py on the 256-request ShareGPT-like trace (output tokens/s,
      with and without compile time; mean decode step against the per-device floor), stopped
      with SIGINT at its time limit, so it reports the steps it ran, marked incomplete;
  profile (TP > 1 only; TP = 1 has no collectives): benchmarks/collective_share.py, a profiler
      trace of a few decode steps at one batch, for the all-reduce share of the GPU's busy time.
Results of earlier calls can be read back (--reuse: their output directories, or a markdown file
with "### MODEL_tpN" sections such as results/tp_scaling_h200x2.md), so a call can measure
only what is missing. Writes into --out-dir: throughput_MODEL_tpN.md, profile_MODEL_tpN.json,
run.log, tp_scaling.md (header, tables) and tp_scaling.png (scaling plot).
Usage: python benchmarks/tp_scaling.py --out-dir OUT [--runs llama3-70b:2,4,8 llama3-8b:1,2,4,8]
       [--parts throughput,profile] [--reuse DIR_OR_MD ...] [--time-limit MODEL=SECONDS ...]
NCCL's NVLink multicast is turned off for every child (it can take a host's GPUs down).
"""

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUNS = ["llama3-70b:2,4,8", "llama3-8b:1,2,4,8"]
DEFAULT_LIMITS = {"llama3-70b": 290}   # seconds per throughput run; others: --default-limit
NO_MULTICAST = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                    NVSHMEM_DISABLE_NVLS="1")
THROUGHPUT_ROWS = {  # throughput.py's metric row -> key
    "output tokens/s": "tokens_s", "output tokens/s excluding compile": "tokens_s_warm",
    "mean decode step, device (ms)": "step_ms", "mean decode floor (ms)": "floor_ms",
    "decode time / floor": "ratio", "compile time inside the run (s)": "compile_s"}
PROBE = ("import json, platform, jax, flax; d = jax.devices()[0]; print(json.dumps(dict("
         "count=jax.device_count(), kind=getattr(d, 'device_kind', d.platform), "
         "jax=jax.__version__, flax=flax.__version__, python=platform.python_version())))")


def parse_runs(specs) -> list[tuple[str, int]]:
    """["llama3-8b:1,2"] -> [("llama3-8b", 1), ("llama3-8b", 2)]."""
    runs = []
    for spec in specs:
        model, _, sizes = spec.partition(":")
        if not model or not sizes:
            raise ValueError(f"a run is MODEL:TP[,TP...], got {spec!r}")
        runs += [(model, int(size)) for size in sizes.split(",")]
    return runs


def read_throughput(text: str) -> dict:
    """The numbers of one throughput.py report."""
    row = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] in THROUGHPUT_ROWS:
            row.setdefault(THROUGHPUT_ROWS[cells[0]], float(cells[1]))
    bandwidth = re.search(r"measured copy bandwidth ([\d.]+) TB/s", text)
    device = re.search(r"^device: ([^,]+), date ([\d-]+)", text, re.M)
    row.update(bandwidth_tb_s=float(bandwidth.group(1)) if bandwidth else None,
               is_complete="INCOMPLETE" not in text,
               device=device.group(1) if device else None, date=device.group(2) if device else None)
    return row


def read_reused(paths) -> tuple[dict, dict]:
    """({(model, tp): throughput row}, {(model, tp): profile}) from earlier outputs."""
    throughput, profiles = {}, {}
    for path in map(Path, paths):
        if path.is_dir():
            for file in sorted(path.glob("*_tp*.md")):
                match = re.fullmatch(r"(?:throughput_)?(.+)_tp(\d+)\.md", file.name)
                if match:
                    throughput[match[1], int(match[2])] = read_throughput(file.read_text()) | \
                        dict(source=str(file))
            for file in sorted(path.glob("profile_*_tp*.json")):
                result = json.loads(file.read_text())
                profiles[result["model"], result["tensor_parallel_size"]] = result
        else:
            sections = re.split(r"^### (\S+)_tp(\d+)\s*$", path.read_text(), flags=re.M)
            for model, size, text in zip(sections[1::3], sections[2::3], sections[3::3]):
                text = re.split(r"^## ", text, flags=re.M)[0]
                throughput[model, int(size)] = read_throughput(text) | dict(source=str(path))
    return throughput, profiles


def run_child(command, limit: float, log, name: str, interrupt: bool) -> int:
    """One measurement process under a time limit: SIGINT (throughput.py then reports what it
    ran) or SIGTERM at the limit, SIGKILL a minute later."""
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, PYTHONUNBUFFERED="1", **NO_MULTICAST))
    try:
        code = process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT if interrupt else signal.SIGTERM)
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
    message = f"{name}: exit {code}, {time.perf_counter() - start:.0f} s (limit {limit:.0f} s)"
    print(message, flush=True)
    log.write(f"==== {message}\n")
    log.flush()
    return code


def measure(args, runs, out: Path, log) -> None:
    python = sys.executable
    for model, size in runs:
        name = f"{model}_tp{size}"
        if "throughput" in args.parts:
            limit = args.time_limit.get(model, DEFAULT_LIMITS.get(model, args.default_limit))
            run_child([python, "benchmarks/throughput.py", "--model", model,
                       "--tensor-parallel-size", str(size), *args.throughput_flags.split(),
                       "--out", str(out / f"throughput_{name}.md")], limit, log,
                      f"throughput {name}", interrupt=True)
        if "profile" in args.parts and size > 1:
            layers = args.profile_layers.get(model, 0)
            run_child([python, "benchmarks/collective_share.py", "--model", model,
                       "--tensor-parallel-size", str(size), "--num-layers", str(layers),
                       *args.profile_flags.split(), "--out", str(out / f"profile_{name}.json")],
                      args.profile_limit, log, f"profile {name}", interrupt=False)


def percent(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def number(row, key, spec) -> str:
    return "" if row.get(key) is None else format(row[key], spec)


def tables(runs, throughput, profiles) -> list[str]:
    lines = ["| model | TP | output tok/s | excl. compile | decode step (ms) | floor (ms) | ratio "
             "| all-reduce share | copy BW (TB/s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, size in runs:
        row, profile = throughput.get((model, size), {}), profiles.get((model, size))
        share = ("0 (no collectives)" if size == 1 else "not measured" if profile is None
                 else percent(profile["all_reduce_share"]))
        cells = ["not measured"] if not row else [
            number(row, "tokens_s", ".0f") + ("" if row["is_complete"] else " (incomplete)"),
            number(row, "tokens_s_warm", ".0f"), number(row, "step_ms", ".2f"),
            number(row, "floor_ms", ".2f"), number(row, "ratio", ".2f")]
        cells += [""] * (5 - len(cells))
        lines.append(f"| {model} | {size} | {' | '.join(cells)} | {share} | "
                     f"{number(row, 'bandwidth_tb_s', '.2f')} |")
    lines += ["", "Tokens/s, step, floor and ratio come from the trace run (throughput.py; the "
              "floor is one GPU's weight and KV bytes over the copy bandwidth that run "
              "measured); the all-reduce share from the profile below, at one batch and context.",
              "", "All-reduce profiles (collective_share.py; per decode step on the first GPU):",
              "", "| model | TP | layers | batch | mean context | timed step (ms) | GPU busy (ms) "
              "| all-reduce (ms) | all collectives (ms) | all-reduce share | collectives share |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (model, size), p in sorted(profiles.items()):
        lines.append(
            f"| {model} | {size} | {p['num_layers']} of {p['full_num_layers']} | {p['batch']} | "
            f"{p['mean_context']:.0f} | {p['step_ms']:.2f} | {number(p, 'busy_ms', '.2f')} | "
            f"{number(p, 'all_reduce_ms', '.2f')} | {number(p, 'collectives_ms', '.2f')} | "
            f"{percent(p['all_reduce_share'])} | {percent(p['collectives_share'])} |")
    if not profiles:
        lines.append("| none | | | | | | | | | | |")
    return lines


def sources(runs, throughput, profiles) -> list[str]:
    """Where every number came from: this call, or which earlier file (with its device, date)."""
    lines = []
    for model, size in runs:
        row = throughput.get((model, size))
        if row:
            lines.append(f"- {model} TP={size} throughput: {row['source']} ({row['device']}, "
                         f"{row['date']})")
        if (model, size) in profiles:
            profile = profiles[model, size]
            lines.append(f"- {model} TP={size} profile: {profile['device']}, {profile['date']}, "
                         f"kernels {profile['kernels']}")
    return lines


def _value(row, key) -> float:
    return float("nan") if row.get(key) is None else row[key]


def plot(runs, throughput, profiles, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, step, share) = plt.subplots(1, 3, figsize=(16, 4.5))
    for model in dict.fromkeys(model for model, _ in runs):
        sizes = [s for m, s in runs if m == model and (m, s) in throughput]
        rows = [throughput[model, s] for s in sizes]
        if rows:
            warm = [_value(r, "tokens_s_warm") for r in rows]
            line, = rate.plot(sizes, warm, marker="o", label=model)
            rate.plot(sizes, [warm[0] * s / sizes[0] for s in sizes], linestyle=":",
                      color=line.get_color(), label=f"{model}, linear from TP={sizes[0]}")
            step.plot(sizes, [_value(r, "step_ms") for r in rows], marker="o",
                      color=line.get_color(), label=f"{model} step")
            step.plot(sizes, [_value(r, "floor_ms") for r in rows], marker="x", linestyle="--",
                      color=line.get_color(), label=f"{model} floor")
        measured = [s for m, s in runs if m == model and
                    (s == 1 or profiles.get((m, s), {}).get("all_reduce_share") is not None)]
        share.plot(measured, [0 if s == 1 else 100 * profiles[model, s]["all_reduce_share"]
                              for s in measured], marker="o", label=model)
    for ax, label in ((rate, "output tokens/s, compile excluded"),
                      (step, "mean decode step, device (ms)"),
                      (share, "all-reduce share of GPU busy time (%)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({size for _, size in runs}),
                      [str(size) for size in sorted({size for _, size in runs})])
        ax.set_xlabel("tensor-parallel size")
        ax.set_ylabel(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(args, probe, planned, runs, skipped, throughput, profiles) -> str:
    multicast = " ".join(f"{key}={value}" for key, value in NO_MULTICAST.items())
    lines = [
        "# Tensor-parallel scaling\n",
        f"- This call's machine: {probe['count']} x {probe['kind']}; date "
        f"{datetime.date.today()}; python {probe['python']}, jax {probe['jax']}, flax "
        f"{probe['flax']}; NCCL NVLink multicast off ({multicast}).",
        f"- Command: `python benchmarks/tp_scaling.py {shlex.join(sys.argv[1:])}`",
        f"- Measured in this call: {' and '.join(args.parts) or 'nothing'} for "
        f"{', '.join(f'{m} TP={s}' for m, s in planned) or 'no run'}.",
        *([f"- Not run (more devices needed than the {probe['count']} visible): "
           f"{', '.join(f'{m} TP={s}' for m, s in skipped)}."] if skipped else []),
        "", *tables(runs, throughput, profiles), "", "Sources:", "",
        *sources(runs, throughput, profiles)]
    return "\n".join(lines) + "\n"


def key_values(pairs) -> dict:
    return {key: float(value) for key, value in (pair.split("=") for pair in pairs)}


def main(argv=None):
    parser = argparse.ArgumentParser(description="tensor-parallel scaling runs")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="MODEL:TP[,TP...] ...")
    parser.add_argument("--parts", default="throughput,profile",
                        help="what to measure: throughput, profile, both, or '' (report only)")
    parser.add_argument("--reuse", nargs="*", default=[],
                        help="earlier output directories or markdown files with ### MODEL_tpN")
    parser.add_argument("--time-limit", nargs="*", default=[], help="MODEL=SECONDS ...")
    parser.add_argument("--default-limit", type=float, default=110)
    parser.add_argument("--throughput-flags", default="--num-requests 256")
    parser.add_argument("--profile-flags", default="--batch 64 --steps 10")
    parser.add_argument("--profile-layers", nargs="*", default=[],
                        help="MODEL=N: profile only the first N layers of MODEL")
    parser.add_argument("--profile-limit", type=float, default=240)
    args = parser.parse_args(argv)
    args.parts = [part for part in args.parts.split(",") if part]
    args.time_limit = key_values(args.time_limit)
    args.profile_layers = {k: int(v) for k, v in key_values(args.profile_layers).items()}
    out = Path(args.out_dir).resolve()   # the children run in the repository root
    out.mkdir(parents=True, exist_ok=True)
    probe = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1])
    requested = parse_runs(args.runs)
    planned = [run for run in requested if run[1] <= probe["count"]] if args.parts else []
    with open(out / "run.log", "a") as log:
        measure(args, planned, out, log)
    throughput, profiles = read_reused(args.reuse)
    mine, my_profiles = read_reused([out])   # this call's (and earlier calls' into out)
    throughput, profiles = throughput | mine, profiles | my_profiles
    runs = [run for run in requested if run in planned or run in throughput or run in profiles]
    skipped = [run for run in requested if run[1] > probe["count"] and run not in runs]
    text = report(args, probe, planned, runs, skipped, throughput, profiles)
    (out / "tp_scaling.md").write_text(text)
    plot(runs, throughput, profiles, out / "tp_scaling.png")
    print(text)


if __name__ == "__main__":
    main()
