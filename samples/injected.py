"""One injected problem, with the truth a finding is held to (issue 23: findings over any
recording, checked on workloads that time themselves).

Usage: injected.py --problem {spin,serialize,lock,none} --truth PATH --duration SECONDS
                   [--go-fifo PATH]

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
  none       `compute` does arithmetic in `crunch()` in slices of 5 ms with 5 ms sleeps between;
             `idle` sleeps. Nothing to find: no thread waits for another, no GC to speak of, no
             polling, no serialization.

Protocol as in cpu_mix.py: READY on stdout once every thread runs its steady loop; with
--go-fifo the window starts once a line is read there, else at READY; it lasts --duration
seconds (monotonic clock), then the threads stop and the truth is written.

Truth JSON: {"pid", "python", "problem", "window": {"start_mono_ns", "end_mono_ns"},
  "threads": {name: native tid}, "window_cpu_s": {name: thread CPU over the window},
  and per problem: spin: "poll_cpu_s", "poll_calls", "items"; serialize: "dumps_cpu_s",
  "dumps_calls", "steps"; lock: "acquire_wait_s", "acquires", "acquires_waited", "held_s",
  "write_out_s"; none: "crunch_cpu_s"}.
"""

import argparse
import collections
import json
import os
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
    while not STOP.is_set():
        time.sleep(0.05)


PROBLEMS = {
    "spin": [("producer", producer), ("reader", reader)],
    "serialize": [("sender", sender)],
    "lock": [("flusher", flusher), ("handler", handler)],
    "none": [("compute", compute), ("idle", idle)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", choices=sorted(PROBLEMS), required=True)
    ap.add_argument("--truth", required=True)
    ap.add_argument("--duration", type=float, required=True, help="window, seconds")
    ap.add_argument("--go-fifo", help="after READY, start the window once a line is read here")
    args = ap.parse_args()
    set_comm("injected-main")
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
    else:
        doc["crunch_cpu_s"], _ = timed("compute")
    with open(args.truth, "w") as f:
        json.dump(doc, f, indent=1)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
