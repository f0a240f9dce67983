"""Adversarial target: corrupts its own interpreter state (through ctypes) while enginescope
records and dumps it (tests/live_adversarial.rs).

Usage: corrupt.py --dir DIR        (DIR holds the FIFOs `go` and `done` the test made)

Threads (OS names):
  es-bad-code    its stack's caller frame gets a code pointer into unmapped memory
  es-bad-garbage its caller frame's code pointer points at random bytes
  es-bad-lines   two code objects on its stack get a garbage line table, one with a size of 2^40
  es-churn       (phase 2) links a copy of es-bad-garbage's thread state into the thread list,
                 unmaps it while it is linked, unlinks it, over and over: a thread state freed
                 under the reader
  es-healthy     pure-Python work in es_healthy_worker() throughout: what must go on being seen
The three es-bad-* threads spin in C (PBKDF2 with the GIL released) on top of their corrupted
frames, so they are on CPU and sampled, and never run the corrupted Python code again (the
frames the C call returns to are intact; the corrupted ones are below them and are never
returned to: the call runs for hours and the test kills the process). The main thread makes
the thread-state list cyclic (its own `next`, the list's tail, points at the head), then waits.
The garbage collector is disabled: in 3.14 it walks thread stacks and the thread list.

Protocol: prints READY once every thread runs; then reads one JSON line of offsets from DIR/go
(the test takes them from enginescope's attach: tstate/frame/code field offsets), corrupts,
writes DIR/corrupted.json (the regions the test checksums to prove enginescope wrote nothing,
and each thread's native id) and DONE to DIR/done. Reading `CHURN` from DIR/go starts phase 2
(acknowledged with DONE on DIR/done once the first freed thread state has been linked).
"""
import ctypes
import gc
import hashlib
import json
import os
import sys
import threading
import time

gc.disable()

DIR = sys.argv[sys.argv.index("--dir") + 1]
api = ctypes.pythonapi
api.PyThreadState_Get.restype = ctypes.c_void_p
api.PyInterpreterState_Get.restype = ctypes.c_void_p
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

KEEP = []  # objects whose addresses were written into interpreter structures: never freed
TSTATE = {}
NATIVE = {}
ENTERED = {}


def rd(addr):
    return ctypes.c_uint64.from_address(addr).value


def wr(addr, value):
    ctypes.c_uint64.from_address(addr).value = value


def set_comm(name):
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def es_spin_in_c(name):
    """Record this thread's state, then stay on CPU in C, GIL released, for hours."""
    TSTATE[name] = api.PyThreadState_Get()
    NATIVE[name] = threading.get_native_id()
    ENTERED[name].set()
    while True:
        hashlib.pbkdf2_hmac("sha256", b"key", b"salt", (1 << 31) - 1)


def es_parked_code_unmapped():
    es_spin_in_c("es-bad-code")


def es_parked_code_garbage():
    es_spin_in_c("es-bad-garbage")


def es_lines_inner():
    es_spin_in_c("es-bad-lines")


def es_parked_lines():
    es_lines_inner()


def es_healthy_work(n):
    s = 0
    for i in range(n):
        s = (s * 31 + i) & 0xFFFF
    return s


def es_healthy_worker():
    NATIVE["es-healthy"] = threading.get_native_id()
    TSTATE["es-healthy"] = api.PyThreadState_Get()
    ENTERED["es-healthy"].set()
    while True:
        es_healthy_work(2000)


def start(name, fn):
    ENTERED[name] = threading.Event()

    def run():
        set_comm(name)
        fn()

    threading.Thread(target=run, name=name, daemon=True).start()
    ENTERED[name].wait()


CHURN_GO = threading.Event()
CHURN_LINKED = threading.Event()
OFF = {}


def es_churn():
    NATIVE["es-churn"] = threading.get_native_id()
    ENTERED["es-churn"].set()
    CHURN_GO.wait()
    victim = TSTATE["es-bad-garbage"]
    nxt = victim + OFF["tstate_next"]
    size = 1 << 14
    while True:
        fake = libc.mmap(None, size, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
        if fake in (None, ctypes.c_void_p(-1).value):
            time.sleep(0.01)
            continue
        ctypes.memmove(fake, victim, 4096)
        old = rd(nxt)
        wr(fake + OFF["tstate_next"], old)
        wr(nxt, fake)  # linked
        time.sleep(0.002)
        libc.munmap(fake, size)  # freed while linked
        CHURN_LINKED.set()
        time.sleep(0.002)
        wr(nxt, old)  # unlinked
        time.sleep(0.001)


def frame_of(tstate):
    f = rd(tstate + OFF["tstate_frame"])
    if OFF.get("cframe_current_frame") is not None and f:
        f = rd(f + OFF["cframe_current_frame"])
    return f


def code_of(frame):
    return rd(frame + OFF["frame_code"]) & ~OFF["frame_code_tag_mask"] & 0xFFFFFFFFFFFFFFFF


def caller_frame(name, top_fn, caller_fn):
    """The frame of `caller_fn` just below `top_fn` on thread `name`'s stack, checked."""
    top = frame_of(TSTATE[name])
    assert code_of(top) == id(top_fn.__code__), (name, "top frame is not", top_fn.__name__)
    prev = rd(top + OFF["frame_previous"])
    assert code_of(prev) == id(caller_fn.__code__), (name, "caller is not", caller_fn.__name__)
    return top, prev


def main():
    set_comm("es-main")
    NATIVE["es-main"] = threading.get_native_id()
    TSTATE["es-main"] = api.PyThreadState_Get()
    start("es-bad-code", es_parked_code_unmapped)
    start("es-bad-garbage", es_parked_code_garbage)
    start("es-bad-lines", es_parked_lines)
    start("es-churn", es_churn)
    start("es-healthy", es_healthy_worker)  # the newest thread: the head of the list
    print("READY", flush=True)

    with open(os.path.join(DIR, "go")) as f:
        OFF.update(json.loads(f.readline()))
    interp = api.PyInterpreterState_Get()
    regions = []
    sentinel = bytearray(os.urandom(1 << 16))
    KEEP.append(sentinel)
    regions.append(("sentinel", ctypes.addressof((ctypes.c_char * len(sentinel)).from_buffer(sentinel)), len(sentinel)))

    # A frame's code pointer into unmapped memory (page 0xdead0000000 is not mapped).
    _, f1 = caller_frame("es-bad-code", es_spin_in_c, es_parked_code_unmapped)
    wr(f1 + OFF["frame_code"], 0xDEAD0000000)
    regions.append(("frame es-bad-code", f1, 64))

    # A frame's code pointer at random bytes.
    junk = bytes(os.urandom(4096))
    KEEP.append(junk)
    _, f2 = caller_frame("es-bad-garbage", es_spin_in_c, es_parked_code_garbage)
    wr(f2 + OFF["frame_code"], id(junk) + 64)
    regions.append(("frame es-bad-garbage", f2, 64))
    regions.append(("junk", id(junk) + 32, 4000))

    # Line tables overwritten: random bytes of a plausible size, and one claiming 2^40 bytes.
    lt1 = bytes(os.urandom(512))
    lt2 = bytes(os.urandom(64))
    KEEP.extend([lt1, lt2])
    wr(id(lt2) + OFF["bytes_size"], 1 << 40)
    c1, c2 = id(es_parked_lines.__code__), id(es_lines_inner.__code__)
    caller_frame("es-bad-lines", es_spin_in_c, es_lines_inner)
    wr(c1 + OFF["code_linetable"], id(lt1))
    wr(c2 + OFF["code_linetable"], id(lt2))
    # (past each object's reference count and type)
    regions.append(("code es_parked_lines", c1 + 16, 112))
    regions.append(("code es_lines_inner", c2 + 16, 112))
    regions.append(("linetable 2^40", id(lt2) + 16, 48))

    # The thread-state list made cyclic: the tail (this, the oldest thread) points at the head.
    head = rd(interp + OFF["interp_threads_head"])
    assert head == TSTATE["es-healthy"], "the newest thread is not the list head"
    main_ts = TSTATE["es-main"]
    wr(main_ts + OFF["tstate_next"], head)
    # (prev and next only: the rest changes as the threads run)
    regions.append(("tstate es-main links", main_ts, 16))
    regions.append(("tstate es-healthy links", head, 16))

    with open(os.path.join(DIR, "corrupted.json"), "w") as f:
        json.dump({"regions": regions, "native": NATIVE, "pid": os.getpid()}, f)
    with open(os.path.join(DIR, "done"), "w") as f:
        f.write("DONE\n")

    with open(os.path.join(DIR, "go")) as f:
        cmd = f.readline().strip()
    if cmd == "CHURN":
        CHURN_GO.set()
        CHURN_LINKED.wait()
        with open(os.path.join(DIR, "done"), "w") as f:
            f.write("DONE\n")
    threading.Event().wait()


main()
