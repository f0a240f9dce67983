#!/usr/bin/env python3
"""Who waits on a process's mmap_lock, for how long, and who held it meanwhile (issue 34).

Reads the kernel's mmap_lock tracepoints (tracefs; root) for DUR seconds and prints, per
process of PIDS (each with its threads), the time its threads spent between asking for their
address space's lock and getting it, the longest waits, and for each long wait the tasks
(of any process: enginescope's readers included) that held the same lock when it began.

    python3 bench/mmap_lock_waits.py DUR PID [PID...]

A wait is the span from `mmap_lock_start_locking` to `mmap_lock_acquire_returned` of one task.
A holder is a task between `acquire_returned` (success) and `released` on the same mm.
Events are the kernel's own; nothing is sampled.
"""
import os
import re
import sys
import time
from collections import defaultdict

T = "/sys/kernel/tracing"
LINE = re.compile(
    r"^\s*(?P<comm>.+?)-(?P<tid>\d+)\s+\[\d+\]\s+\S+\s+(?P<ts>[\d.]+):\s+"
    r"mmap_lock_(?P<ev>start_locking|acquire_returned|released):\s+mm=(?P<mm>\S+)"
    r".*?write=(?P<w>true|false)(?:\s+success=(?P<ok>true|false))?"
)


def w(path, text):
    with open(os.path.join(T, path), "w") as f:
        f.write(text)


def tgid_of(tid):
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    dur = float(sys.argv[1])
    pids = [int(p) for p in sys.argv[2:]]
    if not os.path.exists(os.path.join(T, "events/mmap_lock")):
        os.system(f"mount -t tracefs nodev {T} 2>/dev/null")
    w("tracing_on", "0")
    w("trace", "")
    w("buffer_size_kb", "65536")
    w("trace_clock", "mono")
    w("events/mmap_lock/enable", "1")
    w("tracing_on", "1")
    time.sleep(dur)
    w("tracing_on", "0")
    w("events/mmap_lock/enable", "0")
    with open(os.path.join(T, "trace")) as f:
        lines = f.readlines()
    w("trace", "")

    pending = {}  # tid -> (ts, mm, write)
    holders = defaultdict(dict)  # mm -> {tid: (since, write, comm)}
    waits = []  # (tid, comm, mm, write, start, dur, holders at start)
    comm_of = {}
    parsed = 0
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        parsed += 1
        tid, ts, mm, ev = int(m["tid"]), float(m["ts"]), m["mm"], m["ev"]
        comm_of[tid] = m["comm"].strip()
        write = m["w"] == "true"
        if ev == "start_locking":
            pending[tid] = (ts, mm, write, dict(holders[mm]))
        elif ev == "acquire_returned":
            p = pending.pop(tid, None)
            if p is not None:
                waits.append((tid, mm, write, p[0], ts - p[0], p[3]))
            if m["ok"] == "true":
                holders[mm][tid] = (ts, write)
        else:
            holders[mm].pop(tid, None)

    tgid = {}
    for tid, *_ in waits:
        if tid not in tgid:
            tgid[tid] = tgid_of(tid)
    print(f"{len(lines)} trace lines, {parsed} mmap_lock events in {dur:.0f} s")
    for pid in pids:
        mine = [x for x in waits if tgid.get(x[0]) == pid]
        total = sum(x[4] for x in mine)
        long_ = sorted(mine, key=lambda x: -x[4])[:8]
        print(
            f"pid {pid}: {len(mine)} lock takes, waited {total * 1e3:.1f} ms "
            f"({total / dur * 100:.2f}% of one CPU's time), "
            f"over 1 ms: {sum(1 for x in mine if x[4] > 1e-3)}"
        )
        for tid, mm, write, start, d, held in long_:
            hs = ", ".join(
                f"{comm_of.get(h, '?')}/{h}({'w' if hw else 'r'}, held {(start - since) * 1e3:.2f} ms)"
                for h, (since, hw) in held.items()
            )
            print(
                f"   {comm_of.get(tid, '?')}/{tid} {'write' if write else 'read'} "
                f"waited {d * 1e3:.2f} ms; holders then: {hs or 'none'}"
            )


if __name__ == "__main__":
    main()
