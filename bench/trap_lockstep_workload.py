# bench/trap_breadth.py's lock-step workload. A pair: A (this process, CPU 0) and B (child, CPU 1) hand a token back and forth
# through shared memory; the waiting side spins on the flag with os.sched_yield() (like vLLM's
# shm_broadcast readers) or blocks on a pipe (mode "block"). Each turn A runs broad work and
# calls f (probed) or g in alternating blocks; B runs the same amount of work. Prints per-block
# ns per round trip after 'warm'.
import os, sys, time, random, struct
from multiprocessing import shared_memory
mode = sys.argv[1]; dur = float(sys.argv[2]); warm = float(sys.argv[3])
def f(n=0):
    for _ in range(n): pass
    return 1
def g(n=0):
    for _ in range(n): pass
    return 1
N = 400
src = "".join(f"def h{i}(x):\n    d = {{'a': x, 'b': [x, {i}]}}\n    s = 'v{i}' + str(x)\n    return len(d) + s.count('v') + max(x, {i})\n" for i in range(N))
ns = {}; exec(src, ns); fns = [ns[f"h{i}"] for i in range(N)]
def work():
    s = 0
    for h in fns: s += h(3)
    return s
shm = shared_memory.SharedMemory(create=True, size=64)
buf = shm.buf
buf[0] = 0
r1, w1 = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
me = 0 if pid else 1
os.sched_setaffinity(0, {me})
def wait_for(v):
    if mode == "block":
        os.read(r1 if me == 1 else r2, 1)
        return
    while buf[0] != v:
        if mode == "yield": os.sched_yield()
def give(v):
    buf[0] = v
    if mode == "block":
        os.write(w1 if me == 0 else w2, b"x")
if pid == 0:
    # B
    while True:
        wait_for(1)
        if buf[1] == 1:
            break
        work()
        give(0)
    os._exit(0)
print(f"ready {os.getpid()}", flush=True)
end = time.time() + warm
while time.time() < end:
    f(20000); g(20000)
print("warm", flush=True)
sys.stdin.readline()
end = time.time() + dur
B = 20
while time.time() < end:
    for kind in ((0, 1) if random.random() < 0.5 else (1, 0)):
        c = f if kind else g
        t = time.perf_counter_ns()
        for _ in range(B):
            work(); c()
            give(1)
            wait_for(0)
        print(kind, (time.perf_counter_ns() - t) // B)
sys.stdout.flush()
buf[1] = 1; give(1)
os.waitpid(pid, 0)
shm.close(); shm.unlink()
