"""A small vLLM-like inference engine in pure-stdlib Python, for enginescope's tests and demos.

    python samples/engine/serve.py serve [MODEL] --port 0 --seconds 10 --truth DIR [--fixed]

Three kinds of process, like `vllm serve`: this API server (comm: the interpreter's name), the
EngineCore (`VLLM::EngineCore`) and the Worker (`VLLM::Worker`, or `VLLM::Worker_TP<n>`).
It reproduces three CPU costs of a real vLLM deployment, each with a fix (--fixed):
an O(n) LRU eviction scan on the Worker's `aux-output-writer` thread that holds the GIL
against `Worker.execute_model`; a shared-memory MessageQueue that pickles one list per request
per step; gen-2 garbage collections in the EngineCore. See README.md in this directory."""
import argparse
import os
import sys

FIXES = ("evict", "queue", "gc")


def build_parser():
    ap = argparse.ArgumentParser(prog="serve.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the engine")
    p.add_argument("model", nargs="?", default="tiny-moe",
                   help="model name (nothing is loaded; the default --served-model-name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000,
                   help="metrics port; 0 picks a free one (READY says which)")
    p.add_argument("--served-model-name", help="model_name label of the metrics")
    p.add_argument("--no-metrics", action="store_true", help="no HTTP server at all")
    p.add_argument("--seconds", type=float,
                   help="length of the measurement window; then exit cleanly (default: run "
                        "until SIGTERM/SIGINT)")
    p.add_argument("--duration", type=float, dest="seconds", help=argparse.SUPPRESS)
    p.add_argument("--truth", metavar="DIR",
                   help="write DIR/<role>-<pid>.json from every process at exit")
    p.add_argument("--ready-fd", type=int, help="also write the READY line to this fd")
    p.add_argument("--ready-fifo", help="also write the READY line into this FIFO")
    p.add_argument("--go-fd", type=int,
                   help="after READY, start the window once a line is read from this fd")
    p.add_argument("--go-fifo", help="after READY, start the window once a line is read here")
    p.add_argument("--fixed", action="store_true", help="apply all three fixes")
    p.add_argument("--fix", default="",
                   help="comma-separated subset of the fixes: evict,queue,gc")
    load = p.add_argument_group("load")
    load.add_argument("--requests", type=int,
                      help="requests in flight (default 64; 24 with --serialize-stalls)")
    load.add_argument("--ramp", metavar="LEVELS:SECONDS",
                      help="requests in flight step through these levels, each held SECONDS, "
                           "cycling (e.g. 8,16,32,64:1): a sweep of concurrencies, so that "
                           "what grows with the batch shows; instead of --requests")
    load.add_argument("--max-tokens", type=int, default=128,
                      help="each request's max_tokens is drawn in [N/2, N]")
    load.add_argument("--warmup-requests", type=int,
                      help="requests that must finish before READY (default: --requests)")
    load.add_argument("--seed", default="1")
    fe = p.add_argument_group("frontend stalls")
    fe.add_argument("--serialize-stalls", action="store_true",
                    help="the API server's main thread runs an asyncio event loop that answers "
                         "requests returning their routed experts; serializing those "
                         "responses to JSON stalls the loop, which times itself")
    fe.add_argument("--serialize-ms", type=float, default=60.0,
                    help="CPU time of serializing one routed-experts response (sized at start)")
    fe.add_argument("--serialize-gap", type=float, default=0.3,
                    help="seconds between a group's last response and the next group")
    fe.add_argument("--serialize-group-max", type=int, default=5,
                    help="groups of 1..N requests (each size in turn, in a seeded order), all "
                         "finishing in one step")
    fe.add_argument("--serialize-groups", type=int, default=0,
                    help="end the window once N groups submitted inside it have been "
                         "answered (--seconds still bounds it): the number of stalls does "
                         "not depend on how fast the machine is")
    eng = p.add_argument_group("engine")
    eng.add_argument("--workers", type=int, default=1, help="tensor-parallel size")
    eng.add_argument("--max-num-seqs", type=int, default=48)
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument("--num-blocks", type=int, default=2048, help="KV-cache blocks")
    eng.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    eng.add_argument("--steps-per-s", type=float,
                     help="pace the EngineCore's steps (default 0: as fast as it goes; 100 with "
                          "--serialize-stalls)")
    eng.add_argument("--exec-ms", type=float, default=2.45,
                     help="CPU time of the calibrated part of one Worker.execute_model "
                          "(the per-token bookkeeping adds ~0.25 ms at the default load)")
    eng.add_argument("--python-share", type=float, default=0.35,
                     help="part of --exec-ms that is pure Python (the rest releases the GIL)")
    eng.add_argument("--layers", type=int, default=8,
                     help="native kernels per step (GIL releases)")
    eng.add_argument("--evict-ms", type=float, default=9.0,
                     help="CPU time of one slow _evict_to_fit scan")
    eng.add_argument("--puts-per-s", type=float, default=46.0,
                     help="AuxOutputStore.put rate of the aux-output-writer thread")
    eng.add_argument("--gc-heap", type=int, default=40000,
                     help="long-lived lists (128 references each) in the EngineCore")
    eng.add_argument("--gc-churn", type=int, default=1500,
                     help="objects in the EngineCore's per-step outputs (cyclic, die young)")
    eng.add_argument("--gc-retained", type=int, default=300,
                     help="objects in the EngineCore's per-step sample records (cyclic, kept)")
    eng.add_argument("--gc-retain-steps", type=int, default=16,
                     help="steps the sample records are kept")
    eng.add_argument("--gc-threshold", default="700,10,10",
                     help="the EngineCore's gc.set_threshold (three integers)")
    tr = p.add_argument_group("truth")
    tr.add_argument("--call-cap", type=int, default=200000,
                    help="calls kept per function (all are counted)")
    tr.add_argument("--list-cap", type=int, default=200000,
                    help="rows per list in the truth files")
    p.add_argument("-q", "--quiet", action="store_true")
    return ap


def make_config(args):
    fix = set(FIXES) if args.fixed else set()
    for f in filter(None, (x.strip() for x in args.fix.split(","))):
        if f not in FIXES:
            raise SystemExit("--fix: unknown fix %r (choose from %s)" % (f, ",".join(FIXES)))
        fix.add(f)
    truth = os.path.abspath(args.truth) if args.truth else None
    requests = args.requests
    if requests is None:
        # Fewer than --max-num-seqs minus a group, so that nothing waits and a group of routed
        # requests is admitted in one step.
        requests = 24 if args.serialize_stalls else 64
    steps_per_s = args.steps_per_s
    if steps_per_s is None:
        # A paced engine leaves the API server's loop a core on a small machine.
        steps_per_s = 100.0 if args.serialize_stalls else 0
    ramp = None
    if args.ramp:
        try:
            levels, seconds = args.ramp.split(":")
            ramp = {"levels": [int(x) for x in levels.split(",")], "seconds": float(seconds)}
        except ValueError:
            raise SystemExit("--ramp: expected LEVELS:SECONDS such as 8,16,32,64:1, got %r"
                             % args.ramp)
        if not ramp["levels"] or min(ramp["levels"]) < 1 or ramp["seconds"] <= 0:
            raise SystemExit("--ramp: levels must be at least 1 and SECONDS above 0")
        # Warm-up and the metrics' first figures as at the highest level.
        requests = max(ramp["levels"])
    if truth:
        os.makedirs(truth, exist_ok=True)
    return {
        "ramp": ramp,
        "model": args.model,
        "served_model_name": args.served_model_name or args.model,
        "truth": truth,
        "fix": sorted(fix),
        "requests": requests,
        "max_tokens": args.max_tokens,
        "warmup_requests": requests if args.warmup_requests is None
        else args.warmup_requests,
        "serialize_stalls": args.serialize_stalls,
        "serialize_ms": args.serialize_ms,
        "serialize_gap": args.serialize_gap,
        "serialize_group_max": args.serialize_group_max,
        "serialize_groups": args.serialize_groups,
        "seed": args.seed,
        "workers": args.workers,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "steps_per_s": steps_per_s,
        "exec_ms": args.exec_ms,
        "python_share": args.python_share,
        "layers": args.layers,
        "evict_ms": args.evict_ms,
        "puts_per_s": args.puts_per_s,
        "gc_heap": args.gc_heap,
        "gc_churn": args.gc_churn,
        "gc_retained": args.gc_retained,
        "gc_retain_steps": args.gc_retain_steps,
        "gc_threshold": [int(x) for x in args.gc_threshold.split(",")],
        "call_cap": args.call_cap,
        "list_cap": args.list_cap,
        "seconds": args.seconds,
        "quiet": args.quiet,
    }


def main(argv=None):
    args = build_parser().parse_args(argv)
    cfg = make_config(args)
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import api_server
    sys.exit(api_server.serve(args, cfg))


if __name__ == "__main__":
    main()
