"""A target that misbehaves while it is recorded (tests/live_faults.rs): two threads spin in
`spin()`; --after seconds after READY the process exits (--exit) or replaces itself with a new
Python (--exec) whose main thread spins in `after_exec()` for --for seconds, then exits. The
new Python comes through a shell that waits a moment first, as a launcher script would: the
process is a shell, then a Python still starting, before it is a Python to record. With
--churn N it instead starts short-lived threads (`churn`, each summing a few hundred numbers in
`work()`), N a second in batches of ten, for --for seconds, then prints how many it started.

Usage: faults.py (--exit | --exec) --after S [--for S]
       faults.py --churn N [--for S]"""
import argparse
import os
import sys
import threading
import time


def spin():
    x = 0
    while True:
        x += 1


def work():
    x = 0
    for i in range(300):
        x += i


def churn(per_s, for_s):
    print("READY", flush=True)
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < for_s:
        batch = [threading.Thread(target=work, name="churn") for _ in range(10)]
        for t in batch:
            t.start()
        for t in batch:
            t.join()
        n += 10
        # Pace to per_s: the next batch when its time comes.
        ahead = t0 + n / per_s - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
    print("started %d threads" % n, flush=True)


def main():
    ap = argparse.ArgumentParser()
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--exit", action="store_true")
    mode.add_argument("--exec", action="store_true")
    mode.add_argument("--churn", type=float)
    ap.add_argument("--after", type=float, default=0.0)
    ap.add_argument("--for", dest="for_s", type=float, default=5.0)
    a = ap.parse_args()
    if a.churn:
        churn(a.churn, a.for_s)
        return
    for _ in range(2):
        threading.Thread(target=spin, name="spinner", daemon=True).start()
    print("READY", flush=True)
    time.sleep(a.after)
    if a.exit:
        os._exit(0)
    code = (
        "import time\n"
        "def after_exec(s):\n"
        "    t = time.monotonic()\n"
        "    x = 0\n"
        "    while time.monotonic() - t < s:\n"
        "        x += 1\n"
        "after_exec(%f)\n" % a.for_s
    )
    sys.stdout.flush()
    launcher = 'sleep 0.2; exec "$0" -c "$1"'
    os.execv("/bin/sh", ["/bin/sh", "-c", launcher, sys.executable, code])


if __name__ == "__main__":
    main()
