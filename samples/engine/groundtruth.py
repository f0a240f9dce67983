"""In-process timings that a profiler is compared with: calls of the named functions, GC pauses,
and the truth file each process writes at exit.

Every timestamp is time.monotonic_ns(): CLOCK_MONOTONIC, the clock of the profiler's own
events (on Linux time.perf_counter_ns() reads the same clock)."""
import gc
import json
import os
import sys
import threading
import time
from array import array

mono = time.monotonic_ns
tcpu = time.thread_time_ns

SCHEMA = "enginescope-sample-engine/1"


class CallLog:
    """Calls of one function, appended by the one thread that calls it: start (monotonic ns),
    wall ns, thread-CPU ns. The first `cap` calls are kept; `calls_total` counts them all."""

    def __init__(self, qualname, func, role_note, cap):
        self.qualname = qualname
        code = getattr(func, "__code__", None)
        self.name = code.co_name if code else qualname.rsplit(".", 1)[-1]
        self.file = code.co_filename if code else None
        self.line = code.co_firstlineno if code else None
        self.note = role_note
        self.cap = cap
        self.starts = array("q")
        self.walls = array("q")
        self.cpus = array("q")
        self.calls_total = 0
        self.thread = None  # native id of the caller (set on the first call)
        # The same calls timed inside the callee (first statement to last), where a probe
        # times them; only for functions that report it (shm_broadcast.MessageQueue).
        self.body_starts = array("q")
        self.body_walls = array("q")
        # Items per call, where the caller says (add(..., items=n)); one per kept call.
        self.items = array("q")

    def add(self, t0, t1, c0, c1, items=None):
        """One call; `items`: how many items it handled (records of a message), where its cost
        may grow with them."""
        self.calls_total += 1
        if self.thread is None:
            self.thread = threading.get_native_id()
        if len(self.starts) < self.cap:
            self.starts.append(t0)
            self.walls.append(t1 - t0)
            self.cpus.append(c1 - c0)
            if items is not None:
                self.items.append(items)

    def add_body(self, t0, t1):
        if len(self.body_starts) < self.cap:
            self.body_starts.append(t0)
            self.body_walls.append(t1 - t0)

    def doc(self, start, end, list_cap):
        idx = [i for i, t in enumerate(self.starts) if start <= t < end]
        body = sorted(w for t, w in zip(self.body_starts, self.body_walls) if start <= t < end)
        walls = sorted(self.walls[i] for i in idx)
        cpus = sorted(self.cpus[i] for i in idx)
        rows = [[self.starts[i], self.walls[i], self.cpus[i]] for i in idx[:list_cap]]
        return {
            "qualname": self.qualname,
            "name": self.name,
            "file": self.file,
            "firstlineno": self.line,
            "what": self.note,
            "thread_native_id": self.thread,
            "calls_total": self.calls_total,
            "calls_kept": len(self.starts),
            "calls": len(idx),
            "wall_ns": summary(walls),
            # Timed inside the call, where a probe times it (absent where not measured).
            **({"body_wall_ns": summary(body), "body_calls": len(body)} if body else {}),
            "cpu_ns": summary(cpus),
            # Wall and thread-CPU time per item handled (least squares over the window's
            # calls), where known.
            **({"per_item": per_item([(self.items[i], self.walls[i]) for i in idx]),
                "per_item_cpu": per_item([(self.items[i], self.cpus[i]) for i in idx])}
               if len(self.items) == len(self.starts) and idx else {}),
            "columns": ["start_ns", "wall_ns", "cpu_ns"],
            "list": rows,
            "list_truncated": len(idx) > list_cap,
        }


def per_item(points, min_calls=5):
    """Time per item handled: the median of the calls with each item count (of those with at
    least `min_calls` calls), a least-squares line through those medians: {slope_ns,
    intercept_ns, r, calls, counts, items_min, items_max, items_mean}. Medians, because a
    collection of the whole heap now and then lands inside a call and its 50 ms would outweigh
    every record. slope and r are None where fewer than three item counts qualify."""
    by = {}
    for items, t in points:
        by.setdefault(items, []).append(t)
    med = [(k, sorted(v)[(len(v) - 1) // 2]) for k, v in sorted(by.items()) if len(v) >= min_calls]
    xs = [p[0] for p in points]
    out = {"slope_ns": None, "intercept_ns": None, "r": None, "calls": len(points),
           "counts": len(med), "items_min": min(xs), "items_max": max(xs),
           "items_mean": round(sum(xs) / len(xs), 2)}
    if len(med) < 3:
        return out
    n = len(med)
    mx = sum(x for x, _ in med) / n
    my = sum(y for _, y in med) / n
    sxx = sum((x - mx) ** 2 for x, _ in med)
    syy = sum((y - my) ** 2 for _, y in med)
    sxy = sum((x - mx) * (y - my) for x, y in med)
    if sxx <= 0:
        return out
    slope = sxy / sxx
    out.update(slope_ns=round(slope, 1), intercept_ns=round(my - slope * mx, 1),
               r=None if syy <= 0 else round(sxy / (sxx * syy) ** 0.5, 4))
    return out


def percentile(sorted_xs, p):
    """Nearest-rank percentile of an ascending list (p in 0..100)."""
    if not sorted_xs:
        return None
    k = max(0, min(len(sorted_xs) - 1, int(-(-p * len(sorted_xs) // 100)) - 1))
    return sorted_xs[k]


def summary(sorted_xs):
    if not sorted_xs:
        return {"count": 0, "total": 0, "mean": None, "p50": None, "p90": None, "p99": None,
                "max": None, "min": None}
    total = sum(sorted_xs)
    return {
        "count": len(sorted_xs),
        "total": total,
        "mean": round(total / len(sorted_xs), 1),
        "min": sorted_xs[0],
        "p50": percentile(sorted_xs, 50),
        "p90": percentile(sorted_xs, 90),
        "p99": percentile(sorted_xs, 99),
        "max": sorted_xs[-1],
    }


class GcMonitor:
    """Every collection of this process through gc.callbacks: the start callback's clock read to
    the stop callback's, the generation, and the thread that ran it (whichever allocated)."""

    def __init__(self, cap=200000):
        self.cap = cap
        self.rows = []  # (start_ns, dur_ns, generation, native_id, collected, cpu_ns,
        #              stop_callback_end_ns)
        self.total_pauses = 0
        self._t0 = 0
        self._c0 = 0

    def install(self):
        rows = self.rows
        cap = self.cap
        native_id = threading.get_native_id

        def on_gc(phase, info):
            t = mono()
            if phase == "start":
                self._t0 = t
                self._c0 = tcpu()
                return
            c = tcpu()
            self.total_pauses += 1
            if len(rows) < cap:
                row = (self._t0, t - self._t0, info["generation"], native_id(),
                       info.get("collected", 0), c - self._c0)
                # The stop callback's last clock read: its own calls above are points where
                # the interpreter hands the GIL to a thread that asked for it, so the collector
                # (its function, as a probe on it sees it) can return milliseconds after `t`.
                rows.append(row + (mono(),))

        self._cb = on_gc
        gc.callbacks.append(on_gc)

    def doc(self, start, end, list_cap):
        by_gen = {}
        inwin = [r for r in self.rows if start <= r[0] < end]
        for g in (0, 1, 2):
            by_gen[str(g)] = {"count": 0, "total_ns": 0, "max_ns": 0, "cpu_ns": 0}
        for r in inwin:
            d = by_gen.setdefault(str(r[2]), {"count": 0, "total_ns": 0, "max_ns": 0,
                                              "cpu_ns": 0})
            d["count"] += 1
            d["total_ns"] += r[1]
            d["max_ns"] = max(d["max_ns"], r[1])
            d["cpu_ns"] += r[5]
        wall = max(end - start, 1)
        for d in by_gen.values():
            d["share_of_wall"] = round(d["total_ns"] / wall, 6)
            d["cpu_share_of_wall"] = round(d["cpu_ns"] / wall, 6)
        by_thread = {}
        for r in inwin:
            t = by_thread.setdefault(r[3], {"native_id": r[3], "count": 0, "total_ns": 0})
            t["count"] += 1
            t["total_ns"] += r[1]
        return {
            "thresholds": list(gc.get_threshold()),
            "freeze_count": gc.get_freeze_count() if hasattr(gc, "get_freeze_count") else None,
            "tracked_objects": len(gc.get_objects()),
            "by_generation": by_gen,
            "gen2_share_of_wall": by_gen["2"]["share_of_wall"],
            "share_of_wall": round(sum(d["total_ns"] for d in by_gen.values()) / wall, 6),
            "by_thread": list(by_thread.values()),
            "pauses_total_lifetime": self.total_pauses,
            "pause_columns": ["start_ns", "dur_ns", "generation", "native_id", "collected",
                              "cpu_ns", "stop_callback_end_ns"],
            "pauses": [list(r) for r in inwin[:list_cap]],
            "pauses_truncated": len(inwin) > list_cap,
        }


def base_doc(role, config, window, clock_note=None):
    return {
        "schema": SCHEMA,
        "role": role,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "switch_interval_s": sys.getswitchinterval(),
        "fixed": sorted(config["fix"]),
        "config": config,
        "window": {"start_mono_ns": window[0], "end_mono_ns": window[1]},
    }


def write_truth(directory, role, doc):
    path = os.path.join(directory, "%s-%d.json" % (role, os.getpid()))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return path
