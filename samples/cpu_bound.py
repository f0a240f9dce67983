"""Benchmark target: N threads doing the same pure-Python CPU work; it measures its own speed.

Usage: cpu_bound.py [--threads 4] --duration SECONDS [--progress-interval 0.1]

Each worker thread (OS name `cpu-worker-K`) repeats one unit of work, `handle_request()`, which
goes through a few nested functions (tokenize, score, update a dict), so a sampled stack is
about 8 Python frames deep counting threading's bootstrap frames. All workers share the GIL, so
the process uses about one core whatever --threads is; on a 2-core machine a profiler has the
other core, and what it costs the target shows up as lower throughput: ptrace stops, GIL or
cache disturbance, or competing for the CPU.

Protocol: once every worker has finished its first unit, starts the measurement window and
prints READY on stdout. The main thread then records (CLOCK_MONOTONIC ns, units completed by
all workers) every --progress-interval seconds, so a caller can compute throughput over any
sub-interval of the window (e.g. exactly while a profiler was attached). After --duration
seconds it prints one JSON line and exits 0:
  {"python", "pid", "threads", "window": {"start_mono_ns", "end_mono_ns"}, "duration_s",
   "iterations", "iterations_per_s", "per_thread": [iterations...],
   "progress": [[mono_ns, iterations], ...]}
"iterations" counts units completed inside the window. Nothing here sleeps to wait for
readiness.

Runs unchanged on CPython 3.10-3.15.
"""
import argparse
import json
import os
import sys
import threading
import time

mono = time.monotonic_ns

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")
STOP = False
ARRIVED = threading.Semaphore(0)


def set_comm(name):
    """Set this thread's OS name (what /proc/PID/task/TID/comm shows) and its Python name
    (threading), so the two agree."""
    threading.current_thread().name = name
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
            f.write(name[:15])
    except OSError:
        pass


# --- one unit of work: handle_request -> parse -> tokenize / score -> mix ------------------

def mix(h, v):
    return (h * 1000003 ^ v) & 0xFFFFFFFF


def score(token, weights):
    h = 0
    for ch in token:
        h = mix(h, ord(ch))
    weights[token] = weights.get(token, 0) + (h & 7)
    return h


def tokenize(seed):
    return [WORDS[(seed + i * 7) % len(WORDS)] for i in range(8)]


def parse(seed, weights):
    total = 0
    for token in tokenize(seed):
        total += score(token, weights)
    return total


def handle_request(seed, weights):
    return parse(seed, weights) % 65521


def worker_loop(counts, k):
    weights = {}
    seed = k
    handle_request(seed, weights)
    counts[k] += 1
    ARRIVED.release()
    while not STOP:
        seed = handle_request(seed, weights)
        counts[k] += 1


def thread_main(counts, k):
    set_comm("cpu-worker-%d" % k)
    worker_loop(counts, k)


# --- the main thread -----------------------------------------------------------------------

def record_progress(counts, deadline_ns, interval_s):
    """Samples (time, total units) until the deadline; the last sample is at the deadline."""
    progress = []
    while True:
        now = mono()
        progress.append([now, sum(counts)])
        left = deadline_ns - now
        if left <= 0:
            return progress
        time.sleep(min(interval_s, left / 1e9))


def main():
    global STOP
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--duration", type=float, required=True, help="measurement window, seconds")
    ap.add_argument("--progress-interval", type=float, default=0.1, help="seconds between progress samples")
    args = ap.parse_args()
    set_comm("cpu-main")

    counts = [0] * args.threads
    threads = [threading.Thread(target=thread_main, args=(counts, k), name="cpu-worker-%d" % k, daemon=True)
               for k in range(args.threads)]
    for t in threads:
        t.start()
    for _ in threads:
        ARRIVED.acquire()

    # The window starts just before READY, so whatever a caller does after reading it is inside.
    before = list(counts)
    first = [mono(), sum(counts)]
    print("READY", flush=True)
    progress = [first] + record_progress(counts, first[0] + int(args.duration * 1e9), args.progress_interval)
    after = list(counts)
    STOP = True
    for t in threads:
        t.join()

    # The first and last progress samples are the window's edges; per_thread comes from
    # snapshots a few bytecodes outside them, so its sum can differ by a unit or two.
    (start, base), (end, last) = progress[0], progress[-1]
    per_thread = [a - b for a, b in zip(after, before)]
    total = last - base
    print(json.dumps({
        "python": sys.version.split()[0],
        "pid": os.getpid(),
        "threads": args.threads,
        "window": {"start_mono_ns": start, "end_mono_ns": end},
        "duration_s": round((end - start) / 1e9, 6),
        "iterations": total,
        "iterations_per_s": round(total / ((end - start) / 1e9), 1),
        "per_thread": per_thread,
        "progress": [[t, n - base] for t, n in progress],
    }), flush=True)


if __name__ == "__main__":
    main()
