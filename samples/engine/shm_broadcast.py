"""A message queue over a shared-memory ring buffer, after vLLM's
vllm/distributed/device_communicators/shm_broadcast.py: one writer, one or more readers (the
EngineCore broadcasts each step's scheduler output to every tensor-parallel Worker; Worker 0
sends the sampled tokens back on a queue of its own).

The ring is one `multiprocessing.shared_memory` segment (`/dev/shm/psm_*`, as in vLLM): n_chunks
fixed-size data chunks, then a metadata area with one byte per chunk saying "written" and one
byte per reader saying "read by reader r" (vLLM's layout). The handshake is two counting
semaphores per reader (`/dev/shm/sem.mp-*`, again as in vLLM's process tree): `data[r]` counts
chunks written (and announced: a message's chunks are announced together after its last one)
and not yet taken by reader r, `space[r]` counts chunks reader r has freed. The writer takes
one `space` credit from every reader before it overwrites a chunk, so a chunk is reused only
once every reader has read it; the metadata bytes record the same facts and are checked. A
waiting side blocks in sem_timedwait with the GIL released (off-CPU, like a real engine
waiting for its peer) and wakes every `poll_s` to see whether its peer died.

What goes through it: a message is a list of records, each record a list of ints (one
scheduled request of a step, or one sampled token).

  slow path (the bug):  every record is pickled on its own and written as its own chunk,
                        behind a header chunk: one full handshake per request per step.
  packed path (--fixed): all records packed into one array('i') blob, one chunk, built by
                        one C call per step (the records' lengths, then their ints; the
                        EngineCore's records are arrays already, joined as bytes): no
                        Python-level work per request on the sending side.

Control messages (window start, shutdown) are one pickled chunk and are not timed."""
import pickle
import struct
from itertools import chain
import time
from contextlib import contextmanager
from array import array
from multiprocessing import shared_memory

HEADER = struct.Struct("<IIQ")  # kind, count, payload bytes
KIND_PICKLED_HEAD = 1  # `count` KIND_PICKLED_RECORD chunks follow
KIND_PICKLED_RECORD = 2
KIND_PACKED = 3  # one array('i') blob: the `count` records' lengths, then all their ints
KIND_CONTROL = 4  # one pickled object


class PeerGone(Exception):
    """The process on the other end of the queue is gone (or we were told to stop)."""


class Control:
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj


class Handle:
    """What the other side needs to attach (passed to a child when it is spawned, since
    semaphores can only be handed over then)."""

    def __init__(self, name, n_readers, n_chunks, max_chunk_bytes, data_sems, space_sems):
        self.name = name
        self.n_readers = n_readers
        self.n_chunks = n_chunks
        self.max_chunk_bytes = max_chunk_bytes
        self.data_sems = data_sems
        self.space_sems = space_sems


class MessageQueue:
    def __init__(self, handle, role, rank=0, packed=False, alive=None, poll_s=0.5, owner=False,
                 shm=None):
        self.handle = handle
        self.role = role  # "writer" or "reader"
        self.rank = rank
        self.packed = packed
        self.alive = alive  # callable: False once the peer is gone or we should stop
        self.poll_s = poll_s
        self.owner = owner
        self.shm = shm if shm is not None else shared_memory.SharedMemory(name=handle.name)
        self.buf = self.shm.buf
        self.n_readers = handle.n_readers
        self.n_chunks = handle.n_chunks
        self.chunk = handle.max_chunk_bytes
        self.meta_base = self.n_chunks * self.chunk
        self.meta_stride = 1 + self.n_readers
        self.index = 0
        self.unposted = 0
        # Ground truth timed inside the call (groundtruth.CallLog.add_body), where a probe
        # times it: the caller's clock also holds what it waits for around the call (the GIL,
        # on a thread that shares it with a writer).
        self.body_log = None
        if role == "reader":
            self.data_sem = handle.data_sems[rank]
            self.space_sem = handle.space_sems[rank]

    @classmethod
    def create(cls, ctx, n_readers, n_chunks, max_chunk_bytes):
        """Allocate the ring and its semaphores; returns the handle. The creating process
        attaches with `MessageQueue(handle, role, ..., owner=True, shm=shm)` and unlinks at
        exit."""
        size = n_chunks * max_chunk_bytes + n_chunks * (1 + n_readers)
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[n_chunks * max_chunk_bytes:size] = bytes(size - n_chunks * max_chunk_bytes)
        handle = Handle(shm.name, n_readers, n_chunks, max_chunk_bytes,
                        [ctx.Semaphore(0) for _ in range(n_readers)],
                        [ctx.Semaphore(n_chunks) for _ in range(n_readers)])
        return handle, shm

    # --- the handshake (shaped like vLLM's ShmRingBuffer / MessageQueue) ---------------------

    @contextmanager
    def get_data(self, i):
        view = self.buf[i * self.chunk:(i + 1) * self.chunk]
        try:
            yield view
        finally:
            view.release()

    @contextmanager
    def get_metadata(self, i):
        m = self.meta_base + i * self.meta_stride
        view = self.buf[m:m + self.meta_stride]
        try:
            yield view
        finally:
            view.release()

    def _wait(self, sem):
        if sem.acquire(False):
            return
        self.flush()  # never block with chunks the readers were not told about
        while not sem.acquire(True, self.poll_s):
            if self.alive is not None and not self.alive():
                raise PeerGone(self.handle.name)

    def flush(self):
        """Tell the readers about the chunks written since the last flush. A message's chunks
        are announced together, after its last one, so a reader wakes once per message (a
        real engine's readers spin instead; waking per chunk would measure the scheduler)."""
        n = self.unposted
        self.unposted = 0
        for sem in self.handle.data_sems:
            for _ in range(n):
                sem.release()

    @contextmanager
    def acquire_write(self):
        """Yields the next chunk once every reader has read what it held."""
        for sem in self.handle.space_sems:
            self._wait(sem)
        with self.get_metadata(self.index) as meta:
            read_count = sum(meta[1:])
            if meta[0] and read_count != self.n_readers:
                raise RuntimeError("chunk %d reused before every reader read it" % self.index)
            meta[0] = 0
            with self.get_data(self.index) as buf:
                yield buf
            # order matters: clear the read flags before raising the written flag
            for r in range(1, self.n_readers + 1):
                meta[r] = 0
            meta[0] = 1
        self.unposted += 1
        self.index = (self.index + 1) % self.n_chunks

    @contextmanager
    def acquire_read(self):
        """Yields the next chunk written and not yet read by this reader."""
        self._wait(self.data_sem)
        with self.get_metadata(self.index) as meta:
            if not meta[0] or meta[1 + self.rank]:
                raise RuntimeError("chunk %d signalled but not written for reader %d"
                                   % (self.index, self.rank))
            with self.get_data(self.index) as buf:
                yield buf
            meta[1 + self.rank] = 1
        self.space_sem.release()
        self.index = (self.index + 1) % self.n_chunks

    def _write_chunk(self, kind, count, payload):
        n = len(payload)
        if n + HEADER.size > self.chunk:
            raise ValueError("message of %d bytes does not fit a %d-byte chunk" % (n, self.chunk))
        with self.acquire_write() as buf:
            HEADER.pack_into(buf, 0, kind, count, n)
            buf[HEADER.size:HEADER.size + n] = payload

    # --- the API --------------------------------------------------------------------------

    def enqueue(self, records):
        """Send one message: a list of records (lists of ints)."""
        log = self.body_log
        t0 = time.perf_counter_ns() if log is not None else 0
        if self.packed:
            lengths = array("i", map(len, records))
            if records and type(records[0]) is array:
                # Records kept as arrays (the EngineCore's): their bytes joined, a memcpy each.
                payload = lengths.tobytes() + b"".join(records)
            else:
                lengths.extend(chain.from_iterable(records))
                payload = memoryview(lengths).cast("B")
            self._write_chunk(KIND_PACKED, len(records), payload)
        else:
            self._write_chunk(KIND_PICKLED_HEAD, len(records), b"")
            for rec in records:
                self._write_chunk(KIND_PICKLED_RECORD, 0, pickle.dumps(rec))
        self.flush()
        if log is not None:
            log.add_body(t0, time.perf_counter_ns())

    def dequeue(self):
        """Receive one message: its list of records, or a Control."""
        # One way out (see worker.AuxOutputStore._evict_to_fit).
        log = self.body_log
        t0 = time.perf_counter_ns() if log is not None else 0
        result = None
        with self.acquire_read() as buf:
            kind, count, n = HEADER.unpack_from(buf, 0)
            payload = buf[HEADER.size:HEADER.size + n]
            try:
                if kind == KIND_PACKED:
                    blob = array("i")
                    blob.frombytes(payload)
                elif kind == KIND_CONTROL:
                    result = Control(pickle.loads(payload))
                elif kind != KIND_PICKLED_HEAD:
                    raise RuntimeError("unexpected chunk kind %d" % kind)
            finally:
                payload.release()
        if result is None:
            records = []
            if kind == KIND_PACKED:
                pos = count
                for n in blob[:count]:
                    records.append(blob[pos:pos + n].tolist())
                    pos += n
            else:
                for _ in range(count):
                    with self.acquire_read() as buf:
                        kind, _, n = HEADER.unpack_from(buf, 0)
                        if kind != KIND_PICKLED_RECORD:
                            raise RuntimeError("expected a record chunk, got kind %d" % kind)
                        payload = buf[HEADER.size:HEADER.size + n]
                        try:
                            records.append(pickle.loads(payload))
                        finally:
                            payload.release()
            result = records
        if log is not None:
            log.add_body(t0, time.perf_counter_ns())
        return result

    def enqueue_control(self, obj):
        self._write_chunk(KIND_CONTROL, 0, pickle.dumps(obj))
        self.flush()

    def close(self):
        self.buf = None
        try:
            self.shm.close()
        except (BufferError, OSError):
            pass
        if self.owner:
            try:
                self.shm.unlink()
            except OSError:
                pass

