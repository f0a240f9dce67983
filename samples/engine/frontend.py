"""The API server's asyncio frontend (`--serialize-stalls`): the main thread runs an asyncio event
loop, like vLLM's OpenAI server (uvicorn + AsyncLLM), and delivers the responses of requests that
ask for their routed experts (vLLM's router replay: the top-k expert ids of every position in
every MoE layer). Each such response is built and serialized to JSON on the loop
(`JSONResponse.render` -> `json.dumps`, as starlette does), a few hundred kB to a few MB, and
while that runs the loop serves nothing else: an event-loop stall. The real case this
reproduces in miniature: ~100 long requests finishing together stalled a vLLM API server's loop
for ~25 s while ~8 MB of routed-experts JSON per response was serialized.

What runs on the loop:
  * `routed_client`: a client that submits a group of 1..--serialize-group-max requests that
    return routed experts, all with the same prompt length and max_tokens, so the scheduler
    admits them in one step and they finish in one step ("several long requests finishing
    together"; their handlers render once all of them have finished, so that a group is one
    stall even where its requests finish a step or two apart), waits for all their responses, pauses --serialize-gap seconds, and again; the
    group sizes cycle through 1..N in an order shuffled with --seed, so stalls of different
    lengths happen (every N consecutive groups have each size once), and two groups' stalls
    never run into each other however slow the machine;
  * `create_completion` (one task per such request): waits for the request to finish, builds
    its response (the routed experts: positions x layers x top-k ids, the number of positions
    calibrated at start so one response costs --serialize-ms to serialize) and renders it;
  * a heartbeat every 10 ms that measures how late it runs (the loop's lag, as seen by a
    timer), and drives readiness, GO and the window's end.
The output-handler thread hands finished requests to the loop (`call_soon_threadsafe`); the
background load (load-generator thread, closed loop of --requests plain requests) goes on as
without the option.

The loop times itself: its selector (`TimedSelector`, epoll) reads the clock around every wait,
so the loop's busy time is exactly the time between two waits. A stretch of busy time that the
loop did not leave for a wait of at least MERGE_IDLE_NS is one stall; stretches of at least
RECORD_NS are kept. Every render is timed (monotonic and thread CPU clock). Between stalls the
main thread is blocked in the selector's epoll wait (`selectors.py`)."""
import asyncio
import json
import random
import selectors
import threading
import time
from array import array

import groundtruth as gt

mono = time.monotonic_ns
tcpu = time.thread_time_ns

HEARTBEAT_NS = 10_000_000
# A wait in the selector shorter than this does not end a stall (the loop polled, found work
# and went on: `select(0)` between two ready callbacks takes microseconds).
MERGE_IDLE_NS = 1_000_000
# Busy stretches at least this long are kept in the truth (all are counted).
RECORD_NS = 20_000_000
# Heartbeats at least this late are kept in the truth (all are summarized).
LAG_RECORD_NS = 2_000_000
LAYERS = 32
TOPK = 8
NUM_EXPERTS = 64
ROUTED_PROMPT = 64
ROUTED_MAX_TOKENS = 48
# Routed requests' ids, apart from the load generator's.
ROUTED_BASE = 1 << 40


class TimedSelector(selectors.EpollSelector):
    """The event loop's selector, reading the clock around each wait. While the loop waits,
    the innermost Python frame is selectors.py's `select` (enginescope's idle frame)."""

    def __init__(self, on_wait):
        super().__init__()
        self._on_wait = on_wait

    def select(self, timeout=None):
        c0 = tcpu()
        t0 = mono()
        try:
            return super().select(timeout)
        finally:
            t1 = mono()
            self._on_wait(t0, t1, timeout, c0, tcpu())


class LoopMonitor:
    """Busy stretches of the loop from the selector's waits, and the heartbeat's lags."""

    def __init__(self, cap):
        self.cap = cap
        self.stopped = False  # the loop has stopped: waits no longer count
        self.last_wait_end = None
        self.last_wait_cpu = 0  # the thread's CPU clock then
        self.cur_start = None
        self.cur_cpu = 0
        self.stretches = []  # [start_ns, end_ns, cpu_ns] of stretches >= RECORD_NS
        self.stretches_total = 0
        self.busy_starts = array("q")  # every busy stretch (the first `cap` * 8)
        self.busy_ends = array("q")
        self.waits = 0
        self.lags = []  # (run_ns, lag_ns) of heartbeats at least LAG_RECORD_NS late
        self.lag_all = []  # every lag (ns), for the summary
        self.beats = 0

    def on_wait(self, t0, t1, timeout, c0, c1):
        """A wait of the selector from t0 to t1 (the thread's CPU clock c0 and c1 then). The
        loop went idle if it had nothing ready (it polls with timeout 0 when callbacks are
        ready: that is no idle time, however long the poll took because the thread was
        preempted) and waited at least MERGE_IDLE_NS."""
        if self.stopped:
            return
        self.waits += 1
        if self.last_wait_end is not None:
            if self.cur_start is None:
                self.cur_start = self.last_wait_end
                self.cur_cpu = self.last_wait_cpu
            if (timeout is None or timeout > 0) and t1 - t0 >= MERGE_IDLE_NS:
                self._close(self.cur_start, t0, c0 - self.cur_cpu)
                self.cur_start = None
        self.last_wait_end = t1
        self.last_wait_cpu = c1

    def close_open(self, now, cpu_now):
        """The main thread's last stretch ends at `now` (the window's end: the loop's last
        iteration and its shutdown count as busy, as the thread is)."""
        if self.last_wait_end is not None:
            if self.cur_start is None:
                self.cur_start, self.cur_cpu = self.last_wait_end, self.last_wait_cpu
            self._close(self.cur_start, now, cpu_now - self.cur_cpu)
            self.cur_start = None
            self.last_wait_end = None

    def _close(self, start, end, cpu):
        self.stretches_total += 1
        if len(self.busy_starts) < 8 * self.cap:
            self.busy_starts.append(start)
            self.busy_ends.append(end)
        if end - start >= RECORD_NS and len(self.stretches) < self.cap:
            self.stretches.append([start, end, cpu])

    def beat(self, due, now):
        self.beats += 1
        lag = max(0, now - due)
        if len(self.lag_all) < self.cap:
            self.lag_all.append(lag)
        if lag >= LAG_RECORD_NS and len(self.lags) < self.cap:
            self.lags.append((now, lag))


class JSONResponse:
    """starlette.responses.JSONResponse, in short: the body is rendered when it is built."""
    media_type = "application/json"

    def __init__(self, content):
        self.body = self.render(content)

    def render(self, content):
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8")


def expert_rows(seed):
    """A pool of top-k expert-id rows; a response's routed experts are drawn from it."""
    rng = random.Random("%s/experts" % seed)
    return [sorted(rng.sample(range(NUM_EXPERTS), TOPK)) for _ in range(4096)]


def build_response(rows, req_id, model, positions, tokens, created):
    """The completion response with its routed experts: per position, per layer, the top-k
    expert ids (the nested lists vLLM's router replay returns)."""
    n = len(rows)
    base = (req_id * 7919) % n
    routed = [[rows[(base + p * LAYERS + l) % n] for l in range(LAYERS)]
              for p in range(positions)]
    return {
        "id": "cmpl-%d" % req_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": "", "finish_reason": "length",
                     "routed_experts": routed}],
        "usage": {"completion_tokens": tokens},
    }


def calibrate(rows, target_ns, model):
    """Positions per response so that rendering one response costs about `target_ns` of CPU
    (the fastest of three renders of a 1024-position response, scaled)."""
    probe = 1024
    content = build_response(rows, 0, model, probe, 0, 0)
    best = None
    for _ in range(3):
        c0 = tcpu()
        body = JSONResponse(content).body
        c = tcpu() - c0
        best = c if best is None else min(best, c)
    per_pos = max(best / probe, 1.0)
    positions = max(16, int(round(target_ns / per_pos)))
    return positions, {"probe_positions": probe, "probe_cpu_ns": best,
                       "probe_bytes": len(body), "ns_per_position": round(per_pos, 1)}


class Frontend:
    def __init__(self, cfg, client, stop):
        self.cfg = cfg
        self.client = client
        self.stop = stop
        self.rows = expert_rows(cfg["seed"])
        self.positions, self.calibration = calibrate(
            self.rows, int(cfg["serialize_ms"] * 1e6), cfg["served_model_name"])
        self.monitor = LoopMonitor(cfg["list_cap"])
        self.loop = None
        self.pending = {}  # req_id -> future of its finished TrackedRequest
        self.tasks = set()
        self.waiters = []  # (predicate, future), checked by the heartbeat
        self.due = 0
        self.rng = random.Random("%s/routed" % cfg["seed"])
        self.next_routed = ROUTED_BASE
        self.groups = []  # (submit_ns, size)
        self.window_start = None  # mono() at the window's start
        self.groups_done = 0  # groups submitted inside the window and answered
        self.renders = []  # (start_ns, wall_ns, cpu_ns, bytes, req_id)

    # --- called from other threads ----------------------------------------------------------

    def finished(self, reqs):
        """The output-handler thread: these routed requests finished."""
        loop = self.loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._finished, reqs)
        except RuntimeError:  # the loop is closed (shutdown)
            pass

    # --- on the loop ----------------------------------------------------------------------------

    def _finished(self, reqs):
        for r in reqs:
            fut = self.pending.pop(r.req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(r)

    def _beat(self):
        now = mono()
        self.monitor.beat(self.due, now)
        keep = []
        for pred, fut in self.waiters:
            if fut.done():
                continue
            if pred():
                fut.set_result(None)
            else:
                keep.append((pred, fut))
        self.waiters = keep
        self.due += HEARTBEAT_NS
        if self.due <= now:
            self.due = now + HEARTBEAT_NS
        self.loop.call_at(self.due / 1e9, self._beat)

    def _wait_for(self, pred):
        fut = self.loop.create_future()
        if pred():
            fut.set_result(None)
        else:
            self.waiters.append((pred, fut))
        return fut

    def _spawn(self, coro):
        t = self.loop.create_task(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def routed_client(self):
        loop = self.loop
        gap = self.cfg["serialize_gap"]
        sizes = list(range(1, max(1, self.cfg["serialize_group_max"]) + 1))
        self.rng.shuffle(sizes)
        n = 0
        while True:
            await asyncio.sleep(gap)
            k = sizes[n % len(sizes)]
            n += 1
            rids = list(range(self.next_routed, self.next_routed + k))
            self.next_routed += k
            futs = []
            for rid in rids:
                fut = loop.create_future()
                self.pending[rid] = fut
                futs.append(fut)
            # Each handler renders once the whole group has finished: the group's renders
            # then run back to back in one turn of the loop, one stall, however many engine
            # steps its requests took to finish (on a loaded machine some finished a step or
            # two apart, and a group of five made several short stalls instead of one).
            together = asyncio.gather(*futs)
            handlers = [loop.create_task(self.create_completion(rid, fut, together))
                        for rid, fut in zip(rids, futs)]
            submitted = mono()
            self.groups.append((submitted, k))
            try:
                self.client.submit_routed(rids, ROUTED_PROMPT, ROUTED_MAX_TOKENS)
            except (OSError, ValueError):
                self.stop.set()
                return
            await asyncio.gather(*handlers)
            if self.window_start is not None and submitted >= self.window_start:
                self.groups_done += 1

    async def create_completion(self, rid, fut, together):
        # Woken by the group's barrier alone, so that every handler of the group wakes in one
        # turn of the loop (awaiting its own future first, the handler of the group's last
        # request woke a turn earlier than the rest and rendered alone, with the loop's poll
        # between it and the others).
        await together
        req = fut.result()
        content = build_response(self.rows, rid, self.cfg["served_model_name"],
                                 self.positions, req.tokens, int(time.time()))
        t0 = mono()
        c0 = tcpu()
        response = JSONResponse(content)
        c1 = tcpu()
        t1 = mono()
        if len(self.renders) < self.cfg["list_cap"]:
            self.renders.append((t0, t1 - t0, c1 - c0, len(response.body), rid))

    async def main(self, announce_and_wait_go, begin_window, deadline_s):
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.due = mono() + HEARTBEAT_NS
        loop.call_at(self.due / 1e9, self._beat)
        self._spawn(self.routed_client())
        stop = self.stop
        await self._wait_for(lambda: self.client.warm.is_set() or stop.is_set())
        if stop.is_set():
            return None
        go = loop.create_future()

        def waiter():
            try:
                announce_and_wait_go()
            except OSError:
                stop.set()
            try:
                loop.call_soon_threadsafe(lambda: go.done() or go.set_result(None))
            except RuntimeError:
                pass

        # READY and GO may block (FIFOs): a daemon thread, gone at GO (or abandoned on a
        # signal), so the loop keeps serving meanwhile.
        threading.Thread(target=waiter, name="go-waiter", daemon=True).start()
        await asyncio.wait([go, self._wait_for(stop.is_set)],
                           return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            return None
        start = begin_window()
        self.window_start = start
        deadline = None if deadline_s is None else start + int(deadline_s * 1e9)
        groups = self.cfg.get("serialize_groups", 0)
        await self._wait_for(lambda: stop.is_set()
                             or (deadline is not None and mono() >= deadline)
                             or (groups > 0 and self.groups_done >= groups))
        return start

    def run(self, announce_and_wait_go, begin_window, deadline_s):
        """Run the loop on this (the main) thread until the window ends or `stop`; returns the
        window's start (None if it never started)."""
        loop = asyncio.SelectorEventLoop(TimedSelector(self.monitor.on_wait))
        try:
            return loop.run_until_complete(
                self.main(announce_and_wait_go, begin_window, deadline_s))
        finally:
            # The stretch the loop is in when it stops ends with the window (close_open); the
            # shutdown's own polls do not count.
            self.monitor.stopped = True
            self.loop = None
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    # --- truth --------------------------------------------------------------------------------

    def doc(self, start, end, threads, list_cap):
        """The `event_loop` section of the API server's truth."""
        mon = self.monitor
        renders = [r for r in self.renders if start <= r[0] < end]
        stalls = []
        for a, b, cpu in mon.stretches:
            if b <= start or a >= end:  # stalls that overlap the window
                continue
            inside = [r for r in self.renders if a <= r[0] < b]
            lags = [lag for t, lag in mon.lags if a <= t <= b]
            stalls.append({
                "start_mono_ns": a,
                "dur_ns": b - a,
                "cpu_ns": cpu,
                "serialize_ns": sum(r[1] for r in inside),
                "serialize_cpu_ns": sum(r[2] for r in inside),
                "responses": len(inside),
                "bytes": sum(r[3] for r in inside),
                "heartbeat_lag_ns": max(lags) if lags else 0,
            })
        cpu = [t.get("window_cpu_s") for t in threads]
        api_cpu_ns = int(round(sum(c for c in cpu if c is not None) * 1e9))
        json_cpu = sum(r[2] for r in renders)
        lag_sorted = sorted(mon.lag_all)
        groups = [g for g in self.groups if start <= g[0] < end]
        return {
            "loop": "asyncio SelectorEventLoop (epoll) on the main thread",
            "heartbeat_ns": HEARTBEAT_NS,
            "merge_idle_ns": MERGE_IDLE_NS,
            "record_ns": RECORD_NS,
            "serialize_ms_target": self.cfg["serialize_ms"],
            "positions": self.positions,
            "layers": LAYERS,
            "topk": TOPK,
            "calibration": self.calibration,
            "groups": {"gap_s": self.cfg["serialize_gap"],
                       "max_size": self.cfg["serialize_group_max"],
                       "window_target": self.cfg.get("serialize_groups", 0),
                       "answered_window": self.groups_done,
                       "prompt_tokens": ROUTED_PROMPT, "max_tokens": ROUTED_MAX_TOKENS,
                       "submitted_window": len(groups),
                       "requests_window": sum(g[1] for g in groups)},
            "stalls": stalls[:list_cap],
            "stalls_truncated": len(stalls) > list_cap,
            "busy_ns_window": sum(max(0, min(b, end) - max(a, start))
                                  for a, b in zip(mon.busy_starts, mon.busy_ends)),
            "busy_stretches_total": mon.stretches_total,
            "selector_waits": mon.waits,
            "heartbeat": {"beats": mon.beats, "lag_ns": gt.summary(lag_sorted),
                          "late_columns": ["run_ns", "lag_ns"],
                          "late": [list(x) for x in mon.lags
                                   if start <= x[0] < end][:list_cap]},
            "serialization": {
                "responses_window": len(renders),
                "bytes_window": sum(r[3] for r in renders),
                "json_wall_ns_window": sum(r[1] for r in renders),
                "json_cpu_ns_window": json_cpu,
                "api_server_cpu_ns_window": api_cpu_ns,
                "json_share_of_cpu": round(json_cpu / api_cpu_ns, 6) if api_cpu_ns else None,
                "pickle_send_cpu_ns_window": self.client.send_cpu_in(start, end),
            },
            "render_columns": ["start_ns", "wall_ns", "cpu_ns", "bytes", "req_id"],
            "renders": [list(r) for r in renders[:list_cap]],
        }


