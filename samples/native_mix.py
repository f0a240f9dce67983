"""Ground truth for native frames: one thread cycling through known C hot spots, timed in-process.

Usage: native_mix.py --truth PATH --duration SECONDS [--go-fifo PATH] [--cext PATH]

Thread `nat-cpu` (OS name set through /proc/self/task/TID/comm) loops over these calls, each
timed with time.monotonic_ns() (wall) and time.thread_time_ns() (this thread's CPU):

  pickle    pickle.dumps(list of 200k ints)         -> _pickle (save_list, batch_list, ...)
  json      json.dumps(list of 100k ints)           -> _json (encoder_listencode_list, ...)
  zlib      zlib.compress(1 MiB, level 6)           -> zlib module, libz deflate
  hashlib   hashlib.sha256(4 MiB).digest()          -> _hashlib, libcrypto SHA-256
  cext      spin_native(N) from --cext (a shared object the test builds with cc; loaded with
            ctypes), a pure C busy loop                -> spin_native
  python    a pure-Python loop (no native hot spot)

Each call is short (a few ms) and the order is shuffled per cycle (seeded), so no period
aliases with a sampling rate. The main thread (`nat-main`) blocks in time.sleep for the window.

Protocol (as samples/cpu_mix.py): prints READY once the worker is in its loop; with --go-fifo
the window starts once a line was read from that FIFO. After --duration seconds the main thread
reads the worker's CPU clock, stops it, writes --truth and prints DONE.

Truth JSON (times cover only the window; a call straddling an edge counts pro rata):
  {"pid", "python", "window": {"start_mono_ns", "end_mono_ns"},
   "threads": [{"native_id", "name", "wall_s", "cpu_s",
                "functions": {"pickle": {"wall_s", "cpu_s", "calls"}, ...}}]}
"""

import argparse
import ctypes
import hashlib
import json
import os
import pickle
import random
import sys
import threading
import time
import zlib


def set_name(name):
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--duration", type=float, required=True)
    ap.add_argument("--go-fifo")
    ap.add_argument("--cext")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()

    ints = list(range(200_000))
    small = list(range(100_000))
    rnd = random.Random(a.seed)
    blob = bytes(rnd.getrandbits(8) for _ in range(1 << 16)) * 16  # 1 MiB, compressible
    big = os.urandom(4 << 20)
    spin = None
    if a.cext:
        lib = ctypes.CDLL(a.cext)
        spin = lib.spin_native
        spin.argtypes = [ctypes.c_long]
        spin.restype = ctypes.c_long

    def py_loop():
        x = 0
        for i in range(60_000):
            x += i * i % 7
        return x

    calls = {
        "pickle": lambda: pickle.dumps(ints),
        "json": lambda: json.dumps(small),
        "zlib": lambda: zlib.compress(blob, 6),
        "hashlib": lambda: hashlib.sha256(big).digest(),
        "python": py_loop,
    }
    if spin is not None:
        calls["cext"] = lambda: spin(3_000_000)

    state = {"stop": False, "window": None, "ready": threading.Event()}
    events = []  # (name, t0, t1, c0, c1)

    def worker():
        set_name("nat-cpu")
        names = sorted(calls)
        for n in names:  # warm up (first-call costs out of the window)
            calls[n]()
        state["ready"].set()
        mono, cpu = time.monotonic_ns, time.thread_time_ns
        while not state["stop"]:
            rnd.shuffle(names)
            for n in names:
                f = calls[n]
                t0, c0 = mono(), cpu()
                f()
                c1, t1 = cpu(), mono()
                events.append((n, t0, t1, c0, c1))

    set_name("nat-main")
    th = threading.Thread(target=worker, name="nat-cpu")
    th.start()
    state["ready"].wait()
    clock = time.pthread_getcpuclockid(th.ident)
    print("READY", flush=True)
    if a.go_fifo:
        with open(a.go_fifo) as f:
            f.readline()
    w0 = time.monotonic_ns()
    cpu0 = time.clock_gettime_ns(clock)
    time.sleep(a.duration)
    w1 = time.monotonic_ns()
    cpu1 = time.clock_gettime_ns(clock)
    state["stop"] = True
    th.join()

    funcs = {}
    for n, t0, t1, c0, c1 in events:
        lo, hi = max(t0, w0), min(t1, w1)
        if hi <= lo:
            continue
        frac = (hi - lo) / max(t1 - t0, 1)
        d = funcs.setdefault(n, {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0})
        d["wall_s"] += (hi - lo) / 1e9
        d["cpu_s"] += (c1 - c0) * frac / 1e9
        d["calls"] += 1
    truth = {
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "window": {"start_mono_ns": w0, "end_mono_ns": w1},
        "threads": [
            {
                "native_id": th.native_id,
                "name": "nat-cpu",
                "wall_s": (w1 - w0) / 1e9,
                "cpu_s": (cpu1 - cpu0) / 1e9,
                "functions": funcs,
            }
        ],
    }
    with open(a.truth, "w") as f:
        json.dump(truth, f, indent=1)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
