"""CPU time of a vLLM server and the tokens it has generated, for the probe-cost benchmarks.

Usage: engine_cpu.py API_SERVER_PID PORT

Prints one JSON object: "threads" ({"pid/tid/comm": CPU seconds, utime + stime} for every
thread of the API server and its descendants), "cpu" (their sum), "tok" (the server's
vllm:generation_tokens_total, summed over engines).
"""

import json
import os
import sys
import urllib.request


def main():
    root, port = int(sys.argv[1]), sys.argv[2]
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(st[1]), []).append(int(d))

    def tree(p):
        yield p
        for c in kids.get(p, []):
            yield from tree(c)

    tick = os.sysconf("SC_CLK_TCK")
    threads = {}
    for p in tree(root):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                raw = open(f"/proc/{p}/task/{t}/stat").read()
            except OSError:
                continue
            st = raw.rsplit(")", 1)[1].split()
            name = raw[raw.index("(") + 1:raw.rindex(")")]
            threads[f"{p}/{t}/{name}"] = (int(st[11]) + int(st[12])) / tick
    url = f"http://127.0.0.1:{port}/metrics"
    metrics = urllib.request.urlopen(url, timeout=30).read().decode()
    tok = sum(float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("vllm:generation_tokens_total"))
    print(json.dumps({"threads": threads, "cpu": sum(threads.values()), "tok": tok}))


if __name__ == "__main__":
    main()
