# bench/trap_breadth.py's workload. Per-trap cost in narrow vs broad interpreter code: blocks of iterations alternate between
# calling f (probed: 2 traps a call) and g (same body, not probed); each iteration then runs
# `work` (narrow: one small loop; broad: N distinct generated functions). Prints per-block
# ns/iteration with the block kind to stdout after a 'ready' line; runs for argv[2] s.
import sys, time, random
mode = sys.argv[1]; dur = float(sys.argv[2])
def f(n=0):
    for _ in range(n): pass
    return 1
def g(n=0):
    for _ in range(n): pass
    return 1
src = []
N = 400
for i in range(N):
    k = i % 8
    if k == 0: body = f"    s = 0\n    for j in range({3 + i % 5}): s += j * {i}\n    return s"
    elif k == 1: body = f"    d = {{'a{i}': x, 'b': [x, {i}]}}\n    return len(d) + d['b'][1]"
    elif k == 2: body = f"    t = (x, {i}, 'k{i}')\n    return hash(t) & 7"
    elif k == 3: body = f"    s = 'v{i}' + str(x)\n    return s.upper().count('V')"
    elif k == 4: body = f"    l = [x] * {2 + i % 4}\n    l.append({i})\n    return sum(l) % 11"
    elif k == 5: body = f"    try:\n        return {{1: 2}}[x % 3]\n    except KeyError:\n        return {i}"
    elif k == 6: body = f"    return max(x, {i}) - min(x, {i} // 2)"
    else: body = f"    o = C{i % 13}(x)\n    return o.v + {i}"
    src.append(f"def h{i}(x):\n{body}\n")
classes = "".join(f"class C{j}:\n    def __init__(self, v): self.v = v + {j}\n" for j in range(13))
ns = {}
exec(classes + "".join(src), ns)
fns = [ns[f"h{i}"] for i in range(N)]
random.seed(1)
def broad():
    s = 0
    for h in fns:
        s += h(3)
    return s
def narrow():
    s = 0
    for j in range(1600):
        s += j
    return s
NP = int(sys.argv[4]) if len(sys.argv) > 4 else 800
big = bytearray(64 << 20)
offs = [random.randrange(0, (64 << 20) >> 12) << 12 for _ in range(NP)]
def pages():
    b = big
    s = 0
    for o in offs:
        s += b[o]
    return s
work = {"broad": broad, "narrow": narrow, "pages": pages}[mode]
# Size iterations to ~similar time
t0 = time.perf_counter_ns(); 
for _ in range(50): work()
per = (time.perf_counter_ns() - t0) / 50
print(f"ready work {per/1000:.1f} us", flush=True)
w0 = time.time() + float(sys.argv[3]) if len(sys.argv) > 3 else 0
while time.time() < w0:
    f(20000); g(20000)
print("warm", flush=True)
sys.stdin.readline()  # go
end = time.time() + dur
B = 50
while time.time() < end:
    for kind in (0, 1) if random.random() < 0.5 else (1, 0):
        c = f if kind else g
        t = time.perf_counter_ns()
        for _ in range(B):
            c(); work()
        print(kind, (time.perf_counter_ns() - t) // B, flush=False)
sys.stdout.flush()
