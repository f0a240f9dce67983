"""One injected problem, with the truth a finding is held to (issue 23: findings over any
recording, checked on workloads that time themselves).

Usage: injected.py --problem {spin,serialize,lock,gc,growth,none} --truth PATH
                   --duration SECONDS [--go-fifo PATH] [--metrics-port PORT]

Problems (threads named through /proc/self/task/TID/comm, so a profiler reports them):

  spin       `producer` puts an item on a deque every 2 ms (deadline-paced sleeps); `reader`
             waits for each in `poll_items()`, a loop that calls os.sched_yield() until the
             deque has one (a busy-wait that gives the GIL back each turn, as vLLM's
             MessageQueue readers do), then handles it in `handle()` (~0.02 ms of Python).
             Truth: the reader's CPU time inside poll_items() over the window (thread CPU
             clock read around each call): the cores it burns waiting.
  serialize  `sender` runs steps: `schedule()` (~1 ms of Python), then `send_batch()`, which
             encodes a batch of 64 request records to JSON (`json.dumps`, pure-Python
             `JSONEncoder.iterencode` frames around the C encoder), then sleeps 0.5-3.5 ms
             (random: a fixed period would alias with the sampler's). Truth:
             the sender's CPU time inside json.dumps over the window.
  lock       `flusher` takes STORE_LOCK in `flush_store()` and holds it across `write_out()`, a
             blocking call (a 6 ms sleep standing for a disk or network write, the GIL
             released), then sleeps 1-3 ms without it; `handler` handles results: ~0.3 ms of
             Python in `prepare()`, then `record_result()` appends to the store under the same
             lock, then sleeps 0.2 ms (the next result's arrival). The handler spends most of its time asleep on the lock. Truth: the handler's
             wall time inside `STORE_LOCK.acquire()` over the window (perf counter around
             each acquire), the number of acquires that waited (> 0.1 ms), and the flusher's
             time holding the lock and inside write_out().
  gc         a gen-0/1 collection storm: `engine-loop` runs steps of `build_outputs()`, which
             makes 3,000 two-list reference cycles and holds them until the step ends (so
             every young collection traverses the step's live objects, and only the collector
             frees them), then sleeps 0.5-1.5 ms. The heap is frozen (gc.freeze()) and the
             thresholds are (5000, 10, 10), so pauses are a few hundred µs and mostly young.
             Truth: every collection in the window timed by a gc.callbacks hook (its clock
             read at "start" and at "stop"): count and seconds, by generation, and the thread.
  growth     per-request serialization that grows with a batch size exposed on a /metrics
             gauge: `sender` runs steps of `schedule()` (~0.3 ms of Python), then
             `pack_requests()`, which pickles each of the batch's request records on its own
             (`pickle.dumps` per request, as the seed's MessageQueue did), then sleeps 0.5-2 ms.
             The batch size follows a staircase (8, 40, 16, 64, 24, 56, 32, 48 requests, each
             held 0.5 s, round and round) and is served as `vllm:num_requests_running` on
             http://127.0.0.1:PORT/metrics (--metrics-port). Truth: each pack_requests call's
             thread CPU and batch size over the window, and the least-squares slope of the
             median CPU per batch size (ns per request), as the bundled engine fits its own.
  none       `compute` does arithmetic in `crunch()` in slices of 5 ms with 5 ms sleeps between;
             `idle` sleeps through the window (one wait on an event). Nothing to find: no thread
             waits for another, no GC to speak of, no polling, no serialization.

Protocol as in cpu_mix.py: READY on stdout once every thread runs its steady loop; with
--go-fifo the window starts once a line is read there, else at READY; it lasts --duration
seconds (monotonic clock), then the threads stop and the truth is written.

Truth JSON: {"pid", "python", "problem", "window": {"start_mono_ns", "end_mono_ns"},
  "threads": {name: native tid}, "window_cpu_s": {name: thread CPU over the window},
  and per problem: spin: "poll_cpu_s", "poll_calls", "items"; serialize: "dumps_cpu_s",
  "dumps_calls", "steps"; lock: "acquire_wait_s", "acquires", "acquires_waited", "held_s",
  "write_out_s"; gc: "gc_s", "pauses", "by_generation" {gen: {"pauses", "total_s"}},
  "gc_threads" {name: pauses}; growth: "send_cpu_s", "send_calls", "slope_ns_per_request",
  "intercept_ns", "r", "batch_min", "batch_max", "slope_by_scrape_ns" (the same calls' CPU
  fitted per interval between the scrapes this process served, as a finding reads them:
  what a perfect observer with those scrapes would say), "scrape_intervals";
  none: "crunch_cpu_s"}.
"""

import argparse
import collections
import gc
import http.server
import json
import os
import pickle
import random
import sys
import threading
import time

STOP = threading.Event()
STARTED = threading.Semaphore(0)
WINDOW = [0, 1 << 62]  # [start, end) monotonic ns, set by the main thread
mono = time.monotonic_ns


def set_comm(name):
    threading.current_thread().name = name
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
            f.write(name[:15])
    except OSError:
        pass


class Thread:
    """A named worker: its native id, its CPU clock, and its timed calls (wall start, CPU
    spent) appended only by itself."""

    def __init__(self, name, body):
        self.name = name
        self.body = body
        self.native_id = None
        self.clock = None
        self.calls = []
        self.t = threading.Thread(target=self.run, name=name, daemon=True)

    def run(self):
        set_comm(self.name)
        self.native_id = threading.get_native_id()
        self.clock = time.pthread_getcpuclockid(threading.get_ident())
        STARTED.release()
        self.body(self)

    def cpu(self):
        return time.clock_gettime_ns(self.clock)


def in_window(t):
    return WINDOW[0] <= t < WINDOW[1]


# ---- spin ----
ITEMS = collections.deque()


def producer(me):
    nxt = mono()
    n = 0
    while not STOP.is_set():
        ITEMS.append(n)
        n += 1
        nxt += 2_000_000
        d = nxt - mono()
        if d > 0:
            time.sleep(d / 1e9)


def poll_items():
    while not ITEMS:
        if STOP.is_set():
            return None
        os.sched_yield()
    return ITEMS.popleft()


def handle(item):
    s = 0
    for i in range(400):
        s += i * item
    return s


def reader(me):
    while not STOP.is_set():
        t, c = mono(), me.cpu()
        item = poll_items()
        me.calls.append((t, me.cpu() - c))
        if item is not None:
            handle(item)


# ---- serialize ----
def schedule(step):
    s = 0
    for i in range(2500):
        s += i ^ step
    return s


def send_batch(me, step):
    batch = [
        {"request_id": "req-%d-%d" % (step, i), "tokens": list(range(i % 7, i % 7 + 48)),
         "logprobs": [0.25 * k for k in range(16)], "finished": False}
        for i in range(64)
    ]
    t, c = mono(), me.cpu()
    text = json.dumps(batch)
    me.calls.append((t, me.cpu() - c))
    return len(text)


def sender(me):
    # Sleeps of random length between steps: a loop of fixed period would alias with a
    # sampler of fixed rate (both run on the clock), and its samples would land on the same
    # phases of the step run after run (JSON read 16% under and 10% over its CPU in five
    # runs when the sender slept a fixed 2 ms; the thread's CPU within 1% each time).
    rng = random.Random(7)
    step = 0
    while not STOP.is_set():
        schedule(step)
        send_batch(me, step)
        step += 1
        time.sleep(rng.uniform(0.0005, 0.0035))


# ---- lock ----
STORE_LOCK = threading.Lock()
STORE = collections.deque(maxlen=4096)


def write_out():
    time.sleep(0.006)


def flush_store(me):
    with STORE_LOCK:
        w = mono()
        write_out()
        x = mono()
        STORE.clear()
        me.calls.append((w, (mono() - w, x - w)))


def flusher(me):
    rng = random.Random(11)
    while not STOP.is_set():
        flush_store(me)
        time.sleep(rng.uniform(0.001, 0.003))


def prepare(i):
    s = 0
    for k in range(1500):
        s += k ^ i
    return s


def record_result(me, i):
    t = time.perf_counter_ns()
    STORE_LOCK.acquire()
    waited = time.perf_counter_ns() - t
    try:
        STORE.append(i)
    finally:
        STORE_LOCK.release()
    me.calls.append((mono(), waited))


def handler(me):
    i = 0
    while not STOP.is_set():
        record_result(me, prepare(i))
        i += 1
        # Results arrive: a short sleep, which also lets the flusher take the GIL back at once
        # after its own sleeps (no GIL contention to speak of beside the lock's).
        time.sleep(0.0002)


# ---- gc ----
GC_PAUSES = []  # (start mono ns, duration ns, generation, native thread id)
_gc_start = [0]


def gc_hook(phase, info):
    t = mono()
    if phase == "start":
        _gc_start[0] = t
    else:
        GC_PAUSES.append((_gc_start[0], t - _gc_start[0], info["generation"],
                          threading.get_native_id()))


def build_outputs(step):
    out = []
    for i in range(3000):
        a = [i, step]
        b = [a]
        a.append(b)
        out.append(a)
    return len(out)


def engine_loop(me):
    rng = random.Random(5)
    step = 0
    while not STOP.is_set():
        t = mono()
        build_outputs(step)
        me.calls.append((t, 0))
        step += 1
        time.sleep(rng.uniform(0.0005, 0.0015))


# ---- growth ----
LEVELS = (8, 40, 16, 64, 24, 56, 32, 48)
BATCH = [LEVELS[0]]
SCRAPES = []  # (mono ns, value served): each /metrics request, as the scraper read it


def batch_size():
    """The staircase: each level held 0.5 s, round and round (from the process's start)."""
    return LEVELS[int((mono() - T0) / 5e8) % len(LEVELS)]


def pack_requests(me, step, n):
    t, c = mono(), me.cpu()
    total = 0
    for i in range(n):
        rec = [step, i, n] + list(range(i % 5, i % 5 + 40))
        total += len(pickle.dumps(rec))
    me.calls.append((t, (me.cpu() - c, n)))
    return total


def grower(me):
    rng = random.Random(13)
    step = 0
    while not STOP.is_set():
        n = batch_size()
        BATCH[0] = n
        schedule(step)
        pack_requests(me, step, n)
        step += 1
        time.sleep(rng.uniform(0.0005, 0.002))


class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        n = BATCH[0]
        SCRAPES.append((mono(), n))
        body = ("# TYPE vllm:num_requests_running gauge\n"
                'vllm:num_requests_running{model_name="injected"} %d\n' % n).encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def theil_sen(points):
    """The median of the pairwise slopes."""
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points)
              for b in points[i + 1:] if b[0] != a[0]]
    return median(slopes) if slopes else 0.0


def by_scrape(calls):
    """The slope a perfect observer of these calls would read with the scrapes this process
    served: per interval between two scrapes, the median CPU of the calls that began in it
    against the mean of the two values (intervals with at least 3 calls and half the median
    interval's), the line through them by the median of pairwise slopes."""
    scrapes = sorted(SCRAPES)
    per = []
    for (a, va), (b, vb) in zip(scrapes, scrapes[1:]):
        d = [c for (w, c, _) in calls if a <= w < b]
        if d:
            per.append(((va + vb) / 2, d))
    if not per:
        return 0.0, 0
    enough = max(3, sorted(len(d) for _, d in per)[len(per) // 2] // 2)
    points = [(x, median(d)) for x, d in per if len(d) >= enough]
    return theil_sen(points), len(points)


def fit(points):
    """Least squares y = a + b x over (x, y): (b, a, r)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    syy = sum((y - my) ** 2 for _, y in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    b = sxy / sxx if sxx else 0.0
    r = sxy / (sxx * syy) ** 0.5 if sxx and syy else 0.0
    return b, my - b * mx, r


# ---- none ----
def crunch(ms):
    end = mono() + ms * 1_000_000
    s = 0
    while mono() < end:
        for i in range(200):
            s += i * i
    return s


def compute(me):
    while not STOP.is_set():
        t, c = mono(), me.cpu()
        crunch(5)
        me.calls.append((t, me.cpu() - c))
        time.sleep(0.005)


def idle(me):
    # Asleep the whole window, woken once at its end. Sleeping in a loop, it would wake into
    # the GIL that `compute` holds half the time and wait for it each time (a wake every
    # 50 ms: ~100 waits of ~2.5 ms in a 4 s window, 6.1% of it in one CI run, over the
    # gil_contention threshold: contention by construction, in a workload meant to have none).
    STOP.wait()


PROBLEMS = {
    "spin": [("producer", producer), ("reader", reader)],
    "serialize": [("sender", sender)],
    "lock": [("flusher", flusher), ("handler", handler)],
    "gc": [("engine-loop", engine_loop)],
    "growth": [("sender", grower)],
    "none": [("compute", compute), ("idle", idle)],
}
T0 = mono()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", choices=sorted(PROBLEMS), required=True)
    ap.add_argument("--truth", required=True)
    ap.add_argument("--duration", type=float, required=True, help="window, seconds")
    ap.add_argument("--go-fifo", help="after READY, start the window once a line is read here")
    ap.add_argument("--metrics-port", type=int, default=0,
                    help="growth: serve the batch size on this port (0: any free one)")
    args = ap.parse_args()
    set_comm("injected-main")
    if args.problem == "gc":
        gc.collect()
        gc.freeze()
        gc.set_threshold(5000, 10, 10)
        gc.callbacks.append(gc_hook)
    if args.problem == "growth":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", args.metrics_port), Metrics)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        print("METRICS http://127.0.0.1:%d/metrics" % server.server_address[1], flush=True)
    threads = [Thread(n, b) for n, b in PROBLEMS[args.problem]]
    for t in threads:
        t.t.start()
    for _ in threads:
        STARTED.acquire()
    # Each thread's loop has run a few turns (the spin reader has read items, the sender
    # sent batches) before READY.
    while any(t.name != "idle" and t.name != "producer" and len(t.calls) < 3 for t in threads):
        time.sleep(0.01)
    print("READY", flush=True)
    if args.go_fifo:
        while True:
            with open(args.go_fifo) as f:
                if f.readline():
                    break
    cpu0 = {t.name: t.cpu() for t in threads}
    start = mono()
    WINDOW[0] = start
    end_at = start + int(args.duration * 1e9)
    while mono() < end_at:
        time.sleep(max(0.0, (end_at - mono()) / 1e9))
    end = mono()
    WINDOW[1] = end
    cpu1 = {t.name: t.cpu() for t in threads}
    STOP.set()
    for t in threads:
        t.t.join(timeout=5)
    doc = {
        "pid": os.getpid(),
        "python": sys.version.split()[0],
        "problem": args.problem,
        "window": {"start_mono_ns": start, "end_mono_ns": end},
        "threads": {t.name: t.native_id for t in threads},
        "window_cpu_s": {n: (cpu1[n] - cpu0[n]) / 1e9 for n in cpu0},
    }
    by = {t.name: t for t in threads}

    def timed(name):
        calls = [c for (w, c) in by[name].calls if in_window(w)]
        return sum(calls) / 1e9, len(calls)

    if args.problem == "spin":
        doc["poll_cpu_s"], doc["poll_calls"] = timed("reader")
    elif args.problem == "serialize":
        doc["dumps_cpu_s"], doc["dumps_calls"] = timed("sender")
    elif args.problem == "lock":
        waits = [c for (w, c) in by["handler"].calls if in_window(w)]
        doc["acquire_wait_s"] = sum(waits) / 1e9
        doc["acquires"] = len(waits)
        doc["acquires_waited"] = sum(1 for c in waits if c > 100_000)
        held = [c for (w, c) in by["flusher"].calls if in_window(w)]
        doc["held_s"] = sum(h for h, _ in held) / 1e9
        doc["write_out_s"] = sum(x for _, x in held) / 1e9
    elif args.problem == "gc":
        gc.callbacks.remove(gc_hook)
        names = {t.native_id: t.name for t in threads}
        pauses = [p for p in GC_PAUSES if in_window(p[0])]
        doc["gc_s"] = sum(p[1] for p in pauses) / 1e9
        doc["pauses"] = len(pauses)
        gens = {}
        for _, d, g, _ in pauses:
            e = gens.setdefault(str(g), {"pauses": 0, "total_s": 0.0})
            e["pauses"] += 1
            e["total_s"] += d / 1e9
        doc["by_generation"] = gens
        doc["gc_threads"] = dict(collections.Counter(names.get(p[3], "other") for p in pauses))
    elif args.problem == "growth":
        inside = [(w, c, n) for (w, (c, n)) in by["sender"].calls if in_window(w)]
        doc["send_cpu_s"] = sum(c for _, c, _ in inside) / 1e9
        doc["send_calls"] = len(inside)
        per = collections.defaultdict(list)
        for _, c, n in inside:
            per[n].append(c)
        b, a, r = fit([(n, median(v)) for n, v in per.items()])
        doc["slope_ns_per_request"], doc["intercept_ns"], doc["r"] = b, a, r
        doc["batch_min"], doc["batch_max"] = min(per), max(per)
        doc["slope_by_scrape_ns"], doc["scrape_intervals"] = by_scrape(inside)
    else:
        doc["crunch_cpu_s"], _ = timed("compute")
    with open(args.truth, "w") as f:
        json.dump(doc, f, indent=1)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
