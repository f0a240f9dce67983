#!/usr/bin/env python3
"""Tally the bytes of enginescope recordings (.esrec files or directories of segments) per
record tag: where an agent's disk goes (docs/deployment.md).

Usage: tools/segment_bytes.py DIR_OR_FILE... [--seconds S]
  --seconds S: bytes/s over S seconds (else over the span from the first segment's meta
  start_unix_s to the last segment's modification time).
"""
import json
import os
import sys

NAMES = {1: "meta", 2: "process", 3: "thread", 4: "frame", 5: "stack", 6: "sample",
         7: "off-CPU", 8: "counters", 9: "end", 10: "GIL wait", 11: "GC pause",
         12: "engine", 13: "metric series", 14: "metric point", 15: "scrape error",
         16: "probe", 17: "call", 18: "asyncio task", 19: "GC method", 20: "probe watch",
         21: "interval", 22: "samples (sum)", 23: "off-CPU (sum)", 24: "GIL wait (sum)",
         25: "call histogram", 26: "wake-up", 27: "GC pause histogram",
         28: "off-CPU run"}


def varint(b, i):
    v = 0
    shift = 0
    while True:
        if i >= len(b):
            raise EOFError
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return v, i


def tally(path, out, span):
    with open(path, "rb") as f:
        b = f.read()
    if b[:6] != b"ESREC\0":
        print(f"{path}: not a recording", file=sys.stderr)
        return
    out.setdefault("header", [0, 0])
    out["header"][0] += 1
    out["header"][1] += 8
    i = 8
    while i < len(b):
        t = b[i]
        try:
            n, j = varint(b, i + 1)
        except EOFError:
            break
        if j + n > len(b):
            break
        e = out.setdefault(t, [0, 0])
        e[0] += 1
        e[1] += j + n - i
        if t == 1:
            try:
                m = json.loads(b[j:j + n])
                span[0] = min(span[0], m.get("start_unix_s", span[0]))
            except ValueError:
                pass
        i = j + n
    span[1] = max(span[1], os.path.getmtime(path))


def main():
    args = sys.argv[1:]
    seconds = None
    if "--seconds" in args:
        k = args.index("--seconds")
        seconds = float(args[k + 1])
        del args[k:k + 2]
    files = []
    for a in args:
        if os.path.isdir(a):
            files += sorted(os.path.join(a, f) for f in os.listdir(a) if f.endswith(".esrec"))
        else:
            files.append(a)
    out = {}
    span = [float("inf"), 0.0]
    for f in files:
        tally(f, out, span)
    total = sum(v[1] for v in out.values())
    secs = seconds or (span[1] - span[0] if span[1] > span[0] else None)
    print(f"{len(files)} file(s), {total} bytes" +
          (f" over {secs:.0f} s: {total / secs:.0f} B/s" if secs else ""))
    print(f"{'record':<22} {'count':>10} {'bytes':>12} {'share':>7} {'B/record':>9}" +
          (f" {'B/s':>9}" if secs else ""))
    for k, (c, n) in sorted(out.items(), key=lambda kv: -kv[1][1]):
        name = NAMES.get(k, f"tag {k}") if isinstance(k, int) else k
        print(f"{name:<22} {c:>10} {n:>12} {100 * n / max(total, 1):>6.1f}% {n / max(c, 1):>9.1f}" +
              (f" {n / secs:>9.1f}" if secs else ""))


if __name__ == "__main__":
    main()
