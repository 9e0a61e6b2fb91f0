#!/usr/bin/env bash
# The throughput runs and compiled parity of tp_scaling_h200x2.md, on a machine with 2 GPUs:
# (1) compiled TP parity (tests/parallel_worker.py on the tiny GQA checkpoint, Pallas GPU kernels:
# TP=1 and 2 greedy tokens, shardings, and two data-parallel replicas behind the server app),
# then (2) benchmarks/throughput.py on the 256-request ShareGPT-like trace: llama3-70b at TP=2,
# llama3-8b at TP=2 and TP=1. Writes env.txt, parity.json, run.log, one table per run and
# summary.md into OUT_DIR. Each throughput run has its own time limit (seconds: LIMIT_70B,
# LIMIT_8B), after which it reports the steps it ran, marked incomplete.
#
# Usage, from the repository root: bash benchmarks/results/tp_scaling_h200x2.sh OUT_DIR
# CHECKPOINT (a tiny GQA checkpoint already written, e.g. by tests/hf_fixtures.py), PYTHON,
# BIG/SMALL (presets) and FLAGS (extra throughput.py flags) override the defaults; a CPU rehearsal
# uses XLA_FLAGS=--xla_force_host_platform_device_count=2 BIG=tiny SMALL=tiny and small flags.
set -u -o pipefail
out=${1:?usage: $0 OUT_DIR}
python=${PYTHON:-python3}
# NVLink multicast stays off (it can take a host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
mkdir -p "$out"
# The server app (data-parallel check) needs fastapi; where the GPU machine lacks it, wheels put
# in .whl/ are installed first.
if [ -d .whl ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
log="$out/run.log"

{
  date -u +"date: %Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | sed 's/^/gpu: /'
  nvidia-smi topo -m
  "$python" -c 'import platform, jax, flax
print(f"python {platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}, "
      f"devices {jax.devices()}")'
  echo "git: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +dirty)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# (1) parity: tiny float32 checkpoints written with transformers, then the TP worker.
start=$SECONDS
checkpoint=${CHECKPOINT:-}
if [ -z "$checkpoint" ]; then
  checkpoint=$(mktemp -d)/llama_gqa
  "$python" -c "from pathlib import Path; from tests import hf_fixtures
Path('$checkpoint').mkdir(parents=True); hf_fixtures.build_llama_gqa(Path('$checkpoint'))" \
    >> "$log" 2>&1
fi
"$python" -m tests.parallel_worker tp "$checkpoint" 2>> "$log" | tail -n 1 > "$out/parity.json"
echo "parity worker: exit ${PIPESTATUS[0]}, $((SECONDS - start)) s" | tee -a "$log"
"$python" - "$out/parity.json" <<'EOF' | tee "$out/summary.md"
import json, sys
report = json.load(open(sys.argv[1]))
sizes = [key for key in ("1", "2", "4") if key in report]
same = all(report[s]["tokens"] == report["1"]["tokens"] for s in sizes)
print(f"TP parity on GPU (tiny GQA float32, Pallas kernels): sizes {sizes}, greedy tokens "
      f"{'identical' if same else 'DIFFER'}; TP=2 cache spec {report['2']['cache_spec']}, "
      f"shard shape {report['2']['cache_shard_shape']}, shard_maps {report['2']['shard_maps']}; "
      f"DP replicas on devices {report['dp']['devices']}, routed {report['dp']['num_routed']}, "
      f"texts equal TP=1: {report['dp']['texts'] == report['1']['texts']}; "
      f"dummy weights equal on a mesh: {report['dummy_same_on_mesh']}")
if not same:
    for size in sizes:
        print(size, report[size]["tokens"])
EOF

# (2) throughput on the trace, one process per run (each frees its GPUs when it exits).
run() {  # name, time limit, flags...
  local name=$1 limit=$2
  shift 2
  start=$SECONDS
  # shellcheck disable=SC2086  # FLAGS is split on purpose
  timeout -s INT "$limit" "$python" benchmarks/throughput.py --num-requests 256 "$@" ${FLAGS:-} \
    --out "$out/$name.md" >> "$log" 2>&1
  echo "$name: exit $?, $((SECONDS - start)) s" | tee -a "$log"
}
big=${BIG:-llama3-70b}
small=${SMALL:-llama3-8b}
run "${big}_tp2" "${LIMIT_70B:-240}" --model "$big" --tensor-parallel-size 2
run "${small}_tp2" "${LIMIT_8B:-110}" --model "$small" --tensor-parallel-size 2
run "${small}_tp1" "${LIMIT_8B:-110}" --model "$small" --tensor-parallel-size 1

{
  echo
  echo "| run | output tok/s | excl. compile | mean decode step (ms) | floor (ms) | ratio |" \
    "compile (s) |"
  echo "|---|---:|---:|---:|---:|---:|---:|"
  for name in "${big}_tp2" "${small}_tp2" "${small}_tp1"; do
    file="$out/$name.md"
    [ -f "$file" ] || { echo "| $name | not finished | | | | | |"; continue; }
    value() { grep -F "| $1 |" "$file" | head -n 1 | awk -F'|' '{gsub(/ /, "", $3); print $3}'; }
    echo "| $name | $(value 'output tokens/s') | $(value 'output tokens/s excluding compile') |" \
      "$(value 'mean decode step, device (ms)') | $(value 'mean decode floor (ms)') |" \
      "$(value 'decode time / floor') | $(value 'compile time inside the run (s)') |"
  done
} | tee -a "$out/summary.md"
