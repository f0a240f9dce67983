"""Benchmark target for GIL and GC tracing overhead: frequent GIL hand-offs and collections.

Usage: switch_churn.py --threads 4 --duration S [--switch-interval 0.0005] [--cycles-per-iter N]

Each worker thread (OS name `churn-K`) repeats a unit of pure-Python work that also creates
--cycles-per-iter reference cycles (garbage only the collector frees). With a short switch
interval the threads hand the GIL to each other thousands of times a second (each hand-off is
a futex wait of the thread taking it), and the cycles trigger hundreds of young collections a
second. Prints READY once every worker has done one unit, then after --duration seconds one
JSON line: {"python", "iterations", "iterations_per_s", "gc_collections", "window_s"}.
Throughput is how the cost of tracing shows up. Nothing here sleeps to wait for readiness.
"""
import argparse
import gc
import json
import sys
import threading
import time

STOP = False
ARRIVED = threading.Semaphore(0)


def set_comm(name):
    threading.current_thread().name = name
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def unit(n_cycles):
    s = 0
    for i in range(300):
        s += i * i
    for _ in range(n_cycles):
        a = []
        b = [a]
        a.append(b)
    return s


def worker(name, counts, idx, n_cycles):
    set_comm(name)
    unit(n_cycles)
    ARRIVED.release()
    n = 0
    while not STOP:
        unit(n_cycles)
        n += 1
        counts[idx] = n


def main():
    global STOP
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--switch-interval", type=float, default=0.0005)
    ap.add_argument("--cycles-per-iter", type=int, default=20)
    args = ap.parse_args()
    set_comm("churn-main")
    sys.setswitchinterval(args.switch_interval)
    counts = [0] * args.threads
    ts = [threading.Thread(target=worker, args=("churn-%d" % i, counts, i, args.cycles_per_iter), daemon=True)
          for i in range(args.threads)]
    for t in ts:
        t.start()
    for _ in ts:
        ARRIVED.acquire()
    gc0 = sum(s["collections"] for s in gc.get_stats())
    start_counts = list(counts)
    t0 = time.monotonic()
    print("READY", flush=True)
    time.sleep(args.duration)
    end_counts = list(counts)
    t1 = time.monotonic()
    gc1 = sum(s["collections"] for s in gc.get_stats())
    STOP = True
    its = sum(end_counts) - sum(start_counts)
    print(json.dumps({"python": sys.version.split()[0], "iterations": its,
                      "iterations_per_s": its / (t1 - t0), "gc_collections": gc1 - gc0,
                      "window_s": t1 - t0}), flush=True)


if __name__ == "__main__":
    main()
