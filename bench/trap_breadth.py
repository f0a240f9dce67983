"""What one debug trap costs a Python loop, by the code that runs after it (issues 34, 35).
The workload alternates blocks of iterations calling f (probed, two traps a call) and g (the
same, not probed), each iteration then running narrow code (one small loop), broad code (400
distinct generated functions) or pages (reads of N random pages of 64 MiB); the difference of
the blocks' medians is two traps. Usage: trap_breadth.py ENGINESCOPE narrow|broad|pages SECONDS
rec|norec [PAGES] (MODE yield|spin|block: trap_lockstep_workload.py's pair, the waiting side
spinning with sched_yield, spinning, or blocking on a pipe); the workload on CPU 0, enginescope on CPU 1; ENGINESCOPE_PROBE_SHARE=0.5
watches half the time (on-phases on every CPU) instead of all of it."""
import subprocess, sys, time, statistics as st
import os
PY = os.environ.get("PY", "/root/.pyenv/versions/3.12.1/bin/python3.12")
SHARE = os.environ.get("ENGINESCOPE_PROBE_SHARE")
ES = sys.argv[1]; mode = sys.argv[2]; dur = float(sys.argv[3]); rec = sys.argv[4] == "rec"
# yield|spin|block: two processes in lock-step (trap_lockstep_workload.py, pinned there).
LOCKSTEP = mode in ("yield", "spin", "block")
WL = "trap_lockstep_workload.py" if LOCKSTEP else "trap_breadth_workload.py"
pin = [] if LOCKSTEP else ["taskset", "-c", "0"]
w = subprocess.Popen(pin + [PY, os.path.join(os.path.dirname(os.path.abspath(__file__)), WL), mode, str(dur), "3" if rec else "0"] + sys.argv[5:6], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
hdr = w.stdout.readline().strip()
r = None
if rec:
    r = subprocess.Popen(["taskset", "-c", "1", ES, "record", "--pid", str(w.pid), "--probe", WL + ":f"] + ([] if SHARE else ["--exact-probes"]) + [ "--probe-max-rate", "0", "--no-offcpu", "--no-gil", "--no-gc", "-d", str(dur + 2), "-o", f"/tmp/trap_breadth_{mode}.esrec"], stderr=subprocess.PIPE, text=True)
# The workload calls f and g slowly for 3 s (the sampler meets f there and the probe
# attaches), then says so and waits.
w.stdout.readline()
w.stdin.write("go\n"); w.stdin.flush()
rows = [l.split() for l in w.stdout]
w.wait()
if r:
    r.terminate(); r.wait()
by = {0: [], 1: []}
for k, ns in rows:
    by[int(k)].append(int(ns))
# drop first and last 5%
m0 = st.median(by[0]); m1 = st.median(by[1])
print(f"{mode:6s} rec={rec} {hdr}: blocks {len(by[0])}/{len(by[1])} g {m0/1000:.2f} us/iter, f {m1/1000:.2f} us/iter, f-g {(m1-m0)/1000:.2f} us (per trap {(m1-m0)/2000:.2f})")
