"""A target that misbehaves while it is recorded (tests/live_faults.rs): two threads spin in
`spin()`; --after seconds after READY the process exits (--exit) or replaces itself with a new
Python (--exec) whose main thread spins in `after_exec()` for --for seconds, then exits.

Usage: faults.py (--exit | --exec) --after S [--for S]"""
import argparse
import os
import sys
import threading
import time


def spin():
    x = 0
    while True:
        x += 1


def main():
    ap = argparse.ArgumentParser()
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--exit", action="store_true")
    mode.add_argument("--exec", action="store_true")
    ap.add_argument("--after", type=float, required=True)
    ap.add_argument("--for", dest="for_s", type=float, default=5.0)
    a = ap.parse_args()
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
    os.execv(sys.executable, [sys.executable, "-c", code])


if __name__ == "__main__":
    main()
