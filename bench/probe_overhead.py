"""What `record --probe` costs the target, at 1,000 and 10,000 probed calls per second.

    sudo python3 bench/probe_overhead.py [--python PY] [--rounds 3] [--seconds 5] [--out FILE]

A child process calls `work()` (about 10 µs of pure-Python work per call) from one thread,
paced to RATE calls/s, for --seconds, and reports its own figures: calls made, the calling
thread's CPU time per call (its CPU clock, so a debug trap's kernel time counts) and the
median call time seen by the caller (perf_counter_ns around the call). Modes, interleaved per
round so drift hits all of them alike:

  baseline       nothing attached
  wrapper        the peer: the hand-written monkeypatch people use today, a decorator that
                 times every call with perf_counter_ns and appends it to a list (in-process)
  sampling       `enginescope record --rate 99` without probes (the floor for the modes below)
  exact          `enginescope record --rate 99 --probe work --probe-max-rate 0` (breakpoints on
                 every call, no cap)
  capped         `enginescope record --rate 99 --probe work` (default --probe-max-rate 2000:
                 above it the probe switches to sampling)

Per mode and rate: added CPU per call in the target (µs, against baseline of the same round),
added caller-seen call time (p50, µs), and for the enginescope modes how many calls the
recording holds against the child's own count. Medians over rounds. The figures go into
docs/benchmarks.md with this command.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ES = os.path.join(ROOT, "target", "release", "enginescope")

CHILD = r'''
import sys, time, threading, os, json
rate, seconds, wrap = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
times = []
def work():
    x = 0
    for i in range(250):
        x += i * i
    return x
if wrap:
    inner = work
    def work():
        t0 = time.perf_counter_ns()
        try:
            return inner()
        finally:
            times.append(time.perf_counter_ns() - t0)
    work.__qualname__ = "work_wrapper"
# Warm up, in the thread that is measured, until the profiler is attached (the parent writes a
# line on stdin then): a probe attaches to the threads it sees running the function.
go = threading.Event()
def wait_go():
    sys.stdin.readline()
    go.set()
threading.Thread(target=wait_go, daemon=True).start()
print("READY", flush=True)
while not go.is_set():
    work()
    time.sleep(0.001)
period = 1e9 / rate
seen = []
c0 = time.thread_time_ns()
start = time.perf_counter_ns()
next_t = start
n = 0
while time.perf_counter_ns() - start < seconds * 1e9:
    a = time.perf_counter_ns()
    work()
    seen.append(time.perf_counter_ns() - a)
    n += 1
    next_t += period
    d = next_t - time.perf_counter_ns()
    if d > 0:
        time.sleep(d / 1e9)
cpu = time.thread_time_ns() - c0
seen.sort()
print(json.dumps({"calls": n, "cpu_ns_per_call": cpu / n, "p50_ns": seen[len(seen) // 2]}), flush=True)
'''


def run(py, mode, rate, seconds):
    wrap = "1" if mode == "wrapper" else "0"
    child = subprocess.Popen(
        [py, "-c", CHILD, str(rate), str(seconds), wrap],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "READY"
    rec = None
    out = None
    if mode in ("sampling", "exact", "capped"):
        out = tempfile.mktemp(suffix=".esrec")
        cmd = [ES, "record", "--pid", str(child.pid), "--rate", "99", "-o", out, "--no-offcpu"]
        if mode in ("exact", "capped"):
            cmd += ["--probe", "work"]
        if mode == "exact":
            cmd += ["--probe-max-rate", "0"]
        rec = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        # Readiness: sampling started, and for probes the probe attached.
        want = "enginescope: probe " if mode != "sampling" else "sampling started"
        for line in rec.stderr:
            if want in line:
                break
    child.stdin.write("go\n")
    child.stdin.flush()
    res = json.loads(child.stdout.readline())
    child.wait()
    if rec:
        rec.send_signal(2)
        rest = rec.stderr.read()
        rec.wait()
        if mode != "sampling":
            # "enginescope: N probed calls timed (...)": every call, warm-up included.
            for line in rest.splitlines():
                if "probed calls timed" in line:
                    res["recorded_calls"] = int(line.split()[1])
        os.unlink(out)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    modes = ["baseline", "wrapper", "sampling", "exact", "capped"]
    results = {}
    for rnd in range(args.rounds):
        for rate in (1000, 10000):
            base = None
            for mode in modes:
                r = run(args.python, mode, rate, args.seconds)
                if mode == "baseline":
                    base = r
                r["added_cpu_us"] = (r["cpu_ns_per_call"] - base["cpu_ns_per_call"]) / 1e3
                r["added_p50_us"] = (r["p50_ns"] - base["p50_ns"]) / 1e3
                results.setdefault((rate, mode), []).append(r)
                print(rnd, rate, mode, json.dumps(r), flush=True)
    print()
    print("| calls/s | mode | added CPU per call (µs) | added call time p50 (µs) | calls recorded / made |")
    print("|---|---|---|---|---|")
    table = []
    for (rate, mode), rs in results.items():
        cpu = statistics.median(r["added_cpu_us"] for r in rs)
        p50 = statistics.median(r["added_p50_us"] for r in rs)
        rec = [r.get("recorded_calls") for r in rs]
        made = [r["calls"] for r in rs]
        recs = ", ".join(f"{a}/{b}" for a, b in zip(rec, made)) if mode in ("exact", "capped") else ""
        print(f"| {rate} | {mode} | {cpu:.1f} | {p50:.1f} | {recs} |")
        table.append({"rate": rate, "mode": mode, "added_cpu_us": cpu, "added_p50_us": p50, "rounds": rs})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
