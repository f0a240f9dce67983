#!/usr/bin/env python3
"""Time `enginescope dump` against py-spy 0.4.3's `dump` and Austin 3.7's `--where` on a
many-thread process.

Usage: bench/dump_latency.py [--python PY] [--runs N] [--peers VENV] [--threads N] [--depth D]
Starts samples/stacks.py with 8 + N threads (default N 42: 50 threads), each plain worker D
frames deep (it signals READY), then times each tool's dump of it N times, interleaved
(A B C A B C ...), and prints medians and ratios. enginescope never stops the target; `py-spy
dump` stops it (ptrace) unless --nonblocking; `austin --where` reads it without stopping it.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12"))
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--peers", default="/opt/es-peers", help="venv with py-spy==0.4.3")
    ap.add_argument("--enginescope", default=os.path.join(ROOT, "target/release/enginescope"))
    ap.add_argument("--threads", type=int, default=42, help="plain worker threads (8 more run)")
    ap.add_argument("--depth", type=int, default=0, help="frames deep each worker parks")
    ap.add_argument("--no-austin", action="store_true")
    args = ap.parse_args()

    d = tempfile.mkdtemp(prefix="es-bench-dump-")
    # 7 named threads + the workers + main (42 workers: 50 threads).
    p = subprocess.Popen([args.python, os.path.join(ROOT, "samples/stacks.py"), "--truth", d + "/truth.json",
                          "--threads", str(args.threads), "--depth", str(args.depth)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "READY"
        nthreads = len(os.listdir("/proc/%d/task" % p.pid))
        tools = {
            "enginescope dump": [args.enginescope, "dump", "--pid", str(p.pid)],
            "py-spy dump": [os.path.join(args.peers, "bin/py-spy"), "dump", "--pid", str(p.pid)],
            "py-spy dump --nonblocking": [os.path.join(args.peers, "bin/py-spy"), "dump", "--nonblocking", "--pid", str(p.pid)],
        }
        if not args.no_austin:
            tools["austin --where"] = [os.path.join(args.peers, "bin/austin"), "--where", str(p.pid)]
        times = {k: [] for k in tools}
        for _ in range(args.runs):
            for k, cmd in tools.items():
                t0 = time.perf_counter()
                r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                dt = time.perf_counter() - t0
                if r.returncode != 0:
                    sys.exit("%s failed: %s" % (k, r.stderr.decode()))
                times[k].append(dt * 1000)
        ver = subprocess.run([args.python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True).stdout.strip()
        base = statistics.median(times["enginescope dump"])
        print("Python %s, %d threads (workers %d frames deep), %d runs each, interleaved; wall time per dump (process start to exit)"
              % (ver, nthreads, args.depth, args.runs))
        print("| tool | median ms | p90 ms | ratio to enginescope |")
        print("|---|---|---|---|")
        for k, v in times.items():
            v.sort()
            print("| %s | %.1f | %.1f | %.2f |" % (k, statistics.median(v), v[int(0.9 * (len(v) - 1))], statistics.median(v) / base))
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
