#!/usr/bin/env bash
# The run behind serve_bench_llama3-8b_h200.md: serve a random-weight Llama-3-8B-shaped model
# (`python -m jpaged.serve --load-format dummy`), sweep request rates with serve_bench.py, stop the
# server. Writes env.txt, server.log, table.md and plot.png into OUT_DIR.
#
# Usage, from the repository root: bash benchmarks/results/serve_bench_llama3-8b_h200.sh OUT_DIR
# PRESET, SERVER_FLAGS, BENCH_FLAGS, PORT, PYTHON and STARTUP_TIMEOUT override the defaults (a
# CPU rehearsal uses PRESET=tiny and small flags).
set -u -o pipefail
out=${1:?usage: $0 OUT_DIR}
python=${PYTHON:-python3}
preset=${PRESET:-llama3-8b}
port=${PORT:-8000}
server_flags=${SERVER_FLAGS:-"--dtype bfloat16 --max-num-seqs 64 --max-model-len 2048 \
--max-num-batched-tokens 1024"}
bench_flags=${BENCH_FLAGS:-"--request-rate 1,2,4,8,16,inf --num-requests 32 --max-input-len 1024 \
--max-output-len 512 --max-token-id 128000 --timeout 120"}
mkdir -p "$out"

{
  date -u +"date: %Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    | sed 's/^/gpu: /'
  "$python" -c 'import platform, jax, flax, fastapi, uvicorn
print(f"python {platform.python_version()}, jax {jax.__version__}, flax {flax.__version__}, "
      f"fastapi {fastapi.__version__}, uvicorn {uvicorn.__version__}, backend "
      f"{jax.default_backend()}: {jax.devices()[0].device_kind}")'
  echo "git: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo +dirty)"
  echo "server flags: --load-format dummy $server_flags"
  echo "bench flags: $bench_flags"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

model_dir=$(mktemp -d)
"$python" benchmarks/serve_bench.py --write-model-dir "$model_dir" --preset "$preset" || exit 1

# shellcheck disable=SC2086  # the flag strings are split on purpose
"$python" -m jpaged.serve --model "$model_dir" --served-model-name "$preset-dummy" \
  --load-format dummy --port "$port" --uvicorn-log-level warning $server_flags \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$model_dir"' EXIT

# Healthy = weights drawn and every bucket compiled (the server binds its port only then).
start=$SECONDS
until "$python" -c "import sys, urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', \
timeout=1)" 2>/dev/null; do
  if ! kill -0 "$server" 2>/dev/null; then
    echo "server exited during start-up:"; tail -n 40 "$out/server.log"; exit 1
  fi
  if (( SECONDS - start > ${STARTUP_TIMEOUT:-480} )); then
    echo "server not healthy after $((SECONDS - start)) s:"; tail -n 40 "$out/server.log"; exit 1
  fi
  sleep 2
done
echo "server healthy after $((SECONDS - start)) s"

# shellcheck disable=SC2086
"$python" benchmarks/serve_bench.py --base-url "http://127.0.0.1:$port" $bench_flags \
  --out "$out/table.md" --plot "$out/plot.png" \
  --plot-title "jpaged, $preset shape, random weights, serve_bench"
status=$?
echo "serve_bench exit status $status; server log tail:"
tail -n 15 "$out/server.log"
exit "$status"
