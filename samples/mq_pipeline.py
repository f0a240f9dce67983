"""Ground truth for per-call latency probes: a two-process MessageQueue pipeline that times its
own calls.

Usage: mq_pipeline.py --truth PATH --duration SECONDS [--go-fifo PATH] [--requests N]
                      [--steps-per-s N] [--puts-per-s N] [--evict-items N] [--gc-truth]

Processes and threads (OS names set through /proc/self/task/TID/comm):

  producer (the process started)   main thread `mq-producer`: each step builds one list per
      request ([request id, step, token ids...]) and calls `MessageQueue.enqueue(obj)`, which
      pickles it into a shared-memory ring slot (like vLLM's shm_broadcast MessageQueue); then
      it paces itself (time.sleep) to --steps-per-s.
  consumer (a forked child)        main thread `mq-consumer`: `MessageQueue.dequeue()` waits for
      the next slot (a blocking read on a notification pipe) and unpickles it; then hands every
      8th step's payload to the writer thread. Thread `aux-writer`: `AuxStore.put(key, value)`
      stores it and calls `AuxStore._evict_to_fit()`, a linear scan over --evict-items entries
      to find the least recently used one (pure Python, holding the GIL), like the LRU scan
      that cost vLLM's router replay its throughput.

Timing: every call of `MessageQueue.enqueue`, `MessageQueue.dequeue`, `AuxStore.put`,
`AuxStore._evict_to_fit` and the producer's `Engine.step`, `Engine.schedule`, `Engine.update`
and `Engine.pace` records (native thread id, start, duration) with
time.perf_counter_ns() (CLOCK_MONOTONIC, the clock enginescope uses) taken as the first
statement of the body and in a `finally:` around it, so the time covers the body only: not the
call overhead, and not the cost of a profiler's breakpoint traps at entry and return. Each
call is also timed by its caller, around the call expression ("outer_calls"): that time holds
the whole call, traps and set-up included. A profiler's span of a call lies between the two.

Protocol: once both processes are in their steady loops (the child says so through a pipe),
prints READY (and the calls continue: a profiler that finds functions by sampling them needs
them running). With --go-fifo, a thread reads one line from that FIFO and marks the window
start then; without it the window starts at READY. --duration seconds after the window start
the producer stops, the consumer drains, both write their truth, and the producer prints DONE.
Calls made before the window start are recorded too (the truth covers every call from READY
on), so a test can pick window edges in quiet gaps between calls. Nothing sleeps for readiness.

Truth JSON (producer at PATH, consumer at PATH.consumer.json):
  {"pid", "role", "python", "window": {"start_mono_ns", "end_mono_ns"},
   "threads": {"<native tid>": "name"},
   "calls": {"MessageQueue.enqueue": [[tid, start_ns, dur_ns], ...], ...},
   "outer_calls": {same names: the same calls timed by their callers around the call},
   "gc_pauses": [[start_ns, dur_ns, generation], ...],   (producer, --gc-truth only)
   "gc_outer": [[start_ns, dur_ns], ...],   (--gc-truth: an explicit gc.collect(0) after each
                                            automatic collection, timed by its caller)
   "steal_ns": N or null}   (producer: the hypervisor's steal over the window, all CPUs
                             together, from /proc/stat: a vCPU stolen mid-call stretches the
                             call's wall time with no switch-out anyone in the guest can see)
"""

import argparse
import gc
import os
import pickle
import sys
import threading
import time
from multiprocessing import shared_memory

CALLS = {}
RECORDING = False


def now():
    return time.perf_counter_ns()


def note(name, t0):
    if RECORDING:
        CALLS.setdefault(name, []).append((threading.get_native_id(), t0, now() - t0))


OUTER = {}


def outer(name, t0):
    """The same call timed by its caller, around the call expression: t0 taken just before it.
    This clock sees what the body's cannot: the call's set-up and return, a profiler's traps,
    and a collection that the interpreter runs on entering the function (3.12+ collect at the
    next eval-breaker check, which can be the callee's first instruction)."""
    if RECORDING:
        OUTER.setdefault(name, []).append((threading.get_native_id(), t0, now() - t0))


def name_thread(name):
    threading.current_thread().name = name
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


SLOTS = 16
SLOT_BYTES = 1 << 20


class MessageQueue:
    """A shared-memory ring of SLOTS slots; a pipe carries one byte per written slot."""

    def __init__(self, shm, notify_r, notify_w):
        self.shm = shm
        self.buf = shm.buf
        self.notify_r = notify_r
        self.notify_w = notify_w
        self.head = 0
        self.tail = 0

    def enqueue(self, obj):
        t0 = now()
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            if len(data) + 8 > SLOT_BYTES:
                raise ValueError("message larger than a slot")
            off = (self.head % SLOTS) * SLOT_BYTES
            self.buf[off:off + 8] = len(data).to_bytes(8, "little")
            self.buf[off + 8:off + 8 + len(data)] = data
            self.head += 1
            os.write(self.notify_w, b"x")
        finally:
            note("MessageQueue.enqueue", t0)

    def dequeue(self):
        t0 = now()
        try:
            if os.read(self.notify_r, 1) != b"x":
                return None
            off = (self.tail % SLOTS) * SLOT_BYTES
            n = int.from_bytes(self.buf[off:off + 8], "little")
            obj = pickle.loads(self.buf[off + 8:off + 8 + n])
            self.tail += 1
            return obj
        finally:
            note("MessageQueue.dequeue", t0)


class AuxStore:
    """Keeps the last `capacity` payloads; evicts the least recently used by a linear scan."""

    def __init__(self, capacity, items):
        self.capacity = capacity
        self.entries = {}
        self.last_used = {}
        self.clock = 0
        for i in range(items):
            self.entries[("warm", i)] = i
            self.last_used[("warm", i)] = i
        self.clock = items

    def put(self, key, value):
        t0 = now()
        try:
            self.clock += 1
            self.entries[key] = value
            self.last_used[key] = self.clock
            tc = now()
            self._evict_to_fit()
            outer("AuxStore._evict_to_fit", tc)
        finally:
            note("AuxStore.put", t0)

    def _evict_to_fit(self):
        t0 = now()
        try:
            while len(self.entries) > self.capacity:
                oldest_key = None
                oldest = None
                for k, used in self.last_used.items():
                    if oldest is None or used < oldest:
                        oldest, oldest_key = used, k
                del self.entries[oldest_key]
                del self.last_used[oldest_key]
        finally:
            note("AuxStore._evict_to_fit", t0)


class Engine:
    """The producer's step, like vLLM's EngineCore.step: schedule a batch (build one list per
    request), enqueue it, update from it; then pace to --steps-per-s. Five functions on one
    thread, so that a test can probe more of them than a thread has debug registers."""

    def __init__(self, mq, requests, tokens):
        self.mq = mq
        self.requests = requests
        self.tokens = list(range(tokens))

    def step(self, step):
        t0 = now()
        try:
            tc = now()
            obj = self.schedule(step)
            outer("Engine.schedule", tc)
            tc = now()
            self.mq.enqueue(obj)
            outer("MessageQueue.enqueue", tc)
            tc = now()
            self.update(obj)
            outer("Engine.update", tc)
        finally:
            note("Engine.step", t0)

    def schedule(self, step):
        t0 = now()
        try:
            return [[r, step] + self.tokens for r in range(self.requests)]
        finally:
            note("Engine.schedule", t0)

    def update(self, obj):
        t0 = now()
        try:
            n = 0
            for x in obj:
                n += len(x)
            return n
        finally:
            note("Engine.update", t0)

    def pace(self, delay_ns):
        t0 = now()
        try:
            time.sleep(delay_ns / 1e9)
        finally:
            note("Engine.pace", t0)


GC_PAUSES = []
# --gc-truth: (start_ns, dur_ns) of each explicit gc.collect(0) the producer makes, timed by its
# caller: a collection's outer clock (its callbacks' span is the inner one). One is made 5 steps
# after each automatic collection, so that both kinds keep coming: an explicit collection
# resets the allocation count that triggers the automatic ones, and made soon after one it
# delays the next only a little (yet late enough to find garbage and caches as cold as an
# automatic one does).
GC_OUTER = []
GC_EXPLICIT = {"running": False, "due": None}


def gc_callback(phase, info):
    """gc.callbacks truth (--gc-truth): (start, dur, generation) of each collection."""
    if not RECORDING:
        return
    t = now()
    if phase == "start":
        gc_callback.t0 = t
    elif getattr(gc_callback, "t0", None) is not None:
        GC_PAUSES.append((gc_callback.t0, t - gc_callback.t0, info.get("generation")))
        gc_callback.t0 = None
        if not GC_EXPLICIT["running"] and GC_EXPLICIT["due"] is None:
            GC_EXPLICIT["due"] = 5


def steal_ns():
    """The machine's steal so far (the `steal` column of /proc/stat, all CPUs together), ns;
    None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000000000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def write_truth(path, role, window, steal=None):
    out = {
        "pid": os.getpid(),
        "role": role,
        "python": sys.version.split()[0],
        "window": window,
        "threads": {str(t.native_id): t.name for t in threading.enumerate()},
        "calls": CALLS,
        "outer_calls": OUTER,
        "gc_pauses": GC_PAUSES,
        "gc_outer": GC_OUTER,
        "steal_ns": steal,
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        import json

        json.dump(out, f)
    os.replace(tmp, path)


def consumer(args, shm_name, notify_r, ready_w, window_r):
    global RECORDING
    name_thread("mq-consumer")
    threading.current_thread().name = "mq-consumer"
    try:
        # 3.13+: the producer owns the segment; do not let this process's tracker unlink it.
        shm = shared_memory.SharedMemory(name=shm_name, track=False)
    except TypeError:
        shm = shared_memory.SharedMemory(name=shm_name)
    mq = MessageQueue(shm, notify_r, -1)
    store = AuxStore(args.evict_items, args.evict_items)
    work = []
    cond = threading.Condition()

    def writer():
        name_thread("aux-writer")
        n = 0
        while True:
            with cond:
                while not work:
                    cond.wait()
                item = work.pop(0)
            if item is None:
                return
            tc = now()
            store.put(("step", n), item)
            outer("AuxStore.put", tc)
            n += 1

    wt = threading.Thread(target=writer, name="aux-writer")
    wt.start()
    RECORDING = True
    os.write(ready_w, b"R")
    step = 0
    every = max(1, round(args.steps_per_s / args.puts_per_s))
    while True:
        tc = now()
        obj = mq.dequeue()
        outer("MessageQueue.dequeue", tc)
        if obj is None or obj == "STOP":
            break
        step += 1
        if step % every == 0:
            with cond:
                work.append(obj)
                cond.notify()
    with cond:
        work.append(None)
        cond.notify()
    wt.join()
    window = os.read(window_r, 64).decode().split()
    write_truth(
        args.truth + ".consumer.json",
        "consumer",
        {"start_mono_ns": int(window[0]), "end_mono_ns": int(window[1])},
    )
    del mq
    shm.close()


def main():
    global RECORDING
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--go-fifo")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--steps-per-s", type=float, default=200.0)
    ap.add_argument("--puts-per-s", type=float, default=25.0)
    ap.add_argument("--evict-items", type=int, default=60000)
    ap.add_argument("--gc-truth", action="store_true", help="time the producer's collections with gc.callbacks")
    args = ap.parse_args()

    shm = shared_memory.SharedMemory(create=True, size=SLOTS * SLOT_BYTES)
    notify_r, notify_w = os.pipe()
    ready_r, ready_w = os.pipe()
    window_r, window_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(notify_w)
            consumer(args, shm.name, notify_r, ready_w, window_r)
        finally:
            os._exit(0)
    os.close(notify_r)
    name_thread("mq-producer")
    threading.current_thread().name = "mq-producer"
    mq = MessageQueue(shm, -1, notify_w)
    engine = Engine(mq, args.requests, args.tokens)
    if args.gc_truth:
        gc.callbacks.append(gc_callback)
    if os.read(ready_r, 1) != b"R":
        sys.exit("consumer failed to start")

    window = {"start_mono_ns": None}
    go = threading.Event()

    def wait_go():
        if args.go_fifo:
            with open(args.go_fifo) as f:
                f.readline()
        window["start_mono_ns"] = now()
        window["steal0"] = steal_ns()
        go.set()

    RECORDING = True
    if not args.go_fifo:
        wait_go()
    print("READY", flush=True)
    if args.go_fifo:
        threading.Thread(target=wait_go, name="go-reader", daemon=True).start()

    period = 1e9 / args.steps_per_s
    step = 0
    next_t = now()
    while True:
        if go.is_set() and now() - window["start_mono_ns"] >= args.duration * 1e9:
            break
        tc = now()
        engine.step(step)
        outer("Engine.step", tc)
        step += 1
        if GC_EXPLICIT["due"] is not None:
            GC_EXPLICIT["due"] -= 1
        if GC_EXPLICIT["due"] == 0:
            GC_EXPLICIT["due"] = None
            GC_EXPLICIT["running"] = True
            tc = now()
            gc.collect(0)
            GC_OUTER.append((tc, now() - tc))
            GC_EXPLICIT["running"] = False
        next_t += period
        delay = next_t - now()
        if delay > 0:
            tc = now()
            engine.pace(delay)
            outer("Engine.pace", tc)
        else:
            next_t = now()
    end = now()
    steal1 = steal_ns()
    mq.enqueue("STOP")
    os.write(window_w, f"{window['start_mono_ns']} {end}".encode())
    os.waitpid(pid, 0)
    steal0 = window.get("steal0")
    write_truth(args.truth, "producer", {"start_mono_ns": window["start_mono_ns"], "end_mono_ns": end},
                None if steal0 is None or steal1 is None else steal1 - steal0)
    shm.close()
    shm.unlink()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
