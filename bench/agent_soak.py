#!/usr/bin/env python3
"""The agent's soak (issue 25): `enginescope agent --vllm` at its defaults (or with extra flags,
such as --raw-events) for hours on the bundled engine under a steady load, beside a vLLM-shaped
tree whose processes and threads keep coming and going (samples/fleet_churn.py).

Every minute it writes one row: the agent's heap (RssAnon), VmRSS, descriptors, threads and CPU
(seconds since start), its segments' bytes and count; and, for the bundled engine's EngineCore
and Worker main threads, the CPU the agent exported over the minute
(`enginescope_thread_cpu_seconds_total`, from samples) against the kernel's (schedstat) over
the same minute, with the samples the agent says it lost.

The exported counters advance once per aggregation interval (10 s at the defaults), so a
minute's exported CPU covers the intervals closed within it: under a steady load its rate is
the minute's, within a sixth at worst (one interval more or less); the run's whole-span ratio
is printed too.

Usage: bench/agent_soak.py OUT [--seconds 7200] [--python PY] [--es BIN] [--agent=FLAG ...]
(docs/deployment.md, "Soak figures", has the runs and their curves).
Each run uses its own ports: two soaks (defaults and --raw-events) can run side by side, each
agent restricted to its own engines with --engine-port.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def status(pid, key):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_s(pid):
    with open("/proc/%d/stat" % pid) as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_ns(pid):
    """The main thread's time on CPU (schedstat: ns), None once gone."""
    try:
        with open("/proc/%d/task/%d/schedstat" % (pid, pid)) as f:
            return int(f.read().split()[0])
    except OSError:
        return None


def children(pid):
    out = []
    try:
        for t in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, t)) as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


def find_desc(root, prefix):
    todo, seen = [root], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        if comm(p).startswith(prefix):
            return p
        todo += children(p)
    return None


LINE = re.compile(r'^([a-zA-Z_:]+)\{([^}]*)\} ([0-9.eE+-]+|NaN)$')


def exposition(port, keep):
    import urllib.request
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    with open(keep, "w") as f:
        f.write(text)
    rows = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            rows.append((m.group(1), labels, float(m.group(3))))
        elif line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            try:
                rows.append((name, {}, float(v)))
            except ValueError:
                pass
    return rows


def exported_cpu(rows, engine, role):
    return sum(v for n, l, v in rows
               if n == "enginescope_thread_cpu_seconds_total" and l.get("engine") == engine
               and l.get("role") == role and l.get("thread") == "MainThread")


def total(rows, name):
    return sum(v for n, _, v in rows if n == name)


def du(d):
    b = n = 0
    for e in os.scandir(d):
        if e.name.endswith(".esrec"):
            try:
                b += e.stat().st_size
                n += 1
            except OSError:
                pass
    return b, n


def ready(proc, what):
    """The READY line a workload prints once it runs (its pid and port)."""
    for line in proc.stdout:
        if line.startswith("READY"):
            return line.split()
    sys.exit("%s exited before READY" % what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=7200)
    ap.add_argument("--every", type=float, default=60)
    ap.add_argument("--python", default="/root/.pyenv/versions/3.12.1/bin/python3.12")
    ap.add_argument("--es", default=os.path.join(ROOT, "target/release/enginescope"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--steps-per-s", type=float, default=50)
    ap.add_argument("--engine-args", default="--fix evict",
                    help="more arguments of the bundled engine (default: without the eviction "
                         "scan, so that two soaks and a build fit on two CPUs)")
    ap.add_argument("--agent", action="append", default=[], dest="agent_flags",
                    metavar="FLAG", help="a flag of the agent's, e.g. --agent=--raw-events")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    segs = os.path.join(a.out, "segs")
    os.makedirs(segs, exist_ok=True)
    eport, cport = free_port(), free_port()
    engine = subprocess.Popen(
        [a.python, os.path.join(ROOT, "samples/engine/serve.py"), "serve", "--port", str(eport),
         "--requests", str(a.requests), "--steps-per-s", str(a.steps_per_s),
         "--truth", os.path.join(a.out, "truth")] + a.engine_args.split(),
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    churn = subprocess.Popen(
        [a.python, os.path.join(ROOT, "samples/fleet_churn.py"), "serve", "--port", str(cport),
         "--workers", "2", "--worker-life", "3", "--threads-per-s", "10"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    procs = [engine, churn]
    agent = None
    try:
        ready(engine, "the bundled engine")
        ready(churn, "fleet_churn")
        core = find_desc(engine.pid, "VLLM::EngineCor")
        worker = find_desc(engine.pid, "VLLM::Worker")
        log = open(os.path.join(a.out, "agent.log"), "w")
        cmd = [a.es, "agent", "--vllm", "--engine-port", str(eport), "--engine-port", str(cport),
               "--listen", "127.0.0.1:0", "--dir", segs] + a.agent_flags
        agent = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        procs.append(agent)
        mport = None
        label = None
        for line in agent.stderr:
            log.write(line)
            m = re.search(r"enginescope: (engine\d+): API server %d," % engine.pid, line)
            if m:
                label = m.group(1)
            m = re.search(r"serving metrics on http://127\.0\.0\.1:(\d+)", line) or \
                re.search(r"listening on 127\.0\.0\.1:(\d+)", line) or \
                re.search(r"127\.0\.0\.1:(\d+)/metrics", line)
            if m and mport is None:
                mport = int(m.group(1))
            if "sampling started" in line:
                break
        if mport is None or label is None:
            sys.exit("the agent printed no metrics address or no engine of pid %d: see %s"
                     % (engine.pid, log.name))
        # The agent's log goes on to its file from here.
        import threading

        def pump():
            for line in agent.stderr:
                log.write(line)
                log.flush()
        threading.Thread(target=pump, daemon=True).start()
        t0 = time.monotonic()
        rows = []
        prev = None
        hdr = ("t_s anon_mib vmrss_mib fds threads agent_cpu_s disk_bytes segments "
               "core_exp_s core_true_s worker_exp_s worker_true_s lost processes")
        print(hdr, flush=True)
        out = open(os.path.join(a.out, "soak.txt"), "w")
        out.write("# " + " ".join(cmd) + "\n" + hdr + "\n")
        k = 0
        while time.monotonic() - t0 < a.seconds:
            k += 1
            # The pace of the measurement (one row a minute), not a wait for readiness.
            time.sleep(max(0.0, t0 + k * a.every - time.monotonic()))
            if agent.poll() is not None:
                sys.exit("the agent exited (rc %s): see %s" % (agent.returncode, log.name))
            exp = exposition(mport, os.path.join(a.out, "metrics.txt"))
            cur = {
                "t": time.monotonic() - t0,
                "core_exp": exported_cpu(exp, label, "engine_core"),
                "worker_exp": exported_cpu(exp, label, "worker"),
                "core_true": (thread_cpu_ns(core) or 0) / 1e9,
                "worker_true": (thread_cpu_ns(worker) or 0) / 1e9,
                "lost": total(exp, "enginescope_samples_lost_total"),
                "processes": total(exp, "enginescope_processes"),
            }
            b, n = du(segs)
            row = [round(cur["t"]), (status(agent.pid, "RssAnon") or 0) / 1024,
                   (status(agent.pid, "VmRSS") or 0) / 1024,
                   len(os.listdir("/proc/%d/fd" % agent.pid)),
                   len(os.listdir("/proc/%d/task" % agent.pid)), cpu_s(agent.pid), b, n]
            if prev:
                row += [cur["core_exp"] - prev["core_exp"], cur["core_true"] - prev["core_true"],
                        cur["worker_exp"] - prev["worker_exp"],
                        cur["worker_true"] - prev["worker_true"]]
            else:
                row += [0, 0, 0, 0]
            row += [cur["lost"], cur["processes"]]
            line = " ".join("%.3f" % x if isinstance(x, float) else str(x) for x in row)
            print(line, flush=True)
            out.write(line + "\n")
            out.flush()
            rows.append((cur, row))
            prev = cur
        first, last = rows[0][0], rows[-1][0]
        summary = {
            "seconds": last["t"],
            "core_exported_over_true": (last["core_exp"] - first["core_exp"])
            / max(1e-9, last["core_true"] - first["core_true"]),
            "worker_exported_over_true": (last["worker_exp"] - first["worker_exp"])
            / max(1e-9, last["worker_true"] - first["worker_true"]),
        }
        print(json.dumps(summary), flush=True)
        out.write("# " + json.dumps(summary) + "\n")
    finally:
        if agent and agent.poll() is None:
            agent.send_signal(signal.SIGINT)
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
        for p in (engine, churn):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
