"""Ground truth for GIL-wait tracing: a writer thread holding the GIL against a launcher thread.

Usage: gil_contention.py --truth PATH --duration SECONDS [--go-fifo PATH] [--ready-fifo PATH]
                         [--seed S] [--thread-names os|python|same] [--gate]

The bug in miniature: an auxiliary output store does a pure-Python scan on every put, and the
thread that launches the model steps keeps losing the GIL to it.

Threads (OS names set through /proc/self/task/TID/comm, so a profiler can report them):

  gil-main    the main thread. Calibrates the launcher alone, starts the writer, waits until
              both are in their steady loops, prints READY; with --go-fifo it then blocks until
              a line can be read from that FIFO. The measurement window starts there. It blocks
              in time.sleep() inside `hold_window()` for the whole window, then stops and joins
              the workers in `join_workers()`.
  launcher    `Worker.execute_model()` in a loop: 2-3 ms of thread CPU time of pure Python
              (uniform, seeded), then time.sleep(0.002), the short blocking wait of a step.
  aux-writer  `AuxOutputStore.put()` paced at 45 puts/s (intervals uniform in 20-24.4 ms, no
              catch-up bursts): it stores an entry in an OrderedDict and calls
              `AuxOutputStore._evict_to_fit()`, a pure-Python scan over the OrderedDict that
              runs for 8-10 ms of thread CPU time (uniform, mean 9) and then evicts the oldest
              entries beyond the capacity.

--thread-names: `os` (default) names each thread as above, OS name and Python name alike;
`python` gives the threads those Python names only (`threading`), so every thread keeps the
process's OS name, as before Python 3.14; `same` names both workers `engine-worker` (Python
name only): two threads that a profiler can tell apart only by their thread id. Each thread's
Python name is in the truth (`threads[].python_name`).

--gate: the workers wait (blocked, running no Python) from READY until the window starts, and
stop right after it ends, so whatever a profiler attached at READY counts of their CPU time and
GIL waits lies in the window, give or take the one step and the one put that straddle its end.
The truth then has each worker's CPU time from the start of the window to the end of its loop
(`threads[].active_cpu_s`), and the writer's GIL wait bracketed like the launcher's:
`writer.gil_wait_lower_s` = its puts' wall - CPU less its run-queue time in the window and
less the machine's steal during its puts (`writer.steal_in_puts_s`, all CPUs, read around every
put: a bound on what the hypervisor took while the writer ran, which its CPU clock leaves out;
0 on a quiet host) (GIL waits inside `put`, none after its sleeps counted),
`writer.gil_wait_upper_s` = its puts' wall -
CPU plus its sleeps' overshoot beyond the requested time (every moment it was neither computing
nor in the requested sleep, run queue and timer slack included).

Only these two threads run Python during the window, so whenever the launcher waits for the
GIL, the writer holds it (by construction; the main thread is asleep). The writer runs 9 ms of
CPU per put, longer than the 5 ms switch interval: the launcher, back from its 2 ms sleep while
a put runs, waits up to 5 ms, forces a switch, computes for 2-3 ms and sleeps again, and the
writer carries on. What the writer runs while it holds the GIL is `_evict_to_fit` (its share of
the writer's CPU time is in the truth, ~0.99), so that is what a profiler should name as the
holder's function for most of the launcher's wait.

How the launcher's GIL wait is measured. Every step is timed with time.monotonic_ns() (wall)
and time.thread_time_ns() (this thread's CPU) at three points inside execute_model: before the
compute, after the compute, after the sleep. A step runs from one execute_model start to the
next. Without the writer, a step's wall time is its CPU time + the requested sleep + a small
extra (timer slack and wake-up latency of the sleep, a few µs of bookkeeping). That extra is
calibrated over 200 steps with the launcher alone, before the writer starts, from the steps no
other process preempted (getrusage(RUSAGE_THREAD).ru_nivcsw did not move; getrusage keeps the
GIL, so counting preemptions during the window changes nothing in the contention). With the
writer, each step's GIL wait is

    wait = step wall - step CPU - requested sleep - calibrated extra

which counts every wait wherever it happens in the step: (a) inside the compute (wall - CPU of
the compute: the launcher wants the GIL and has not got it), (b) when time.sleep() returns and
must take the GIL back (the sleep's overshoot beyond the requested time and its calibrated
overshoot), (c) anywhere in the loop's few bytecodes in between. Parts (a) and (b) are in the
truth per step and in total. In practice (b) is nearly all of it: back from its sleep while a
put runs, the launcher waits one switch interval (5 ms, `contended_wait_ms_median`) before it
forces the writer to drop the GIL; its 2-3 ms compute is shorter than a switch interval, so the
writer, waiting in turn, rarely takes the GIL back in the middle of it.

Error. The estimate also counts time the thread was runnable but not running (run queue: another
process on the CPU; `preempted_steps` counts the steps where that happened) and the forced-switch
handshake (asked to drop the GIL, a thread waits until the other has taken it: a "switch wait",
tens of µs per switch, ~50 a second here). So the truth also has the window's run-queue time
(`runq_s`, from /proc/self/task/TID/schedstat, read by the main thread at the window edges; the
calibration reads it between its steps, where no other thread wants the GIL) and two figures
without it: `gil_wait_excl_runq_s` = the steps' wall - CPU - requested sleep, minus the
calibrated extra without its run-queue part, minus the window's run-queue time: every GIL wait
with no run-queue time in it; and `gil_wait_upper_s` = that + `runq_s`, as if all of the run
queue were wake-up latency after the GIL was handed over. A profiler that times the futex waits
on the GIL counts that wake-up latency but not preemption during the compute, and reports
switch waits apart: its launcher GIL wait plus switch wait lies between `gil_wait_excl_runq_s`
and `gil_wait_upper_s`. Those two do not depend on how loaded the machine was during the
calibration; `gil_wait_s` (the calibrated extra with its run-queue part) does, and lies between
them when the load is steady. `quiet` is true when at most 10% of the steps were preempted and
the run queue held the launcher for at most 2% of the window: then all three agree within a few
percent. Random error: the calibrated extra varies by its standard deviation per step, so a
total's random error is about std * sqrt(steps); `error_s` is three times that plus one step's
wait at each window edge, where steps count pro rata (`error_excl_runq_s` the same with the
extra without its run-queue part, a few times smaller).

Steal and preemption. A thread's CPU clock stops while its vCPU is stolen by the hypervisor
(this VM: 0.1-0.6 s of steal over both CPUs in a 5 s window) or while it sits preempted in the
run queue, so wall - CPU counts both as waits although nothing was waited for. A wait for the GIL
blocks the thread (a futex wait: a voluntary context switch, getrusage's ru_nvcsw), so each step
also records its compute's and its sleep's voluntary switches (`compute_blocks`,
`sleep_blocks`), and `gil_wait_blocked_s` counts a step's compute only when it blocked and its
sleep only when it blocked more than the sleep's own once: steal and preemption in parts of a
step that never waited are out, and so is the calibration's bias there. Its calibrated extra is
the one without run-queue time (the calibration's load is not the window's), so it counts all
of the run-queue delay after a wake-up, which a futex timing counts too (upper end);
`gil_wait_lower_s` is it less all of the window's run-queue time (lower end). `steal_s` is the
machine's steal over the window, all CPUs together (/proc/stat).

Measured on the 2-core VM (CPython 3.10-3.15; 10 s windows on 3.12.1 and sid 3.14.10, other
work running, one core often busy): the launcher waits a quarter of the window (gil_wait_s
2.3-2.7 s of 10 s; 60-64 contended steps/s with a median wait of 4.8-5.0 ms, the switch
interval; nearly all of it when its sleep returns, under 0.2 s inside the compute); 45.0
puts/s of 9.0 ms CPU, 99% of the writer's CPU in _evict_to_fit. The bracket
[gil_wait_excl_runq_s, gil_wait_upper_s] is 2.52-2.56 s in a quiet run and as wide as
1.74-3.00 s with 1.26 s of run queue in a loaded one. The launcher's thread CPU clock equals
the sum of its steps' CPU within 0.1%, and its off-CPU time equals requested sleep + GIL wait
+ calibrated extra within a few ms.

The writer is timed the same way per put (put and _evict_to_fit, wall and CPU); its GIL wait
inside put is wall - CPU of the put.

Protocol: READY on stdout (and into --ready-fifo if given) once both workers are in their
steady loops; the window starts right after READY, or, with --go-fifo, right after a line has
been read from that FIFO (so a profiler can attach between READY and GO and see the whole
window). After --duration seconds the main thread reads both workers' CPU clocks and run-queue
times, stops them, writes --truth and prints DONE. Nothing here sleeps to wait for readiness.

Truth JSON (window figures only; steps and puts that straddle an edge count pro rata):
  {"pid", "python", "switch_interval_s", "window": {"start_mono_ns", "end_mono_ns"},
   "threads": [{"native_id", "name" (its role), "python_name", "wall_s", "cpu_s", "offcpu_s",
                "runq_s", "active_cpu_s" (--gate; null for the main thread)}],
   "steal_s",
   "launcher": {"native_id", "steps", "steps_per_s", "gil_wait_s", "gil_wait_excl_runq_s",
                "gil_wait_upper_s", "gil_wait_blocked_s", "gil_wait_lower_s",
                "runq_s", "wait_in_compute_s", "wait_after_sleep_s", "wait_elsewhere_s",
                "gil_wait_share" (of the window), "wait_per_step_ms_mean", "error_s",
                "error_excl_runq_s", "contended_steps" (wait > 0.5 ms),
                "contended_wait_ms_median", "contended_wait_ms_mean", "preempted_steps", "quiet",
                "clean_steps", "clean_steps_gil_wait_s", "calibration": {...},
                "step_columns", "steps_list": [[...], ...]},
   "writer": {"native_id", "puts", "puts_per_s", "put_cpu_ms_mean", "evict_cpu_ms_mean",
              "evict_wall_ms_mean", "evict_cpu_s", "gil_wait_in_put_s", "sleep_overshoot_s",
              "steal_in_puts_s", "gil_wait_lower_s", "gil_wait_upper_s", "put_columns",
              "puts_list": [[...], ...]},
   "gil_holder": {"thread", "native_id", "function", "caller", "file", "share_of_holder_cpu",
                  "waiter_function"}}
step/put columns are named in the file; times are ns, "in_window" the fraction counted.
Function names are co_qualname (3.11+) and co_name on 3.10 (`_evict_to_fit`, `execute_model`):
the truth names them as this interpreter does.

Runs unchanged on CPython 3.10-3.15, also without /proc (then runq figures are null).
"""
import argparse
import collections
import json
import os
import random
import sys
import threading
import time

try:
    import resource
except ImportError:  # a build without it: no preemption counts
    resource = None

mono = time.monotonic_ns
tcpu = time.thread_time_ns

MS = 1000000
COMPUTE_CPU_NS = (2 * MS, 3 * MS)
SLEEP_S = 0.002
SLEEP_NS = 2 * MS
EVICT_CPU_NS = (8 * MS, 10 * MS)
PUT_INTERVAL_S = (0.020, 0.0244)  # mean 22.2 ms: 45 puts/s
STORE_CAPACITY = 4096
CALIBRATION_STEPS = 200
CONTENDED_NS = MS // 2  # a step that waited longer than this for the GIL is "contended"

STOP = threading.Event()
WINDOW = threading.Event()  # --gate: the workers' steady loops begin when it is set
GATED = False
CALIBRATED = threading.Event()
ARRIVED = threading.Semaphore(0)


NAMES = "os"  # --thread-names
SAME_NAME = "engine-worker"


def set_comm(name, worker=False):
    """Set this thread's OS name (what /proc/PID/task/TID/comm shows) and its Python name
    (threading), so the two agree; with --thread-names python or same, the Python name only
    (`engine-worker` for both workers with same)."""
    if NAMES == "same" and worker:
        name = SAME_NAME
    threading.current_thread().name = name
    if NAMES != "os":
        return
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def runq_ns(native_id):
    """Time this thread spent runnable but waiting for a CPU, ns; None without /proc."""
    try:
        with open("/proc/self/task/%d/schedstat" % native_id) as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


class StealClock:
    """Time the hypervisor ran something else while this machine's CPUs had work (the `steal`
    column of /proc/stat, all CPUs together), ns; None where unavailable. A thread's CPU clock
    does not advance while its vCPU is stolen, so wall - CPU counts it although the thread was
    not waiting for anything. Read from a descriptor kept open (~15 µs a reading, so the writer
    can read it around every put; pread serves every thread)."""

    def __init__(self):
        try:
            self.fd = os.open("/proc/stat", os.O_RDONLY)
        except OSError:
            self.fd = None
        self.tick_ns = 1000000000 // os.sysconf("SC_CLK_TCK")

    def read(self):
        if self.fd is None:
            return None
        try:
            return int(os.pread(self.fd, 256, 0).split(None, 9)[8]) * self.tick_ns
        except (OSError, ValueError, IndexError):
            return None


STEAL = StealClock()


def blocks():
    """This thread's voluntary context switches so far (it blocked: a sleep, a futex wait on the
    GIL); -1 where unavailable."""
    if resource is None:
        return -1
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def preemptions():
    """This thread's involuntary context switches so far (getrusage keeps the GIL, so reading
    it changes nothing in the contention); -1 where unavailable."""
    if resource is None:
        return -1
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def qualname(fn):
    code = fn.__code__
    return getattr(code, "co_qualname", code.co_name)


# --- the workers' code. Each named function burns CPU or blocks in its own frame. ------------

class AuxOutputStore:
    """An output cache whose every put scans it whole: the writer thread's work."""

    def __init__(self, capacity):
        self.capacity = capacity
        self._data = collections.OrderedDict()
        for i in range(capacity):
            self._data[i] = 64 + i % 977
        self._next = capacity

    def put(self, value, evict_cpu_ns):
        key = self._next
        self._next += 1
        self._data[key] = len(value)
        e0 = mono(); ce0 = tcpu()
        self._evict_to_fit(evict_cpu_ns)
        ce1 = tcpu(); e1 = mono()
        return e0, e1, ce0, ce1

    def _evict_to_fit(self, cpu_ns):
        # Sum the sizes from the oldest entry on, over and over, until cpu_ns of thread CPU
        # time have gone by (the stand-in for a scan that is slow because the store is big);
        # then drop the oldest entries beyond the capacity.
        end = tcpu() + cpu_ns
        data = self._data
        total = 0
        n = 0
        while True:
            for size in data.values():
                total += size
                n += 1
                if not n & 63 and tcpu() >= end:
                    break
            else:
                continue
            break
        while len(data) > self.capacity:
            data.popitem(last=False)
        return total


class Worker:
    """The launcher: a model step is some Python compute, then a short blocking wait."""

    def __init__(self):
        self.x = 1

    def execute_model(self, cpu_ns, sleep_s):
        va = blocks()
        a = mono(); ca = tcpu()
        end = ca + cpu_ns
        x = self.x
        while tcpu() < end:
            for i in range(100):
                x = (x * 31 + i) % 1000003
        self.x = x
        b = mono(); cb = tcpu()
        vb = blocks()
        time.sleep(sleep_s)
        c = mono(); cc = tcpu()
        vc = blocks()
        return a, ca, b, cb, c, cc, va, vb, vc


def hold_window(deadline_ns):
    while True:
        left = deadline_ns - mono()
        if left <= 0:
            return
        time.sleep(left / 1e9)


def join_workers(threads):
    for t in threads:
        t.join()


# --- the workers' loops ----------------------------------------------------------------------

class Rec:
    def __init__(self, name, seed):
        self.name = name
        self.rng = random.Random("%s/%s" % (seed, name))
        self.native_id = None
        self.clock = None
        self.items = []
        self.calibration = []
        self.sleeps = []  # the writer's (start, end, requested) ns
        self.active_cpu0 = None  # thread CPU when its window loop began / ended (--gate)
        self.active_cpu1 = None


def gate(rec):
    """--gate: block until the window starts (running no Python meanwhile)."""
    if GATED:
        WINDOW.wait()
    rec.active_cpu0 = tcpu()


def launcher_loop(rec):
    w = Worker()
    draw = rec.rng.randint
    tid = rec.native_id
    # Calibration: the same steps with nobody else running Python, so reading the run-queue
    # time between steps (a file read, which lets the GIL go) disturbs nothing.
    cal = rec.calibration
    for _ in range(CALIBRATION_STEPS + 2):
        cal.append((preemptions(), runq_ns(tid)) + w.execute_model(draw(*COMPUTE_CPU_NS), SLEEP_S))
    CALIBRATED.set()
    ARRIVED.release()
    gate(rec)
    items = rec.items
    while not STOP.is_set():
        items.append((preemptions(), None) + w.execute_model(draw(*COMPUTE_CPU_NS), SLEEP_S))
    items.append((preemptions(), None) + w.execute_model(0, 0))  # closes the last step
    rec.active_cpu1 = tcpu()


def writer_loop(rec):
    store = AuxOutputStore(STORE_CAPACITY)
    rng = rec.rng
    items = rec.items
    ARRIVED.release()
    gate(rec)
    next_t = mono()
    while not STOP.is_set():
        next_t += int(rng.uniform(*PUT_INTERVAL_S) * 1e9)
        now = mono()
        if next_t > now:
            s0 = mono()
            time.sleep((next_t - now) / 1e9)
            rec.sleeps.append((s0, mono(), next_t - now))
        elif now - next_t > 25 * MS:
            next_t = now  # far behind: no burst of puts to catch up
        evict_ns = rng.randint(*EVICT_CPU_NS)
        # The steal is read inside the put's timing: a read drops the GIL, and taking it back
        # is a GIL wait the put's wall - CPU must count (outside, it would be in no figure).
        t0 = mono(); c0 = tcpu()
        s0 = STEAL.read()
        e0, e1, ce0, ce1 = store.put(b"x" * 64, evict_ns)
        s1 = STEAL.read()
        c1 = tcpu(); t1 = mono()
        stolen = None if s0 is None or s1 is None else s1 - s0
        items.append((t0, t1, c0, c1, e0, e1, ce0, ce1, stolen))
    rec.active_cpu1 = tcpu()


def pyname(rec):
    """A worker's Python name under --thread-names."""
    return SAME_NAME if NAMES == "same" else rec.name


def thread_main(rec, loop):
    set_comm(rec.name, worker=True)
    rec.native_id = threading.get_native_id()
    rec.clock = time.pthread_getcpuclockid(threading.get_ident())
    loop(rec)


# --- the main thread: turning the timings into the truth ---------------------------------------

def step_rows(calls):
    """Per step (execute_model start to the next start): start, compute wall/CPU, sleep
    wall/CPU, step wall/CPU, requested sleep, preemptions, run-queue time (ns; None unknown),
    voluntary context switches in the compute and in the sleep (-1 unknown)."""
    rows = []
    for (p, q, a, ca, b, cb, c, cc, va, vb, vc), nxt in zip(calls, calls[1:]):
        pre = -1 if p < 0 else nxt[0] - p
        rq = None if q is None or nxt[1] is None else nxt[1] - q
        vcomp = -1 if va < 0 else vb - va
        vsleep = -1 if vb < 0 else vc - vb
        rows.append((a, b - a, cb - ca, c - b, cc - cb, nxt[2] - a, nxt[3] - ca, SLEEP_NS, pre, rq,
                     vcomp, vsleep))
    return rows


def mean_std(xs):
    if not xs:
        return 0.0, 0.0
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def overlap(t0, t1, start, end):
    """Fraction of [t0, t1) inside [start, end)."""
    if t1 <= t0:
        return 1.0 if start <= t0 < end else 0.0
    return max(0, min(t1, end) - max(t0, start)) / (t1 - t0)


def launcher_doc(rec, start, end, runq_window):
    cal_all = step_rows(rec.calibration)[1:]  # the first step warms up
    # The baseline comes from the steps no other process preempted (all of them when the
    # counts are unavailable): preemption is a property of the machine's load, not of the step.
    cal = [r for r in cal_all if r[8] == 0] or cal_all
    extra = [r[5] - r[6] - r[7] for r in cal]
    sleep_extra = [r[3] - r[4] - r[7] for r in cal]
    compute_extra = [r[1] - r[2] for r in cal]
    extra_m, extra_sd = mean_std(extra)
    extra_nq_m, extra_nq_sd = mean_std(
        [r[5] - r[6] - r[7] - r[9] for r in cal if r[9] is not None])
    sleep_m, sleep_sd = mean_std(sleep_extra)
    comp_m, _ = mean_std(compute_extra)
    cal_rq = [r[9] for r in cal if r[9] is not None]
    runq_per_step = sum(cal_rq) / len(cal_rq) if cal_rq else None

    steps = 0.0
    wait = wait_compute = wait_sleep = 0.0
    clean_steps = clean_wait = 0.0
    blocked_wait = 0.0
    preempted = 0
    rows = []
    contended = []
    max_step_wait = 0.0
    for r in step_rows(rec.items):
        f = overlap(r[0], r[0] + r[5], start, end)
        if f <= 0:
            continue
        w = r[5] - r[6] - r[7] - extra_m
        wc = r[1] - r[2] - comp_m
        ws = r[3] - r[4] - r[7] - sleep_m
        # A wait for the GIL blocks the thread (a futex wait: a voluntary context switch); a
        # part of the step in which the thread never blocked (the compute with none, the sleep
        # with only its own) waited for nothing, whatever its wall - CPU says: that is time
        # the thread was runnable or its vCPU was stolen by the hypervisor.
        wb = w - (0 if r[10] != 0 else wc) - (0 if r[11] < 0 or r[11] > 1 else ws)
        blocked_wait += wb * f
        steps += f
        wait += w * f
        wait_compute += wc * f
        wait_sleep += ws * f
        if r[8] > 0:
            preempted += 1
        else:
            clean_steps += f
            clean_wait += w * f
        max_step_wait = max(max_step_wait, w)
        if w > CONTENDED_NS and f == 1.0:
            contended.append(w)
        rows.append([r[0], r[1], r[2], r[3], r[4], r[5], r[6], int(round(w)), int(round(wc)),
                     int(round(ws)), r[8], round(f, 6), r[10], r[11]])
    window_s = (end - start) / 1e9
    # Run-queue time beyond the wake-up latency the calibrated extra already holds.
    runq_extra = None
    if runq_window is not None and runq_per_step is not None:
        runq_extra = runq_window - runq_per_step * steps
    # Without any run-queue time: the calibrated extra without its run-queue part, and the
    # window's run-queue time taken out. Robust to the machine's load changing between the
    # calibration and the window; the upper bound counts all of the window's run-queue time as
    # wake-up latency after GIL handoffs (which a futex timing includes).
    excl_s = upper_s = lower_s = None
    if runq_extra is not None:
        excl_s = round((wait - runq_extra) / 1e9, 6)
        upper_s = round((wait - runq_extra + runq_window) / 1e9, 6)
        lower_s = round((blocked_wait - runq_window) / 1e9, 6)
    # The blocked-only count with the calibrated extra less its run-queue part: the calibration's
    # wake-ups waited in a run queue as loaded as the machine was then (beside a parallel test,
    # milliseconds a step: the count went below zero), and the window's run-queue time is taken
    # out of the lower end as measured instead.
    if runq_per_step is not None:
        blocked_wait += (extra_m - extra_nq_m) * steps
        if runq_window is not None:
            lower_s = round((blocked_wait - runq_window) / 1e9, 6)
    error_ns = 3 * extra_sd * steps ** 0.5 + 2 * max_step_wait
    error_nq_ns = 3 * extra_nq_sd * steps ** 0.5 + 2 * max_step_wait
    contended.sort()
    median_ms = mean_ms = None
    if contended:
        median_ms = round(contended[len(contended) // 2] / 1e6, 4)
        mean_ms = round(sum(contended) / len(contended) / 1e6, 4)
    # Few enough preemptions and little enough run-queue time that the two estimates agree.
    quiet = None
    if r_known(rec):
        quiet = preempted <= 0.1 * steps and (
            runq_window is None or runq_window <= 0.02 * (end - start))
    return {
        "native_id": rec.native_id,
        "steps": round(steps, 3),
        "steps_per_s": round(steps / window_s, 3),
        "gil_wait_s": round(wait / 1e9, 6),
        "gil_wait_excl_runq_s": excl_s,
        "gil_wait_upper_s": upper_s,
        "gil_wait_blocked_s": round(blocked_wait / 1e9, 6),
        "gil_wait_lower_s": lower_s,
        "runq_s": None if runq_window is None else round(runq_window / 1e9, 6),
        "wait_in_compute_s": round(wait_compute / 1e9, 6),
        "wait_after_sleep_s": round(wait_sleep / 1e9, 6),
        "wait_elsewhere_s": round((wait - wait_compute - wait_sleep) / 1e9, 6),
        "gil_wait_share": round(wait / (end - start), 6),
        "wait_per_step_ms_mean": round(wait / max(steps, 1e-9) / 1e6, 4),
        "error_s": round(error_ns / 1e9, 6),
        "error_excl_runq_s": None if runq_extra is None else round(error_nq_ns / 1e9, 6),
        "contended_steps": len(contended),
        "contended_wait_ms_median": median_ms,
        "contended_wait_ms_mean": mean_ms,
        "preempted_steps": preempted if r_known(rec) else None,
        "quiet": quiet,
        "clean_steps": round(clean_steps, 3),
        "clean_steps_gil_wait_s": round(clean_wait / 1e9, 6),
        "calibration": {
            "steps": len(cal_all),
            "clean_steps": len(cal),
            "step_extra_us_mean": round(extra_m / 1e3, 3),
            "step_extra_us_std": round(extra_sd / 1e3, 3),
            "step_extra_excl_runq_us_std": round(extra_nq_sd / 1e3, 3),
            "sleep_overshoot_us_mean": round(sleep_m / 1e3, 3),
            "sleep_overshoot_us_std": round(sleep_sd / 1e3, 3),
            "compute_extra_us_mean": round(comp_m / 1e3, 3),
            "runq_us_per_step": None if runq_per_step is None else round(runq_per_step / 1e3, 3),
        },
        "step_columns": ["start_ns", "compute_wall_ns", "compute_cpu_ns", "sleep_wall_ns",
                         "sleep_cpu_ns", "step_wall_ns", "step_cpu_ns", "gil_wait_ns",
                         "wait_in_compute_ns", "wait_after_sleep_ns", "preemptions",
                         "in_window", "compute_blocks", "sleep_blocks"],
        "steps_list": rows,
    }


def r_known(rec):
    return bool(rec.items) and rec.items[0][0] >= 0


def writer_doc(rec, start, end):
    puts = 0.0
    put_cpu = evict_cpu = evict_wall = wait = stolen = 0.0
    steal_known = True
    rows = []
    for t0, t1, c0, c1, e0, e1, ce0, ce1, st in rec.items:
        f = overlap(t0, t1, start, end)
        if f <= 0:
            continue
        puts += f
        if st is None:
            steal_known = False
        else:
            stolen += st * f
        put_cpu += (c1 - c0) * f
        evict_cpu += (ce1 - ce0) * f
        evict_wall += (e1 - e0) * f
        wait += ((t1 - t0) - (c1 - c0)) * f
        rows.append([t0, t1 - t0, c1 - c0, e1 - e0, ce1 - ce0, round(f, 6)])
    overshoot = 0.0
    for s0, s1, req in rec.sleeps:
        f = overlap(s0, s1, start, end)
        overshoot += max(0, s1 - s0 - req) * f
    window_s = (end - start) / 1e9
    n = max(puts, 1e-9)
    return {
        "native_id": rec.native_id,
        "puts": round(puts, 3),
        "puts_per_s": round(puts / window_s, 3),
        "put_cpu_ms_mean": round(put_cpu / n / 1e6, 4),
        "evict_cpu_ms_mean": round(evict_cpu / n / 1e6, 4),
        "evict_wall_ms_mean": round(evict_wall / n / 1e6, 4),
        "evict_cpu_s": round(evict_cpu / 1e9, 6),
        "gil_wait_in_put_s": round(wait / 1e9, 6),
        "steal_in_puts_s": round(stolen / 1e9, 6) if steal_known else None,
        "sleep_overshoot_s": round(overshoot / 1e9, 6),
        "put_columns": ["start_ns", "put_wall_ns", "put_cpu_ns", "evict_wall_ns", "evict_cpu_ns",
                        "in_window"],
        "puts_list": rows,
    }


def read_clocks(recs):
    return [time.clock_gettime_ns(r.clock) for r in recs]


def read_runq(recs):
    return [runq_ns(r.native_id) for r in recs]


def wait_for_go(path):
    """Block until a line can be read from the FIFO at `path`."""
    while True:
        with open(path) as f:
            if f.readline():
                return


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--duration", type=float, required=True, help="measurement window, seconds")
    ap.add_argument("--go-fifo", help="after READY, start the window only once a line is read here")
    ap.add_argument("--ready-fifo", help="also write READY into this FIFO (opened for writing)")
    ap.add_argument("--seed", default="1", help="seed of the work-length draws")
    ap.add_argument("--thread-names", choices=["os", "python", "same"], default="os",
                    help="os: OS and Python names; python: Python names only; same: both "
                         "workers named engine-worker (Python name only)")
    ap.add_argument("--gate", action="store_true",
                    help="workers run only from the window's start to its end")
    args = ap.parse_args()
    global NAMES, GATED
    NAMES = args.thread_names
    GATED = args.gate

    main_rec = Rec("gil-main", args.seed)
    set_comm(main_rec.name)
    main_rec.native_id = threading.get_native_id()
    main_rec.clock = time.pthread_getcpuclockid(threading.get_ident())

    launcher = Rec("launcher", args.seed)
    writer = Rec("aux-writer", args.seed)
    lt = threading.Thread(target=thread_main, args=(launcher, launcher_loop), name=pyname(launcher),
                          daemon=True)
    lt.start()
    CALIBRATED.wait()
    wt = threading.Thread(target=thread_main, args=(writer, writer_loop), name=pyname(writer),
                          daemon=True)
    wt.start()
    ARRIVED.acquire()
    ARRIVED.acquire()
    recs = [main_rec, launcher, writer]

    if args.ready_fifo:
        with open(args.ready_fifo, "w") as f:
            f.write("READY\n")
    print("READY", flush=True)
    if args.go_fifo:
        wait_for_go(args.go_fifo)
    start = mono()
    cpu0 = read_clocks(recs)
    rq0 = read_runq(recs)
    st0 = STEAL.read()
    WINDOW.set()
    hold_window(start + int(args.duration * 1e9))
    cpu1 = read_clocks(recs)
    rq1 = read_runq(recs)
    st1 = STEAL.read()
    end = mono()

    STOP.set()
    join_workers([lt, wt])

    wall = (end - start) / 1e9
    threads = []
    for r, a, b, q0, q1, t in zip(recs, cpu0, cpu1, rq0, rq1, [None, lt, wt]):
        rq = None if q0 is None or q1 is None else q1 - q0
        active = None
        if args.gate and r.active_cpu0 is not None and r.active_cpu1 is not None:
            active = round((r.active_cpu1 - r.active_cpu0) / 1e9, 6)
        threads.append({
            "native_id": r.native_id,
            "name": r.name,
            "python_name": (t or threading.main_thread()).name,
            "active_cpu_s": active,
            "wall_s": round(wall, 6),
            "cpu_s": round((b - a) / 1e9, 6),
            "offcpu_s": round(wall - (b - a) / 1e9, 6),
            "runq_s": None if rq is None else round(rq / 1e9, 6),
        })
    lrq = None if rq0[1] is None or rq1[1] is None else rq1[1] - rq0[1]
    wdoc = writer_doc(writer, start, end)
    wrq = None if rq0[2] is None or rq1[2] is None else rq1[2] - rq0[2]
    wdoc["gil_wait_lower_s"] = round(max(0.0, wdoc["gil_wait_in_put_s"] - (wrq or 0) / 1e9
                                         - (wdoc["steal_in_puts_s"] or 0.0)), 6)
    wdoc["gil_wait_upper_s"] = round(wdoc["gil_wait_in_put_s"] + wdoc["sleep_overshoot_s"], 6)
    writer_cpu = (cpu1[2] - cpu0[2]) or 1
    doc = {
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "switch_interval_s": sys.getswitchinterval(),
        "window": {"start_mono_ns": start, "end_mono_ns": end},
        "steal_s": None if st0 is None or st1 is None else round((st1 - st0) / 1e9, 6),
        "threads": threads,
        "launcher": launcher_doc(launcher, start, end, lrq),
        "writer": wdoc,
        "gil_holder": {
            "thread": writer.name,
            "native_id": writer.native_id,
            "function": qualname(AuxOutputStore._evict_to_fit),
            "caller": qualname(AuxOutputStore.put),
            "file": AuxOutputStore._evict_to_fit.__code__.co_filename,
            "share_of_holder_cpu": round(wdoc["evict_cpu_s"] * 1e9 / writer_cpu, 4),
            "waiter_function": qualname(Worker.execute_model),
        },
    }
    tmp = args.truth + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.truth)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
