#!/usr/bin/env python3
"""Highest sustained sampling rate without loss, and the recorder's own cost and memory.

Usage: bench/max_rate.py [--python PY] [--rates 1000,2000,5000,10000,20000] [--duration 5]
                         [--enginescope BIN]

For each rate: a fresh samples/cpu_bound.py (4 threads, GIL-bound: about one busy core) prints
READY; `enginescope record --rate R --duration D --json` samples it; the summary's counters say
how many samples the kernel took (bpf_samples), how many reached the recording (samples) and how
many were dropped because the ring buffer was full (bpf_ringbuf_full_lost). Also reported: the
recorder's CPU seconds per second and max RSS (os.wait4), and samples per second of target CPU.
A rate is sustained when nothing was lost and every kernel sample was recorded.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_s(pid):
    """utime + stime of a process, seconds."""
    with open("/proc/%d/stat" % pid) as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12"))
    ap.add_argument("--rates", default="1000,2000,5000,10000,20000")
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--enginescope", default=os.path.join(ROOT, "target/release/enginescope"))
    args = ap.parse_args()
    ver = subprocess.run([args.python, "-c", "import sys; print(sys.version.split()[0])"],
                         capture_output=True, text=True).stdout.strip()
    print("Python %s, samples/cpu_bound.py --threads 4, %.0f s per rate, `%s record --backend bpf`"
          % (ver, args.duration, os.path.relpath(args.enginescope, ROOT)))
    print()
    print("| rate Hz | expected (rate x target CPU s) | kernel samples | recorded | lost (ring full) | recorder CPU s/s | recorder max RSS MB | bytes/sample |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    best = None
    for rate in [int(r) for r in args.rates.split(",")]:
        d = tempfile.mkdtemp(prefix="es-maxrate-")
        tgt = subprocess.Popen([args.python, os.path.join(ROOT, "samples/cpu_bound.py"), "--threads", "4",
                                "--duration", str(args.duration + 3)], stdout=subprocess.PIPE, text=True)
        try:
            assert tgt.stdout.readline().strip() == "READY"
            out = os.path.join(d, "r.esrec")
            c0 = cpu_s(tgt.pid)
            rec = subprocess.Popen([args.enginescope, "record", "--backend", "bpf", "--pid", str(tgt.pid),
                                    "--rate", str(rate), "--duration", str(args.duration), "--json", "-o", out],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            so = rec.stdout.read()  # small: the JSON summary
            se = rec.stderr.read()
            _, status, ru = os.wait4(rec.pid, 0)
            target_cpu = cpu_s(tgt.pid) - c0
            rec.returncode = os.waitstatus_to_exitcode(status)
            if rec.returncode != 0:
                print("| %d | failed: %s |" % (rate, se.strip().splitlines()[-1:]))
                continue
            s = json.loads(so)
        finally:
            tgt.kill()
            tgt.wait()
        c = s["counters"]
        cpu = (ru.ru_utime + ru.ru_stime) / s["duration_s"]
        print("| %d | %.0f | %d | %d | %d | %.3f | %.1f | %.1f |" % (
            rate, rate * target_cpu, c.get("bpf_samples", 0), s["samples"], c.get("bpf_ringbuf_full_lost", 0),
            cpu, ru.ru_maxrss / 1024, s["bytes"] / max(1, s["samples"])))
        if c.get("bpf_ringbuf_full_lost", 0) == 0 and s["samples"] >= c.get("bpf_samples", 0):
            best = rate
    print()
    print("highest sustained rate without loss: %s Hz" % best)


if __name__ == "__main__":
    sys.exit(main())
