"""Print the headline numbers of one run's truth files:

    python samples/engine/summarize.py DIR [DIR2]

With two directories (say slow and --fixed), prints them side by side."""
import glob
import json
import os
import sys


def load(d):
    docs = {}
    for p in sorted(glob.glob(os.path.join(d, "*.json"))):
        with open(p) as f:
            doc = json.load(f)
        key = doc["role"] if doc["role"] != "worker" else "worker%d" % doc.get("rank", 0)
        docs[key] = doc
    return docs


def ms(ns):
    return None if ns is None else round(ns / 1e6, 3)


def numbers(d):
    docs = load(d)
    api, ec, w = docs.get("api_server"), docs.get("engine_core"), docs.get("worker0")
    out = {}
    if api:
        win = api["window"]
        out["python"] = api["python"]
        out["fixed"] = ",".join(api["fixed"]) or "-"
        out["window s"] = round((win["end_mono_ns"] - win["start_mono_ns"]) / 1e9, 3)
        out["gen tok/s (API)"] = api["generation_tokens"]["per_s_window"]
        out["TTFT p50 ms"] = ms(api["requests"]["ttft_ns"]["p50"])
        out["ITL p50 ms"] = ms(api["requests"]["itl_ns"]["p50"])
        out["ITL p90 ms"] = ms(api["requests"]["itl_ns"]["p90"])
        loop = api.get("event_loop")
        if loop:
            stalls = loop["stalls"]
            out["loop stalls >= 20 ms"] = len(stalls)
            out["loop stalls > 100 ms"] = sum(1 for x in stalls if x["dur_ns"] > 100_000_000)
            out["longest stall ms"] = ms(max((x["dur_ns"] for x in stalls), default=None))
            out["loop busy share"] = round(loop["busy_ns_window"]
                                           / max(win["end_mono_ns"] - win["start_mono_ns"], 1),
                                           3)
            out["JSON share of API CPU"] = loop["serialization"]["json_share_of_cpu"]
    if ec:
        f = ec["functions"]
        out["steps/s"] = round(f["EngineCore.step"]["calls"] / max(out.get("window s", 1), 1e-9),
                               1)
        out["step p50 ms"] = ms(f["EngineCore.step"]["wall_ns"]["p50"])
        out["enqueue p50 ms"] = ms(f["MessageQueue.enqueue"]["wall_ns"]["p50"])
        out["enqueue mean ms"] = ms(f["MessageQueue.enqueue"]["wall_ns"]["mean"])
        out["EC dequeue p50 ms"] = ms(f["MessageQueue.dequeue"]["wall_ns"]["p50"])
        g = ec["gc"]
        out["EC gen2 GC share"] = g["gen2_share_of_wall"]
        out["EC gen2 GC CPU share"] = g["by_generation"]["2"]["cpu_share_of_wall"]
        out["EC gen2 count"] = g["by_generation"]["2"]["count"]
        out["EC gen2 max ms"] = ms(g["by_generation"]["2"]["max_ns"])
        out["EC GC share (all gens)"] = g["share_of_wall"]
        for t in ec["threads"]:
            if t["name"] == "MainThread" and t.get("window_cpu_s") is not None:
                out["EC main CPU/s"] = round(t["window_cpu_s"] / out.get("window s", 1), 3)
    if w:
        f = w["functions"]
        ex = f["Worker.execute_model"]
        out["execute_model p50 ms"] = ms(ex["wall_ns"]["p50"])
        out["execute_model mean ms"] = ms(ex["wall_ns"]["mean"])
        out["execute_model p90 ms"] = ms(ex["wall_ns"]["p90"])
        out["execute_model cpu p50 ms"] = ms(ex["cpu_ns"]["p50"])
        off = sum(r[1] - r[2] for r in ex["list"])
        out["execute_model off-CPU ms/s"] = round(off / 1e6 / out.get("window s", 1), 1)
        out["W dequeue p50 ms"] = ms(f["MessageQueue.dequeue"]["wall_ns"]["p50"])
        out["W enqueue p50 ms"] = ms(f["MessageQueue.enqueue"]["wall_ns"]["p50"])
        ev = f["AuxOutputStore._evict_to_fit"]
        out["_evict_to_fit cpu p50 ms"] = ms(ev["cpu_ns"]["p50"])
        out["_evict_to_fit wall p50 ms"] = ms(ev["wall_ns"]["p50"])
        out["puts/s"] = w["aux_store"]["puts_per_s_window"]
        out["store entries"] = w["aux_store"]["capacity"]
        cpu = 0.0
        for t in w["threads"]:
            if t.get("window_cpu_s") is not None:
                cpu += t["window_cpu_s"]
        out["Worker CPU/s"] = round(cpu / out.get("window s", 1), 3)
    total = 0.0
    for doc in docs.values():
        for t in doc["threads"]:
            total += t.get("window_cpu_s") or 0.0
    out["all threads CPU/s"] = round(total / max(out.get("window s", 1), 1e-9), 3)
    return out


def main():
    cols = [numbers(d) for d in sys.argv[1:]]
    keys = []
    for c in cols:
        for k in c:
            if k not in keys:
                keys.append(k)
    width = max(len(k) for k in keys)
    print("%-*s  %s" % (width, "", "  ".join("%14s" % os.path.basename(d.rstrip("/"))[:14]
                                              for d in sys.argv[1:])))
    for k in keys:
        print("%-*s  %s" % (width, k, "  ".join("%14s" % (c.get(k),) for c in cols)))


if __name__ == "__main__":
    main()
