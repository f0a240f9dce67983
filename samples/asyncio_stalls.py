"""Ground truth for event-loop stalls in a plain asyncio server (no vLLM, no role): tasks that
stall the loop with `json.dumps` of large responses, timed by the loop itself.

Usage: asyncio_stalls.py --truth PATH [--requests N] [--go-fifo PATH] [--seed S]
                         [--hold-fifo PATH --release PATH] [--uvloop]

The main thread runs an asyncio loop. After GO, `main` answers --requests requests one at a
time, 0.2-0.4 s apart (idle in between, so no two stalls run into each other however slow the
machine): each a task named `handler-N` (asyncio task names) whose coroutine
`handle_request` awaits `render_response`, which runs `json.dumps` of response pieces (~10 ms
each, sized at start) until the thread has spent 150-400 ms of CPU: a stall of the loop at least
that long on any machine. The loop's selector reads the
clock around every wait (`TimedSelector`), so each stall's start and length are exact; a busy
stretch the loop did not leave for a wait of at least 1 ms is one stall.

With --uvloop the loop is uvloop's (`uvloop.run`), whose poll cannot be timed from Python:
`stalls` is then empty, and `renders` (every `json.dumps` of a response, timed around the call,
with its task) is the truth to compare with.

With --hold-fifo, after the window the loop runs one more task, `dump-probe`
(`hold_for_dump` awaiting `spin_until_released`), which writes HOLDING to that FIFO and then
keeps the loop busy until the file --release exists (at most 60 s): a moment at which a `dump`
must show that task and chain.

Truth JSON: {"pid", "python", "window": {"start_mono_ns", "end_mono_ns"},
  "stalls": [{"start_mono_ns", "dur_ns", "task", "coro", "chain"}],
  "renders": [{"start_mono_ns", "dur_ns", "task", "coro", "chain"}],
  "hold": {"task", "coro", "chain"} (with --hold-fifo)}  (busy stretches >= 20 ms inside the
  window; `task` is the name of the handler task that rendered in it, "" if none, `coro` its
  coroutine's qualified name and `chain` the await chain that ran the render, outermost first,
  as the coroutines themselves report it: `sys._getframe` names of the awaiting frames).
"""
import argparse
import asyncio
import inspect
import json
import os
import random
import selectors
import sys
import time

mono = time.monotonic_ns
tcpu = time.thread_time_ns

MERGE_IDLE_NS = 1_000_000
RECORD_NS = 20_000_000


class TimedSelector(selectors.EpollSelector):
    def __init__(self, on_wait):
        super().__init__()
        self._on_wait = on_wait

    def select(self, timeout=None):
        t0 = mono()
        try:
            return super().select(timeout)
        finally:
            self._on_wait(t0, mono(), timeout)


class Monitor:
    def __init__(self):
        self.last_end = None
        self.cur = None
        self.stretches = []
        self.tasks_in = []  # (task name, coroutine, chain) that rendered in the current stretch
        self.renders = []  # (start, end, (task name, coroutine, chain)) of every render

    def on_wait(self, t0, t1, timeout):
        if self.last_end is not None:
            if self.cur is None:
                self.cur = self.last_end
            if (timeout is None or timeout > 0) and t1 - t0 >= MERGE_IDLE_NS:
                if t0 - self.cur >= RECORD_NS:
                    self.stretches.append((self.cur, t0, list(self.tasks_in)))
                self.cur = None
                self.tasks_in = []
        self.last_end = t1


_rng = random.Random(7)
ROW_POOL = [[_rng.randrange(1000) for _ in range(8)] for _ in range(4096)]


def payload(n):
    """A response of `n` rows (drawn from a pool: building it is cheap next to its JSON)."""
    return {"id": n, "rows": [ROW_POOL[(n * 7919 + i) % 4096] for i in range(n)]}


def calibrate():
    """Rows per ms of CPU for building and rendering a response (the fastest of three)."""
    n = 50000
    best = None
    for _ in range(3):
        c0 = tcpu()
        json.dumps(payload(n))
        c = tcpu() - c0
        best = c if best is None else min(best, c)
    return n / max(best / 1e6, 0.01)


def await_chain():
    """The running task's name, its coroutine's qualified name and the coroutine frames on this
    thread's stack from the task's coroutine to the caller, outermost first (asyncio's own
    record of what runs: `current_task()` and the frames' code)."""
    task = asyncio.current_task()
    coro = task.get_coro()
    chain = []
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_flags & inspect.CO_COROUTINE:
            chain.append(getattr(f.f_code, "co_qualname", f.f_code.co_name))
        if f.f_code is coro.cr_code:
            break
        f = f.f_back
    chain.reverse()
    return task.get_name(), coro.__qualname__, chain


async def render_response(mon, name, cpu_ns, chunk_rows):
    """Render JSON pieces of `chunk_rows` rows (~10 ms each) until this thread has spent
    `cpu_ns` of CPU: a stall of at least that length whatever the machine's speed or the
    calibration's error (the response's size is what varies)."""
    t0 = mono()
    c0 = tcpu()
    size = 0
    while tcpu() - c0 < cpu_ns:
        size += len(json.dumps(payload(chunk_rows)))
    t1 = mono()
    who = await_chain()
    mon.tasks_in.append(who)
    mon.renders.append((t0, t1, who))
    return size


async def handle_request(mon, name, cpu_ns, chunk_rows):
    return await render_response(mon, name, cpu_ns, chunk_rows)


async def main(args, mon):
    loop = asyncio.get_running_loop()
    rng = random.Random(args.seed)
    per_ms = calibrate()
    print("READY", flush=True)
    if args.go_fifo:
        await loop.run_in_executor(None, lambda: open(args.go_fifo).readline())
    start = mono()
    for n in range(args.requests):
        # Idle between requests (the previous one answered first), so no two stalls run into
        # each other however slow the machine is.
        await asyncio.sleep(rng.uniform(0.2, 0.4))
        name = "handler-%d" % n
        cpu_ns = int(rng.uniform(150, 400) * 1e6)
        await asyncio.create_task(
            handle_request(mon, name, cpu_ns, max(1, int(per_ms * 10))), name=name
        )
    await asyncio.sleep(0.05)
    end = mono()
    hold = None
    if args.hold_fifo:
        hold = await asyncio.create_task(hold_for_dump(args), name="dump-probe")
    return start, end, hold


async def spin_until_released(args):
    """Keep the loop busy (this task running) until the release file exists."""
    deadline = mono() + 60_000_000_000
    x = 0
    while not os.path.exists(args.release) and mono() < deadline:
        for _ in range(1000):
            x += 1
    return x


async def hold_for_dump(args):
    with open(args.hold_fifo, "w") as f:
        f.write("HOLDING\n")
    hold = await_chain()
    await spin_until_released(args)
    name, coro, chain = hold
    return {"task": name, "coro": coro, "chain": chain + ["spin_until_released"]}


def run():
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--requests", type=int, default=10,
                    help="requests answered in the window (each one stall)")
    ap.add_argument("--go-fifo")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--hold-fifo")
    ap.add_argument("--release")
    ap.add_argument("--uvloop", action="store_true")
    args = ap.parse_args()
    mon = Monitor()
    if args.uvloop:
        import uvloop
        start, end, hold = uvloop.run(main(args, mon))
    else:
        loop = asyncio.SelectorEventLoop(TimedSelector(mon.on_wait))
        start, end, hold = loop.run_until_complete(main(args, mon))
        loop.close()
    stalls = []
    for a, b, t in mon.stretches:
        if start <= a and b <= end:
            name, coro, chain = t[0] if t else ("", "", [])
            stalls.append({"start_mono_ns": a, "dur_ns": b - a, "task": name, "coro": coro,
                           "chain": chain})
    renders = [{"start_mono_ns": a, "dur_ns": b - a, "task": t[0], "coro": t[1], "chain": t[2]}
               for a, b, t in mon.renders if start <= a and b <= end]
    doc = {"pid": os.getpid(), "python": sys.version,
           "window": {"start_mono_ns": start, "end_mono_ns": end}, "stalls": stalls,
           "renders": renders}
    if hold is not None:
        doc["hold"] = hold
    tmp = args.truth + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.truth)
    print("DONE", flush=True)


if __name__ == "__main__":
    run()
