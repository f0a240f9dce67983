"""The EngineCore process (`VLLM::EngineCore`), started by the API server.

Main thread: `EngineCore.run_busy_loop` takes new requests from the input queue and calls
`EngineCore.step()`, which
  * schedules (a small vLLM v1 scheduler: waiting/running queues, paged KV blocks of
    --block-size tokens from a pool of --num-blocks, a prefix cache of full prompt blocks
    keyed by chained block hashes, at most --max-num-seqs running and
    --max-num-batched-tokens per step),
  * hands the step to the workers (`MultiprocExecutor.execute_model`: `MessageQueue.enqueue`
    of one record per scheduled request, then `MessageQueue.dequeue` of the sampled tokens),
  * updates the requests and emits outputs (token ids, finished flags, scheduler stats).
`engine-input` thread: receives requests and control messages from the API server.
`engine-output` thread: sends each step's outputs to the API server.

GC (the third bug): the EngineCore keeps a large live heap (--gc-heap lists standing for the
tokenizer/detokenizer and grammar tables a real EngineCore holds). Every step it builds
  * the step's output objects (--gc-churn objects: per request an entry and its detokenizer
    window lists) that point back at their batch: reference cycles that die with the step,
    so young collections run often (the collector counts allocations that were not freed);
  * sample records (`RequestTrace` with top-k logprob entries, --gc-retained objects per
    step) that point back at their step (`StepTrace`), kept for --gc-retain-steps steps, so
    they are promoted to the oldest generation before they become garbage.
Young collections clear the first kind; the promotions make a full (generation-2) collection
due about every tenth generation-1 collection, and each full collection walks the whole live
heap and frees the old records. The collector's thresholds are set to --gc-threshold (700,10,10: the default
of 3.10-3.12; 3.13 raised the first to 2000) so the rhythm is the same on every version.
Fixed (--fixed / --fix gc): gc.freeze() after setup moves the heap out of the collector's
reach, and the records have no back references and are not kept (reference counting frees
them)."""
import collections
import gc
from array import array
import multiprocessing
import os
import queue
import threading
import time
import traceback

import groundtruth as gt
import procutil
import worker as worker_mod
from shm_broadcast import MessageQueue, PeerGone

mono = time.monotonic_ns
tcpu = time.thread_time_ns


# --- requests and the paged KV cache ------------------------------------------------------------

class Request:
    __slots__ = ("req_id", "prompt", "max_tokens", "output", "num_computed", "blocks",
                 "block_ids", "reserved", "num_cached", "arrival_ns", "hashed_blocks",
                 "last_hash")

    def __init__(self, req_id, prompt, max_tokens, arrival_ns):
        self.req_id = req_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output = []
        self.num_computed = 0
        self.blocks = []
        self.block_ids = None  # packed (--fix queue): the blocks' ids as an array('i')
        self.reserved = 0
        self.num_cached = 0
        self.arrival_ns = arrival_ns
        self.hashed_blocks = 0
        self.last_hash = None


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None
        self.prev_free = None
        self.next_free = None


class FreeBlockQueue:
    """Doubly linked list of free blocks (vLLM's FreeKVCacheBlockQueue): allocation takes the
    head; freed blocks go to the tail, so cached blocks are evicted least recently used
    first; a prefix-cache hit takes a free block out of the middle in O(1)."""

    def __init__(self, blocks):
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-2)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, b):
        last = self.tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self.tail
        self.tail.prev_free = b
        self.num_free += 1

    def remove(self, b):
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def popleft(self):
        b = self.head.next_free
        if b is self.tail:
            raise RuntimeError("no free KV blocks")
        self.remove(b)
        return b


class BlockPool:
    def __init__(self, num_blocks):
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free = FreeBlockQueue(self.blocks)
        self.cached = {}  # block hash -> block

    def allocate(self, n):
        out = []
        for _ in range(n):
            b = self.free.popleft()
            if b.block_hash is not None:
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks):
        for b in blocks:
            if b.ref_cnt == 0:
                self.free.remove(b)
            b.ref_cnt += 1

    def release(self, blocks):
        for b in reversed(blocks):  # the request's last blocks are evicted first
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free.append(b)

    def usage(self):
        return 1.0 - self.free.num_free / self.num_blocks


class SchedulerOutput:
    __slots__ = ("records", "scheduled", "num_tokens")

    def __init__(self):
        self.records = []
        self.scheduled = []  # (request, num new tokens)
        self.num_tokens = 0


class Scheduler:
    def __init__(self, cfg):
        self.block_size = cfg["block_size"]
        self.max_num_seqs = cfg["max_num_seqs"]
        self.max_batched = cfg["max_num_batched_tokens"]
        # The fixed queue (--fix queue) sends each step as one array: each request's record is
        # an array('i') whose block ids are kept as the blocks are allocated (as vLLM keeps
        # per-request arrays), so the MessageQueue packs them with one C call per step.
        self.packed = "queue" in cfg["fix"]
        self.pool = BlockPool(cfg["num_blocks"])
        self.waiting = collections.deque()
        self.running = []
        self.reserved = 0  # blocks promised to running requests, not yet allocated
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prompt_tokens = 0
        self.finished = 0

    def add_request(self, req):
        self.waiting.append(req)

    def has_requests(self):
        return bool(self.waiting or self.running)

    def _blocks_for(self, tokens):
        return -(-tokens // self.block_size)

    def _cached_prefix(self, req):
        """Blocks of the prompt already in the prefix cache (never the last prompt token)."""
        bs = self.block_size
        hits = []
        parent = None
        prompt = req.prompt
        for i in range((len(prompt) - 1) // bs):
            h = hash((parent, tuple(prompt[i * bs:(i + 1) * bs])))
            b = self.pool.cached.get(h)
            if b is None:
                break
            hits.append(b)
            parent = h
        return hits, parent

    def _record(self, req, n_new, tokens):
        if self.packed:
            rec = array("i", (req.req_id, req.num_computed, n_new, len(req.block_ids)))
            rec += req.block_ids
            rec.append(len(tokens))
            rec.extend(tokens)
            return rec
        blocks = [b.block_id for b in req.blocks]
        return [req.req_id, req.num_computed, n_new, len(blocks)] + blocks + [len(tokens)] + tokens

    def schedule(self):
        so = SchedulerOutput()
        pool = self.pool
        budget = self.max_batched
        for req in self.running:
            if req.num_computed + 1 > len(req.blocks) * self.block_size:
                new = pool.allocate(1)
                req.blocks.extend(new)
                if self.packed:
                    req.block_ids.extend(b.block_id for b in new)
                req.reserved -= 1
                self.reserved -= 1
            so.records.append(self._record(req, 1, [req.output[-1]]))
            so.scheduled.append((req, 1))
            budget -= 1
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, last_hash = self._cached_prefix(req)
            num_cached = len(hits) * self.block_size
            n_new = len(req.prompt) - num_cached
            if n_new > budget:
                break
            total_blocks = self._blocks_for(len(req.prompt) + req.max_tokens)
            now_blocks = self._blocks_for(len(req.prompt)) - len(hits)
            revived = sum(1 for b in hits if b.ref_cnt == 0)
            if pool.free.num_free - revived - self.reserved < total_blocks - len(hits):
                break
            self.waiting.popleft()
            pool.touch(hits)
            req.blocks = hits + pool.allocate(now_blocks)
            if self.packed:
                req.block_ids = array("i", [b.block_id for b in req.blocks])
            req.reserved = total_blocks - len(hits) - now_blocks
            self.reserved += req.reserved
            req.num_cached = num_cached
            req.num_computed = num_cached
            req.hashed_blocks = len(hits)
            req.last_hash = last_hash
            self.prefix_queries += len(req.prompt)
            self.prefix_hits += num_cached
            self.running.append(req)
            so.records.append(self._record(req, n_new, req.prompt[num_cached:]))
            so.scheduled.append((req, n_new))
            budget -= n_new
        so.num_tokens = self.max_batched - budget
        return so

    def _cache_prompt_blocks(self, req):
        bs = self.block_size
        prompt = req.prompt
        parent = req.last_hash
        cached = self.pool.cached
        for i in range(req.hashed_blocks, len(prompt) // bs):
            h = hash((parent, tuple(prompt[i * bs:(i + 1) * bs])))
            b = req.blocks[i]
            if h not in cached:
                b.block_hash = h
                cached[h] = b
            parent = h
        req.hashed_blocks = len(prompt) // bs
        req.last_hash = parent

    def update_from_output(self, so, sampled):
        """Returns [[req_id, token, finished], ...] and the requests that finished."""
        outputs = []
        done = []
        for (req, n_new), (rid, tok) in zip(so.scheduled, sampled):
            if rid != req.req_id:
                raise RuntimeError("worker output out of order: %d != %d" % (rid, req.req_id))
            first = not req.output
            req.num_computed += n_new
            req.output.append(tok)
            if first:
                self.prompt_tokens += len(req.prompt)
                self._cache_prompt_blocks(req)
            finished = len(req.output) >= req.max_tokens
            outputs.append([rid, tok, 1 if finished else 0])
            if finished:
                done.append(req)
        for req in done:
            self.running.remove(req)
            self.pool.release(req.blocks)
            self.reserved -= req.reserved
            req.reserved = 0
            req.blocks = []
            req.block_ids = None
            self.finished += 1
        return outputs, done


# --- per-step sample records: the GC churn ------------------------------------------------------

class StepTrace:
    __slots__ = ("step", "requests")


class RequestTrace:
    __slots__ = ("step_trace", "req_id", "token", "logprobs")


def step_outputs(outputs, n_objects, cyclic):
    """The step's output objects: per request [batch, req_id, token, finished, window] where
    window holds detokenizer-window lists that point back at the entry."""
    batch = []
    per = max(1, n_objects // max(1, len(outputs)) - 1)
    for rid, tok, fin in outputs:
        item = [batch if cyclic else None, rid, tok, fin]
        owner = item if cyclic else None
        item.append([[owner, tok, j] for j in range(per)])
        batch.append(item)
    return batch


def trace_step(step_no, sampled, per_request, cyclic):
    """The step's sample records: per request its token and `per_request` top-k logprob
    entries ([owner, token id, logprob, rank] lists). With `cyclic`, records point back at
    their StepTrace and entries at their RequestTrace: reference cycles."""
    st = StepTrace()
    st.step = step_no
    st.requests = []
    for rid, tok in sampled:
        rt = RequestTrace()
        rt.step_trace = st if cyclic else None
        rt.req_id = rid
        rt.token = tok
        owner = rt if cyclic else None
        rt.logprobs = [[owner, (tok + r) & 1023, -0.125 * r, r] for r in range(per_request)]
        st.requests.append(rt)
    return st


# --- the executor: workers and message queues ---------------------------------------------------

class MultiprocExecutor:
    def __init__(self, cfg, ctx, alive):
        self.cfg = cfg
        n = cfg["workers"]
        packed = "queue" in cfg["fix"]
        n_chunks = max(64, 2 * (cfg["max_num_seqs"] + 2))
        self.sched_handle, sched_shm = MessageQueue.create(ctx, n, n_chunks, 256 * 1024)
        self.resp_handle, resp_shm = MessageQueue.create(ctx, 1, n_chunks, 64 * 1024)
        self.alive = alive
        self.procs = []
        self.conns = []
        for rank in range(n):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_mod.run_worker, name="VllmWorker-%d" % rank,
                            args=(cfg, rank, self.sched_handle,
                                  self.resp_handle if rank == 0 else None, w, os.getpid()),
                            daemon=True)
            p.start()
            w.close()
            self.procs.append(p)
            self.conns.append(r)
        self.sched_mq = MessageQueue(self.sched_handle, "writer", 0, packed, self._alive,
                                     owner=True, shm=sched_shm)
        self.resp_mq = MessageQueue(self.resp_handle, "reader", 0, packed, self._alive,
                                    owner=True, shm=resp_shm)
        self.ready = []
        for rank, conn in enumerate(self.conns):
            while not conn.poll(0.5):
                if not self._alive():
                    raise PeerGone("worker %d did not start" % rank)
            self.ready.append(conn.recv()[1])
        cap = cfg["call_cap"]
        self.enqueue_log = gt.CallLog("MessageQueue.enqueue", MessageQueue.enqueue,
                                      "scheduler output to the workers", cap)
        self.dequeue_log = gt.CallLog("MessageQueue.dequeue", MessageQueue.dequeue,
                                      "sampled tokens from worker 0", cap)
        self.sched_mq.body_log = self.enqueue_log
        self.resp_mq.body_log = self.dequeue_log

    def _alive(self):
        return self.alive() and all(p.is_alive() for p in self.procs)

    def execute_model(self, so):
        t0 = mono()
        c0 = tcpu()
        self.sched_mq.enqueue(so.records)
        c1 = tcpu()
        t1 = mono()
        self.enqueue_log.add(t0, t1, c0, c1, len(so.records))
        t0 = mono()
        c0 = tcpu()
        out = self.resp_mq.dequeue()
        c1 = tcpu()
        t1 = mono()
        self.dequeue_log.add(t0, t1, c0, c1)
        flat = out[0]  # one record: req_id, token, req_id, token, ...
        return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]

    def broadcast_control(self, obj):
        self.sched_mq.enqueue_control(obj)

    def shutdown(self, window):
        """Tell the workers to stop (they write their truth), collect their truth paths."""
        paths = []
        try:
            self.sched_mq.alive = lambda: any(p.is_alive() for p in self.procs)
            self.broadcast_control(("shutdown", window[0], window[1]))
        except (PeerGone, ValueError, OSError):
            pass
        for p, conn in zip(self.procs, self.conns):
            path = None
            deadline = time.monotonic() + 20
            try:
                while time.monotonic() < deadline:
                    if conn.poll(0.5):
                        msg = conn.recv()
                        if msg[0] == "done":
                            path = msg[1]
                            break
                    elif not p.is_alive():
                        break
            except (EOFError, OSError):
                pass
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
            paths.append({"role": "worker", "pid": p.pid, "truth": path, "exitcode": p.exitcode})
        self.sched_mq.close()
        self.resp_mq.close()
        return paths


# --- the engine ---------------------------------------------------------------------------------

class EngineCore:
    def __init__(self, cfg, executor, stop):
        self.cfg = cfg
        self.executor = executor
        self.stop = stop
        self.scheduler = Scheduler(cfg)
        self.input_queue = queue.Queue()
        self.output_queue = queue.Queue()
        self.step_log = gt.CallLog("EngineCore.step", EngineCore.step, "one engine step",
                                   cfg["call_cap"])
        fix = set(cfg["fix"])
        self.gc_fixed = "gc" in fix
        self.retained = collections.deque(maxlen=max(1, cfg["gc_retain_steps"]))
        self.steps = 0
        self.generated = 0
        self.tokens_log = []  # (step end ns, generated tokens that step)
        self.shutdown_requested = False
        self.window_start = None
        self.heap = None

    def build_heap(self):
        """The long-lived state (tokenizer/detokenizer, grammar tables) a real EngineCore keeps:
        --gc-heap lists of 128 references each."""
        gc.set_threshold(*self.cfg["gc_threshold"])
        row = list(range(128))
        self.heap = [row[:] for _ in range(self.cfg["gc_heap"])]
        if self.gc_fixed:
            gc.collect()
            gc.freeze()

    def _process_input_queue(self):
        q = self.input_queue
        if not self.scheduler.has_requests():
            while True:
                try:
                    item = q.get(timeout=0.5)
                    break
                except queue.Empty:
                    if self.stop.is_set():
                        return
            self._handle(item)
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item):
        tag = item[0]
        if tag == "add":
            for rid, prompt, max_tokens, arrival in item[1]:
                self.scheduler.add_request(Request(rid, prompt, max_tokens, arrival))
        elif tag == "window":
            self.window_start = item[1]
            self.executor.broadcast_control(("window", item[1]))
        elif tag == "shutdown":
            self.shutdown_requested = True

    def step(self):
        sched = self.scheduler
        so = sched.schedule()
        if not so.records:
            if sched.waiting and not sched.running:
                req = sched.waiting[0]
                raise RuntimeError(
                    "request %d (prompt %d + max_tokens %d) can never be scheduled with "
                    "--num-blocks %d x --block-size %d and --max-num-batched-tokens %d" % (
                        req.req_id, len(req.prompt), req.max_tokens, sched.pool.num_blocks,
                        sched.block_size, sched.max_batched))
            return None
        sampled = self.executor.execute_model(so)
        outputs, done = sched.update_from_output(so, sampled)
        self.steps += 1
        self.generated += len(outputs)
        cyclic = not self.gc_fixed
        step_outputs(outputs, self.cfg["gc_churn"], cyclic)
        st = trace_step(self.steps, sampled, self.cfg["gc_retained"] // max(1, len(sampled)),
                        cyclic)
        if cyclic:
            self.retained.append(st)
        stats = (len(sched.running), len(sched.waiting), sched.pool.usage(),
                 sched.prefix_queries, sched.prefix_hits, sched.prompt_tokens, so.num_tokens)
        return outputs, stats

    def run_busy_loop(self):
        interval = int(1e9 / self.cfg["steps_per_s"]) if self.cfg["steps_per_s"] > 0 else 0
        next_t = mono()
        log = self.step_log
        while not self.stop.is_set():
            self._process_input_queue()
            if self.shutdown_requested or self.stop.is_set():
                return
            if interval:
                next_t += interval
                now = mono()
                if next_t > now:
                    procutil.wait_until(next_t)
                elif now - next_t > interval:
                    next_t = now
            t0 = mono()
            c0 = tcpu()
            result = self.step()
            c1 = tcpu()
            t1 = mono()
            if result is None:
                continue
            log.add(t0, t1, c0, c1)
            self.tokens_log.append((t1, len(result[0])))
            self.output_queue.put(("out", result[0], result[1]))


def input_thread(core, conn, window):
    rec = procutil.register_thread("engine-input")
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                core.stop.set()  # the API server is gone
                break
            tag = msg[0]
            if tag == "add":
                core.input_queue.put(msg)
            elif tag == "window":
                procutil.read_thread_clocks("start")
                window[0] = msg[1]
                core.input_queue.put(msg)
            elif tag == "shutdown":
                procutil.read_thread_clocks("end")
                window[0], window[1] = msg[1], msg[2]
                core.input_queue.put(msg)
                break
    finally:
        procutil.thread_exiting(rec)


def output_thread(core, conn):
    rec = procutil.register_thread("engine-output")
    try:
        while True:
            item = core.output_queue.get()
            if item is None:
                break
            try:
                conn.send(item)
            except (OSError, ValueError):
                core.stop.set()
                break
    finally:
        procutil.thread_exiting(rec)


def run_engine_core(cfg, input_conn, output_conn, parent_pid):
    stop = threading.Event()
    procutil.child_signals(stop)
    procutil.die_with_parent(parent_pid)
    procutil.set_process_title("VLLM::EngineCore")
    main_rec = procutil.register_thread("MainThread", set_comm=False)
    gcmon = gt.GcMonitor(cfg["list_cap"])
    gcmon.install()
    ctx = multiprocessing.get_context("spawn")

    def alive():
        return not stop.is_set() and os.getppid() == parent_pid

    try:
        executor = MultiprocExecutor(cfg, ctx, alive)
    except PeerGone as e:
        output_conn.send(("failed", str(e)))
        return
    core = EngineCore(cfg, executor, stop)
    core.build_heap()
    ready_ns = mono()
    output_conn.send(("ready", {"pid": os.getpid(),
                                "workers": [r["pid"] for r in executor.ready],
                                "worker_info": executor.ready}))
    window = [ready_ns, None]
    it = threading.Thread(target=input_thread, args=(core, input_conn, window),
                          name="engine-input", daemon=True)
    ot = threading.Thread(target=output_thread, args=(core, output_conn), name="engine-output",
                          daemon=True)
    it.start()
    ot.start()
    ended = "shutdown"
    try:
        core.run_busy_loop()
        if not core.shutdown_requested:
            ended = "stopped"
    except PeerGone:
        ended = "stopped" if stop.is_set() else "worker_gone"
    except Exception as e:  # still stop the workers, write the truth and tell the API server
        traceback.print_exc()
        ended = "error: %s" % e
    if window[1] is None:
        procutil.read_thread_clocks("end")
        window[1] = mono()
    procutil.thread_exiting(main_rec)
    workers = executor.shutdown(window)
    core.output_queue.put(None)
    ot.join(10)

    path = None
    if cfg["truth"]:
        start, end = window
        lc = cfg["list_cap"]
        gen_in = sum(n for t, n in core.tokens_log if start <= t < end)
        sched = core.scheduler
        doc = gt.base_doc("engine_core", cfg, window)
        doc.update({
            "title": "VLLM::EngineCore",
            "comm": procutil.read_comm(),
            "cmdline": procutil.read_cmdline(),
            "ended": ended,
            "threads": procutil.threads_doc(),
            "functions": {
                "EngineCore.step": core.step_log.doc(start, end, lc),
                "MessageQueue.enqueue": executor.enqueue_log.doc(start, end, lc),
                "MessageQueue.dequeue": executor.dequeue_log.doc(start, end, lc),
            },
            "gc": gcmon.doc(start, end, lc),
            "heap_lists": cfg["gc_heap"],
            "steps_total": core.steps,
            "generation_tokens": {"total": core.generated, "window": gen_in,
                                  "per_s_window": round(gen_in / max((end - start) / 1e9, 1e-9),
                                                        3)},
            "scheduler": {"finished_requests": sched.finished,
                          "prompt_tokens": sched.prompt_tokens,
                          "prefix_cache_queries": sched.prefix_queries,
                          "prefix_cache_hits": sched.prefix_hits,
                          "num_blocks": sched.pool.num_blocks},
            "workers": workers,
        })
        path = gt.write_truth(cfg["truth"], "engine_core", doc)
    try:
        output_conn.send(("bye", {"truth": path, "workers": workers, "ended": ended}))
    except (OSError, ValueError):
        pass
