"""Ground truth for GC-pause tracing: threads churning reference cycles, every collection timed.

Usage: gc_churn.py --truth PATH --duration SECONDS [--go-fifo PATH] [--ready-fifo PATH]
                   [--heap N] [--cycles-per-s N] [--medium-per-s N]

Threads (OS names set through /proc/self/task/TID/comm, so a profiler can report them):

  gc-main      the main thread. Builds a live heap of --heap tracked objects (lists, 150,000 by
               default) and ages it into the oldest generation with gc.collect(), sets the GC
               thresholds to (1000, 10, 10) on every version, starts the allocators, waits until
               they are in their steady loops and the first automatic full collection has
               happened, prints READY; with --go-fifo it then blocks until a line can be read
               from that FIFO. The measurement window starts there. It blocks in time.sleep()
               inside `hold_window()` for the window, then stops and joins the allocators.
  gc-alloc-0,  each runs ticks of 2 ms (deadline-paced, no catch-up bursts): `alloc_cycles()`
  gc-alloc-1   makes half of --cycles-per-s (150,000/s in all) two-list reference cycles, which
               only the collector frees, and `churn_medium()` half of --medium-per-s (250,000/s)
               one-element lists kept in a ring for 100 ms, long enough to survive a young
               collection and be promoted, then freed by reference counting.

What that makes the collector do, by construction (CPython's generational collector on 3.10-3.13
and on the 3.14/3.15 builds checked, see below):
  * generation 0 is collected every 1000 net allocations of tracked objects. The cycles are
    300,000 objects/s, and the medium-lived lists are allocated and freed at the same rate, so
    about 300 gen-0 collections/s, each short (about a thousand young objects);
  * generation 1 every 10 gen-0 collections: about 30/s, a little longer (it also scans what
    the last young collections promoted);
  * generation 2 every 10 gen-1 collections, but only when the objects promoted into it since
    the last full collection exceed 25% of it: the medium-lived lists do that (25,000 promoted
    per gen-1 collection against a heap of 150,000 + the ring), so about 3/s. A full collection
    traverses the whole live heap, so it lasts tens of times longer than a gen-0 one.
Measured numbers are in the truth, and they are what a profiler is held to.

How it is measured. A gc.callbacks hook reads time.monotonic_ns() first thing at "start" and at
"stop", and records info["generation"], info["collected"], info["uncollectable"] and the thread
(threading.get_native_id(): the collection runs in whichever thread's allocation triggered it).
A pause is [start callback's clock read, stop callback's clock read]. What a tracer of the
interpreter's `collecting` flag sees is slightly longer: CPython sets the flag, calls the start
callbacks, collects, calls the stop callbacks, clears the flag, so the flag's interval also holds
the callback machinery (building the info dict, the call) before the first clock read and the
rest of the stop callback after the second. `callback_cost_ns` is one call of the hook, timed
before the window over 5,000 direct calls: expect a traced pause to be longer than the truth's
by about that much (one part of each of the two calls) plus about a µs of CPython's own
bookkeeping; over hundreds of gen-0 pauses a second that is a few ms/s of total GC time. The
hook's own time is inside the truth's pauses (its first clock read is the start, its second the
end), so the collector's real work is shorter by a little less than one call.

The flag's interval is measured too: a copy of the hook is called last (the two are installed
in one step), and a pause's flag_dur_ns is the span from the first hook's start to the last
one's stop plus the gap between the two at the start, its median over the pauses (the first
hook's rest and the last one's call up to its clock read: the same code as what the span
leaves out, the first hook's call up to its clock read and the last one's rest after it).
What it still leaves out is CPython's building of the info dict and its bookkeeping around
the callbacks. Measured on the 2-core Intel VM: flag_dur_ns exceeds dur_ns by 7-10 µs per
pause (the callbacks run with the caches the collection left, far slower than
callback_cost_ns); a uprobe tracer of the collector read
a median 4-8 µs per pause above flag_dur_ns (its own two int3 traps and what flag_dur_ns leaves
out) where, with the one hook alone, it read 11-15 µs above dur_ns (+3-4% of the GC total).
A tracer is held to flag_total_s and flag_max_ms.

Pauses are wall time: a collection preempted by another process on the machine lasts longer,
and a tracer of the `collecting` flag sees the same longer pause. The counts are checked against
the interpreter's own: `gc_stats_delta[g].collections` equals the number of generation-g pauses
(every collection calls the hook). On 3.15, gc.get_stats() also has the collector's own
"duration" per generation, a little shorter than the hook's pauses (about 12 µs per pause: it
leaves out the callbacks and some of the collector's bookkeeping).

A pause counts in the window when it starts inside it (start_mono_ns <= start < end_mono_ns).

Measured on the 2-core VM (10 s windows, other work loading the machine): 3.12.1 239 gen-0/s
(mean 0.25 ms), 21.6 gen-1/s (1.2 ms), 1.9 gen-2/s (35 ms); sid 3.14.10 246/s (0.19 ms),
22.4/s (1.0 ms), 2.0/s (21 ms); GC 11-15% of the window; callback_cost_ns 330-420; allocators
use about 10% of a core each.

Truth JSON:
  {"pid", "python", "thresholds", "heap_objects", "window": {"start_mono_ns", "end_mono_ns"},
   "callback_cost_ns", "pauses", "total_s", "max_ms", "share",
   "flag_total_s", "flag_max_ms", "flag_excess_median_ns" (flag_dur_ns's sum, max, and median
   excess over dur_ns; null if the two hooks' events could not be paired),
   "by_generation": {"0": {"pauses", "total_s", "max_ms", "mean_ms"}, "1": ..., "2": ...}
                    (the three numbered keys always, any other generation that occurs),
   "by_thread": [{"native_id", "name", "pauses", "total_s", "max_ms"}],
   "threads": [{"native_id", "name", "wall_s", "cpu_s"}],
   "gc_stats_delta": [per generation: the window's change of gc.get_stats() (collections,
                      collected, and on 3.15 its own "duration" per generation)],
   "rates": {"cycles_per_s", "medium_per_s"} (achieved in the window),
   "pause_columns": ["start_ns", "dur_ns", "generation", "native_id", "collected",
                     "uncollectable", "flag_dur_ns"],
   "pause_list": [[...], ...]}

Generations. On 3.10-3.13 and on the Debian sid builds of 3.14.10 and 3.15.2 checked here,
gc.get_threshold() has three thresholds, gc.get_stats() three generations, and gc.callbacks
reports generation 0, 1 or 2 for the generation collected (a collection of generation n also
collects the younger ones). The incremental collector of the 3.14 development cycle (a young
generation and an old one collected in increments) is not what these builds run; on a build
that has it, its automatic collections report 0 (young) or 1 (an increment) and a full
gc.collect() 2: the truth keys pauses by whatever generation the callback reports, and records
gc.get_threshold() so the two can be told apart.

Protocol as in cpu_mix.py: READY on stdout (and into --ready-fifo), the window after READY or,
with --go-fifo, after a line has been read from that FIFO; DONE after the truth is written.
Nothing here sleeps to wait for readiness. Runs unchanged on CPython 3.10-3.15, with or without
/proc.
"""
import argparse
import collections
import gc
import json
import os
import sys
import threading
import time

mono = time.monotonic_ns
native_id = threading.get_native_id

MS = 1000000
THRESHOLDS = (1000, 10, 10)
TICK_NS = 2 * MS
MEDIUM_LIFETIME_S = 0.100
ALLOCATORS = 2

STOP = threading.Event()
ARRIVED = threading.Semaphore(0)
FULL_SEEN = threading.Event()
EVENTS = []  # (t_ns, is_start, generation, native_id, collected, uncollectable)
EVENTS_LAST = []  # the same, from the same hook's copy called last


def set_comm(name):
    """Set this thread's OS name (what /proc/PID/task/TID/comm shows) and its Python name
    (threading), so the two agree."""
    threading.current_thread().name = name
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def make_hook(events, full_seen):
    append = events.append

    def on_gc(phase, info):
        t = mono()
        gen = info["generation"]
        append((t, phase == "start", gen, native_id(), info.get("collected", 0),
                info.get("uncollectable", 0)))
        if gen == 2 and not full_seen.is_set() and phase == "stop":
            full_seen.set()
    return on_gc


def callback_cost_ns(n=5000):
    """One call of the hook, ns (direct calls, into a throwaway list)."""
    sink = []
    flag = threading.Event()
    flag.set()
    hook = make_hook(sink, flag)
    info = {"generation": 0, "collected": 0, "uncollectable": 0}
    best = None
    for _ in range(5):
        del sink[:]
        t0 = mono()
        for _ in range(n // 5):
            hook("start", info)
        t1 = mono()
        per = (t1 - t0) / (n // 5)
        best = per if best is None else min(best, per)
    return round(best, 1)


# --- the allocators' code ------------------------------------------------------------------

def alloc_cycles(n):
    """n two-list cycles, dropped at once: garbage only the collector can free."""
    for _ in range(n):
        a = []
        b = [a]
        a.append(b)
    return n


def churn_medium(ring, n, base):
    """n one-element lists into a ring that frees the oldest: objects that live ~100 ms."""
    push = ring.append
    for i in range(n):
        push([base + i])
    return n


def hold_window(deadline_ns):
    while True:
        left = deadline_ns - mono()
        if left <= 0:
            return
        time.sleep(left / 1e9)


def join_workers(threads):
    for t in threads:
        t.join()


class Rec:
    def __init__(self, name):
        self.name = name
        self.native_id = None
        self.clock = None
        self.ticks = []  # (t_ns, cycles, medium)


def alloc_loop(rec, cycles_per_s, medium_per_s):
    ticks_per_s = 1e9 / TICK_NS
    ring = collections.deque(maxlen=max(1, int(medium_per_s * MEDIUM_LIFETIME_S)))
    # Whole objects per tick, with the remainder carried so the rates hold exactly.
    c_acc = m_acc = 0.0
    made = 0
    ticks = rec.ticks
    ARRIVED.release()
    next_t = mono()
    while not STOP.is_set():
        c_acc += cycles_per_s / ticks_per_s
        m_acc += medium_per_s / ticks_per_s
        nc, nm = int(c_acc), int(m_acc)
        c_acc -= nc
        m_acc -= nm
        t = mono()
        alloc_cycles(nc)
        churn_medium(ring, nm, made)
        made += nm
        ticks.append((t, nc, nm))
        next_t += TICK_NS
        now = mono()
        if next_t > now:
            time.sleep((next_t - now) / 1e9)
        elif now - next_t > 20 * MS:
            next_t = now  # far behind: no burst to catch up


def thread_main(rec, args):
    set_comm(rec.name)
    rec.native_id = threading.get_native_id()
    rec.clock = time.pthread_getcpuclockid(threading.get_ident())
    alloc_loop(rec, *args)


# --- the truth -------------------------------------------------------------------------------

def pauses_from(events, last):
    """Pair each start with the next stop (collections never nest). `last` holds the events of
    the hook's copy called last, one for each of `events` in the same order; a pause's
    flag_dur_ns is its span from the first hook's start to the last one's stop, plus the gap
    between the two hooks at the start (what the callback machinery outside that span costs:
    see flag_dur_ns in the docstring). The gap added is the median over all pauses, not each
    pause's own: the code between the two clock reads is the same every time, and a pause
    whose thread was preempted inside its gap (milliseconds, on a loaded machine) would
    otherwise count the preemption twice, once inside the span and once more as the gap."""
    paired = len(last) == len(events)
    spans = []
    open_ = None
    for k, ev in enumerate(events):
        t, is_start, gen, nid, collected, uncollectable = ev
        if is_start:
            open_ = (k, ev)
        elif open_ is not None and open_[1][2] == gen:
            i, start = open_
            span = gap = None
            if paired:
                span, gap = last[k][0] - start[0], last[i][0] - start[0]
            spans.append((start, t, gen, collected, uncollectable, span, gap))
            open_ = None
    gaps = sorted(g for *_, g in spans if g is not None)
    gap = gaps[len(gaps) // 2] if gaps else None
    out = []
    for start, t, gen, collected, uncollectable, span, _ in spans:
        flag = span + gap if span is not None and gap is not None else None
        out.append((start[0], t - start[0], gen, start[3], collected, uncollectable, flag))
    return out


def gen_key(g):
    return str(g) if g is not None and g >= 0 else "unknown"


def summarize(pauses):
    n = len(pauses)
    total = sum(p[1] for p in pauses)
    mx = max((p[1] for p in pauses), default=0)
    return {
        "pauses": n,
        "total_s": round(total / 1e9, 9),
        "max_ms": round(mx / 1e6, 6),
        "mean_ms": round(total / n / 1e6, 6) if n else 0.0,
    }


def stats_delta(a, b):
    out = []
    for x, y in zip(a, b):
        d = {}
        for k, v in y.items():
            if isinstance(v, (int, float)) and isinstance(x.get(k), (int, float)):
                d[k] = round(v - x[k], 9) if isinstance(v, float) else v - x[k]
        out.append(d)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--duration", type=float, required=True, help="measurement window, seconds")
    ap.add_argument("--go-fifo", help="after READY, start the window only once a line is read here")
    ap.add_argument("--ready-fifo", help="also write READY into this FIFO (opened for writing)")
    ap.add_argument("--heap", type=int, default=150000, help="live tracked objects")
    ap.add_argument("--cycles-per-s", type=float, default=150000.0, help="two-list cycles per s")
    ap.add_argument("--medium-per-s", type=float, default=250000.0,
                    help="medium-lived lists per s")
    args = ap.parse_args()

    main_rec = Rec("gc-main")
    set_comm(main_rec.name)
    main_rec.native_id = threading.get_native_id()
    main_rec.clock = time.pthread_getcpuclockid(threading.get_ident())

    heap = [[i, i + 1] for i in range(args.heap)]
    gc.collect()
    gc.collect()
    gc.set_threshold(*THRESHOLDS)
    cost = callback_cost_ns()
    # The timing hook first and a copy of it last, in one step (no collection between).
    closed = threading.Event()
    closed.set()
    gc.callbacks.extend([make_hook(EVENTS, FULL_SEEN), make_hook(EVENTS_LAST, closed)])

    recs = [Rec("gc-alloc-%d" % i) for i in range(ALLOCATORS)]
    rate = (args.cycles_per_s / ALLOCATORS, args.medium_per_s / ALLOCATORS)
    threads = []
    for r in recs:
        t = threading.Thread(target=thread_main, args=(r, rate), name=r.name, daemon=True)
        t.start()
        threads.append(t)
    for _ in recs:
        ARRIVED.acquire()
    FULL_SEEN.wait()
    all_recs = [main_rec] + recs

    if args.ready_fifo:
        with open(args.ready_fifo, "w") as f:
            f.write("READY\n")
    print("READY", flush=True)
    if args.go_fifo:
        while True:
            with open(args.go_fifo) as f:
                if f.readline():
                    break
    start = mono()
    stats0 = gc.get_stats()
    cpu0 = [time.clock_gettime_ns(r.clock) for r in all_recs]
    hold_window(start + int(args.duration * 1e9))
    cpu1 = [time.clock_gettime_ns(r.clock) for r in all_recs]
    stats1 = gc.get_stats()
    end = mono()

    STOP.set()
    join_workers(threads)
    gc.callbacks.clear()

    events = list(EVENTS)
    pauses = [p for p in pauses_from(events, list(EVENTS_LAST)) if start <= p[0] < end]
    flags = [p[6] for p in pauses if p[6] is not None]
    gaps = sorted(p[6] - p[1] for p in pauses if p[6] is not None)
    by_gen = {"0": [], "1": [], "2": []}
    for p in pauses:
        by_gen.setdefault(gen_key(p[2]), []).append(p)
    names = {r.native_id: r.name for r in all_recs}
    by_tid = {}
    for p in pauses:
        by_tid.setdefault(p[3], []).append(p)
    window_ns = end - start
    total = sum(p[1] for p in pauses)
    cycles = sum(c for r in recs for t, c, m in r.ticks if start <= t < end)
    medium = sum(m for r in recs for t, c, m in r.ticks if start <= t < end)
    wall = window_ns / 1e9
    doc = {
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "thresholds": list(gc.get_threshold()),
        "heap_objects": len(heap),
        "window": {"start_mono_ns": start, "end_mono_ns": end},
        "callback_cost_ns": cost,
        "pauses": len(pauses),
        "total_s": round(total / 1e9, 9),
        "max_ms": round(max((p[1] for p in pauses), default=0) / 1e6, 6),
        "share": round(total / window_ns, 6),
        "flag_total_s": round(sum(flags) / 1e9, 9) if len(flags) == len(pauses) else None,
        "flag_max_ms": round(max(flags, default=0) / 1e6, 6) if len(flags) == len(pauses) else None,
        "flag_excess_median_ns": gaps[len(gaps) // 2] if gaps else None,
        "by_generation": {k: summarize(v) for k, v in sorted(by_gen.items())},
        "by_thread": [
            dict(native_id=t, name=names.get(t, ""), **{k: v for k, v in summarize(ps).items()
                                                         if k != "mean_ms"})
            for t, ps in sorted(by_tid.items(), key=lambda kv: -sum(p[1] for p in kv[1]))
        ],
        "threads": [
            {"native_id": r.native_id, "name": r.name, "wall_s": round(wall, 6),
             "cpu_s": round((b - a) / 1e9, 6)}
            for r, a, b in zip(all_recs, cpu0, cpu1)
        ],
        "gc_stats_delta": stats_delta(stats0, stats1),
        "rates": {"cycles_per_s": round(cycles / wall, 1), "medium_per_s": round(medium / wall, 1)},
        "pause_columns": ["start_ns", "dur_ns", "generation", "native_id", "collected",
                          "uncollectable", "flag_dur_ns"],
        "pause_list": [list(p) for p in pauses],
    }
    tmp = args.truth + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.truth)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
