"""Trap counts per call of candidate hardware-watch addresses for exact per-call latency
(docs/probes.md, "Why this design"). Run as root:

    python3 bench/watch_candidates.py PYTHON [ARGS...]      # e.g. /root/.pyenv/versions/3.12.1/bin/python3.12
    SCRIPT=/tmp/watch_candidates.py python3 bench/watch_candidates.py chroot /opt/pyvers/sid /usr/bin/python3.14
      (copy this file to /opt/pyvers/sid/tmp/ first)

Env: N (iterations, default 20000), EX=1 (call through f(*a), i.e. entered from C on 3.11),
WHICH (space-separated subset of: none entry curframe slot_prev caller_sp caller_instr
slot_isentry code_rc). For each candidate it starts PYTHON on this file in workload mode,
attaches `perf stat -e mem:ADDR/LEN:rw` (`:w` for code_rc) to it, runs N loop iterations
(each calls f, g and h; h calls k) and prints the traps per iteration. Timings per iteration
are only indicative (one trap is ~14 us in this VM; the machine is shared).
"""
import os
import sys

if os.environ.get("WATCH_WORKLOAD") != "1":
    import subprocess, sys, time, os, signal
    N = int(os.environ.get("N", "20000"))
    cmd = sys.argv[1:]
    for which in os.environ.get("WHICH", "none entry curframe slot_prev caller_sp caller_instr").split():
        p = subprocess.Popen(cmd + [os.environ.get("SCRIPT", os.path.abspath(__file__)), str(N)], env=dict(os.environ, WATCH_WORKLOAD='1'), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        A = {}
        pid = None
        while True:
            line = p.stdout.readline().split()
            if line[0] == "READY": break
            if line[0] == "RC": continue
            if line[0] == "PID": pid = int(line[1]); continue
            A[line[0]] = f"{line[1]}/{line[2]}"
        tpid = pid or p.pid
        pp = None
        MODE = 'w' if which == 'code_rc' else 'rw'
        if which != "none":
            pp = subprocess.Popen(["perf", "stat", "-x,", "-e", f"mem:{A[which]}:{MODE}", "-p", str(tpid), "-o", "/tmp/pexp/ps.out"])
            time.sleep(1.0)
        p.stdin.write("go\n"); p.stdin.flush()
        done = p.stdout.readline().strip()
        cnt = 0
        if pp:
            pp.send_signal(signal.SIGINT); pp.wait()
            for l in open("/tmp/pexp/ps.out"):
                if "mem:" in l: cnt = int(l.split(",")[0])
        p.stdin.write("go\n"); p.stdin.flush(); p.wait()
        print(f"{which:13} {A.get(which,''):22} traps={cnt:7} per_iter={cnt/N:.3f} {done}", flush=True)
    sys.exit(0)
else:
    import ctypes, sys, time, os
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    minor = sys.version_info[1]
    api = ctypes.pythonapi
    api.PyThreadState_Get.restype = ctypes.c_void_p
    def u64(a): return ctypes.c_uint64.from_address(a).value
    if minor >= 13:
        rt = ctypes.addressof(ctypes.c_char.in_dll(api, "_PyRuntime"))
        assert ctypes.string_at(rt, 8) == b"xdebugpy"
        sys.path.insert(0, os.path.dirname(__file__))
        # section layouts (mirror of src/cpython/offsets.rs debug_layout)
        L = {13: [3, 13, 9, 6, 10], 14: [3, 16, 9, 8, 11], 15: [3, 16, 16, 1, 8, 11]}[minor]
        base = rt + 24
        secs = []
        for n in L:
            secs.append([u64(base + 8*i) for i in range(n)]); base += 8*n
        ts = secs[2]
        fr = secs[4] if minor == 15 else secs[3]
        co = secs[5] if minor == 15 else secs[4]
        TS_CUR = ts[4]
        F_PREV, F_INSTR = fr[1], fr[3]
        F_SP = fr[6] if minor >= 14 else 64
        CO_ADAPT = co[9]
    else:
        TS_CUR = None
        F_PREV = 48 if minor == 11 else 8
        F_INSTR, F_SP = 56, 64
        CO_ADAPT = 184 if minor == 11 else 192

    def iframe(fo): return u64(id(fo) + 24)
    slot = [0]
    def f(x):
        if x:
            return 1
        return 2
    def g(): pass
    def k(): pass
    def h(): k()
    def grab(): slot[0] = iframe(sys._getframe())
    def loop(n):
        for i in range(n):
            f(i & 1); g(); h()
    def main():
        ts = api.PyThreadState_Get()
        if minor >= 13: cur = ts + TS_CUR
        elif minor == 12: cur = u64(ts + 56) + 0
        else: cur = u64(ts + 56) + 8
        loop(100)  # warm/specialize
        grab_loop()
    def grab_loop():
        # The slot of loop's callees: the frame of a function called from loop's frame position.
        pass
    ts = api.PyThreadState_Get()
    print("PID", os.getpid(), flush=True)
    EX = os.environ.get('EX') == '1'
    a1 = (1,); a0 = ()
    def run():
        fl = sys._getframe()
        L = iframe(fl)
        grab()          # called from run's frame: its frame is the slot of run's callees
        F = slot[0]
        cur = ts + TS_CUR if minor >= 13 else (u64(ts + 56) + (0 if minor == 12 else 8))
        loop(200)
        print(f"entry {id(f.__code__) + CO_ADAPT:#x} 1", flush=True)
        print(f"curframe {cur:#x} 8", flush=True)
        print(f"slot_prev {F + F_PREV:#x} 8", flush=True)
        print(f"caller_sp {L + F_SP:#x} 8", flush=True)
        print(f"caller_instr {L + F_INSTR:#x} 8", flush=True)
        print(f"slot_isentry {F + 68:#x} 1", flush=True)
        print(f"code_rc {id(f.__code__):#x} 8", flush=True)
        print(f"RC {sys.getrefcount(f.__code__)}", flush=True)
        print("READY", flush=True)
        sys.stdin.readline()
        t = time.perf_counter()
        # loop body inlined here so that f, g, h are called from run's frame (slot F)
        for i in range(N):
            if EX:
                f(*a1); g(*a0); h(*a0)
            else:
                f(i & 1); g(); h()
        dt = time.perf_counter() - t
        print(f"DONE {N} {dt*1e6/N:.2f}us/iter", flush=True)
        sys.stdin.readline()
    run()
