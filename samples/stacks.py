"""Ground truth for `enginescope dump`: threads parked at known Python stacks.

Every thread (the main thread included) ends up blocked in a C call (`lock.acquire()`, the main
thread `os.read()`) on a line that also held its last Python action, so its stack no longer
changes. The main thread
records every thread's stack with `sys._current_frames()` (function = co_qualname on 3.11+,
co_name on 3.10; file = co_filename; line = f_lineno), writes it to --truth as JSON, then
parks; READY on stdout comes once it has (with --spin from the spinner, which then holds the
GIL for good). Nothing here sleeps.

Threads: nested functions, a method, a closure, a generator, an asyncio coroutine, non-ASCII
function names, deep recursion, --threads N plain workers (--depth D: each D frames deep), and
with --spin one thread that runs pure Python forever (it holds the GIL).
"""
import argparse
import asyncio
import json
import os
import sys
import threading

PARK = threading.Lock()
PARK.acquire()  # never released: every acquire below blocks forever
ARRIVED = threading.Semaphore(0)
STOP = False


def set_comm(name):
    """Set this thread's OS name (what /proc/PID/task/TID/comm shows) and its Python name
    (threading), so the two agree."""
    threading.current_thread().name = name
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def qualname(code):
    return getattr(code, "co_qualname", code.co_name)


def frames_of(frame, stop_at=None):
    """Innermost first, starting at `stop_at`'s frame if given."""
    out = []
    if stop_at is not None:
        while frame is not None and frame.f_code is not stop_at:
            frame = frame.f_back
    while frame is not None:
        out.append({"function": qualname(frame.f_code), "file": frame.f_code.co_filename, "line": frame.f_lineno})
        frame = frame.f_back
    return out


# --- the parked threads' code -------------------------------------------------------------

def leaf():
    ARRIVED.release() or PARK.acquire()


def middle():
    leaf()


def outer():
    middle()


class Engine:
    def step(self):
        self._launch()

    def _launch(self):
        ARRIVED.release() or PARK.acquire()


def make_closure():
    def inner():
        ARRIVED.release() or PARK.acquire()
    return inner


def producer():
    yield 1
    yield ARRIVED.release() or PARK.acquire()


def consume():
    g = producer()
    next(g)
    next(g)


async def handler():
    ARRIVED.release() or PARK.acquire()


async def serve():
    await handler()


def run_loop():
    asyncio.run(serve())


def grüße():
    ARRIVED.release() or PARK.acquire()


def 函数():
    grüße()


def recurse(n):
    if n == 0:
        ARRIVED.release() or PARK.acquire()
    recurse(n - 1)


# With --spin the spinner says READY, once the main thread is parked: a READY printed by the
# main thread before it parks left a moment in which the GIL was the main thread's (or nobody's,
# the spinner not yet woken) while a dump could already look: holds_gil read false for the
# spinner when the machine was busy.
ANNOUNCE = False
PARK_R, PARK_W = os.pipe()  # the main thread parks reading PARK_R (nothing is ever written)


def main_parked():
    """Whether the main thread is blocked reading PARK_R (its GIL released for good)."""
    path = "/proc/self/task/%d/syscall" % threading.main_thread().native_id
    with open(path) as f:
        fields = f.read().split()
    return len(fields) > 1 and fields[0] == "0" and int(fields[1], 16) == PARK_R


def announce():
    """Print READY once the main thread is parked (called once, from the spinner's loop)."""
    global ANNOUNCE
    while not main_parked():
        pass
    ANNOUNCE = False
    print("READY", flush=True)


def spin():
    # One line, every instruction of it on that line on 3.10-3.15 (`while not STOP: ANNOUNCE and
    # announce()` compiles a jump with no line, and a dump that met the thread there read none).
    while not (STOP or (ANNOUNCE and announce())): pass


def worker():
    ARRIVED.release() or PARK.acquire()


def thread_main(name, target, args=()):
    set_comm(name)
    target(*args)


# --- the main thread -----------------------------------------------------------------------

def write_truth(path, threads, spinner):
    current = sys._current_frames()
    by_ident = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in current.items():
        t = by_ident.get(ident)
        if t is None:
            continue
        if t is threading.main_thread():
            frames = frames_of(frame, stop_at=finish.__code__)
        else:
            frames = frames_of(frame)
        out.append({
            "native_id": t.native_id,
            "name": threads.get(ident, "es-main"),
            "holds_gil": spinner is not None and ident == spinner.ident,
            "gc_collecting": False,
            "frames": frames,
        })
    doc = {"pid": os.getpid(), "version": sys.version, "threads": out}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def finish(path, threads, spinner):
    write_truth(path, threads, spinner) or set_announce(spinner) or os.read(PARK_R, 1)


def set_announce(spinner):
    """READY: now from the main thread, or with a spinner from it once this thread parks."""
    global ANNOUNCE
    if spinner is None:
        print("READY", flush=True)
    else:
        ANNOUNCE = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", required=True)
    ap.add_argument("--threads", type=int, default=4, help="extra plain worker threads")
    ap.add_argument("--spin", action="store_true", help="one thread running pure Python forever")
    ap.add_argument("--depth", type=int, default=0,
                    help="each plain worker parks DEPTH frames deep in recurse() (0: in worker())")
    args = ap.parse_args()
    if args.depth:
        sys.setrecursionlimit(max(sys.getrecursionlimit(), args.depth + 100))
    set_comm("es-main")
    specs = [
        ("es-nested", outer, ()),
        ("es-method", Engine().step, ()),
        ("es-closure", make_closure(), ()),
        ("es-generator", consume, ()),
        ("es-asyncio", run_loop, ()),
        ("es-unicode", 函数, ()),
        ("es-recurse", recurse, (40,)),
    ] + [("es-worker-%d" % i, recurse, (args.depth,)) if args.depth else
         ("es-worker-%d" % i, worker, ()) for i in range(args.threads)]
    names = {}
    for name, target, targs in specs:
        t = threading.Thread(target=thread_main, args=(name, target, targs), name=name, daemon=True)
        t.start()
        names[t.ident] = name
    for _ in specs:
        ARRIVED.acquire()
    spinner = None
    if args.spin:
        spinner = threading.Thread(target=thread_main, args=("es-spin", spin), name="es-spin", daemon=True)
        spinner.start()
        names[spinner.ident] = "es-spin"
    # Each worker released ARRIVED on its park line, so its stack is final. The spinner's stack
    # is final once it runs spin(); wait for that by looking, not by sleeping.
    while spinner is not None:
        f = sys._current_frames().get(spinner.ident)
        if f is not None and f.f_code is spin.__code__:
            break
    finish(args.truth, names, spinner)


if __name__ == "__main__":
    main()
