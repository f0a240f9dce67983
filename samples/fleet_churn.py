"""Soak target for the always-on agent: a vLLM-shaped process tree whose processes and threads
keep coming and going.

Usage: fleet_churn.py serve --port PORT [--workers 2] [--worker-life 3.0] [--threads-per-s 20]
                           [--duration SECONDS]

Processes (titles as vLLM sets them, through /proc/self/comm, so `enginescope agent --vllm`
finds them: the server is the engine's root because its argv has `serve` and `--port`):

  server        this process: serves a small `/metrics` page with `vllm:` series on
                127.0.0.1:PORT (so the agent's scraper has something to read), starts the
                engine core, prints READY once the core says its first workers run.
  VLLM::EngineCore  keeps --workers worker processes alive: each lives --worker-life seconds
                (0.5x to 1.5x, seeded) and is replaced when it exits, so a new worker pid
                appears every worker-life / workers seconds.
  VLLM::Worker  (comm `VLLM::Worker`) runs `execute_model()` steps of pure-Python work and
                starts short-lived request threads (`req-N`, a new name each time, 50-150 ms
                each, --threads-per-s in all) that allocate reference cycles for the collector.

Every child dies with its parent (PR_SET_PDEATHSIG), and the server stops after --duration
seconds (default: until killed). Nothing here sleeps to wait for readiness: READY follows a
line from the engine core on a pipe.
"""
import argparse
import ctypes
import http.server
import os
import random
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def set_comm(name):
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def set_thread_comm(name):
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
            f.write(name[:15])
    except OSError:
        pass


# --- worker -----------------------------------------------------------------------------

def make_garbage(n):
    for _ in range(n):
        a = []
        b = [a]
        a.append(b)


def request(n):
    set_thread_comm("req-%d" % n)
    end = time.monotonic() + 0.05 + (n % 11) * 0.01
    s = 0
    while time.monotonic() < end:
        make_garbage(50)
        s += sum(range(200))
        time.sleep(0.005)
    return s


def execute_model(step):
    s = 0
    for i in range(3000):
        s += (i * step) % 7
    return s


def worker(args):
    die_with_parent()
    set_comm("VLLM::Worker")
    rng = random.Random(os.getpid())
    life = args.worker_life * rng.uniform(0.5, 1.5)
    end = time.monotonic() + life
    period = 1.0 / max(args.threads_per_s, 0.1)
    next_thread = time.monotonic()
    n = 0
    step = 0
    while time.monotonic() < end:
        execute_model(step)
        step += 1
        now = time.monotonic()
        if now >= next_thread:
            threading.Thread(target=request, args=(os.getpid() * 1000 + n,), daemon=True).start()
            n += 1
            next_thread = now + period
        time.sleep(0.01)


# --- engine core ------------------------------------------------------------------------

def core(args):
    die_with_parent()
    set_comm("VLLM::EngineCore")
    me = [sys.executable, os.path.abspath(__file__), "worker",
          "--worker-life", str(args.worker_life), "--threads-per-s", str(args.threads_per_s)]
    workers = [subprocess.Popen(me) for _ in range(args.workers)]
    print("CORE-READY", flush=True)
    while True:
        for i, w in enumerate(workers):
            if w.poll() is not None:
                workers[i] = subprocess.Popen(me)
        time.sleep(0.05)


# --- server -----------------------------------------------------------------------------

class Metrics(http.server.BaseHTTPRequestHandler):
    started = time.monotonic()

    def do_GET(self):
        if self.path != "/metrics":
            self.send_response(404)
            self.end_headers()
            return
        up = time.monotonic() - self.started
        body = (
            "# HELP vllm:generation_tokens_total Generation tokens.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            'vllm:generation_tokens_total{model_name="fake"} %d\n'
            "# HELP vllm:kv_cache_usage_perc KV cache usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="fake"} %.3f\n'
        ) % (int(up * 100), (up % 10) / 10)
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def serve(args):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Metrics)
    threading.Thread(target=srv.serve_forever, name="metrics", daemon=True).start()
    me = [sys.executable, os.path.abspath(__file__), "core", "--workers", str(args.workers),
          "--worker-life", str(args.worker_life), "--threads-per-s", str(args.threads_per_s)]
    c = subprocess.Popen(me, stdout=subprocess.PIPE, text=True)
    line = c.stdout.readline()
    if line.strip() != "CORE-READY":
        print("engine core failed: %r" % line, file=sys.stderr)
        c.kill()
        sys.exit(1)
    print("READY", flush=True)
    try:
        if args.duration:
            time.sleep(args.duration)
        else:
            while True:
                time.sleep(3600)
    finally:
        c.kill()
        c.wait()
        srv.shutdown()
    print("DONE", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["serve", "core", "worker"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-life", type=float, default=3.0)
    ap.add_argument("--threads-per-s", type=float, default=20.0)
    ap.add_argument("--duration", type=float, default=0.0)
    args = ap.parse_args()
    {"serve": serve, "core": core, "worker": worker}[args.mode](args)


if __name__ == "__main__":
    main()
