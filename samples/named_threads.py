"""Ground truth for Python thread names: named threads, several sharing one OS name, a GIL fight
between two of them, and threads started and renamed inside the measurement window.

Usage: named_threads.py --truth PATH --duration SECONDS [--go-fifo PATH] [--seed S]

Threads (Python names; none sets its OS name, so before 3.14 all carry the process's OS name,
and from 3.14, where CPython sets the OS name from the Python name cut to 15 bytes, the
`engine-output-writer-N` threads share `engine-output-w`):

  MainThread              starts the others, prints READY, waits for GO (with --go-fifo), then
                          at a third of the window starts `late-joiner-0` and `late-joiner-1`,
                          at two thirds renames `engine-output-writer-2` to
                          `renamed-output-writer-2`, and at the end writes the truth.
  vllm-aux-output-writer  the GIL holder: `scan()` runs 8-10 ms of pure Python, then sleeps 10 ms.
  vllm-step-launcher      the waiter: `launch()` runs 1-2 ms of pure Python, then sleeps 2 ms;
                          back from each sleep while a scan runs it waits for the GIL.
  engine-output-writer-N  (N = 0, 1, 2) `tick()` runs 1 ms of pure Python every 20 ms.
  late-joiner-N           (N = 0, 1) the same as the output writers, started mid-window.

The window starts at GO (or READY without --go-fifo) and lasts --duration seconds. Every
thread stamps its start (CLOCK_MONOTONIC) and every name it had, with when it got it.

Truth JSON: {"pid", "python", "window": {"start_mono_ns", "end_mono_ns"},
  "threads": [{"native_id", "ident", "started_ns", "names": [[t_mono_ns, name], ...],
               "os_name", "cpu_s"}],
  "gil_fight": {"holder": name, "waiter": name}}
`names` is in order; the first entry's time is the thread's start (or 0 for threads that
started before the window), the last entry is the name at the end.
"""
import argparse
import json
import os
import random
import sys
import threading
import time

mono = time.monotonic_ns
tcpu = time.thread_time_ns

WRITERS = 3
LATE = 2


def burn_cpu(ns):
    """Pure Python for `ns` of this thread's CPU time."""
    end = tcpu() + ns
    x = 0
    while tcpu() < end:
        for i in range(200):
            x += i * i
    return x


class Worker:
    def __init__(self, name, body, stop):
        self.stop = stop
        self.body = body
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.names = []
        self.cpu_ns = 0

    def start(self, stamp):
        self.started_ns = mono() if stamp else 0
        self.names.append([self.started_ns, self.thread.name])
        self.thread.start()

    def rename(self, new):
        self.thread.name = new
        self.names.append([mono(), new])

    def run(self):
        self.ready.set()
        while not self.stop.is_set():
            self.body()
        self.cpu_ns = tcpu()


def scan():
    burn_cpu(random.randint(8_000_000, 10_000_000))
    time.sleep(0.010)


def launch():
    burn_cpu(random.randint(1_000_000, 2_000_000))
    time.sleep(0.002)


def tick():
    burn_cpu(1_000_000)
    time.sleep(0.020)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--go-fifo")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    random.seed(args.seed)
    stop = threading.Event()
    workers = [Worker("vllm-aux-output-writer", scan, stop),
               Worker("vllm-step-launcher", launch, stop)]
    workers += [Worker("engine-output-writer-%d" % n, tick, stop) for n in range(WRITERS)]
    for w in workers:
        w.start(False)
    for w in workers:
        w.ready.wait()
    print("READY", flush=True)
    if args.go_fifo:
        with open(args.go_fifo) as f:
            f.readline()
    start = mono()
    length = int(args.duration * 1e9)
    stop_at = start + length
    late = [Worker("late-joiner-%d" % n, tick, stop) for n in range(LATE)]
    time.sleep(max(0.0, (start + length // 3 - mono()) / 1e9))
    for w in late:
        w.start(True)
    time.sleep(max(0.0, (start + 2 * length // 3 - mono()) / 1e9))
    workers[-1].rename("renamed-output-writer-%d" % (WRITERS - 1))
    time.sleep(max(0.0, (stop_at - mono()) / 1e9))
    end = mono()
    everyone = workers + late
    rows = [{"native_id": w.thread.native_id, "ident": w.thread.ident,
             "started_ns": w.started_ns, "names": w.names} for w in everyone]
    main_t = threading.main_thread()
    rows.append({"native_id": main_t.native_id, "ident": main_t.ident, "started_ns": 0,
                 "names": [[0, main_t.name]]})
    for r in rows:
        with open("/proc/self/task/%d/comm" % r["native_id"]) as f:
            r["os_name"] = f.read().rstrip("\n")
    stop.set()
    for w in everyone:
        w.thread.join()
    for r, w in zip(rows, everyone):
        r["cpu_s"] = w.cpu_ns / 1e9
    doc = {"pid": os.getpid(), "python": sys.version,
           "window": {"start_mono_ns": start, "end_mono_ns": end},
           "threads": rows,
           "gil_fight": {"holder": "vllm-aux-output-writer", "waiter": "vllm-step-launcher"}}
    tmp = args.truth + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.truth)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
