#!/usr/bin/env python3
"""The agent's footprint as engines are added (issue 25): N bundled engines (samples/engine,
each an API server, an engine core and a worker with their own load) under one
`enginescope agent --vllm` at its defaults, for each N of --engines.

For each N it starts the engines (each prints READY once warmed up), starts the agent, waits
for its "sampling started" line, and then measures over --seconds:

* the agent's CPU (user + system from /proc/PID/stat, per second of the window),
* its heap (RssAnon) at the window's start and end, and its VmRSS at the end,
* the bytes its segment directory grew by, per second and per engine,
* the engines' own CPU over the same window (every process of every engine, from /proc), and
  what the agent's `enginescope_thread_cpu_seconds_total` advanced by over it (it advances
  once per aggregated interval, so the window is read between two interval edges: the
  window's length is a multiple of --profile-seconds and both reads wait for an edge),
* lost samples (`enginescope_samples_lost_total`).

Usage:
  bench/agent_engines.py [--engines 1,4,8] [--seconds 60] [--python PY] [--enginescope BIN]

Runs as root. Uses only the Python standard library. Nothing waits by sleeping for readiness:
engines print READY, the agent prints its lines; the sampling of /proc is the measurement's
own pace.
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def status_kb(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def dir_bytes(d):
    total = 0
    for dirpath, _, files in os.walk(d):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def metrics(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        return r.read().decode()


def total(text, name):
    s = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            try:
                s += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return s


def wait_line(proc, needle, within, log):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        log.append(line)
        if needle in line:
            return line
    sys.exit(f"no line with {needle!r} within {within} s:\n{''.join(log)}")


def run(n, args, tmp):
    engines = []
    for i in range(n):
        truth = os.path.join(tmp, f"truth{i}")
        p = subprocess.Popen(
            [args.python, os.path.join(ROOT, "samples/engine/serve.py"), "serve", "--port", "0",
             "--requests", str(args.requests), "--seconds", str(args.seconds + 120),
             "--truth", truth],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        while True:
            line = p.stdout.readline()
            if not line:
                sys.exit(f"engine {i} ended before READY")
            if line.startswith("READY"):
                break
        engines.append(p)
    seg = os.path.join(tmp, f"segs{n}")
    agent = subprocess.Popen(
        [args.enginescope, "agent", "--vllm", "--listen", "127.0.0.1:0", "--dir", seg,
         "--profile-seconds", str(args.profile_seconds)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = []
    line = wait_line(agent, "serving metrics on http://", 60, log)
    addr = re.search(r"http://([^/]+)/", line).group(1)
    wait_line(agent, "sampling started", 120, log)
    # Drain the agent's stderr from here on (a full pipe would block it).
    drain = subprocess.Popen(["cat"], stdin=agent.stderr, stdout=subprocess.DEVNULL)
    # Warm-up, then the window between two interval edges of the exported counters.
    time.sleep(args.warmup)  # the measurement's pace, not readiness

    def edge():
        before = total(metrics(addr), "enginescope_thread_cpu_seconds_total")
        deadline = time.monotonic() + 3 * args.profile_seconds
        while time.monotonic() < deadline:
            time.sleep(0.1)  # polling the exporter for its next interval
            now = total(metrics(addr), "enginescope_thread_cpu_seconds_total")
            if now != before:
                return now
        return before

    exported0 = edge()
    procs = [q for e in engines for q in descendants(e.pid)]
    t0 = time.monotonic()
    a0, e0 = cpu_s(agent.pid), sum(cpu_s(q) for q in procs)
    heap0, disk0 = status_kb(agent.pid, "RssAnon"), dir_bytes(seg)
    lost0 = total(metrics(addr), "enginescope_samples_lost_total")
    time.sleep(args.seconds - args.profile_seconds / 2)  # the window's length
    exported1 = edge()
    t1 = time.monotonic()
    a1, e1 = cpu_s(agent.pid), sum(cpu_s(q) for q in procs)
    heap1, vmrss, disk1 = status_kb(agent.pid, "RssAnon"), status_kb(agent.pid, "VmRSS"), dir_bytes(seg)
    lost1 = total(metrics(addr), "enginescope_samples_lost_total")
    span = t1 - t0
    agent.send_signal(signal.SIGINT)
    try:
        agent.wait(timeout=30)
    except subprocess.TimeoutExpired:
        agent.kill()
    drain.wait()
    for e in engines:
        try:
            os.killpg(e.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for e in engines:
        try:
            e.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(e.pid, signal.SIGKILL)
    return {
        "engines": n,
        "processes": len(procs),
        "window_s": span,
        "agent_cpu_s_per_s": (a1 - a0) / span,
        "heap_mib": (heap0 / 1024, heap1 / 1024),
        "vmrss_mib": vmrss / 1024,
        "disk_kb_s_per_engine": (disk1 - disk0) / 1024 / span / n,
        "engines_cpu_s": e1 - e0,
        "exported_cpu_s": exported1 - exported0,
        "lost": lost1 - lost0,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="1,4,8")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--profile-seconds", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=16, help="each engine's requests in flight")
    ap.add_argument("--python", default=os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12"))
    ap.add_argument("--enginescope", default=os.path.join(ROOT, "target/release/enginescope"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="es-agent-engines-")
    binary = os.path.join(tmp, "enginescope")
    shutil.copy(args.enginescope, binary)
    args.enginescope = binary
    print("| engines | processes | window s | agent CPU s/s | heap MiB start → end | VmRSS MiB "
          "| disk KB/s per engine | engines' CPU s (/proc) | exported CPU s | lost |")
    print("|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    try:
        for n in [int(x) for x in args.engines.split(",")]:
            r = run(n, args, tmp)
            print(f"| {r['engines']} | {r['processes']} | {r['window_s']:.1f} "
                  f"| {r['agent_cpu_s_per_s']:.3f} | {r['heap_mib'][0]:.1f} → {r['heap_mib'][1]:.1f} "
                  f"| {r['vmrss_mib']:.1f} | {r['disk_kb_s_per_engine']:.2f} "
                  f"| {r['engines_cpu_s']:.1f} | {r['exported_cpu_s']:.1f} | {r['lost']:.0f} |",
                  flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
