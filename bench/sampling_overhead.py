#!/usr/bin/env python3
"""What sampling costs: enginescope `record` against py-spy 0.4.3 and Austin 3.7 at 100 and 1000 Hz.

Usage: bench/sampling_overhead.py [--python PY] [--rounds N] [--duration S] [--rates 100,1000]
                                  [--enginescope BIN] [--peers VENV] [--quick]
                                  [--append-doc docs/benchmarks.md] [--json OUT]

For every run, a fresh samples/cpu_bound.py (4 threads of pure-Python work, GIL-bound, so one
core) starts and prints READY; the profiler is started right after READY and samples it for
--duration seconds; the target's own window is --duration + --slack seconds, so it covers the
profiler's whole life. Per run it measures:
  * slowdown: the target's throughput while the profiler ran (the target logs its progress on
    CLOCK_MONOTONIC every 0.1 s; this script takes the profiler's spawn and exit on the same
    clock and interpolates), against the mean throughput of the same round's baseline runs (no
    profiler; first --duration seconds of the window; --baselines per round, default 2);
  * profiler CPU seconds per wall second, spawn to exit (os.wait4 rusage: user + system);
  * profiler max RSS (ru_maxrss, via GNU time so that this script's RSS at fork is not counted);
  * samples and errors as the profiler reports them, and the CPU the rest of the machine used
    during the target's window (/proc/stat busy time minus target and profiler): noise.
  * the target's CPU time per unit of work over the same span (schedstat of all its threads;
    use --threads 1, else GIL hand-offs dominate it), and from it a CPU cost: profiler CPU s/s
    plus the target's extra CPU s/s against its round's baselines;
  * for enginescope, its BPF programs' run time (ENGINESCOPE_BPF_STATS=1, `bpf_prog_run_ns`
    in the recording's counters): cost A = profiler CPU + BPF run time, per second;
  * the share of wall time the target's workers were stopped, neither running nor runnable
    (schedstat): a profiler's ptrace pauses (py-spy --native), with --threads 1.
Ratios between configs are also taken per round (each round's pair of runs) and summarized.
Before each run it waits until the rest of the machine is quiet (--quiet cores, default 0.2,
over one second); a run during which the rest used more is discarded and run again (--retries).
Configs run interleaved: each round runs every config once in a shuffled order (seeded), so
slow drift of the machine spreads over all of them. A control config runs `sleep D` in the
profiler's place: its slowdown should be zero, and its spread is the noise floor. Reported:
medians over rounds, the slowdown's interquartile range, and cost = slowdown + profiler CPU/s,
as a ratio of each peer's cost to enginescope's (n/a where enginescope's slowdown IQR contains
zero: a ratio to noise means nothing), and the ratio of profiler CPU alone.
--from-json re-summarizes a saved run without running anything.

If the enginescope binary is missing or its `record` fails, that config is reported as
unavailable with the error and the peers are still measured. A config that fails once is not
run again. Peers missing from --peers are installed there (python3 -m venv; pip install
py-spy==0.4.3 'austin-dist<4').

Commands run (RATE in Hz, D = --duration, whole seconds):
  enginescope record --pid PID --duration D --rate RATE -o OUT [--native]
  py-spy record --native --pid PID --rate RATE --duration D --format raw -o OUT
  py-spy record --pid PID --rate RATE --duration D --format raw -o OUT
  py-spy record --nonblocking --pid PID --rate RATE --duration D --format raw -o OUT
  austin -i <1e6/RATE> -p PID -x D -o OUT          (interval in microseconds)
"""
import argparse
import datetime
import hashlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "samples/cpu_bound.py")
CLK_TCK = os.sysconf("SC_CLK_TCK")
GNU_TIME = "/usr/bin/time"


# --- configs ---------------------------------------------------------------------------------

class Config:
    def __init__(self, name, tool, rate, argv_fn, env=None):
        self.name = name
        self.env = env or {}  # extra environment for the profiler
        self.tool = tool  # "none", "idle process (control)", "enginescope", "py-spy", ...
        self.rate = rate
        self.argv_fn = argv_fn  # (pid, duration, out) -> argv, or None for the baseline
        self.error = None  # set when unavailable or failed; the config is then skipped

    def __repr__(self):
        return self.name


def build_configs(args):
    pyspy = os.path.join(args.peers, "bin/py-spy")
    austin = os.path.join(args.peers, "bin/austin")
    # The control runs a process that does nothing for the profiler's duration: its "slowdown"
    # is what this method reads when nothing samples (noise, and any bias of the intervals).
    configs = [Config("none", "none", None, None),
               Config("idle process (control)", "idle process (control)", None,
                      lambda pid, d, out: ["sleep", str(d)])]
    for rate in args.rates:
        configs += [
            Config("enginescope @%d" % rate, "enginescope", rate,
                   lambda pid, d, out, r=rate: [args.enginescope, "record", "--pid", str(pid), "--duration", str(d),
                                                "--rate", str(r), "-o", out]),
            # Its parts, to see where a cost lands: sampling alone (what Austin and py-spy do),
            # and the defaults with the kernel's BPF run-time statistics left off.
            Config("enginescope sampling only @%d" % rate, "enginescope sampling only", rate,
                   lambda pid, d, out, r=rate: [args.enginescope, "record", "--pid", str(pid), "--duration", str(d),
                                                "--rate", str(r), "-o", out, "--no-offcpu", "--no-gil", "--no-gc"]),
            Config("enginescope no BPF stats @%d" % rate, "enginescope no BPF stats", rate,
                   lambda pid, d, out, r=rate: [args.enginescope, "record", "--pid", str(pid), "--duration", str(d),
                                                "--rate", str(r), "-o", out],
                   env={"ENGINESCOPE_BPF_STATS": "0"}),
            Config("enginescope --native @%d" % rate, "enginescope --native", rate,
                   lambda pid, d, out, r=rate: [args.enginescope, "record", "--pid", str(pid), "--duration", str(d),
                                                "--rate", str(r), "-o", out, "--native"]),
            Config("py-spy --native @%d" % rate, "py-spy --native", rate,
                   lambda pid, d, out, r=rate: [pyspy, "record", "--native", "--pid", str(pid), "--rate", str(r),
                                                "--duration", str(d), "--format", "raw", "-o", out]),
            Config("py-spy @%d" % rate, "py-spy", rate,
                   lambda pid, d, out, r=rate: [pyspy, "record", "--pid", str(pid), "--rate", str(r),
                                                "--duration", str(d), "--format", "raw", "-o", out]),
            Config("py-spy --nonblocking @%d" % rate, "py-spy --nonblocking", rate,
                   lambda pid, d, out, r=rate: [pyspy, "record", "--nonblocking", "--pid", str(pid),
                                                "--rate", str(r), "--duration", str(d), "--format", "raw",
                                                "-o", out]),
            Config("austin @%d" % rate, "austin", rate,
                   lambda pid, d, out, r=rate: [austin, "-i", str(1000000 // r), "-p", str(pid), "-x", str(d),
                                                "-o", out]),
        ]
    # py-spy --native at its default rate (100 Hz): what its pauses cost as people run it.
    configs.append(Config("py-spy --native (default rate)", "py-spy --native (default rate)", 100,
                          lambda pid, d, out: [pyspy, "record", "--native", "--pid", str(pid), "--duration", str(d),
                                               "--format", "raw", "-o", out]))
    return configs


def ensure_peers(venv):
    need = [p for p in ("bin/py-spy", "bin/austin") if not os.access(os.path.join(venv, p), os.X_OK)]
    if not need:
        return
    print("installing peers into %s (missing: %s)" % (venv, ", ".join(need)), file=sys.stderr)
    if not os.path.exists(os.path.join(venv, "bin/pip")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin/pip"), "install", "py-spy==0.4.3", "austin-dist<4"], check=True)


def check_enginescope(config, binary):
    if not os.access(binary, os.X_OK):
        config.error = "%s not found (cargo build --release)" % binary
        return
    r = subprocess.run([binary, "record", "--help"], capture_output=True, text=True)
    if r.returncode != 0:
        config.error = "`enginescope record --help` failed: %s" % last_line(r.stderr or r.stdout)


def freeze_enginescope(args, workdir):
    """Copies the binary into the work directory and runs the copy, so that a rebuild during the
    benchmark does not change what is measured. Returns a description of the build, or None."""
    if not os.access(args.enginescope, os.X_OK):
        return None
    built = datetime.datetime.fromtimestamp(os.path.getmtime(args.enginescope), datetime.timezone.utc)
    copy = os.path.join(workdir, "enginescope")
    shutil.copy2(args.enginescope, copy)
    with open(copy, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    args.enginescope = copy
    return "binary built %s, sha256 %s, tree at %s%s" % (built.strftime("%Y-%m-%d %H:%M UTC"), digest, head,
                                                          " with uncommitted changes" if dirty else "")


def last_line(text):
    """The line that says what went wrong: the first one that starts with "error", else the last."""
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    for l in lines:
        if l.lower().startswith(("error", "py-spy> error")):
            return l
    return lines[-1] if lines else "(no output)"


# --- measuring one run -------------------------------------------------------------------------

# Seconds after a profiler's start from which its CPU counts as steady state.
STEADY_AFTER_S = 2.0


def proc_cpu_ticks(pid):
    """utime + stime of a live process, in clock ticks."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def machine_busy_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]  # all but idle and iowait


def target_cpu_ns(pid):
    """CPU time of every thread of a live process, ns (schedstat: exact, not in ticks). This
    kernel has no IRQ time accounting, so the BPF programs that run on the target's samples
    and context switches are charged to it too."""
    total = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def workers_run_wait_ns(pid):
    """(on-CPU ns, runnable-but-waiting ns) summed over the target's worker threads
    (`cpu-worker-K`). A worker that never sleeps is always one of the two, unless it is
    stopped: wall time minus both is the time a profiler held it stopped (ptrace), whatever
    other load on the machine does (that only moves time from running to waiting)."""
    run = wait = n = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                if not f.read().startswith("cpu-worker"):
                    continue
            with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                v = f.read().split()
            run, wait, n = run + int(v[0]), wait + int(v[1]), n + 1
        except (OSError, ValueError, IndexError):
            pass
    return run, wait, n


class CpuLog(threading.Thread):
    """Logs (CLOCK_MONOTONIC ns, target CPU ns) and the workers' run and wait time every 50 ms
    until the target exits."""
    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.log, self.workers, self.stop = pid, [], [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                t = time.monotonic_ns()
                self.log.append((t, target_cpu_ns(self.pid)))
                self.workers.append((t,) + workers_run_wait_ns(self.pid))
            except OSError:
                return
            self.stop.wait(0.05)


def tree_cpu_ticks(pid):
    """utime + stime of a live process and every live descendant, in clock ticks (the
    profiler runs under GNU time, and may fork helpers)."""
    total, todo, seen = 0, [pid], set()
    while todo and len(seen) < 256:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            total += proc_cpu_ticks(p)
            for tid in os.listdir("/proc/%d/task" % p):
                with open("/proc/%d/task/%s/children" % (p, tid)) as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


class ProfilerCpuLog(threading.Thread):
    """Logs (CLOCK_MONOTONIC ns, CPU ticks of the profiler's process tree) every 100 ms until
    stopped: its CPU in steady state, start-up and exit left out."""
    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.log, self.stop = pid, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.log.append((time.monotonic_ns(), tree_cpu_ticks(self.pid)))
            self.stop.wait(0.1)

    def rate(self, a, b):
        """CPU s/s between the first entry at or after a and the last at or before b (ns)."""
        inside = [e for e in self.log if a <= e[0] <= b]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1e9:
            return None
        (ta, ca), (tb, cb) = inside[0], inside[-1]
        return (cb - ca) / CLK_TCK / ((tb - ta) / 1e9)


def interp(series, t):
    for (ta, va), (tb, vb) in zip(series, series[1:]):
        if ta <= t <= tb:
            return va + (vb - va) * (t - ta) / (tb - ta) if tb > ta else va
    raise ValueError("time outside the series")


def throughput(progress, t0, t1):
    """Units per second between t0 and t1 (ns), interpolating the target's progress log."""
    def at(t):
        for (ta, na), (tb, nb) in zip(progress, progress[1:]):
            if ta <= t <= tb:
                return na + (nb - na) * (t - ta) / (tb - ta) if tb > ta else na
        raise ValueError("time outside the target's window")
    return (at(t1) - at(t0)) / ((t1 - t0) / 1e9)


def profiler_report(config, stderr_text, out_path):
    """(samples, errors) as the profiler reports them; None where it does not say."""
    samples = errors = None
    if config.tool.startswith("enginescope"):
        m = re.search(r"\((\d+) samples, .*?(\d+) lost\)", stderr_text)
        if m:
            samples, errors = int(m.group(1)), int(m.group(2))
    elif config.tool.startswith("py-spy"):
        m = re.search(r"Samples: (\d+) Errors: (\d+)", stderr_text)
        if m:
            samples, errors = int(m.group(1)), int(m.group(2))
    elif config.tool == "austin":
        plain = re.sub(r"\x1b\[[0-9;]*m", "", stderr_text)
        m = re.search(r"Error rate : (\d+)/(\d+)", plain)
        if m:
            errors, samples = int(m.group(1)), int(m.group(2))
    return samples, errors


def wait_for_quiet(threshold, timeout):
    """Waits until the rest of the machine uses at most `threshold` cores over one second (other
    people's builds on a 2-core VM swamp any overhead measurement). Returns the load seen last;
    gives up after `timeout` seconds and lets the run go ahead (its other-CPU figure shows it)."""
    give_up = time.monotonic() + timeout
    while True:
        b0, t0 = machine_busy_ticks(), time.monotonic()
        time.sleep(1.0)
        load = (machine_busy_ticks() - b0) / CLK_TCK / (time.monotonic() - t0)
        if load <= threshold or time.monotonic() > give_up:
            return load


def spawn_measured(argv, log_path, rss_path, env=None):
    """Starts argv under GNU time, which forks it from a small process. ru_maxrss of a forked
    child counts the parent's RSS at fork (the kernel carries the pre-exec high-water mark over
    exec), so this script's own ~16 MiB would be reported for every profiler otherwise."""
    if os.access(GNU_TIME, os.X_OK):
        argv = [GNU_TIME, "-f", "%M", "-o", rss_path] + argv
    log = open(log_path, "w")
    try:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        log.close()


def read_maxrss_mib(rss_path, ru):
    try:
        with open(rss_path) as f:
            return int(f.read().split()[-1]) / 1024  # GNU time prints KiB
    except (OSError, ValueError, IndexError):
        return ru.ru_maxrss / 1024  # includes this script's RSS at fork: an upper bound


def run_once(args, config, workdir, index):
    window = args.duration + args.slack
    rec = {"config": config.name, "tool": config.tool, "rate": config.rate}
    rec["quiet_before"] = round(wait_for_quiet(args.quiet, args.quiet_timeout), 3)
    target = subprocess.Popen([args.python, TARGET, "--threads", str(args.threads), "--duration", str(window)],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = target.stdout.readline().strip()
        if line != "READY":
            raise RuntimeError("target did not print READY (got %r)" % line)
        t_ready, busy0, tgt0 = time.monotonic_ns(), machine_busy_ticks(), proc_cpu_ticks(target.pid)
        cpulog = CpuLog(target.pid)
        cpulog.start()
        prof_cpu = 0.0
        if config.argv_fn is not None:
            out = os.path.join(workdir, "run%d.out" % index)
            log_path = os.path.join(workdir, "run%d.log" % index)
            rss_path = os.path.join(workdir, "run%d.rss" % index)
            argv = config.argv_fn(target.pid, args.duration, out)
            rec["argv"] = argv
            t_spawn = time.monotonic_ns()
            env = None
            if config.tool.startswith("enginescope"):
                # The kernel times enginescope's BPF programs (run in the target's context).
                env = dict(os.environ, ENGINESCOPE_BPF_STATS="1")
            if config.env:
                env = dict(env or os.environ, **config.env)
            prof = spawn_measured(argv, log_path, rss_path, env)
            plog = ProfilerCpuLog(prof.pid)
            plog.start()
            # A profiler that hangs is killed once the target's window is over, plus 10 s.
            killer = threading.Timer(window + 10, prof.kill)
            killer.start()
            _, status, ru = os.wait4(prof.pid, 0)
            t_exit = time.monotonic_ns()
            killer.cancel()
            plog.stop.set()
            plog.join()
            # Steady state: from STEADY_AFTER_S after the start to 0.3 s before the end the
            # profiler was asked for (start-up and exit left out).
            steady = plog.rate(t_spawn + int(STEADY_AFTER_S * 1e9), t_spawn + int((args.duration - 0.3) * 1e9))
            if steady is not None:
                rec["steady_cpu_per_s"] = steady
            prof.returncode = os.waitstatus_to_exitcode(status)
            with open(log_path, errors="replace") as f:
                log_text = f.read()
            wall = (t_exit - t_spawn) / 1e9
            prof_cpu = ru.ru_utime + ru.ru_stime
            rec.update({
                "rc": prof.returncode,
                "spawn_mono_ns": t_spawn, "exit_mono_ns": t_exit, "wall_s": round(wall, 4),
                "cpu_s": round(prof_cpu, 4),
                "cpu_per_s": prof_cpu / wall,
                "maxrss_mib": read_maxrss_mib(rss_path, ru),
                "out_bytes": os.path.getsize(out) if os.path.exists(out) else None,
            })
            rec["samples"], rec["errors"] = profiler_report(config, log_text, out)
            if config.tool.startswith("enginescope") and prof.returncode == 0:
                rep = subprocess.run([argv[0], "report", "-f", "json", out], capture_output=True, text=True)
                try:
                    counters = json.loads(rep.stdout).get("counters", {})
                    if "bpf_prog_run_ns" in counters:
                        rec["bpf_cpu_s"] = counters["bpf_prog_run_ns"] / 1e9
                        rec["bpf_cpu_per_s"] = rec["bpf_cpu_s"] / wall
                        rec["bpf_runs"] = counters.get("bpf_prog_runs")
                    if "native_symbol_load_total_ms" in counters:
                        # One-time: reading the target's symbol tables (part of cpu_s).
                        rec["symbol_load_s"] = counters["native_symbol_load_total_ms"] / 1e3
                except ValueError:
                    pass
            if prof.returncode != 0:
                # GNU time adds "Command exited with non-zero status N" after the tool's own words.
                words = [l for l in log_text.splitlines() if not l.startswith("Command exited with")]
                rec["error"] = "exit %d: %s" % (prof.returncode, last_line("\n".join(words)))
        result_line = target.stdout.readline()
        cpulog.stop.set()
        cpulog.join()
        _, status, tru = os.wait4(target.pid, 0)
        target.returncode = os.waitstatus_to_exitcode(status)
        t_end, busy1 = time.monotonic_ns(), machine_busy_ticks()
        if target.returncode != 0 or not result_line.strip():
            raise RuntimeError("target failed (exit %s)" % target.returncode)
        # CPU the rest of the machine used while the target's window ran: a noise indicator.
        target_cpu = tru.ru_utime + tru.ru_stime - tgt0 / CLK_TCK
        other = (busy1 - busy0) / CLK_TCK - target_cpu - prof_cpu
        rec["other_cpu_per_s"] = max(other, 0.0) / ((t_end - t_ready) / 1e9)
        res = json.loads(result_line)
        prog = res["progress"]
        rec["window_iter_per_s"] = res["iterations_per_s"]
        span = None
        if config.argv_fn is None:
            t0 = prog[0][0]
            span = (t0, t0 + int(args.duration * 1e9))
        elif "error" not in rec:
            end = prog[-1][0]
            if rec["exit_mono_ns"] > end:
                rec["outlived_s"] = (rec["exit_mono_ns"] - end) / 1e9
            span = (max(rec["spawn_mono_ns"], prog[0][0]), min(rec["exit_mono_ns"], end))
        if span is not None:
            rec["iter_per_s"] = throughput(prog, *span)
            # The target's CPU per unit of work over the same span: what sampling adds to the
            # target's own work (BPF programs, cache disturbance), unlike throughput not moved
            # by other load on the machine taking the target's core away.
            lo, hi = max(span[0], cpulog.log[0][0]), min(span[1], cpulog.log[-1][0])
            if hi > lo:
                units = throughput(prog, lo, hi) * (hi - lo) / 1e9
                cpu = interp(cpulog.log, hi) - interp(cpulog.log, lo)
                rec["target_cpu_per_s"] = cpu / (hi - lo)
                rec["target_cpu_ns_per_unit"] = cpu / units if units > 0 else None
            # The share of wall time the workers were stopped (neither running nor runnable):
            # a profiler's pauses. Only meaningful with --threads 1 (several workers also wait
            # for the GIL, asleep).
            w = [x for x in cpulog.workers if lo <= x[0] <= hi and x[3] > 0]
            if len(w) >= 2 and w[-1][3] == w[0][3] and w[-1][0] > w[0][0]:
                a, b = w[0], w[-1]
                wall = (b[0] - a[0]) * b[3]
                rec["stopped_frac"] = 1 - ((b[1] - a[1]) + (b[2] - a[2])) / wall
        return rec
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()


# --- report ------------------------------------------------------------------------------------

def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def quartiles(values):
    return statistics.quantiles(values, n=4, method="inclusive")


def iqr_text(values):
    """Interquartile range of fractions, as percent."""
    if len(values) < 2:
        return "–"
    q = quartiles(values)
    return "%.1f to %.1f" % (100 * q[0], 100 * q[2])


def fmt(v, spec, none="–"):
    return none if v is None else format(v, spec)


def summarize(configs, records, args):
    discarded = [r for r in records if r.get("discarded")]
    records = [r for r in records if not r.get("discarded")]
    base = [r["iter_per_s"] for r in records if r["tool"] == "none"]
    base_med = med(base)
    if base_med is None:
        return "no baseline runs succeeded\n"
    # The machine's speed drifts over minutes, so each run is compared with the mean of the
    # baselines of its own round (a round takes a few minutes), not with a global median.
    ref = {}
    for r in records:
        if r["tool"] == "none":
            ref.setdefault(r["round"], []).append(r["iter_per_s"])
    ref = {k: statistics.mean(v) for k, v in ref.items()}
    rows = []
    for c in configs:
        runs = [r for r in records if r["config"] == c.name and "error" not in r]
        slow = [1 - r["iter_per_s"] / ref.get(r["round"], base_med) for r in runs]
        row = {
            "config": c, "n": len(runs), "error": c.error,
            "slowdown": med(slow), "iqr": iqr_text(slow),
            "within_noise": len(slow) >= 2 and quartiles(slow)[0] <= 0 <= quartiles(slow)[2], "cpu_per_s": med([r.get("cpu_per_s") for r in runs]),
            "maxrss_mib": med([r.get("maxrss_mib") for r in runs]),
            "samples": med([r.get("samples") for r in runs]), "errors": med([r.get("errors") for r in runs]),
            "other_cpu_per_s": med([r["other_cpu_per_s"] for r in runs]),
            "notes": [],
        }
        outlived = [r["outlived_s"] for r in runs if "outlived_s" in r]
        if outlived:
            row["notes"].append("outlived the target's window in %d runs, by up to %.2f s" % (len(outlived), max(outlived)))
        noisy = sum(1 for r in runs if r["other_cpu_per_s"] > args.quiet)
        if noisy:
            row["notes"].append("%d kept after %d noisy reruns" % (noisy, args.retries))
        row["cost"] = None if row["slowdown"] is None or row["cpu_per_s"] is None else row["slowdown"] + row["cpu_per_s"]
        rows.append(row)

    lines = ["Baseline (no profiler): median %.0f units/s over the first %d s of the window; %d runs, "
             "min %.0f, max %.0f (spread %.1f%% of the median). Slowdowns compare each run with the mean "
             "baseline of its own round; the baseline row shows the baselines against that mean (the noise), "
             "the control row a process that does nothing (noise plus any bias of the method)."
             % (base_med, args.duration, len(base), min(base), max(base), 100 * (max(base) - min(base)) / base_med), ""]
    if discarded:
        lines += ["%d runs were discarded and rerun because the rest of the machine used more than %.2f cores "
                  "during them." % (len(discarded), args.quiet), ""]
    lines.append("| profiler | rate Hz | target slowdown % (median) | slowdown IQR | profiler CPU s/s "
                 "| cost (slowdown + CPU/s) | cost / enginescope's | CPU / enginescope's | profiler max RSS MiB "
                 "| samples reported | errors reported | other CPU s/s | runs |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    es_rows = {r["config"].rate: r for r in rows if r["config"].tool == "enginescope" and r["n"]}
    for row in rows:
        c = row["config"]
        rate = "–" if c.rate is None else str(c.rate)
        if row["error"] and row["n"] == 0:
            lines.append("| %s | %s | unavailable: %s | | | | | | | | | | 0 |" % (c.tool, rate, row["error"].replace("|", "/")))
            continue
        es = es_rows.get(c.rate)
        ratio = cpu_ratio = "–"
        if c.rate is not None and row["cost"] is not None:
            if es is None:
                ratio = cpu_ratio = "n/a (no enginescope row)"
            else:
                cpu_ratio = "%.2f" % (row["cpu_per_s"] / es["cpu_per_s"]) if es["cpu_per_s"] > 0 else "n/a"
                if es["within_noise"]:
                    # Dividing by a cost that is mostly noise gives any number at all.
                    ratio = "n/a (enginescope's slowdown within noise)"
                elif es["cost"] <= 0:
                    ratio = "n/a (enginescope's cost <= 0)"
                else:
                    ratio = "%.2f" % (row["cost"] / es["cost"])
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %d%s |" % (
            c.tool, rate, fmt(None if row["slowdown"] is None else 100 * row["slowdown"], ".1f"),
            row["iqr"], fmt(row["cpu_per_s"], ".3f"),
            fmt(row["cost"], ".3f"), ratio, cpu_ratio, fmt(row["maxrss_mib"], ".1f"), fmt(row["samples"], ".0f"),
            fmt(row["errors"], ".0f"), fmt(row["other_cpu_per_s"], ".3f"), row["n"],
            (" (%s)" % "; ".join(row["notes"])) if row["notes"] else ""))
    for row in rows:
        if row["error"] and row["n"] > 0:
            lines += ["", "%s failed in a later round and was not run again: %s" % (row["config"].name, row["error"])]
    return "\n".join(lines) + "\n"


def cpu_cost_summary(configs, records):
    """Cost in CPU: the profiler's CPU s/s plus the target's extra CPU s/s (its CPU per unit of
    work against the mean of its round's baselines), and per-round ratios between configs."""
    records = [r for r in records if not r.get("discarded") and "error" not in r]
    ref = {}
    for r in records:
        if r["tool"] == "none" and r.get("target_cpu_ns_per_unit"):
            ref.setdefault(r["round"], []).append(r["target_cpu_ns_per_unit"])
    ref = {k: statistics.mean(v) for k, v in ref.items()}
    cost = {}  # (config name, round) -> (cost, extra fraction, profiler cpu/s)
    for r in records:
        if r["round"] not in ref or not r.get("target_cpu_ns_per_unit"):
            continue
        extra = r["target_cpu_ns_per_unit"] / ref[r["round"]] - 1
        target_extra = r["target_cpu_per_s"] * extra / (1 + extra)
        cost[(r["config"], r["round"])] = (r.get("cpu_per_s", 0.0) + target_extra, extra, r.get("cpu_per_s", 0.0))
    # Measured directly: the profiler's CPU plus, for enginescope, its BPF programs' run time
    # as the kernel counts it (BPF_ENABLE_STATS); a peer's in-target cost has no such counter.
    direct = {}
    for r in records:
        if "cpu_per_s" in r:
            direct[(r["config"], r["round"])] = (r["cpu_per_s"] + r.get("bpf_cpu_per_s", 0.0), r.get("bpf_cpu_per_s"))
    lines = ["", "Cost in CPU (medians over rounds, [interquartile range]): the target's CPU time per unit of work "
             "against its round's baselines, the profiler's own CPU, and their sum in cores (profiler CPU s/s "
             "+ the target's extra CPU s/s).", "",
             "| profiler | rate Hz | target CPU per unit % | profiler CPU s/s | CPU cost, cores | runs |",
             "|---|---|---|---|---|---|"]

    def spread(v, scale=1.0, spec=".3f"):
        v = [x * scale for x in v]
        if len(v) < 2:
            return format(v[0], spec) if v else "–"
        q = quartiles(v)
        return "%s [%s, %s]" % (format(statistics.median(v), spec), format(q[0], spec), format(q[2], spec))

    for c in configs:
        mine = [v for (name, _), v in cost.items() if name == c.name]
        if not mine:
            continue
        lines.append("| %s | %s | %s | %s | %s | %d |" % (
            c.tool, "–" if c.rate is None else c.rate, spread([m[1] for m in mine], 100, "+.1f"),
            spread([m[2] for m in mine]), spread([m[0] for m in mine]), len(mine)))
    pairs = []
    by_tool = {(c.tool, c.rate): c.name for c in configs}
    for rate in sorted({c.rate for c in configs if c.rate}):
        pairs += [(by_tool.get(("enginescope --native", rate)), by_tool.get(("enginescope", rate))),
                  (by_tool.get(("austin", rate)), by_tool.get(("enginescope --native", rate))),
                  (by_tool.get(("py-spy --native", rate)), by_tool.get(("enginescope --native", rate)))]
    ratio_lines = []
    for a, b in pairs:
        if a is None or b is None:
            continue
        rounds = sorted({rd for (n, rd) in cost if n == a} & {rd for (n, rd) in cost if n == b})
        ratios = [cost[(a, rd)][0] / cost[(b, rd)][0] for rd in rounds if cost[(b, rd)][0] > 0]
        if ratios:
            ratio_lines.append("* %s / %s, per round: %s (%d rounds; min %.2f, max %.2f)"
                               % (a, b, spread(ratios, 1, ".2f"), len(ratios), min(ratios), max(ratios)))
    if ratio_lines:
        lines += ["", "CPU cost ratios, each round's pair of runs divided, median [IQR]:", ""] + ratio_lines
    stopped = {}
    for r in records:
        if "stopped_frac" in r:
            stopped.setdefault(r["config"], []).append(r["stopped_frac"])
    if stopped:
        lines += ["", "Time the target's worker was stopped (neither running nor runnable, from its schedstat): "
                  "a profiler's pauses, as % of wall time, median [IQR]:", ""]
        for c in configs:
            if c.name in stopped:
                lines.append("* %s: %s %% (%d runs)" % (c.name, spread(stopped[c.name], 100, ".2f"), len(stopped[c.name])))
    lines += ["", "Measured CPU (medians [IQR]): the profiler process's CPU s/s plus, for enginescope, the run "
              "time of its BPF programs (kernel BPF stats; these run in the target's context) per s.", "",
              "| profiler | rate Hz | BPF programs s/s | profiler + BPF CPU s/s | runs |", "|---|---|---|---|---|"]
    for c in configs:
        mine = [v for (name, _), v in direct.items() if name == c.name]
        if not mine:
            continue
        bpf = [m[1] for m in mine if m[1] is not None]
        lines.append("| %s | %s | %s | %s | %d |" % (c.tool, "–" if c.rate is None else c.rate,
                                                    spread(bpf) if bpf else "–", spread([m[0] for m in mine]), len(mine)))
    ratio_lines = []
    for a, b in pairs:
        if a is None or b is None:
            continue
        rounds = sorted({rd for (n, rd) in direct if n == a} & {rd for (n, rd) in direct if n == b})
        ratios = [direct[(a, rd)][0] / direct[(b, rd)][0] for rd in rounds if direct[(b, rd)][0] > 0]
        if ratios:
            ratio_lines.append("* %s / %s, per round: %s (%d rounds; min %.2f, max %.2f)"
                               % (a, b, spread(ratios, 1, ".2f"), len(ratios), min(ratios), max(ratios)))
    if ratio_lines:
        lines += ["", "Measured CPU ratios, each round's pair of runs divided, median [IQR]:", ""] + ratio_lines
    steady = {}
    for r in records:
        if "steady_cpu_per_s" in r:
            steady.setdefault((r["tool"], r["rate"]), []).append(
                r["steady_cpu_per_s"] + r.get("bpf_cpu_per_s", 0.0))
    if steady:
        lines += ["", "Steady state: the profiler's CPU from %g s after its start to 0.3 s before the end it was "
                  "asked for (start-up and exit left out; ticks of its process tree), plus enginescope's BPF "
                  "run time over the run, in s/s, median [IQR]; against enginescope's at the same rate:" % STEADY_AFTER_S, "",
                  "| profiler | rate Hz | CPU s/s (steady, + BPF) | / enginescope's | runs |", "|---|---|---|---|---|"]
        for (tool, rate), v in sorted(steady.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0])):
            es = steady.get(("enginescope", rate))
            ratio = "%.2f" % (statistics.median(v) / statistics.median(es)) if es and statistics.median(es) > 0 else "–"
            lines.append("| %s | %s | %s | %s | %d |" % (tool, rate, spread(v), ratio, len(v)))

    return "\n".join(lines) + "\n"


def describe_machine(args):
    ver = subprocess.run([args.python, "-c", "import sys; print(sys.version.split()[0])"],
                         capture_output=True, text=True).stdout.strip()
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for l in f:
            if l.startswith("model name"):
                cpu = l.split(":", 1)[1].strip()
                break
    return {"python": "%s (%s)" % (ver, args.python), "kernel": platform.release(), "cpus": os.cpu_count(),
            "cpu_model": cpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12"))
    ap.add_argument("--rates", default="100,1000", help="comma-separated sampling rates, Hz")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=10, help="profiler duration, whole seconds")
    ap.add_argument("--slack", type=float, help="target window = duration + slack, seconds (default: "
                    "max(4, 1.2 x duration): py-spy counts --duration in samples and runs up to twice as long "
                    "when it falls behind)")
    ap.add_argument("--threads", type=int, default=4, help="target threads")
    ap.add_argument("--enginescope", default=os.path.join(ROOT, "target/release/enginescope"))
    ap.add_argument("--peers", default="/opt/es-peers", help="venv with py-spy==0.4.3 and austin-dist<4")
    ap.add_argument("--only", help="comma-separated tools to run (none is always run): "
                                   "enginescope,enginescope sampling only,enginescope no BPF stats,"
                                   "enginescope --native,py-spy,py-spy --native,"
                                   "py-spy --native (default rate),py-spy --nonblocking,austin")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffle")
    ap.add_argument("--baselines", type=int, default=2, help="baseline runs per round")
    ap.add_argument("--from-json", help="do not run: summarize the runs saved by --json (pass the same "
                                        "--rates/--duration/--only/--quiet/--retries)")
    ap.add_argument("--quiet", type=float, default=0.2,
                    help="cores the rest of the machine may use: each run waits for that before it starts, "
                         "and a run during which more was used is discarded and run again (see --retries)")
    ap.add_argument("--quiet-timeout", type=float, default=600, help="longest wait for a quiet machine, s")
    ap.add_argument("--retries", type=int, default=3, help="reruns of a run the rest of the machine disturbed")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, --duration 2 (slack 4)")
    ap.add_argument("--json", help="write every run's measurements here")
    ap.add_argument("--append-doc", help="append the report, with command line and machine, to this Markdown file")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration = 1, 2
    if args.slack is None:
        args.slack = max(4.0, 1.2 * args.duration)
    args.rates = [int(r) for r in args.rates.split(",")]

    configs = build_configs(args)
    if args.only:
        keep = {"none", "idle process (control)"} | {t.strip() for t in args.only.split(",")}
        configs = [c for c in configs if c.tool in keep]
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        for c in configs:
            mine = [r for r in saved["records"] if r["config"] == c.name]
            errors = [r["error"] for r in mine if "error" in r]
            c.error = errors[-1] if errors else (None if mine else "no runs in %s" % args.from_json)
        print(summarize(configs, saved["records"], args) + cpu_cost_summary(configs, saved["records"]))
        return
    ensure_peers(args.peers)
    workdir = tempfile.mkdtemp(prefix="es-bench-overhead-")
    es_info = None
    if any(c.tool.startswith("enginescope") for c in configs):
        es_info = freeze_enginescope(args, workdir)
        for c in configs:
            if c.tool.startswith("enginescope"):
                check_enginescope(c, args.enginescope)

    machine = describe_machine(args)
    started = datetime.datetime.now(datetime.timezone.utc)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print("Python %s, kernel %s, %d CPUs, load %s; %d rounds x %d configs, %d s per profiler run"
          % (machine["python"], machine["kernel"], machine["cpus"], "/".join(load), args.rounds, len(configs),
             args.duration), file=sys.stderr)
    if es_info:
        print("enginescope: %s" % es_info, file=sys.stderr)

    records = []
    rng = random.Random(args.seed)
    try:
        index = 0
        for rnd in range(args.rounds):
            order = [c for c in configs if c.error is None]
            order += [c for c in configs if c.tool == "none"] * (args.baselines - 1)
            rng.shuffle(order)
            for c in order:
                for attempt in range(args.retries + 1):
                    index += 1
                    rec = run_once(args, c, workdir, index)
                    rec["round"] = rnd + 1
                    records.append(rec)
                    if "error" in rec or rec["other_cpu_per_s"] <= args.quiet or attempt == args.retries:
                        break
                    rec["discarded"] = True
                    print("  round %d %-28s discarded: the rest of the machine used %.2f cores"
                          % (rnd + 1, c.name, rec["other_cpu_per_s"]), file=sys.stderr)
                if "error" in rec:
                    c.error = rec["error"]
                    print("  round %d %-28s FAILED: %s" % (rnd + 1, c.name, rec["error"]), file=sys.stderr)
                else:
                    print("  round %d %-28s %8.0f units/s  %s ns CPU/unit  other %.2f cores%s" % (
                        rnd + 1, c.name, rec["iter_per_s"], fmt(rec.get("target_cpu_ns_per_unit"), ".0f"),
                        rec["other_cpu_per_s"],
                        "" if c.argv_fn is None else "  cpu %.3f s/s  rss %.1f MiB" % (rec["cpu_per_s"], rec["maxrss_mib"])),
                        file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    table = summarize(configs, records, args) + cpu_cost_summary(configs, records)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "argv": sys.argv, "started": started.isoformat(), "enginescope": es_info,
                   "records": records}, f, indent=1)
    if args.append_doc:
        cmd = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
        with open(args.append_doc, "a") as f:
            f.write("\n#### Run of %s\n\n" % started.strftime("%Y-%m-%d %H:%M UTC"))
            f.write("`%s` on Python %s, kernel %s, %d x %s, load average %s at start; %d rounds, "
                    "profiler duration %d s, target window %g s, %d target threads.\n\n"
                    % (cmd, machine["python"], machine["kernel"], machine["cpus"], machine["cpu_model"], " ".join(load),
                       args.rounds, args.duration, args.duration + args.slack, args.threads))
            if es_info:
                f.write("enginescope: %s.\n\n" % es_info)
            f.write(table)


if __name__ == "__main__":
    main()
