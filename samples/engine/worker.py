"""The Worker process (`VLLM::Worker`, or `VLLM::Worker_TP<rank>` with --workers > 1), started by
the EngineCore like vLLM's MultiprocExecutor starts its WorkerProcs.

Main thread: `worker_busy_loop` takes each step's scheduler output from the broadcast
MessageQueue (`MessageQueue.dequeue`), runs `Worker.execute_model` and (rank 0) sends the
sampled tokens back (`MessageQueue.enqueue`). execute_model is about --exec-ms of work: pure
Python (preparing inputs, glue between layers, sampling) and, per layer, a native kernel that
releases the GIL (hashlib.sha256 over a buffer sized at start so that the kernels take their
share of --exec-ms). Each GIL release is a point where the thread must get the GIL back.

`aux-output-writer` thread: the router-replay store of vLLM 0.32 in miniature. At --puts-per-s
(deadline-paced; when nothing new was produced at a deadline it waits for the next step's
output) it takes the routed-expert bytes execute_model produced since its last put and calls
`AuxOutputStore.put`, which calls `AuxOutputStore._evict_to_fit`. The slow store scans all of
its entries in pure Python on every put to find the least recently used one (the scan holds
the GIL: the main thread's execute_model waits for it at its next GIL re-acquisition, up to
the 5 ms switch interval each time); its size is chosen at start so that one scan costs
--evict-ms of CPU. The fixed store (--fixed / --fix evict) is an OrderedDict that evicts
with popitem(last=False) in O(1)."""
import collections
import hashlib
import os
import threading
import time

import groundtruth as gt
import procutil
from shm_broadcast import Control, MessageQueue, PeerGone

mono = time.monotonic_ns
tcpu = time.thread_time_ns

OBJECT_NBYTES = 2048  # one stored object: 128 tokens x 4 layers x top-4 expert ids, uint8
VOCAB = 1024
NEVER = 1 << 62


class AuxOutputStore:
    """Objects keyed by put order, bounded to `capacity` objects of OBJECT_NBYTES. Each entry
    keeps (last-use tick, size); the payload itself is not kept (only its size counts), which
    keeps a store of ~10^5 entries at tens of MB."""

    def __init__(self, capacity, fixed, evict_log=None):
        self.capacity = capacity
        self.max_bytes = capacity * OBJECT_NBYTES
        self.fixed = fixed
        self._entries = collections.OrderedDict() if fixed else {}
        self._total = 0
        self._tick = 0
        self._next_fill = -1
        self.evict_log = evict_log
        self.evicted = 0
        self.puts = 0

    def fill(self, n):
        """Pre-fill with n old entries (negative keys), as a store that has been running."""
        entries = self._entries
        for _ in range(n):
            self._tick += 1
            entries[self._next_fill] = (self._tick, OBJECT_NBYTES)
            self._next_fill -= 1
        self._total += n * OBJECT_NBYTES

    def put(self, key, value):
        nbytes = OBJECT_NBYTES
        t0 = mono()
        c0 = tcpu()
        self._evict_to_fit(nbytes)
        c1 = tcpu()
        t1 = mono()
        if self.evict_log is not None:
            self.evict_log.add(t0, t1, c0, c1)
        self._tick += 1
        self._entries[key] = (self._tick, nbytes)
        self._total += nbytes
        self.puts += 1
        return len(value)

    def _evict_to_fit(self, incoming):
        # One way out (no early returns), like most real methods of this size: a probe's exact
        # method needs one debug register per return instruction.
        entries = self._entries
        if self.fixed:
            while self._total + incoming > self.max_bytes and entries:
                _, (_, nbytes) = entries.popitem(last=False)
                self._total -= nbytes
                self.evicted += 1
        else:
            # The bug: sum every entry's size and find the least recently used one, on every
            # put.
            done = False
            while not done:
                total = 0
                oldest = NEVER
                victim = None
                for key, (tick, nbytes) in entries.items():
                    total += nbytes
                    if tick < oldest:
                        oldest = tick
                        victim = key
                if total + incoming <= self.max_bytes or victim is None:
                    done = True
                else:
                    total -= entries.pop(victim)[1]
                    self.evicted += 1
                    done = total + incoming <= self.max_bytes
                self._total = total
        return self._total

    def scan_cpu_ns(self, rounds=3):
        """Thread-CPU of one full slow scan (min over rounds), without evicting anything."""
        saved = self.max_bytes
        self.max_bytes = NEVER
        fixed = self.fixed
        self.fixed = False
        best = NEVER
        try:
            for _ in range(rounds):
                c0 = tcpu()
                self._evict_to_fit(0)
                best = min(best, tcpu() - c0)
        finally:
            self.max_bytes = saved
            self.fixed = fixed
        return best


def size_store(evict_ms, fixed, evict_log):
    """A store whose slow scan costs about evict_ms of this thread's CPU time: measure the scan
    on a probe store, size the real one, measure it once more and correct once (big dicts scan
    slower per entry than small ones: caches)."""
    probe = AuxOutputStore(50000, False)
    probe.fill(50000)
    per_entry = probe.scan_cpu_ns() / 50000
    del probe
    target_ns = evict_ms * 1e6
    n = max(1000, int(target_ns / per_entry))
    store = AuxOutputStore(n, False)
    store.fill(n)
    measured = store.scan_cpu_ns(2)
    n2 = max(1000, int(n * target_ns / max(measured, 1)))
    if abs(n2 - n) > 0.05 * n:
        store = AuxOutputStore(n2, False)
        store.fill(n2)
        measured = store.scan_cpu_ns(2)
        n = n2
    calib = {"ns_per_entry_probe": round(per_entry, 2), "entries": n,
             "scan_cpu_ms_at_start": round(measured / 1e6, 3)}
    if fixed:
        store = AuxOutputStore(n, True)
        store.fill(n)
    store.evict_log = evict_log
    return store, calib


class AuxOutputWriter:
    """The `aux-output-writer` thread: paced puts of what execute_model produced."""

    def __init__(self, store, puts_per_s, put_log, stop):
        self.store = store
        self.interval_ns = int(1e9 / puts_per_s) if puts_per_s > 0 else 0
        self.put_log = put_log
        self.stop = stop
        self.pending = collections.deque()
        self.data_ready = threading.Event()
        self.next_key = 0
        self.bytes_put = 0

    def submit(self, blob):
        self.pending.append(blob)  # deque.append is atomic: no lock between the two threads
        self.data_ready.set()

    def run(self):
        rec = procutil.register_thread("aux-output-writer")
        try:
            if self.interval_ns:
                self._loop()
            else:
                self.stop.wait()
        finally:
            procutil.thread_exiting(rec)

    def _loop(self):
        store = self.store
        pending = self.pending
        log = self.put_log
        interval = self.interval_ns
        next_t = mono()
        while not self.stop.is_set():
            next_t += interval
            now = mono()
            if next_t > now:
                if self.stop.wait((next_t - now) / 1e9):
                    return
            elif now - next_t > 3 * interval:
                next_t = now  # far behind: no burst of puts to catch up
            # Nothing produced since the last put (the engine stalled): wait for the next step's
            # output rather than skip the slot.
            self.data_ready.clear()
            while not pending:
                if self.stop.is_set():
                    return
                self.data_ready.wait(0.5)
                self.data_ready.clear()
            parts = []
            while pending:
                parts.append(pending.popleft())
            value = b"".join(parts)
            key = self.next_key
            self.next_key += 1
            t0 = mono()
            c0 = tcpu()
            store.put(key, value)
            c1 = tcpu()
            t1 = mono()
            log.add(t0, t1, c0, c1)
            self.bytes_put += len(value)


class Worker:
    """The model runner: execute_model(records) -> [[req_id, token], ...]."""

    def __init__(self, rank, cfg, writer):
        self.rank = rank
        self.block_size = cfg["block_size"]
        self.layers = cfg["layers"]
        self.writer = writer
        self.x = 1
        self._calibrate(cfg["exec_ms"], cfg["python_share"])

    @staticmethod
    def _python_block(n, x):
        for i in range(n):
            x = (x * 31 + i) % 1000003
        return x

    def _calibrate(self, exec_ms, python_share):
        probe = bytes(256 * 1024)
        best = NEVER
        for _ in range(5):
            c0 = tcpu()
            hashlib.sha256(probe).digest()
            best = min(best, tcpu() - c0)
        ns_per_byte = best / len(probe)
        native_ns = exec_ms * 1e6 * (1 - python_share)
        per_layer = max(4096, int(native_ns / self.layers / ns_per_byte))
        self.weights = [bytes([layer + 1]) * per_layer for layer in range(self.layers)]
        best = NEVER
        for _ in range(5):
            c0 = tcpu()
            self._python_block(2000, 1)
            best = min(best, tcpu() - c0)
        ns_per_iter = best / 2000
        python_ns = exec_ms * 1e6 * python_share
        self.iters = max(1, int(python_ns / (self.layers + 2) / ns_per_iter))
        self.calibration = {"sha256_ns_per_byte": round(ns_per_byte, 4),
                            "layer_bytes": per_layer, "python_ns_per_iter": round(ns_per_iter, 2),
                            "python_iters_per_block": self.iters,
                            "python_blocks_per_step": self.layers + 2}

    def execute_model(self, records):
        """Returns the sampled tokens as one flat list: req_id, token, req_id, token, ..."""
        bs = self.block_size
        # Prepare inputs: token ids, positions and paged-KV slots of every scheduled token.
        input_ids = []
        positions = []
        slots = []
        last = []
        for rec in records:
            computed, n_sched, n_blocks = rec[1], rec[2], rec[3]
            blocks = rec[4:4 + n_blocks]
            n_tok = rec[4 + n_blocks]
            input_ids.extend(rec[5 + n_blocks:5 + n_blocks + n_tok])
            for pos in range(computed, computed + n_sched):
                positions.append(pos)
                slots.append(blocks[pos // bs] * bs + pos % bs)
            last.append(len(positions) - 1)
        x = self._python_block(self.iters, self.x + len(input_ids))
        # The forward pass: per layer some Python glue, then a native kernel without the GIL.
        digest = b""
        for layer in range(self.layers):
            x = self._python_block(self.iters, x)
            digest = hashlib.sha256(self.weights[layer]).digest()
        # Sampling, and the routed experts of each new token for the aux-output store.
        out = []
        aux = []
        for k, rec in enumerate(records):
            pos = positions[last[k]]
            out.append(rec[0])
            out.append((digest[k % 32] * 7 + rec[0] * 13 + pos + x) % VOCAB)
            aux.append(digest[(k + pos) % 16:(k + pos) % 16 + 16])
        self.x = self._python_block(self.iters, x)
        self.writer.submit(b"".join(aux))
        return out


def run_worker(cfg, rank, sched_handle, resp_handle, ready_conn, parent_pid):
    stop = threading.Event()
    procutil.child_signals(stop)
    procutil.die_with_parent(parent_pid)
    title = "VLLM::Worker" if cfg["workers"] == 1 else "VLLM::Worker_TP%d" % rank
    procutil.set_process_title(title)
    main_rec = procutil.register_thread("MainThread", set_comm=False)
    fix = set(cfg["fix"])
    gcmon = gt.GcMonitor(cfg["list_cap"])
    gcmon.install()
    cap = cfg["call_cap"]
    logs = {
        "MessageQueue.dequeue": gt.CallLog("MessageQueue.dequeue", MessageQueue.dequeue,
                                           "scheduler output from the EngineCore", cap),
        "Worker.execute_model": gt.CallLog("Worker.execute_model", Worker.execute_model,
                                           "one model step", cap),
        "AuxOutputStore.put": gt.CallLog("AuxOutputStore.put", AuxOutputStore.put,
                                         "aux-output-writer thread", cap),
        "AuxOutputStore._evict_to_fit": gt.CallLog(
            "AuxOutputStore._evict_to_fit", AuxOutputStore._evict_to_fit,
            "called by put, aux-output-writer thread", cap),
    }
    if resp_handle is not None:
        logs["MessageQueue.enqueue"] = gt.CallLog("MessageQueue.enqueue", MessageQueue.enqueue,
                                                  "sampled tokens to the EngineCore", cap)

    def alive():
        return not stop.is_set() and os.getppid() == parent_pid

    packed = "queue" in fix
    sched_mq = MessageQueue(sched_handle, "reader", rank, packed, alive)
    resp_mq = MessageQueue(resp_handle, "writer", 0, packed, alive) if resp_handle else None
    sched_mq.body_log = logs["MessageQueue.dequeue"]
    if resp_mq is not None:
        resp_mq.body_log = logs["MessageQueue.enqueue"]

    store, store_calib = size_store(cfg["evict_ms"], "evict" in fix,
                                    logs["AuxOutputStore._evict_to_fit"])
    writer_stop = threading.Event()
    writer = AuxOutputWriter(store, cfg["puts_per_s"], logs["AuxOutputStore.put"], writer_stop)
    worker = Worker(rank, cfg, writer)
    wt = threading.Thread(target=writer.run, name="aux-output-writer", daemon=True)
    wt.start()
    ready_ns = mono()
    ready_conn.send(("ready", {"rank": rank, "pid": os.getpid(), "store": store_calib,
                               "calibration": worker.calibration}))

    window = [ready_ns, None]
    ended = "shutdown"
    steps = 0
    dq = logs["MessageQueue.dequeue"]
    ex = logs["Worker.execute_model"]
    eq = logs.get("MessageQueue.enqueue")
    try:
        while True:
            t0 = mono()
            c0 = tcpu()
            msg = sched_mq.dequeue()
            c1 = tcpu()
            t1 = mono()
            if isinstance(msg, Control):
                tag = msg.obj[0]
                if tag == "window":
                    procutil.read_thread_clocks("start")
                    window[0] = msg.obj[1]
                elif tag == "shutdown":
                    procutil.read_thread_clocks("end")
                    window = [msg.obj[1], msg.obj[2]]
                    break
                continue
            dq.add(t0, t1, c0, c1, len(msg))
            t0 = mono()
            c0 = tcpu()
            out = worker.execute_model(msg)
            c1 = tcpu()
            t1 = mono()
            ex.add(t0, t1, c0, c1)
            steps += 1
            if resp_mq is not None:
                t0 = mono()
                c0 = tcpu()
                resp_mq.enqueue([out])
                c1 = tcpu()
                t1 = mono()
                eq.add(t0, t1, c0, c1)
    except PeerGone:
        ended = "engine_core_gone" if os.getppid() != parent_pid else "stopped"
        procutil.read_thread_clocks("end")
    if window[1] is None:
        window[1] = mono()
    writer_stop.set()
    wt.join(10)
    procutil.thread_exiting(main_rec)

    path = None
    if cfg["truth"]:
        start, end = window
        lc = cfg["list_cap"]
        doc = gt.base_doc("worker", cfg, window)
        puts_in = logs["AuxOutputStore.put"].doc(start, end, 0)["calls"]
        doc.update({
            "rank": rank,
            "title": title,
            "comm": procutil.read_comm(),
            "cmdline": procutil.read_cmdline(),
            "ended": ended,
            "threads": procutil.threads_doc(),
            "functions": {k: v.doc(start, end, lc) for k, v in logs.items()},
            "gc": gcmon.doc(start, end, lc),
            "steps_total": steps,
            "aux_store": dict(store_calib, fixed=store.fixed, capacity=store.capacity,
                              puts_total=store.puts, evicted_total=store.evicted,
                              puts_per_s_target=cfg["puts_per_s"],
                              puts_per_s_window=round(puts_in / max((end - start) / 1e9, 1e-9),
                                                      3),
                              writer_thread="aux-output-writer"),
            "execute_model": worker.calibration,
        })
        path = gt.write_truth(cfg["truth"], "worker", doc)
    try:
        ready_conn.send(("done", path))
    except OSError:
        pass
    sched_mq.close()
    if resp_mq is not None:
        resp_mq.close()
