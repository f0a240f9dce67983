#!/usr/bin/env python3
"""What holding one probe watchpoint costs a thread that spins on sched_yield (vLLM's
shm_broadcast busy-wait), against sampling alone and nothing, in interleaved arms.

Usage: bench/watch_yield_cost.py [--python PY] [--rounds 4] [--arm-s 6] [--cpu 1]
                                 [--enginescope target/release/enginescope]

A target thread loops on os.sched_yield() with a competing process pinned to the same CPU
(so each yield switches tasks), and every 1,000 yields calls `marker()` (~50 µs of Python):
one probed call per 1,000 switches. It prints its yield count with the wall clock every
second. Arms, in order each round: nothing; `record --probe spin:marker --exact-probes`
(the watchpoint held all the time: two traps per marker call, and every context switch of the
thread with a debug register armed); `record` sampling only. All records use
`--no-offcpu --no-gil --no-gc --rate 999`. The rate of each arm is the mean of the target's
per-second rates inside it (its first 1.5 s and last 0.5 s left out: start-up, shutdown).
Prints yields/s per arm and round, and what the probe's traps alone would explain (marker
calls x 2 x the calibrated trap cost): the rest is what the armed register costs each switch.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SPIN = r'''
import os, sys, time
def marker():
    x = 0
    for i in range(2000):
        x += i
    return x
dur = float(sys.argv[1])
print("READY", flush=True)
n = 0
t0 = last = time.monotonic()
while True:
    os.sched_yield()
    n += 1
    if n % 1000 == 0:
        marker()
        now = time.monotonic()
        if now - last >= 1.0:
            print("RATE", n, time.time(), flush=True)
            last = now
            if now - t0 > dur:
                break
'''

HOG = "import os\nwhile True:\n    os.sched_yield()\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--arm-s", type=float, default=6.0)
    ap.add_argument("--cpu", type=int, default=1)
    ap.add_argument("--enginescope", default=os.path.join(ROOT, "target/release/enginescope"))
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="es-yield-")
    spin_py = os.path.join(work, "spin.py")
    with open(spin_py, "w") as f:
        f.write(SPIN)
    total = a.rounds * 3 * (a.arm_s + 1.5) + 10
    pin = ["taskset", "-c", str(a.cpu)]
    hog = subprocess.Popen(pin + [a.python, "-c", HOG])
    spin = subprocess.Popen(pin + [a.python, spin_py, str(total)], stdout=subprocess.PIPE, text=True)
    assert spin.stdout.readline().startswith("READY")
    rates = []

    def reader():
        prev = None
        for line in spin.stdout:
            f = line.split()
            if f and f[0] == "RATE":
                n, t = int(f[1]), float(f[2])
                if prev:
                    rates.append((t, (n - prev[0]) / (t - prev[1])))
                prev = (n, t)

    import threading
    threading.Thread(target=reader, daemon=True).start()
    base = [a.enginescope, "record", "--pid", str(spin.pid), "--no-offcpu", "--no-gil", "--no-gc",
            "--rate", "999", "--duration", str(int(a.arm_s))]
    arms = {
        "nothing": None,
        "probe (watchpoint held)": ["--probe", "spin.py:marker", "--exact-probes"],
        "sampling only": [],
    }
    spans = []
    traps = []
    try:
        for r in range(a.rounds):
            for name, extra in arms.items():
                s = time.time()
                if extra is None:
                    time.sleep(a.arm_s + 0.3)
                else:
                    out = os.path.join(work, "r.esrec")
                    p = subprocess.run(base + extra + ["-o", out], capture_output=True, text=True)
                    if p.returncode != 0:
                        sys.exit("record failed: " + p.stderr[-500:])
                    if extra:
                        j = subprocess.run([a.enginescope, "report", out, "--format", "json"],
                                           capture_output=True, text=True)
                        import json
                        rep = json.loads(j.stdout)
                        c = rep.get("counters", {})
                        calls = sum(x["calls"] for x in rep.get("function_latency", []))
                        traps.append((calls, c.get("probe_trap_cost_ns", 0), a.arm_s))
                spans.append((r, name, s, time.time()))
    finally:
        spin.kill()
        hog.kill()
    time.sleep(0.2)
    by = {}
    for r, name, s, e in spans:
        v = [x for t, x in rates if s + 1.5 <= t <= e - 0.5]
        if v:
            by.setdefault(name, []).append(statistics.mean(v))
    print("| arm | yields/s per round (thousands) | mean | vs nothing |")
    print("|---|---|---:|---:|")
    ref = statistics.mean(by.get("nothing", [float("nan")]))
    for name, v in by.items():
        m = statistics.mean(v)
        print("| %s | %s | %.0f | %.2fx |" % (name, ", ".join("%.0f" % (x / 1000) for x in v), m / 1000, m / ref))
    if traps:
        share = statistics.mean(2 * c * t / 1e9 / d for c, t, d in traps)
        print("\nThe probe's traps alone: %.1f%% of the thread's time (marker calls x 2 x %d ns)."
              % (share * 100, traps[0][1]))


if __name__ == "__main__":
    main()
