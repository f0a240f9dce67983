#!/usr/bin/env python3
"""Aliasing against a thread in step with a clock: samples/cpu_mix.py --paced (5 ms steps,
0.5 ms in paced_a then 0.5 ms in paced_b, then sleep) recorded by enginescope (re-phased
clock, and with ENGINESCOPE_SAMPLE_REPHASE=0 the fixed grid), py-spy and Austin at the same
rate, one after the other, each on a fresh workload for the same window. Prints, per tool,
the samples that hold paced_a or paced_b and paced_a's share of them (truth: 0.50; each
function runs 10% of the thread's wall time, so at R Hz over S s about 0.1 x R x S samples
each).

Usage (root): python3 bench/paced_aliasing.py [--rate 1000] [--seconds 6] [--python PATH]
         [--peers /opt/es-peers/bin]
"""
import argparse, json, os, subprocess, sys, tempfile, time, collections, re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def workload(py, d, seconds):
    fifo = os.path.join(d, "go")
    os.mkfifo(fifo)
    p = subprocess.Popen([py, os.path.join(ROOT, "samples/cpu_mix.py"), "--paced", "--truth",
                          os.path.join(d, "truth.json"), "--duration", str(seconds),
                          "--go-fifo", fifo], stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.strip() == "READY":
            break
    return p, fifo


def go(fifo):
    with open(fifo, "w") as f:
        f.write("go\n")


def folded_shares(lines):
    """(samples with paced_a, with paced_b, samples of mix-paced) from folded lines."""
    a = b = n = 0
    for l in lines:
        stack, _, c = l.rpartition(" ")
        if not c.isdigit():
            continue
        c = int(c)
        if "paced_loop" not in stack:
            continue
        n += c
        if "paced_a" in stack:
            a += c
        elif "paced_b" in stack:
            b += c
    return a, b, n


def run_enginescope(args, py, env_extra):
    with tempfile.TemporaryDirectory() as d:
        p, fifo = workload(py, d, args.seconds)
        out = os.path.join(d, "r.esrec")
        env = dict(os.environ, **env_extra)
        rec = subprocess.Popen([args.enginescope, "record", "--rate", str(args.rate), "--duration",
                                str(args.seconds + 2), "--pid", str(p.pid), "--no-offcpu", "-o", out],
                               stderr=subprocess.PIPE, text=True, env=env)
        for line in rec.stderr:
            if "sampling started" in line:
                break
        go(fifo)
        p.stdout.read(); p.wait(); rec.communicate()
        truth = json.load(open(os.path.join(d, "truth.json")))
        folded = subprocess.run([args.enginescope, "export", "--format", "folded", "-o", "-", out],
                                capture_output=True, text=True).stdout.splitlines()
        return folded_shares(folded), truth


def run_pyspy(args, py):
    with tempfile.TemporaryDirectory() as d:
        p, fifo = workload(py, d, args.seconds)
        out = os.path.join(d, "raw.txt")
        s = subprocess.Popen([os.path.join(args.peers, "py-spy"), "record", "--nonblocking", "--rate",
                              str(args.rate), "--format", "raw", "--threads", "-o", out, "--pid",
                              str(p.pid), "--duration", str(args.seconds + 2)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy says nothing when it starts sampling: a second to attach
        go(fifo)
        p.stdout.read(); p.wait(); s.wait()
        truth = json.load(open(os.path.join(d, "truth.json")))
        return folded_shares(open(out).read().splitlines()), truth


def run_austin(args, py):
    with tempfile.TemporaryDirectory() as d:
        p, fifo = workload(py, d, args.seconds)
        out = os.path.join(d, "austin.txt")
        s = subprocess.Popen([os.path.join(args.peers, "austin"), "-i", "%dus" % (1_000_000 // args.rate),
                              "-p", str(p.pid), "-o", out, "-x", str(args.seconds + 2)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # as for py-spy
        go(fifo)
        p.stdout.read(); p.wait(); s.wait()
        truth = json.load(open(os.path.join(d, "truth.json")))
        # Austin's lines: P<pid>;T<iid>:<tid>;frames... <metric>: count each line once.
        lines = [re.sub(r" \d+$", " 1", l) for l in open(out).read().splitlines() if l.startswith("P")]
        return folded_shares(lines), truth


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=6)
    ap.add_argument("--python", default=os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12"))
    ap.add_argument("--peers", default="/opt/es-peers/bin")
    ap.add_argument("--enginescope", default=os.path.join(ROOT, "target/release/enginescope"))
    args = ap.parse_args()
    runs = [
        ("enginescope (re-phased clock)", lambda: run_enginescope(args, args.python, {})),
        ("enginescope (fixed grid)", lambda: run_enginescope(args, args.python, {"ENGINESCOPE_SAMPLE_REPHASE": "0"})),
        ("py-spy --nonblocking", lambda: run_pyspy(args, args.python)),
        ("austin", lambda: run_austin(args, args.python)),
    ]
    print("| tool | rate | paced_a samples | paced_b samples | paced_a share (truth 0.50) |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in runs:
        (a, b, _), _truth = fn()
        share = a / (a + b) if a + b else float("nan")
        print(f"| {name} | {args.rate} | {a} | {b} | {share:.2f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
