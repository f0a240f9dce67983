"""The API server process (the one started from the command line: `... serve --port N`).

It starts the EngineCore (multiprocessing spawn, like vLLM), which starts the Worker(s), then
runs the load itself instead of serving HTTP completions:

  `load-generator` thread: keeps --requests requests in flight (closed loop; with --ramp, a
  level that steps through the given ones). Each has a prompt
      (70% start with one of 4 shared 256-token system prompts, so the prefix cache hits) and a
      max_tokens drawn in [--max-tokens/2, --max-tokens]; a finished request is replaced at once.
  `output-handler` thread: receives each step's tokens and scheduler stats from the EngineCore
      and measures what vLLM's output processor measures: time to first token, inter-token
      latency, end-to-end latency (from the request's submission), token counts.
  `metrics-http` thread: serves vLLM's Prometheus metrics at http://HOST:PORT/metrics (also
      /health and /v1/models), unless --no-metrics.
  main thread: readiness, the measurement window, shutdown, the truth file.

With --serialize-stalls the main thread runs an asyncio event loop for the load and the window
instead (frontend.py): requests that return their routed experts are answered on it, and
serializing those responses to JSON stalls the loop."""
import http.server
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time

import engine_core
import groundtruth as gt
import procutil
import prom

mono = time.monotonic_ns
VOCAB = 1024


class Interrupted(Exception):
    pass


class TrackedRequest:
    __slots__ = ("req_id", "arrival_ns", "first_ns", "last_ns", "tokens", "prompt_len",
                 "max_tokens", "routed")

    def __init__(self, req_id, arrival_ns, prompt_len, max_tokens, routed=False):
        self.req_id = req_id
        self.arrival_ns = arrival_ns
        self.first_ns = None
        self.last_ns = None
        self.tokens = 0
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.routed = routed


class EngineClient:
    """The API server's side of the engine: submits requests, handles outputs."""

    def __init__(self, cfg, in_conn, out_conn, metrics, stop):
        self.cfg = cfg
        self.in_conn = in_conn
        self.out_conn = out_conn
        self.metrics = metrics
        self.stop = stop
        self.send_lock = threading.Lock()
        self.cond = threading.Condition()
        self.in_flight = 0
        self.stopping = False
        self.requests = {}
        self.next_id = 0
        self.rng = random.Random("%s/load" % cfg["seed"])
        self.rng_routed = random.Random("%s/routed-prompts" % cfg["seed"])
        prng = random.Random("%s/prefixes" % cfg["seed"])
        self.prefixes = [[prng.randrange(VOCAB) for _ in range(256)] for _ in range(4)]
        self.finished = 0
        self.warm = threading.Event()
        self.bye = None
        self.engine_failed = None
        self.gen_tokens = 0
        # (ns, value) observations for the truth: first token, per-request time per output
        # token, inter-token, end-to-end
        self.ttft = []
        self.tpot = []
        self.itl = []
        self.e2e = []
        self.window = None
        self.gen_at = {}
        # --serialize-stalls: the frontend answers routed requests; sends are timed.
        self.frontend = None
        self.sends = None  # (start_ns, cpu_ns) of every send, when timed

    def send(self, msg):
        if self.sends is None:
            with self.send_lock:
                self.in_conn.send(msg)
            return
        with self.send_lock:
            t0 = mono()
            c0 = time.thread_time_ns()
            self.in_conn.send(msg)
            c = time.thread_time_ns() - c0
            if len(self.sends) < self.cfg["list_cap"]:
                self.sends.append((t0, c))

    def send_cpu_in(self, start, end):
        """CPU time of the sends (pickling, then the pipe write) that started in [start, end)."""
        return sum(c for t, c in self.sends or () if start <= t < end)

    def submit_routed(self, rids, prompt_len, max_tokens):
        """The frontend's requests that return routed experts: same prompt length and
        max_tokens, sent together (the scheduler admits them in one step)."""
        rng = self.rng_routed
        batch = [(rid, [rng.randrange(VOCAB) for _ in range(prompt_len)]) for rid in rids]
        now = mono()
        with self.metrics.lock:
            for rid, prompt in batch:
                self.requests[rid] = TrackedRequest(rid, now, prompt_len, max_tokens, True)
        self.send(("add", [(rid, p, max_tokens, now) for rid, p in batch]))

    def _new_request(self):
        rng = self.rng
        if rng.random() < 0.7:
            prompt = self.prefixes[rng.randrange(4)] + [rng.randrange(VOCAB)
                                                        for _ in range(rng.randint(32, 192))]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(64, 448))]
        m = self.cfg["max_tokens"]
        max_tokens = rng.randint(max(1, m // 2), m)
        rid = self.next_id
        self.next_id += 1
        return rid, prompt, max_tokens

    def load_loop(self):
        rec = procutil.register_thread("load-generator")
        ramp = self.cfg.get("ramp")
        t0 = mono()

        def target_now():
            """--requests, or with --ramp the level of this moment (levels in turn, each held
            its seconds, cycling): as a sweep of concurrencies would load the engine."""
            if not ramp:
                return self.cfg["requests"], None
            levels, step_ns = ramp["levels"], int(ramp["seconds"] * 1e9)
            k = (mono() - t0) // step_ns
            next_s = (t0 + (k + 1) * step_ns - mono()) / 1e9
            return levels[k % len(levels)], max(next_s, 0.001)

        try:
            while True:
                with self.cond:
                    target, wake_s = target_now()
                    while self.in_flight >= target and not self.stopping:
                        self.cond.wait(wake_s)
                        target, wake_s = target_now()
                    if self.stopping:
                        return
                    n = target - self.in_flight
                    self.in_flight = target
                batch = [self._new_request() for _ in range(n)]
                now = mono()
                with self.metrics.lock:
                    for rid, prompt, max_tokens in batch:
                        self.requests[rid] = TrackedRequest(rid, now, len(prompt), max_tokens)
                try:
                    self.send(("add", [(rid, p, mt, now) for rid, p, mt in batch]))
                except (OSError, ValueError):
                    self.stop.set()
                    return
        finally:
            procutil.thread_exiting(rec)

    def stop_load(self):
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def output_loop(self):
        rec = procutil.register_thread("output-handler")
        try:
            while True:
                try:
                    msg = self.out_conn.recv()
                except (EOFError, OSError):
                    break
                tag = msg[0]
                if tag == "out":
                    self._handle_outputs(msg[1], msg[2])
                elif tag == "bye":
                    self.bye = msg[1]
                    if msg[1].get("ended", "").startswith("error"):
                        self.engine_failed = msg[1]["ended"]
                    break
                elif tag == "failed":
                    self.engine_failed = msg[1]
                    break
        finally:
            if self.bye is None or self.engine_failed:
                self.engine_failed = self.engine_failed or "EngineCore exited"
                self.stop.set()
            procutil.thread_exiting(rec)

    def _handle_outputs(self, outputs, stats):
        now = mono()
        m = self.metrics
        done = 0
        routed = []
        with m.lock:
            reqs = self.requests
            for rid, tok, fin in outputs:
                r = reqs[rid]
                if r.first_ns is None:
                    r.first_ns = now
                    v = now - r.arrival_ns
                    m.ttft.observe(v / 1e9)
                    self.ttft.append((now, v))
                else:
                    v = now - r.last_ns
                    m.itl.observe(v / 1e9)
                    self.itl.append((now, v))
                r.last_ns = now
                r.tokens += 1
                if fin:
                    v = now - r.arrival_ns
                    m.e2e.observe(v / 1e9)
                    self.e2e.append((now, v))
                    # vLLM's TPOT: decode time (first to last token) over the tokens after
                    # the first; 0 for a one-token request.
                    v = (now - r.first_ns) // (r.tokens - 1) if r.tokens > 1 else 0
                    m.tpot.observe(v / 1e9)
                    self.tpot.append((now, v))
                    m.success["length"] += 1
                    del reqs[rid]
                    if r.routed:
                        routed.append(r)
                    else:
                        done += 1
            self.gen_tokens += len(outputs)
            m.generation_tokens = self.gen_tokens
            (m.running, m.waiting, m.kv_usage, m.prefix_queries, m.prefix_hits,
             m.prompt_tokens, iteration_tokens) = stats
            m.iteration_tokens.observe(iteration_tokens)
        if routed and self.frontend is not None:
            self.frontend.finished(routed)
        if done:
            self.finished += done
            with self.cond:
                self.in_flight -= done
                self.cond.notify_all()
        if self.finished >= self.cfg["warmup_requests"]:
            self.warm.set()

    def snapshot(self, edge):
        with self.metrics.lock:
            self.gen_at[edge] = (mono(), self.gen_tokens)


def metrics_server(metrics, host, port, model):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body = metrics.render().encode()
                ctype = "text/plain; version=0.0.4; charset=utf-8"
            elif path == "/health":
                body, ctype = b"", "text/plain"
            elif path == "/v1/models":
                body = json.dumps({"object": "list", "data": [
                    {"id": model, "object": "model", "owned_by": "vllm", "root": model}]}).encode()
                ctype = "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer((host, port), Handler)

    def run():
        rec = procutil.register_thread("metrics-http")
        try:
            server.serve_forever(poll_interval=0.5)
        finally:
            procutil.thread_exiting(rec)

    t = threading.Thread(target=run, name="metrics-http", daemon=True)
    t.start()
    return server, t


def _read_line_fd(fd):
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data


def _wait_go(args):
    if args.go_fd is not None:
        _read_line_fd(args.go_fd)
    if args.go_fifo:
        while True:
            with open(args.go_fifo) as f:
                if f.readline():
                    return


def _announce(line, args):
    print(line, flush=True)
    if args.ready_fd is not None:
        os.write(args.ready_fd, (line + "\n").encode())
    if args.ready_fifo:
        with open(args.ready_fifo, "w") as f:
            f.write(line + "\n")


def log(cfg, msg):
    if not cfg["quiet"]:
        sys.stderr.write("(APIServer pid=%d) %s\n" % (os.getpid(), msg))
        sys.stderr.flush()


def _pairs_doc(rows, start, end):
    return gt.summary(sorted(v for t, v in rows if start <= t < end))


def serve(args, cfg):
    stop = threading.Event()
    state = {"interruptible": False}

    def on_signal(signum, frame):
        stop.set()
        if state["interruptible"]:
            raise Interrupted()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    main_rec = procutil.register_thread("MainThread", set_comm=False)
    gcmon = gt.GcMonitor(cfg["list_cap"])
    gcmon.install()
    metrics = prom.EngineMetrics(cfg["served_model_name"])
    server = None
    port = 0
    if not args.no_metrics:
        server, _ = metrics_server(metrics, args.host, args.port, cfg["served_model_name"])
        port = server.server_address[1]

    ctx = multiprocessing.get_context("spawn")
    in_r, in_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    ec = ctx.Process(target=engine_core.run_engine_core, name="EngineCore_DP0",
                     args=(cfg, in_r, out_w, os.getpid()))
    ec.start()
    in_r.close()
    out_w.close()
    client = EngineClient(cfg, in_w, out_r, metrics, stop)
    exit_code = 0
    ready_info = None
    start = end = None
    frontend = None

    def begin_window():
        t = mono()
        procutil.read_thread_clocks("start")
        client.snapshot("start")
        client.window = t
        try:
            client.send(("window", t))
        except (OSError, ValueError):
            stop.set()
        return t

    while not stop.is_set():
        if out_r.poll(0.5):
            msg = out_r.recv()
            if msg[0] == "ready":
                ready_info = msg[1]
            else:
                client.engine_failed = msg[1]
            break
        if not ec.is_alive():
            client.engine_failed = "EngineCore exited before it was ready"
            break
    if ready_info is not None:
        log(cfg, "EngineCore pid=%d, workers %s; metrics on port %d" % (
            ready_info["pid"], ready_info["workers"], port))
        if cfg["serialize_stalls"]:
            import frontend as frontend_mod
            frontend = frontend_mod.Frontend(cfg, client, stop)
            client.frontend = frontend
            client.sends = []
            log(cfg, "asyncio frontend: routed-experts responses of %d positions (%.0f ms of "
                "JSON each), groups of 1-%d, %.2f s apart" % (
                    frontend.positions, cfg["serialize_ms"], cfg["serialize_group_max"],
                    cfg["serialize_gap"]))
        oh = threading.Thread(target=client.output_loop, name="output-handler", daemon=True)
        lg = threading.Thread(target=client.load_loop, name="load-generator", daemon=True)
        oh.start()
        lg.start()
        if frontend is not None:
            def announce_and_wait_go():
                _announce("READY %d %d" % (os.getpid(), port), args)
                _wait_go(args)

            start = frontend.run(announce_and_wait_go, begin_window, args.seconds)
        else:
            while not stop.is_set() and not client.warm.wait(0.5):
                pass
            try:
                if not stop.is_set():
                    # Both may block (a FIFO's open waits for the other end): a signal ends
                    # them.
                    state["interruptible"] = True
                    _announce("READY %d %d" % (os.getpid(), port), args)
                    _wait_go(args)
            except Interrupted:
                pass
            state["interruptible"] = False
        if frontend is None and not stop.is_set():
            start = begin_window()
            if args.seconds is not None:
                deadline = start + int(args.seconds * 1e9)
                while not stop.is_set():
                    left = deadline - mono()
                    if left <= 0:
                        break
                    stop.wait(left / 1e9)
            else:
                while not stop.wait(3600):
                    pass
        end = mono()
        if frontend is not None:
            frontend.monitor.close_open(end, time.thread_time_ns())
        procutil.read_thread_clocks("end")
        client.snapshot("end")
        if start is None:
            start = end
        client.stop_load()
        try:
            client.send(("shutdown", start, end))
        except (OSError, ValueError):
            pass
        oh.join(60)
    ec.join(30)
    if ec.is_alive():
        ec.terminate()
        ec.join(5)
    if server is not None:
        server.shutdown()
        server.server_close()
    procutil.thread_exiting(main_rec)
    if client.engine_failed:
        log(cfg, "engine failed: %s" % client.engine_failed)
        exit_code = 1

    if cfg["truth"]:
        if start is None:
            start = end = mono()
        doc = gt.base_doc("api_server", cfg, (start, end))
        lc = cfg["list_cap"]
        g0 = client.gen_at.get("start", (start, 0))
        g1 = client.gen_at.get("end", (end, client.gen_tokens))
        window_s = max((end - start) / 1e9, 1e-9)
        processes = [{"role": "api_server", "pid": os.getpid()}]
        bye = client.bye or {}
        processes.append({"role": "engine_core", "pid": ec.pid, "truth": bye.get("truth"),
                          "exitcode": ec.exitcode})
        processes.extend(bye.get("workers", []))
        threads = procutil.threads_doc()
        doc.update({
            "comm": procutil.read_comm(),
            "cmdline": procutil.read_cmdline(),
            "metrics_port": port,
            "ended": "engine_failed: %s" % client.engine_failed if client.engine_failed
            else "shutdown",
            "threads": threads,
            "functions": {},
            "gc": gcmon.doc(start, end, lc),
            "processes": processes,
            "generation_tokens": {"total": client.gen_tokens, "window": g1[1] - g0[1],
                                  "per_s_window": round((g1[1] - g0[1]) / window_s, 3),
                                  "snapshot_ns": [g0[0], g1[0]]},
            "requests": {"finished_total": client.finished,
                         "finished_window": sum(1 for t, _ in client.e2e if start <= t < end),
                         "ttft_ns": _pairs_doc(client.ttft, start, end),
                         "itl_ns": _pairs_doc(client.itl, start, end),
                         "e2e_ns": _pairs_doc(client.e2e, start, end),
                         "tpot_ns": _pairs_doc(client.tpot, start, end)},
            "metrics_final": metrics.render(),
        })
        if frontend is not None:
            doc["event_loop"] = frontend.doc(start, end, threads, lc)
        gt.write_truth(cfg["truth"], "api_server", doc)
    print("DONE", flush=True)
    return exit_code
