#!/usr/bin/env python3
"""What exact GIL and GC tracing cost the target, at high switch and collection rates.

Usage: bench/gil_gc_overhead.py [--python PY] [--rounds 3] [--duration 8] [--enginescope BIN]

Target: samples/switch_churn.py (4 threads, switch interval 0.5 ms, 20 reference cycles per
unit): thousands of GIL hand-offs and hundreds of collections per second. Configs, interleaved
in rounds: no profiler; `record --rate 100 --no-gil --no-gc` (sampling and off-CPU only);
`record --rate 100 --no-gc` (+ GIL waits); `record --rate 100 --no-gil` (+ GC pauses);
`record --rate 100` (everything). The profiler attaches after READY and records for the whole
window. Reported: median throughput, slowdown against no profiler, the events per second the
recording holds (GIL waits, GC pauses), and the recorder's CPU seconds per second.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [
    ("no profiler", None),
    ("sampling only (--no-gil --no-gc)", ["--no-gil", "--no-gc"]),
    ("+ GIL waits (--no-gc)", ["--no-gc"]),
    ("+ GC pauses (--no-gil)", ["--no-gil"]),
    ("GIL waits + GC pauses", []),
]


def run(args, extra):
    d = tempfile.mkdtemp(prefix="es-gilgc-")
    tgt = subprocess.Popen([args.python, os.path.join(ROOT, "samples/switch_churn.py"), "--duration",
                            str(args.duration)], stdout=subprocess.PIPE, text=True)
    assert tgt.stdout.readline().strip() == "READY"
    rec = None
    if extra is not None:
        out = os.path.join(d, "r.esrec")
        rec = subprocess.Popen([args.enginescope, "record", "--backend", "bpf", "--pid", str(tgt.pid), "--rate", "100",
                                "--duration", str(args.duration + 5), "--json", "-o", out] + extra,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    result = json.loads(tgt.stdout.readline())
    tgt.wait()
    summary, cpu = None, None
    if rec is not None:
        so = rec.stdout.read()
        _, status, ru = os.wait4(rec.pid, 0)
        summary = json.loads(so)
        cpu = (ru.ru_utime + ru.ru_stime) / summary["duration_s"]
    return result, summary, cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--enginescope", default=os.path.join(ROOT, "target/release/enginescope"))
    args = ap.parse_args()
    res = {name: [] for name, _ in CONFIGS}
    for r in range(args.rounds):
        for name, extra in CONFIGS:
            result, summary, cpu = run(args, extra)
            res[name].append((result, summary, cpu))
            print("round %d %-36s %8.0f it/s" % (r + 1, name, result["iterations_per_s"]), file=sys.stderr)
    base = statistics.median(x[0]["iterations_per_s"] for x in res["no profiler"])
    gc_rate = statistics.median(x[0]["gc_collections"] / x[0]["window_s"] for x in res["no profiler"])
    ver = res["no profiler"][0][0]["python"]
    print("Python %s, samples/switch_churn.py (4 threads, switch interval 0.5 ms), %d rounds of %.0f s, "
          "%.0f collections/s without a profiler" % (ver, args.rounds, args.duration, gc_rate))
    print()
    print("| config | median it/s | slowdown | GIL waits/s recorded | GC pauses/s recorded | recorder CPU s/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, _ in CONFIGS:
        runs = res[name]
        its = statistics.median(x[0]["iterations_per_s"] for x in runs)
        if runs[0][1] is None:
            print("| %s | %.0f | - | - | - | - |" % (name, its))
            continue
        gw = statistics.median(x[1]["counters"].get("bpf_gil_waits", 0) / x[1]["duration_s"] for x in runs)
        gp = statistics.median(x[1]["counters"].get("bpf_gc_edges", 0) / 2 / x[1]["duration_s"] for x in runs)
        cpu = statistics.median(x[2] for x in runs)
        print("| %s | %.0f | %.1f%% | %.0f | %.0f | %.3f |" % (name, its, (1 - its / base) * 100, gw, gp, cpu))


if __name__ == "__main__":
    main()
