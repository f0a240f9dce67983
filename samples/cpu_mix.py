"""Ground truth for a sampling profiler: threads doing known work, timed in-process.

Usage: cpu_mix.py --truth PATH --duration SECONDS [--ready-fifo PATH] [--go-fifo PATH] [--paced]

Threads (OS names set through /proc/self/task/TID/comm, so a profiler can report them):

  mix-main     the main thread. Starts the others, waits until each is in its steady loop,
               prints READY, then blocks in time.sleep() inside `hold_window()` for the whole
               measurement window, then joins the workers in `join_workers()` (after the window).
  mix-cpu      pure-Python CPU work, alternating `hot_a()` (5-9 ms of thread CPU time per call,
               mean 7) and `hot_b()` (2-4 ms, mean 3): a 70/30 split of its CPU time.
  mix-sleeper  `wait_for_work()` blocks for 70-110 ms per call (time.sleep on even calls,
               threading.Event.wait(timeout) on odd ones), then `burst()` burns 3-7 ms of CPU:
               about 5% on-CPU.
  mix-io       `read_pipe()` blocks in os.read() on a pipe; `handle()` burns 2 ms of CPU on each
               message.
  mix-feeder   `feed_pipe()` sleeps 30-70 ms then writes one message into that pipe (about 17
               messages/s once GIL waits are counted).

With --paced the four workers are replaced by one that keeps step with a clock, as a paced
engine loop or a poller does:

  mix-paced    woken every 5 ms on the monotonic clock (absolute deadlines, so its steps
               never drift), runs `paced_a()` then `paced_b()`, 0.5 ms of thread CPU each, and
               sleeps until the next deadline in its loop (`paced_loop`, unattributed): about
               20% on-CPU, each function 10% of the wall clock and half of the CPU time.

Its step is a multiple of a 1 kHz or 200 Hz sampling period, so a sampler on a fixed grid
meets every step at the same point of it: one that samples at a drifting phase reports
paced_a and paced_b at half of the thread's CPU each; one in lock step reports one of them,
the sleep, or nothing. This is the workload that holds a sampler to that.

Lengths are drawn uniformly from those ranges (seeded, --seed) so that no cycle is a multiple
of a 10 ms or 1 ms sampling period: a fixed 7+3 ms cycle sampled at exactly 100 Hz would alias.

Only mix-cpu is CPU-bound: the process asks for just over one core of Python work and, because
of the GIL, gets at most one (this machine has 2 cores, so the profiler has the other).

Protocol: once every thread is in its steady loop, writes READY to --ready-fifo (if given) and
prints READY on stdout; the measurement window starts right after that, or, with --go-fifo,
once a line has been read from that FIFO (so a profiler can attach between READY and GO and
see the whole window). After --duration seconds the main thread reads every thread's CPU
clock, stops the workers, writes --truth and prints DONE. Nothing here sleeps to wait for
readiness.

How it is measured. Every call of a named function is timed with time.monotonic_ns() (wall)
and time.thread_time_ns() (this thread's CPU) around it. On Linux time.perf_counter_ns() reads
the same CLOCK_MONOTONIC; monotonic_ns is used so that call times, the window bounds and a
profiler's own CLOCK_MONOTONIC timestamps are one clock. A call that straddles a window edge
counts only its part inside the window (its CPU time pro rata). Each thread's total CPU over the
window comes from its CPU clock (time.pthread_getcpuclockid), read by the main thread at both
edges, so it includes the thread's loop bookkeeping (`unattributed_*`, well under 1%).

Truth JSON (all times cover only the window):
  {"pid", "python", "window": {"start_mono_ns", "end_mono_ns"},
   "threads": [{"native_id", "name", "wall_s", "cpu_s", "offcpu_s",
                "functions": {"hot_a": {"wall_s", "cpu_s", "calls"}, ...},
                "unattributed_wall_s", "unattributed_cpu_s"}]}
wall_s is the window length; offcpu_s = wall_s - cpu_s. Off-CPU includes every wait: sleeping,
blocking reads, waiting for the GIL (a thread "in" hot_a that waits for the GIL is in hot_a on
the wall clock but off-CPU), and waiting in the run queue. Function names are co_qualname
(3.11+) and co_name (3.10); all are module-level functions, so the two are the same.

What a profiler should report, for a window of 10 s or more (or any sub-window of 5 s or more
once READY is printed; the work is periodic at 100 ms or faster, so shares are stationary).
Measured on the 2-vCPU VM with CPython 3.10-3.15, 3-10 s windows:
  * per-thread on-CPU fraction = cpu_s / wall_s: mix-cpu 0.85-0.91 (it loses the GIL during
    the others' CPU bursts, and more when something else on the machine wants the CPUs),
    mix-sleeper 0.05, mix-io 0.035, mix-feeder 0.004, mix-main 0.000;
  * function shares of one thread's on-CPU samples = functions[f].cpu_s / cpu_s:
    mix-cpu hot_a 0.70, hot_b 0.30 (by construction: each call runs a fixed thread-CPU time);
    mix-sleeper burst 0.96; mix-io handle 0.95;
  * function shares of one thread's wall-clock samples (idle included) =
    functions[f].wall_s / wall_s: mix-cpu hot_a 0.70, hot_b 0.30; mix-sleeper wait_for_work
    0.92, burst 0.08 (bursts over the 5 ms switch interval wait for the GIL); mix-io read_pipe
    0.965, handle 0.035; mix-feeder feed_pipe 1.0; mix-main hold_window 1.0;
  * a function's share counts samples whose stack contains it (inclusive): wait_for_work's
    Event.wait half shows threading.py frames below it; the others are leaves. The few samples
    that land between calls show the thread's loop function (cpu_loop, sleeper_loop, ...) as
    the leaf: that is `unattributed_*` in the truth.
The numbers above are approximate; hold a profiler to the truth file of its own run:
per-function shares within +/-2 percentage points, the on/off-CPU split of each thread within
+/-3 points. Those bounds are wider than the work's own variation but not wider than sampling
noise at low counts: a share p estimated from n samples of one thread has a standard error of
about sqrt(p(1-p)/n), 1.45 points for p = 0.3 and n = 1000 (100 Hz for 10 s), so +/-2 points is
only 1.4 standard errors there. To hold +/-2 points at 3 standard errors, take n >= 4,700
samples of the thread: 1000 Hz for 5 s or more, or 100 Hz for 50 s. The on/off-CPU split of
mix-cpu (p = 0.91) holds +/-3 points at 3 standard errors from n >= 820 samples.

Runs unchanged on CPython 3.10-3.15.
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

MS = 1000000
# (low, high) of the uniform draws; the means give the shares in the docstring.
HOT_A_CPU_NS = (5 * MS, 9 * MS)
HOT_B_CPU_NS = (2 * MS, 4 * MS)
SLEEP_S = (0.070, 0.110)
BURST_CPU_NS = (3 * MS, 7 * MS)
HANDLE_CPU_NS = 2 * MS
FEED_INTERVAL_S = (0.030, 0.070)
PACED_STEP_NS = 5 * MS
PACED_CPU_NS = MS // 2

STOP = threading.Event()
IDLE = threading.Event()  # never set: wait_for_work's Event.wait always times out
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


class Recorder:
    """One thread's calls: (function, wall start, wall end, cpu start, cpu end), appended only
    by that thread, read by the main thread after it joined."""

    def __init__(self, name, seed):
        self.name = name
        self.rng = random.Random("%s/%s" % (seed, name))
        self.calls = []
        self.native_id = None
        self.clock = None


# --- the workers' code. Each named function burns CPU or blocks in its own frame, so it is --
# --- the leaf Python frame (no shared helper), except Event.wait's threading.py frames. -----

def hot_a(cpu_ns):
    end = tcpu() + cpu_ns
    x = 1
    while tcpu() < end:
        for i in range(100):
            x = (x * 31 + i) % 1000003
    return x


def hot_b(cpu_ns):
    end = tcpu() + cpu_ns
    x = 1
    while tcpu() < end:
        for i in range(100):
            x = (x * 17 + i) % 999983
    return x


def burst(cpu_ns):
    end = tcpu() + cpu_ns
    x = 1
    while tcpu() < end:
        for i in range(100):
            x = (x * 13 + i) % 1000033
    return x


def handle(data, cpu_ns):
    end = tcpu() + cpu_ns
    x = len(data)
    while tcpu() < end:
        for i in range(100):
            x = (x * 7 + i) % 1000037
    return x


def paced_a(cpu_ns):
    end = tcpu() + cpu_ns
    x = 1
    while tcpu() < end:
        for i in range(20):
            x = (x * 11 + i) % 1000039
    return x


def paced_b(cpu_ns):
    end = tcpu() + cpu_ns
    x = 1
    while tcpu() < end:
        for i in range(20):
            x = (x * 19 + i) % 1000081
    return x


def wait_for_work(seconds, n):
    if n % 2:
        IDLE.wait(seconds)
    else:
        time.sleep(seconds)


def read_pipe(fd):
    return os.read(fd, 4096)


def feed_pipe(fd, seconds):
    time.sleep(seconds)
    os.write(fd, b"work\n")


def hold_window(deadline_ns):
    while True:
        left = deadline_ns - mono()
        if left <= 0:
            return
        time.sleep(left / 1e9)


def join_workers(threads):
    for t in threads:
        t.join()


# --- the workers' loops --------------------------------------------------------------------

def cpu_loop(rec):
    calls = rec.calls
    draw = rec.rng.randint
    ARRIVED.release()
    while not STOP.is_set():
        a, b = draw(*HOT_A_CPU_NS), draw(*HOT_B_CPU_NS)
        t0 = mono(); c0 = tcpu()
        hot_a(a)
        c1 = tcpu(); t1 = mono()
        calls.append(("hot_a", t0, t1, c0, c1))
        t0 = mono(); c0 = tcpu()
        hot_b(b)
        c1 = tcpu(); t1 = mono()
        calls.append(("hot_b", t0, t1, c0, c1))


def sleeper_loop(rec):
    calls = rec.calls
    rng = rec.rng
    n = 0
    ARRIVED.release()
    while not STOP.is_set():
        sleep_s, burst_ns = rng.uniform(*SLEEP_S), rng.randint(*BURST_CPU_NS)
        t0 = mono(); c0 = tcpu()
        wait_for_work(sleep_s, n)
        c1 = tcpu(); t1 = mono()
        calls.append(("wait_for_work", t0, t1, c0, c1))
        t0 = mono(); c0 = tcpu()
        burst(burst_ns)
        c1 = tcpu(); t1 = mono()
        calls.append(("burst", t0, t1, c0, c1))
        n += 1


def io_loop(rec, fd):
    calls = rec.calls
    ARRIVED.release()
    while True:
        t0 = mono(); c0 = tcpu()
        data = read_pipe(fd)
        c1 = tcpu(); t1 = mono()
        calls.append(("read_pipe", t0, t1, c0, c1))
        if not data:  # the feeder closed the pipe: stop
            return
        t0 = mono(); c0 = tcpu()
        handle(data, HANDLE_CPU_NS)
        c1 = tcpu(); t1 = mono()
        calls.append(("handle", t0, t1, c0, c1))


def feeder_loop(rec, fd):
    calls = rec.calls
    rng = rec.rng
    ARRIVED.release()
    while not STOP.is_set():
        sleep_s = rng.uniform(*FEED_INTERVAL_S)
        t0 = mono(); c0 = tcpu()
        feed_pipe(fd, sleep_s)
        c1 = tcpu(); t1 = mono()
        calls.append(("feed_pipe", t0, t1, c0, c1))
    os.close(fd)


def paced_loop(rec):
    calls = rec.calls
    ARRIVED.release()
    deadline = mono()
    while not STOP.is_set():
        deadline += PACED_STEP_NS
        t0 = mono(); c0 = tcpu()
        paced_a(PACED_CPU_NS)
        c1 = tcpu(); t1 = mono()
        calls.append(("paced_a", t0, t1, c0, c1))
        t0 = mono(); c0 = tcpu()
        paced_b(PACED_CPU_NS)
        c1 = tcpu(); t1 = mono()
        calls.append(("paced_b", t0, t1, c0, c1))
        left = deadline - mono()
        if left > 0:
            time.sleep(left / 1e9)
        else:  # late (preempted): keep the step from now on
            deadline = mono()


def thread_main(rec, loop, args):
    set_comm(rec.name)
    rec.native_id = threading.get_native_id()
    rec.clock = time.pthread_getcpuclockid(threading.get_ident())
    loop(rec, *args)


# --- the main thread -----------------------------------------------------------------------

def clip(calls, start, end):
    """Per-function wall/CPU seconds and call counts inside [start, end]."""
    out = {}
    for fn, t0, t1, c0, c1 in calls:
        lo, hi = max(t0, start), min(t1, end)
        if hi <= lo:
            continue
        frac = (hi - lo) / (t1 - t0)
        f = out.setdefault(fn, {"wall_s": 0.0, "cpu_s": 0.0, "calls": 0})
        f["wall_s"] += (hi - lo) / 1e9
        f["cpu_s"] += (c1 - c0) * frac / 1e9
        f["calls"] += 1
    for f in out.values():
        f["wall_s"] = round(f["wall_s"], 6)
        f["cpu_s"] = round(f["cpu_s"], 6)
    return out


def thread_doc(rec, start, end, cpu0, cpu1):
    wall = (end - start) / 1e9
    cpu = (cpu1 - cpu0) / 1e9
    funcs = clip(rec.calls, start, end)
    return {
        "native_id": rec.native_id,
        "name": rec.name,
        "wall_s": round(wall, 6),
        "cpu_s": round(cpu, 6),
        "offcpu_s": round(wall - cpu, 6),
        "functions": funcs,
        "unattributed_wall_s": round(wall - sum(f["wall_s"] for f in funcs.values()), 6),
        "unattributed_cpu_s": round(cpu - sum(f["cpu_s"] for f in funcs.values()), 6),
    }


def read_clocks(recs):
    return [time.clock_gettime_ns(r.clock) for r in recs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--duration", type=float, required=True, help="measurement window, seconds")
    ap.add_argument("--ready-fifo", help="also write READY into this FIFO (opened for writing)")
    ap.add_argument("--go-fifo", help="after READY, wait for a line from this FIFO before the window")
    ap.add_argument("--seed", default="1", help="seed of the call-length draws")
    ap.add_argument("--paced", action="store_true", help="one worker in step with a 5 ms clock instead of the four")
    args = ap.parse_args()

    main_rec = Recorder("mix-main", args.seed)
    set_comm(main_rec.name)
    main_rec.native_id = threading.get_native_id()
    main_rec.clock = time.pthread_getcpuclockid(threading.get_ident())

    rfd, wfd = os.pipe()
    if args.paced:
        specs = [(Recorder("mix-paced", args.seed), paced_loop, ())]
        os.close(wfd)
    else:
        specs = [
            (Recorder("mix-cpu", args.seed), cpu_loop, ()),
            (Recorder("mix-sleeper", args.seed), sleeper_loop, ()),
            (Recorder("mix-io", args.seed), io_loop, (rfd,)),
            (Recorder("mix-feeder", args.seed), feeder_loop, (wfd,)),
        ]
    threads = []
    for rec, loop, largs in specs:
        t = threading.Thread(target=thread_main, args=(rec, loop, largs), name=rec.name, daemon=True)
        t.start()
        threads.append(t)
    for _ in specs:
        ARRIVED.acquire()
    recs = [main_rec] + [s[0] for s in specs]

    if args.ready_fifo:
        with open(args.ready_fifo, "w") as f:
            f.write("READY\n")
    print("READY", flush=True)
    if args.go_fifo:
        with open(args.go_fifo) as f:
            f.readline()
    start = mono()
    cpu0 = read_clocks(recs)
    t0 = mono(); c0 = tcpu()
    hold_window(start + int(args.duration * 1e9))
    c1 = tcpu(); t1 = mono()
    main_rec.calls.append(("hold_window", t0, t1, c0, c1))
    cpu1 = read_clocks(recs)
    end = mono()

    STOP.set()
    join_workers(threads)  # the feeder closes the pipe, which ends mix-io's read
    os.close(rfd)

    doc = {
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "window": {"start_mono_ns": start, "end_mono_ns": end},
        "threads": [thread_doc(r, start, end, a, b) for r, a, b in zip(recs, cpu0, cpu1)],
    }
    tmp = args.truth + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.truth)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
