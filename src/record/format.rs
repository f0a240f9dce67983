//! The `.esrec` file format, version 1 (docs/recording-format.md).
//!
//! `ESREC\0` + u16 version, then records `[tag: u8][len: varint][payload]`. Payloads are JSON
//! for rare records (meta, processes, threads, counters, end) and LEB128 varints for the
//! frequent ones (frames, stacks, samples, off-CPU intervals). Records are only ever appended
//! and the writer flushes whole records, so a recorder killed at any moment leaves a file that
//! reads cleanly up to its last flush.

use std::collections::HashMap;
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use anyhow::{bail, Context};

use super::model::*;
use super::profile::{self, Accumulator, AggregateOptions, CallKey, GilKey, OffCpuKey, SampleKey};

pub const MAGIC: &[u8; 6] = b"ESREC\0";
pub const VERSION: u16 = 1;

mod tag {
    pub const META: u8 = 1;
    pub const PROCESS: u8 = 2;
    pub const THREAD: u8 = 3;
    pub const FRAME: u8 = 4;
    pub const STACK: u8 = 5;
    pub const SAMPLE: u8 = 6;
    pub const OFFCPU: u8 = 7;
    pub const COUNTERS: u8 = 8;
    pub const END: u8 = 9;
    pub const GIL_WAIT: u8 = 10;
    pub const GC_PAUSE: u8 = 11;
    pub const ENGINE: u8 = 12;
    pub const SERIES: u8 = 13;
    pub const METRIC: u8 = 14;
    pub const SCRAPE_ERROR: u8 = 15;
    pub const PROBE: u8 = 16;
    pub const CALL: u8 = 17;
    pub const TASK: u8 = 18;
    pub const GC_METHOD: u8 = 19;
    pub const PROBE_WATCH: u8 = 20;
    /// Aggregated events (`record::profile`): an interval, then what it added up.
    pub const INTERVAL: u8 = 21;
    pub const SAMPLES: u8 = 22;
    pub const OFFCPU_SUM: u8 = 23;
    pub const GIL_WAIT_SUM: u8 = 24;
    pub const CALL_HIST: u8 = 25;
}

/// The most events one aggregated record may stand for (a reader expands them): far above
/// what one thread does in an interval, a bound against a corrupt count.
const MAX_AGGREGATED_COUNT: u64 = 1 << 24;

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

struct Cur<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cur<'_> {
    fn varint(&mut self) -> anyhow::Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&b) = self.b.get(self.i) else {
                bail!("truncated varint")
            };
            self.i += 1;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!("varint too long")
    }
    fn u8(&mut self) -> anyhow::Result<u8> {
        let Some(&b) = self.b.get(self.i) else {
            bail!("truncated")
        };
        self.i += 1;
        Ok(b)
    }
    fn str(&mut self) -> anyhow::Result<String> {
        let n = self.varint()? as usize;
        let end = self
            .i
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .context("truncated string")?;
        let s = String::from_utf8_lossy(&self.b[self.i..end]).into_owned();
        self.i = end;
        Ok(s)
    }
    fn i32(&mut self) -> anyhow::Result<i32> {
        i32::try_from(unzigzag(self.varint()?)).context("id out of range")
    }
}

/// Spaces after the header's JSON, for [`RecordingWriter::restart_meta`].
const META_SLACK: usize = 48;

/// Appends records to a recording file. Stacks and frames are interned: each distinct frame
/// and stack is written once and referred to by index.
pub struct RecordingWriter {
    out: BufWriter<std::fs::File>,
    frames: HashMap<Frame, u32>,
    stacks: HashMap<Vec<u32>, u32>,
    /// Native and kernel frames: written with their description when first interned (kept
    /// across rotations, so a carried stack keeps its kinds).
    native: HashMap<Frame, NativeFrameInfo>,
    buf: Vec<u8>,
    bytes: u64,
    samples: u64,
    last_sample_ns: u64,
    /// Set for a rotating recording: the tables a new segment starts with.
    carried: Option<Carried>,
    /// Rotations so far: frame and stack ids are only valid within one generation.
    generation: u64,
    /// Set when events are stored aggregated per interval ([`Self::aggregate`]).
    profile: Option<Profile>,
    /// Where this file's `META` payload lies and how long it is (padded with spaces, so that
    /// [`Self::restart_meta`] can write the window's real start over it).
    meta_at: (u64, usize),
    /// The file's blocks are allocated up to here ahead of what is written ([`RESERVE`]);
    /// `None` where the filesystem cannot (no `fallocate`).
    reserved_to: Option<u64>,
}

/// Space kept allocated ahead of a recording's end, so that when its filesystem fills the
/// recording still ends with its counters and end record: [`RecordingWriter::flush`] allocates
/// the next stretch (`fallocate`, size unchanged) once half of it is used, smaller ones
/// ([`RESERVE_TAIL`]) when the filesystem is nearly full, and stops the recording
/// ([`DiskFull`]) when it cannot give even those. What the recorder writes between two
/// flushes (200 ms: ~12 KiB at 999 Hz on one busy thread) and its end fit in the tail.
pub const RESERVE: u64 = 256 << 10;
/// The least kept ahead: when the filesystem cannot give even this, the recording stops
/// (what the recorder writes between two flushes, and its end, fit in it).
pub const RESERVE_TAIL: u64 = 64 << 10;

/// The filesystem holding a recording is full: the recording was stopped, complete up to here.
#[derive(Debug)]
pub struct DiskFull {
    pub bytes: u64,
}

impl std::fmt::Display for DiskFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the filesystem is full (No space left on device): the recording was stopped after {} bytes and ends there, readable",
            self.bytes
        )
    }
}

impl std::error::Error for DiskFull {}

/// Allocate `len` bytes of `f` from `at` on without changing its size. Err(ENOSPC) when the
/// filesystem is full; other errors where it cannot.
fn allocate_ahead(f: &std::fs::File, at: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fallocate on a descriptor we own, with in-range offsets; no memory passed.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_KEEP_SIZE,
            at.min(i64::MAX as u64) as libc::off_t,
            len as libc::off_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A writer's aggregation state (`record::profile`).
struct Profile {
    opts: AggregateOptions,
    /// Start of the interval being added up (ns since the segment's start).
    start_ns: u64,
    acc: Accumulator,
    /// API-server processes: their main thread runs the event loop.
    api_servers: std::collections::HashSet<i32>,
    /// Threads seen running an asyncio task.
    loop_threads: std::collections::HashSet<(i32, i32)>,
}

impl Profile {
    /// Whether the thread's events are written one by one (views need them so: stalls).
    fn raw(&self, pid: i32, tid: i32) -> bool {
        (tid == pid && self.api_servers.contains(&pid)) || self.loop_threads.contains(&(pid, tid))
    }
}

/// The latest description of everything a segment's events refer to (other than frames and
/// stacks), kept by a rotating writer so that each segment reads on its own.
#[derive(Default)]
struct Carried {
    processes: std::collections::BTreeMap<i32, ProcessInfo>,
    threads: std::collections::BTreeMap<(i32, i32), ThreadInfo>,
    engines: std::collections::BTreeMap<String, EngineInfo>,
    /// Metric series of the engines still present, under the ids the caller gives them
    /// (the scraper's); `series_ids` maps those to this file's dense ids, so that series of
    /// engines gone are dropped at a rotation and engines coming and going for hours keep
    /// the tables bounded. Points of a series not in the map are dropped.
    series: Vec<MetricSeries>,
    series_ids: HashMap<u32, u32>,
    /// Probes of the processes still present, likewise under the caller's ids, with
    /// `probe_ids` mapping them to this file's.
    probes: Vec<ProbeInfo>,
    probe_ids: HashMap<u32, u32>,
    /// Exact probes' watches on now (caller's probe id, tid), repeated at time 0 of the next
    /// segment.
    watches: std::collections::BTreeSet<(u32, i32)>,
    /// How each process's GC is timed, repeated in each segment.
    gc_methods: std::collections::BTreeMap<i32, GcMethodInfo>,
    /// The task each event-loop thread runs (threads running none left out).
    tasks: std::collections::BTreeMap<(i32, i32), TaskChange>,
}

/// The stack table of a finished segment, to carry the stacks that open intervals still refer
/// to into the next one ([`RecordingWriter::rotate`]).
pub struct StackCarry {
    frames: Vec<Frame>,
    stacks: Vec<Vec<u32>>,
}

impl StackCarry {
    /// The id in the new segment of the stack that was `old` in the previous one (0, the empty
    /// stack, for an id the previous segment did not have).
    pub fn carry(&self, w: &mut RecordingWriter, old: u32) -> anyhow::Result<u32> {
        let Some(ids) = self.stacks.get(old as usize) else {
            return Ok(0);
        };
        let frames: Vec<Frame> = ids
            .iter()
            .filter_map(|&f| self.frames.get(f as usize).cloned())
            .collect();
        w.intern_stack(&frames)
    }
}

impl RecordingWriter {
    pub fn create(path: &Path, meta: &Meta) -> anyhow::Result<Self> {
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = RecordingWriter {
            out: BufWriter::with_capacity(1 << 16, f),
            frames: HashMap::new(),
            native: HashMap::new(),
            stacks: HashMap::new(),
            buf: Vec::with_capacity(256),
            bytes: 0,
            samples: 0,
            last_sample_ns: 0,
            carried: None,
            generation: 0,
            profile: None,
            meta_at: (0, 0),
            reserved_to: Some(0),
        };
        w.header(meta)?;
        w.keep_reserve()?;
        Ok(w)
    }

    /// A writer whose recording can be continued in a new file ([`Self::rotate`]).
    pub fn create_rotating(path: &Path, meta: &Meta) -> anyhow::Result<Self> {
        let mut w = Self::create(path, meta)?;
        w.carried = Some(Carried::default());
        Ok(w)
    }

    /// Store samples, off-CPU intervals, GIL waits and probed calls added up per interval
    /// (`record::profile`), except those of event-loop threads; in a rotating recording, keep
    /// only the metric series `opts.keep_series` names. The caller calls
    /// [`Self::profile_tick`] often; rotations and the end write the interval so far.
    pub fn aggregate(&mut self, opts: AggregateOptions) {
        self.profile = Some(Profile {
            opts: AggregateOptions {
                interval_ns: opts.interval_ns.max(1),
                ..opts
            },
            start_ns: 0,
            acc: Accumulator::default(),
            api_servers: Default::default(),
            loop_threads: Default::default(),
        });
    }

    /// Whether events are stored aggregated.
    pub fn aggregating(&self) -> bool {
        self.profile.is_some()
    }

    /// `now_ns` (since the segment's start): write the interval when it is over.
    /// Whether the aggregation interval ends by `now_ns` (what [`Self::profile_tick`] writes).
    pub fn profile_due(&self, now_ns: u64) -> bool {
        self.profile
            .as_ref()
            .is_some_and(|p| now_ns >= p.start_ns.saturating_add(p.opts.interval_ns))
    }

    pub fn profile_tick(&mut self, now_ns: u64) -> anyhow::Result<()> {
        match &self.profile {
            Some(p) if now_ns >= p.start_ns.saturating_add(p.opts.interval_ns) => {
                self.write_profile(now_ns)
            }
            _ => Ok(()),
        }
    }

    /// Write what the interval added up, as ending at `end_ns`, and start the next there.
    fn write_profile(&mut self, end_ns: u64) -> anyhow::Result<()> {
        let Some(p) = self.profile.as_mut() else {
            return Ok(());
        };
        let start = p.start_ns;
        p.start_ns = end_ns.max(start);
        if p.acc.is_empty() {
            return Ok(());
        }
        let acc = std::mem::take(&mut p.acc);
        self.buf.clear();
        put_varint(&mut self.buf, start);
        put_varint(&mut self.buf, end_ns.max(start));
        self.record(tag::INTERVAL)?;
        let mut samples: Vec<_> = acc.samples.iter().collect();
        samples.sort_unstable_by_key(|(k, _)| **k);
        for (k, v) in samples {
            self.buf.clear();
            put_varint(&mut self.buf, zigzag(k.pid as i64));
            put_varint(&mut self.buf, zigzag(k.tid as i64));
            put_varint(&mut self.buf, k.stack as u64);
            self.buf.push(k.flags);
            put_varint(&mut self.buf, v.count);
            put_varint(&mut self.buf, v.sum_ns);
            self.samples += v.count;
            self.record(tag::SAMPLES)?;
        }
        let mut off: Vec<_> = acc.offcpu.iter().collect();
        off.sort_unstable_by_key(|(k, _)| **k);
        for (k, v) in off {
            self.buf.clear();
            put_varint(&mut self.buf, zigzag(k.pid as i64));
            put_varint(&mut self.buf, zigzag(k.tid as i64));
            put_varint(&mut self.buf, k.stack as u64);
            self.buf.push(k.preempted as u8);
            put_varint(&mut self.buf, v.count);
            put_varint(&mut self.buf, v.sum_ns);
            self.record(tag::OFFCPU_SUM)?;
        }
        let mut gil: Vec<_> = acc.gil.iter().collect();
        gil.sort_unstable_by_key(|(k, _)| **k);
        for (k, v) in gil {
            self.buf.clear();
            put_varint(&mut self.buf, zigzag(k.pid as i64));
            put_varint(&mut self.buf, zigzag(k.tid as i64));
            put_varint(&mut self.buf, zigzag(k.holder_tid as i64));
            put_varint(&mut self.buf, k.holder_stack as u64);
            put_varint(&mut self.buf, k.waiter_stack as u64);
            self.buf.push(k.switch_wait as u8);
            put_varint(&mut self.buf, v.count);
            put_varint(&mut self.buf, v.sum_ns);
            self.record(tag::GIL_WAIT_SUM)?;
        }
        for (k, h) in acc.call_hists() {
            self.buf.clear();
            put_varint(&mut self.buf, zigzag(k.pid as i64));
            put_varint(&mut self.buf, zigzag(k.tid as i64));
            put_varint(&mut self.buf, k.probe as u64);
            put_varint(&mut self.buf, h.count);
            put_varint(&mut self.buf, h.sum_ns);
            put_varint(&mut self.buf, h.buckets.len() as u64);
            let mut prev = 0u32;
            for (b, n) in &h.buckets {
                put_varint(&mut self.buf, (b - prev) as u64);
                put_varint(&mut self.buf, *n);
                prev = *b;
            }
            self.record(tag::CALL_HIST)?;
        }
        Ok(())
    }

    fn header(&mut self, meta: &Meta) -> anyhow::Result<()> {
        self.out.write_all(MAGIC)?;
        self.out.write_all(&VERSION.to_le_bytes())?;
        self.bytes = 8;
        self.buf.clear();
        serde_json::to_writer(&mut self.buf, meta)?;
        // Room for the start written again when the window begins (JSON allows the spaces).
        self.buf.resize(self.buf.len() + META_SLACK, b' ');
        let len = self.buf.len();
        self.record(tag::META)?;
        self.meta_at = (self.bytes - len as u64, len);
        // Stack 0 is the empty stack.
        self.intern_stack(&[])?;
        // The header is on disk before anything else happens: a recorder killed at once still
        // leaves a readable (empty) recording.
        self.out.flush()?;
        Ok(())
    }

    /// Write `meta` over this file's header record (same length, padded): the recording's
    /// start is known only once its targets are attached and their probes set, after the
    /// file was created. Fails, changing nothing, if it does not fit.
    pub fn restart_meta(&mut self, meta: &Meta) -> anyhow::Result<()> {
        use std::io::{Seek, SeekFrom};
        let (at, len) = self.meta_at;
        let mut json = serde_json::to_vec(meta)?;
        anyhow::ensure!(
            at > 0 && json.len() <= len,
            "the recording's header has no room for its start"
        );
        json.resize(len, b' ');
        self.out.flush()?;
        let f = self.out.get_mut();
        f.seek(SeekFrom::Start(at))?;
        f.write_all(&json)?;
        f.seek(SeekFrom::End(0))?;
        Ok(())
    }

    /// Finish this file with `end` and go on in a new file at `path` that reads on its own:
    /// header with `meta` (its own start), then the processes and threads for which `alive`
    /// holds (`alive(pid, None)` for a process, `alive(pid, Some(tid))` for a thread), the
    /// engines with a live process (or none at all: a remote engine), their metric series
    /// (numbered afresh; points keep naming them by the caller's ids) and every probe under
    /// the same id, all at time 0. Frames and stacks start afresh; the
    /// returned [`StackCarry`] maps stack ids still held by the caller into the new file.
    /// Only for writers made with [`Self::create_rotating`].
    pub fn rotate(
        &mut self,
        path: &Path,
        meta: &Meta,
        end: &EndInfo,
        alive: &dyn Fn(i32, Option<i32>) -> bool,
    ) -> anyhow::Result<StackCarry> {
        anyhow::ensure!(
            self.carried.is_some(),
            "rotate on a writer not made with create_rotating"
        );
        self.write_profile(end.duration_ns)?;
        if let Some(p) = self.profile.as_mut() {
            p.start_ns = 0;
        }
        self.json(tag::END, end)?;
        self.out.flush()?;
        self.release_reserve();
        self.out.get_ref().sync_data().ok();
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        self.out = BufWriter::with_capacity(1 << 16, f);
        self.reserved_to = self.reserved_to.map(|_| 0);
        // Ids are dense from 0, so sorting by id gives the tables back in order.
        let mut frames: Vec<(u32, Frame)> = self.frames.drain().map(|(f, id)| (id, f)).collect();
        frames.sort_unstable_by_key(|(id, _)| *id);
        let frames: Vec<Frame> = frames.into_iter().map(|(_, f)| f).collect();
        let mut stacks: Vec<(u32, Vec<u32>)> = self.stacks.drain().map(|(s, id)| (id, s)).collect();
        stacks.sort_unstable_by_key(|(id, _)| *id);
        let stacks: Vec<Vec<u32>> = stacks.into_iter().map(|(_, s)| s).collect();
        self.generation += 1;
        self.samples = 0;
        self.last_sample_ns = 0;
        self.header(meta)?;
        let mut c = self.carried.take().unwrap_or_default();
        c.processes.retain(|&pid, _| alive(pid, None));
        c.threads
            .retain(|&(pid, tid), _| c.processes.contains_key(&pid) && alive(pid, Some(tid)));
        c.engines.retain(|_, e| {
            let pids = e.pids();
            pids.is_empty() || pids.iter().any(|&p| alive(p, None))
        });
        if let Some(p) = self.profile.as_mut() {
            p.api_servers.retain(|&pid| alive(pid, None));
            p.loop_threads
                .retain(|&(pid, tid)| alive(pid, None) && alive(pid, Some(tid)));
        }
        let res = (|| {
            for p in c.processes.values() {
                self.json(tag::PROCESS, p)?;
            }
            for t in c.threads.values() {
                self.json(
                    tag::THREAD,
                    &ThreadInfo {
                        t_ns: 0,
                        ..t.clone()
                    },
                )?;
            }
            for e in c.engines.values() {
                self.json(
                    tag::ENGINE,
                    &EngineInfo {
                        t_ns: 0,
                        ..e.clone()
                    },
                )?;
            }
            c.series.retain(|s| c.engines.contains_key(&s.engine));
            c.series_ids.clear();
            for (local, s) in c.series.iter().enumerate() {
                c.series_ids.insert(s.id, local as u32);
                self.json(
                    tag::SERIES,
                    &MetricSeries {
                        id: local as u32,
                        ..s.clone()
                    },
                )?;
            }
            c.tasks
                .retain(|&(pid, tid), _| c.threads.contains_key(&(pid, tid)));
            for t in c.tasks.values() {
                self.json(
                    tag::TASK,
                    &TaskChange {
                        t_ns: 0,
                        ..t.clone()
                    },
                )?;
            }
            c.probes.retain(|p| c.processes.contains_key(&p.pid));
            c.probe_ids.clear();
            for (local, p) in c.probes.iter().enumerate() {
                c.probe_ids.insert(p.id, local as u32);
                self.json(
                    tag::PROBE,
                    &ProbeInfo {
                        id: local as u32,
                        t_ns: 0,
                        ..p.clone()
                    },
                )?;
            }
            c.gc_methods.retain(|pid, _| c.processes.contains_key(pid));
            for g in c.gc_methods.values() {
                self.json(
                    tag::GC_METHOD,
                    &GcMethodInfo {
                        t_ns: 0,
                        ..g.clone()
                    },
                )?;
            }
            c.watches
                .retain(|(probe, _)| c.probe_ids.contains_key(probe));
            let on: Vec<(u32, i32)> = c
                .watches
                .iter()
                .filter_map(|&(probe, tid)| Some((*c.probe_ids.get(&probe)?, tid)))
                .collect();
            for (probe, tid) in on {
                self.put_watch(&ProbeWatch {
                    t_ns: 0,
                    probe,
                    tid,
                    on: true,
                })?;
            }
            anyhow::Ok(())
        })();
        self.carried = Some(c);
        res?;
        Ok(StackCarry { frames, stacks })
    }

    fn record(&mut self, tag: u8) -> anyhow::Result<()> {
        let mut head = [0u8; 11];
        head[0] = tag;
        let mut n = 1;
        let mut len = self.buf.len() as u64;
        loop {
            let b = (len & 0x7f) as u8;
            len >>= 7;
            head[n] = if len == 0 { b } else { b | 0x80 };
            n += 1;
            if len == 0 {
                break;
            }
        }
        self.out.write_all(&head[..n])?;
        self.out.write_all(&self.buf)?;
        self.bytes += (n + self.buf.len()) as u64;
        Ok(())
    }

    fn json<T: serde::Serialize>(&mut self, tag: u8, v: &T) -> anyhow::Result<()> {
        self.buf.clear();
        serde_json::to_writer(&mut self.buf, v)?;
        self.record(tag)
    }

    pub fn process(&mut self, p: &ProcessInfo) -> anyhow::Result<()> {
        if let Some(pr) = &mut self.profile {
            if p.role == pr.opts.event_loop_role {
                pr.api_servers.insert(p.pid);
            }
        }
        if let Some(c) = &mut self.carried {
            c.processes.insert(p.pid, p.clone());
        }
        self.json(tag::PROCESS, p)
    }

    pub fn thread(&mut self, t: &ThreadInfo) -> anyhow::Result<()> {
        if let Some(c) = &mut self.carried {
            c.threads.insert((t.pid, t.tid), t.clone());
        }
        self.json(tag::THREAD, t)
    }

    /// An event-loop thread's running task changed (record 18).
    pub fn task_change(&mut self, t: &TaskChange) -> anyhow::Result<()> {
        if let Some(pr) = &mut self.profile {
            if t.task.is_some() {
                pr.loop_threads.insert((t.pid, t.tid));
            }
        }
        if let Some(c) = &mut self.carried {
            if t.task.is_some() {
                c.tasks.insert((t.pid, t.tid), t.clone());
            } else {
                c.tasks.remove(&(t.pid, t.tid));
            }
        }
        self.json(tag::TASK, t)
    }

    pub fn counters(&mut self, c: &std::collections::BTreeMap<String, u64>) -> anyhow::Result<()> {
        self.json(tag::COUNTERS, c)
    }

    /// Frame and stack ids given before a rotation are not valid after it: a caller that
    /// keeps ids keeps them with this.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The id of a frame, writing its definition the first time (as [`Self::intern_stack`]
    /// does for each of its frames).
    pub fn frame_id(&mut self, f: &Frame) -> anyhow::Result<u32> {
        self.intern_frame(f)
    }

    fn intern_frame(&mut self, f: &Frame) -> anyhow::Result<u32> {
        if let Some(&id) = self.frames.get(f) {
            return Ok(id);
        }
        let id = self.frames.len() as u32;
        self.buf.clear();
        put_varint(&mut self.buf, id as u64);
        put_varint(
            &mut self.buf,
            f.line.map(|l| zigzag(l as i64) + 1).unwrap_or(0),
        );
        put_str(&mut self.buf, &f.function);
        put_str(&mut self.buf, &f.file);
        if let Some(n) = self.native.get(f) {
            // Trailing fields: readers before them stop after `file`.
            self.buf.push(n.kind);
            put_varint(&mut self.buf, n.addr);
            put_str(&mut self.buf, &n.module);
            put_str(&mut self.buf, &n.build_id);
        }
        self.record(tag::FRAME)?;
        self.frames.insert(f.clone(), id);
        Ok(id)
    }

    /// The id of a stack of Python, native and kernel frames (innermost first).
    pub fn intern_mixed(
        &mut self,
        frames: &[(Frame, Option<NativeFrameInfo>)],
    ) -> anyhow::Result<u32> {
        for (f, n) in frames {
            if let Some(n) = n {
                if !self.native.contains_key(f) {
                    // Bounded: one entry per distinct native symbol.
                    self.native.insert(f.clone(), n.clone());
                }
            }
        }
        let plain: Vec<Frame> = frames.iter().map(|(f, _)| f.clone()).collect();
        self.intern_stack(&plain)
    }

    /// The id of a stack (innermost frame first), writing its definition the first time.
    pub fn intern_stack(&mut self, frames: &[Frame]) -> anyhow::Result<u32> {
        let ids = frames
            .iter()
            .map(|f| self.intern_frame(f))
            .collect::<anyhow::Result<Vec<u32>>>()?;
        if let Some(&id) = self.stacks.get(&ids) {
            return Ok(id);
        }
        let id = self.stacks.len() as u32;
        self.buf.clear();
        put_varint(&mut self.buf, id as u64);
        put_varint(&mut self.buf, ids.len() as u64);
        for f in &ids {
            put_varint(&mut self.buf, *f as u64);
        }
        self.record(tag::STACK)?;
        self.stacks.insert(ids, id);
        Ok(id)
    }

    pub fn sample(&mut self, s: &Sample) -> anyhow::Result<()> {
        if let Some(p) = self.profile.as_mut().filter(|p| !p.raw(s.pid, s.tid)) {
            p.acc.sample(
                SampleKey {
                    pid: s.pid,
                    tid: s.tid,
                    stack: s.stack,
                    flags: s.flags,
                },
                s.weight_ns as u64,
            );
            return Ok(());
        }
        self.buf.clear();
        // Time as a signed delta from the previous sample (samples from several CPUs can be
        // slightly out of order): 2–3 bytes instead of 5–6.
        put_varint(
            &mut self.buf,
            zigzag(s.t_ns as i64 - self.last_sample_ns as i64),
        );
        self.last_sample_ns = s.t_ns;
        put_varint(&mut self.buf, zigzag(s.pid as i64));
        put_varint(&mut self.buf, zigzag(s.tid as i64));
        put_varint(&mut self.buf, s.stack as u64);
        self.buf.push(s.flags);
        put_varint(&mut self.buf, s.weight_ns as u64);
        self.samples += 1;
        self.record(tag::SAMPLE)
    }

    pub fn offcpu(&mut self, o: &OffCpu) -> anyhow::Result<()> {
        if let Some(p) = self
            .profile
            .as_mut()
            .filter(|p| !p.raw(o.pid, o.tid) || o.dur_ns < profile::LOOP_RAW_MIN_OFFCPU_NS)
        {
            p.acc.offcpu(
                OffCpuKey {
                    pid: o.pid,
                    tid: o.tid,
                    stack: o.stack,
                    preempted: o.preempted,
                },
                o.dur_ns,
            );
            return Ok(());
        }
        self.buf.clear();
        put_varint(&mut self.buf, o.start_ns);
        put_varint(&mut self.buf, o.dur_ns);
        put_varint(&mut self.buf, zigzag(o.pid as i64));
        put_varint(&mut self.buf, zigzag(o.tid as i64));
        put_varint(&mut self.buf, o.stack as u64);
        self.buf.push(o.preempted as u8);
        self.record(tag::OFFCPU)
    }

    pub fn gil_wait(&mut self, g: &GilWait) -> anyhow::Result<()> {
        if let Some(p) = self
            .profile
            .as_mut()
            .filter(|p| !p.raw(g.pid, g.tid) || g.dur_ns < profile::LOOP_RAW_MIN_OFFCPU_NS / 2)
        {
            p.acc.gil(
                GilKey {
                    pid: g.pid,
                    tid: g.tid,
                    holder_tid: g.holder_tid,
                    holder_stack: g.holder_stack,
                    waiter_stack: g.waiter_stack,
                    switch_wait: g.switch_wait,
                },
                g.dur_ns,
            );
            return Ok(());
        }
        self.buf.clear();
        put_varint(&mut self.buf, g.start_ns);
        put_varint(&mut self.buf, g.dur_ns);
        put_varint(&mut self.buf, zigzag(g.pid as i64));
        put_varint(&mut self.buf, zigzag(g.tid as i64));
        put_varint(&mut self.buf, zigzag(g.holder_tid as i64));
        put_varint(&mut self.buf, g.holder_stack as u64);
        put_varint(&mut self.buf, g.waiter_stack as u64);
        self.buf.push(g.switch_wait as u8);
        self.record(tag::GIL_WAIT)
    }

    pub fn gc_pause(&mut self, g: &GcPause) -> anyhow::Result<()> {
        self.buf.clear();
        put_varint(&mut self.buf, g.start_ns);
        put_varint(&mut self.buf, g.dur_ns);
        put_varint(&mut self.buf, zigzag(g.pid as i64));
        put_varint(&mut self.buf, zigzag(g.tid as i64));
        put_varint(&mut self.buf, zigzag(g.generation as i64));
        put_varint(&mut self.buf, zigzag(g.collected));
        self.record(tag::GC_PAUSE)
    }

    pub fn engine(&mut self, e: &EngineInfo) -> anyhow::Result<()> {
        if let Some(pr) = &mut self.profile {
            pr.api_servers.extend(e.api_servers());
        }
        if let Some(c) = &mut self.carried {
            c.engines.insert(e.id.clone(), e.clone());
        }
        self.json(tag::ENGINE, e)
    }

    pub fn series(&mut self, m: &MetricSeries) -> anyhow::Result<()> {
        if let (Some(p), Some(_)) = (&self.profile, &self.carried) {
            if !(p.opts.keep_series)(&m.name) {
                // Not in the map: its points are dropped.
                return Ok(());
            }
        }
        if let Some(c) = &mut self.carried {
            let local = c.series.len() as u32;
            c.series.push(m.clone());
            c.series_ids.insert(m.id, local);
            return self.json(
                tag::SERIES,
                &MetricSeries {
                    id: local,
                    ..m.clone()
                },
            );
        }
        self.json(tag::SERIES, m)
    }

    pub fn metric(&mut self, m: &MetricPoint) -> anyhow::Result<()> {
        let series = match &self.carried {
            Some(c) => match c.series_ids.get(&m.series) {
                Some(&local) => local,
                // A series of an engine gone (dropped at a rotation).
                None => return Ok(()),
            },
            None => m.series,
        };
        self.buf.clear();
        put_varint(&mut self.buf, m.t_ns);
        put_varint(&mut self.buf, series as u64);
        self.buf.extend_from_slice(&m.value.to_le_bytes());
        self.record(tag::METRIC)
    }

    pub fn scrape_error(&mut self, e: &ScrapeError) -> anyhow::Result<()> {
        self.json(tag::SCRAPE_ERROR, e)
    }

    pub fn probe(&mut self, p: &ProbeInfo) -> anyhow::Result<()> {
        if let Some(c) = &mut self.carried {
            let local = c.probes.len() as u32;
            c.probes.push(p.clone());
            c.probe_ids.insert(p.id, local);
            return self.json(
                tag::PROBE,
                &ProbeInfo {
                    id: local,
                    ..p.clone()
                },
            );
        }
        self.json(tag::PROBE, p)
    }

    /// How process `g.pid`'s GC pauses are timed (record 19).
    pub fn gc_method(&mut self, g: &GcMethodInfo) -> anyhow::Result<()> {
        if let Some(c) = &mut self.carried {
            c.gc_methods.insert(g.pid, g.clone());
        }
        self.json(tag::GC_METHOD, g)
    }

    /// An exact probe's watch set on or removed from a thread (record 20).
    pub fn probe_watch(&mut self, w: &ProbeWatch) -> anyhow::Result<()> {
        let probe = match &mut self.carried {
            Some(k) => {
                if w.on {
                    k.watches.insert((w.probe, w.tid));
                } else {
                    k.watches.remove(&(w.probe, w.tid));
                }
                match k.probe_ids.get(&w.probe) {
                    Some(&local) => local,
                    None => return Ok(()),
                }
            }
            None => w.probe,
        };
        self.put_watch(&ProbeWatch { probe, ..*w })
    }

    fn put_watch(&mut self, w: &ProbeWatch) -> anyhow::Result<()> {
        self.buf.clear();
        put_varint(&mut self.buf, w.t_ns);
        put_varint(&mut self.buf, w.probe as u64);
        put_varint(&mut self.buf, zigzag(w.tid as i64));
        self.buf.push(u8::from(w.on));
        self.record(tag::PROBE_WATCH)
    }

    pub fn call(&mut self, c: &FunctionCall) -> anyhow::Result<()> {
        let probe = match &self.carried {
            Some(k) => match k.probe_ids.get(&c.probe) {
                Some(&local) => local,
                // A probe of a process gone (dropped at a rotation).
                None => return Ok(()),
            },
            None => c.probe,
        };
        if let Some(p) = self.profile.as_mut() {
            p.acc.call(
                CallKey {
                    pid: c.pid,
                    tid: c.tid,
                    probe,
                },
                c.dur_ns,
            );
            return Ok(());
        }
        self.buf.clear();
        put_varint(&mut self.buf, c.start_ns);
        put_varint(&mut self.buf, c.dur_ns);
        put_varint(&mut self.buf, zigzag(c.pid as i64));
        put_varint(&mut self.buf, zigzag(c.tid as i64));
        put_varint(&mut self.buf, probe as u64);
        self.record(tag::CALL)
    }

    /// Push buffered records to the file (whole records only), and keep [`RESERVE`] allocated
    /// ahead of them: Err([`DiskFull`]) when the filesystem has no room for it (what is written
    /// is whole, and the reserve left holds the recording's end).
    pub fn flush(&mut self) -> anyhow::Result<()> {
        self.out.flush()?;
        self.keep_reserve()
    }

    fn keep_reserve(&mut self) -> anyhow::Result<()> {
        let Some(until) = self.reserved_to else {
            return Ok(());
        };
        if self.bytes + RESERVE / 2 <= until {
            return Ok(());
        }
        let f = self.out.get_ref();
        match allocate_ahead(f, self.bytes, RESERVE) {
            Ok(()) => self.reserved_to = Some(self.bytes + RESERVE),
            // Nearly full: on in small stretches while the end's room can still be had (a
            // stretch already allocated is granted again at no cost).
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                if allocate_ahead(f, self.bytes, RESERVE_TAIL).is_err() {
                    return Err(DiskFull { bytes: self.bytes }.into());
                }
                self.reserved_to = Some(until.max(self.bytes + RESERVE_TAIL));
            }
            // A filesystem without fallocate: written as it comes.
            Err(_) => self.reserved_to = None,
        }
        Ok(())
    }

    pub fn finish(mut self, end: &EndInfo) -> anyhow::Result<u64> {
        self.write_profile(end.duration_ns)?;
        self.json(tag::END, end)?;
        self.out.flush()?;
        self.release_reserve();
        self.out.get_ref().sync_data().ok();
        Ok(self.bytes)
    }

    /// Give back the blocks allocated past the end ([`RESERVE`]): truncating a file to its own
    /// size frees them.
    fn release_reserve(&mut self) {
        if self.reserved_to.is_some_and(|r| r > 0) {
            let f = self.out.get_ref();
            if let Ok(m) = f.metadata() {
                let _ = f.set_len(m.len());
            }
        }
    }

    pub fn bytes_written(&self) -> u64 {
        self.bytes
    }
    pub fn samples_written(&self) -> u64 {
        self.samples
    }
}

/// The count of an aggregated record, bounded ([`MAX_AGGREGATED_COUNT`]).
fn aggregated_count(n: u64) -> anyhow::Result<u64> {
    anyhow::ensure!(
        n <= MAX_AGGREGATED_COUNT,
        "an aggregated record of {n} events (corrupt?)"
    );
    Ok(n)
}

/// Read a whole recording. A file cut short inside a record (killed recorder) reads up to the
/// last complete record and sets `truncated`.
pub fn read_recording(path: &Path) -> anyhow::Result<Recording> {
    let mut data = Vec::new();
    std::fs::File::open(path)
        .with_context(|| format!("opening {}", path.display()))?
        .read_to_end(&mut data)?;
    parse_recording(&data).with_context(|| format!("reading recording {}", path.display()))
}

pub fn parse_recording(data: &[u8]) -> anyhow::Result<Recording> {
    let mut rd = RecordingReader::default();
    rd.feed(data)?;
    if !rd.saw_meta {
        bail!("recording has no header record");
    }
    if !rd.recording.profile_intervals.is_empty() {
        // Aggregated intervals are written when they end, after raw events of later times.
        let r = &mut rd.recording;
        r.samples.sort_by_key(|s| s.t_ns);
        r.offcpu.sort_by_key(|o| o.start_ns);
        r.gil_waits.sort_by_key(|g| g.start_ns);
        r.calls.sort_by_key(|c| c.start_ns);
    }
    rd.recording.truncated = rd.pending > 0;
    Ok(rd.recording)
}

/// Reads a recording incrementally, as its writer appends to it: `top` follows a live
/// recording (or replays a finished one) with this. Bytes that do not yet form a whole record
/// are kept until the next `feed`.
#[derive(Default)]
pub struct RecordingReader {
    pub recording: Recording,
    tail: Vec<u8>,
    header_done: bool,
    saw_meta: bool,
    last_sample_ns: u64,
    /// Bytes waiting for the rest of their record.
    pending: usize,
    /// The interval the aggregated records being read belong to.
    interval: Option<(u64, u64)>,
}

impl RecordingReader {
    /// Whether the header record has been read.
    pub fn has_meta(&self) -> bool {
        self.saw_meta
    }

    /// Append bytes and apply every complete record in them. Returns how many records were
    /// applied.
    pub fn feed(&mut self, data: &[u8]) -> anyhow::Result<usize> {
        let mut owned = std::mem::take(&mut self.tail);
        let buf: &[u8] = if owned.is_empty() {
            data
        } else {
            owned.extend_from_slice(data);
            &owned
        };
        let mut i = 0;
        if !self.header_done {
            if buf.len() < 8 {
                self.tail = buf.to_vec();
                self.pending = self.tail.len();
                return Ok(0);
            }
            if &buf[..6] != MAGIC {
                bail!("not an enginescope recording (bad magic)");
            }
            let version = u16::from_le_bytes([buf[6], buf[7]]);
            if version != VERSION {
                bail!(
                    "recording format version {version}; this enginescope reads version {VERSION}"
                );
            }
            self.header_done = true;
            i = 8;
        }
        let mut n = 0;
        while i < buf.len() {
            let t = buf[i];
            let mut head = Cur { b: buf, i: i + 1 };
            let Ok(len) = head.varint() else { break };
            let start = head.i;
            let Some(end) = usize::try_from(len)
                .ok()
                .and_then(|l| start.checked_add(l))
                .filter(|&e| e <= buf.len())
            else {
                break;
            };
            self.apply(t, &buf[start..end])?;
            i = end;
            n += 1;
        }
        // Keep the unread rest. Fed a few bytes at a time, a large record is appended to in
        // place rather than copied again on every feed.
        if owned.is_empty() {
            self.tail = data[i..].to_vec();
        } else {
            owned.drain(..i);
            self.tail = owned;
        }
        self.pending = self.tail.len();
        Ok(n)
    }

    fn apply(&mut self, t: u8, p: &[u8]) -> anyhow::Result<()> {
        let r = &mut self.recording;
        let mut c = Cur { b: p, i: 0 };
        match t {
            tag::META => {
                r.meta = serde_json::from_slice(p)?;
                self.saw_meta = true;
            }
            tag::PROCESS => r.processes.push(serde_json::from_slice(p)?),
            tag::THREAD => r.threads.push(serde_json::from_slice(p)?),
            tag::TASK => r.task_changes.push(serde_json::from_slice(p)?),
            tag::COUNTERS => {
                let m: std::collections::BTreeMap<String, u64> = serde_json::from_slice(p)?;
                r.counters.extend(m);
            }
            tag::END => r.end = Some(serde_json::from_slice(p)?),
            tag::FRAME => {
                let id = c.varint()? as usize;
                let line = c.varint()?;
                let function = c.str()?;
                let file = c.str()?;
                if id != r.frames.len() {
                    bail!("frame id {id} out of order");
                }
                if c.i < p.len() {
                    let kind = c.u8()?;
                    let addr = c.varint()?;
                    let module = c.str()?;
                    let build_id = c.str()?;
                    r.frame_native.insert(
                        id as u32,
                        NativeFrameInfo {
                            kind,
                            addr,
                            module,
                            build_id,
                        },
                    );
                }
                r.frames.push(Frame {
                    function,
                    file,
                    line: if line == 0 {
                        None
                    } else {
                        i32::try_from(unzigzag(line - 1)).ok()
                    },
                });
            }
            tag::STACK => {
                let id = c.varint()? as usize;
                let n = c.varint()? as usize;
                if id != r.stacks.len() || n > p.len() {
                    bail!("bad stack record {id}");
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let f = c.varint()? as u32;
                    if f as usize >= r.frames.len() {
                        bail!("stack {id} names unknown frame {f}");
                    }
                    v.push(f);
                }
                r.stacks.push(v);
            }
            tag::SAMPLE => {
                let delta = unzigzag(c.varint()?);
                self.last_sample_ns = self
                    .last_sample_ns
                    .checked_add_signed(delta)
                    .context("sample time out of range")?;
                let s = Sample {
                    t_ns: self.last_sample_ns,
                    pid: c.i32()?,
                    tid: c.i32()?,
                    stack: c.varint()? as u32,
                    flags: c.u8()?,
                    weight_ns: c.varint()? as u32,
                };
                if s.stack as usize >= r.stacks.len() {
                    bail!("sample names unknown stack {}", s.stack);
                }
                r.samples.push(s);
            }
            tag::OFFCPU => {
                let o = OffCpu {
                    start_ns: c.varint()?,
                    dur_ns: c.varint()?,
                    pid: c.i32()?,
                    tid: c.i32()?,
                    stack: c.varint()? as u32,
                    preempted: c.u8()? != 0,
                };
                if o.stack as usize >= r.stacks.len() {
                    bail!("off-CPU interval names unknown stack {}", o.stack);
                }
                r.offcpu.push(o);
            }
            tag::GIL_WAIT => {
                let g = GilWait {
                    start_ns: c.varint()?,
                    dur_ns: c.varint()?,
                    pid: c.i32()?,
                    tid: c.i32()?,
                    holder_tid: c.i32()?,
                    holder_stack: c.varint()? as u32,
                    waiter_stack: c.varint()? as u32,
                    switch_wait: c.u8()? != 0,
                };
                if g.holder_stack as usize >= r.stacks.len()
                    || g.waiter_stack as usize >= r.stacks.len()
                {
                    bail!("GIL wait names an unknown stack");
                }
                r.gil_waits.push(g);
            }
            tag::GC_PAUSE => {
                let g = GcPause {
                    start_ns: c.varint()?,
                    dur_ns: c.varint()?,
                    pid: c.i32()?,
                    tid: c.i32()?,
                    generation: i8::try_from(unzigzag(c.varint()?)).unwrap_or(-1),
                    // Added after the first files of version 1 were written: absent = unknown.
                    collected: c.varint().map(unzigzag).unwrap_or(-1),
                };
                r.gc_pauses.push(g);
            }
            tag::ENGINE => r.engines.push(serde_json::from_slice(p)?),
            tag::SERIES => {
                let m: MetricSeries = serde_json::from_slice(p)?;
                if m.id as usize != r.series.len() {
                    bail!("metric series id {} out of order", m.id);
                }
                r.series.push(m);
            }
            tag::METRIC => {
                let t_ns = c.varint()?;
                let series = c.varint()? as u32;
                let bytes: [u8; 8] =
                    c.b.get(c.i..c.i + 8)
                        .and_then(|b| b.try_into().ok())
                        .context("metric value cut short")?;
                if series as usize >= r.series.len() {
                    bail!("metric names unknown series {series}");
                }
                r.metrics.push(MetricPoint {
                    t_ns,
                    series,
                    value: f64::from_le_bytes(bytes),
                });
            }
            tag::SCRAPE_ERROR => r.scrape_errors.push(serde_json::from_slice(p)?),
            tag::PROBE => {
                let pr: ProbeInfo = serde_json::from_slice(p)?;
                if pr.id as usize != r.probes.len() {
                    bail!("probe id {} out of order", pr.id);
                }
                r.probes.push(pr);
            }
            tag::CALL => {
                let call = FunctionCall {
                    start_ns: c.varint()?,
                    dur_ns: c.varint()?,
                    pid: c.i32()?,
                    tid: c.i32()?,
                    probe: c.varint()? as u32,
                };
                if call.probe as usize >= r.probes.len() {
                    bail!("call names unknown probe {}", call.probe);
                }
                r.calls.push(call);
            }
            tag::GC_METHOD => r.gc_methods.push(serde_json::from_slice(p)?),
            tag::PROBE_WATCH => {
                let w = ProbeWatch {
                    t_ns: c.varint()?,
                    probe: c.varint()? as u32,
                    tid: c.i32()?,
                    on: c.u8()? != 0,
                };
                if w.probe as usize >= r.probes.len() {
                    bail!("probe watch names unknown probe {}", w.probe);
                }
                r.probe_watches.push(w);
            }
            tag::INTERVAL => {
                let (start, end) = (c.varint()?, c.varint()?);
                if end < start {
                    bail!("interval ends before it starts");
                }
                self.interval = Some((start, end));
                r.profile_intervals.push((start, end));
            }
            tag::SAMPLES => {
                let (start, end) = self
                    .interval
                    .context("aggregated samples before an interval")?;
                let (pid, tid) = (c.i32()?, c.i32()?);
                let stack = c.varint()? as u32;
                let flags = c.u8()?;
                let count = aggregated_count(c.varint()?)?;
                let weight = c.varint()?;
                if stack as usize >= r.stacks.len() {
                    bail!("aggregated samples name unknown stack {stack}");
                }
                for i in 0..count {
                    r.samples.push(Sample {
                        t_ns: profile::spread(start, end, count, i),
                        pid,
                        tid,
                        stack,
                        flags,
                        weight_ns: profile::part(weight, count, i).min(u32::MAX as u64) as u32,
                    });
                }
            }
            tag::OFFCPU_SUM => {
                let (start, end) = self
                    .interval
                    .context("aggregated off-CPU before an interval")?;
                let (pid, tid) = (c.i32()?, c.i32()?);
                let stack = c.varint()? as u32;
                let preempted = c.u8()? != 0;
                let count = aggregated_count(c.varint()?)?;
                let dur = c.varint()?;
                if stack as usize >= r.stacks.len() {
                    bail!("aggregated off-CPU names unknown stack {stack}");
                }
                for i in 0..count {
                    let dur_ns = profile::part(dur, count, i);
                    r.offcpu.push(OffCpu {
                        pid,
                        tid,
                        start_ns: profile::ended_by(start, end, count, i, dur_ns),
                        dur_ns,
                        stack,
                        preempted,
                    });
                }
            }
            tag::GIL_WAIT_SUM => {
                let (start, end) = self
                    .interval
                    .context("aggregated GIL waits before an interval")?;
                let (pid, tid, holder_tid) = (c.i32()?, c.i32()?, c.i32()?);
                let holder_stack = c.varint()? as u32;
                let waiter_stack = c.varint()? as u32;
                let switch_wait = c.u8()? != 0;
                let count = aggregated_count(c.varint()?)?;
                let dur = c.varint()?;
                if holder_stack as usize >= r.stacks.len()
                    || waiter_stack as usize >= r.stacks.len()
                {
                    bail!("aggregated GIL waits name an unknown stack");
                }
                for i in 0..count {
                    let dur_ns = profile::part(dur, count, i);
                    r.gil_waits.push(GilWait {
                        pid,
                        tid,
                        start_ns: profile::ended_by(start, end, count, i, dur_ns),
                        dur_ns,
                        holder_tid,
                        holder_stack,
                        waiter_stack,
                        switch_wait,
                    });
                }
            }
            tag::CALL_HIST => {
                let (start, end) = self
                    .interval
                    .context("aggregated calls before an interval")?;
                let (pid, tid) = (c.i32()?, c.i32()?);
                let probe = c.varint()? as u32;
                let count = aggregated_count(c.varint()?)?;
                let _sum_ns = c.varint()?;
                let n = c.varint()?;
                if probe as usize >= r.probes.len() {
                    bail!("aggregated calls name unknown probe {probe}");
                }
                if n > p.len() as u64 {
                    bail!("bad aggregated call record");
                }
                let mut b = 0u64;
                let mut i = 0u64;
                for _ in 0..n {
                    b = b
                        .checked_add(c.varint()?)
                        .filter(|&b| b <= u32::MAX as u64)
                        .context("bucket out of range")?;
                    let k = c.varint()?;
                    if i.checked_add(k).is_none_or(|t| t > count) {
                        bail!("aggregated calls: buckets hold more calls than the count");
                    }
                    let dur_ns = profile::bucket_value(b as u32);
                    for _ in 0..k {
                        r.calls.push(FunctionCall {
                            start_ns: profile::ended_by(start, end, count, i, dur_ns),
                            dur_ns,
                            pid,
                            tid,
                            probe,
                        });
                        i += 1;
                    }
                }
            }
            // Unknown tags are skipped: newer writers may add record kinds.
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(f: &str, line: i32) -> Frame {
        Frame {
            function: f.into(),
            file: "x.py".into(),
            line: Some(line),
        }
    }

    #[test]
    fn native_frames_roundtrip_and_older_frame_records_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("n.esrec");
        let mut w = RecordingWriter::create(&path, &Meta::default()).unwrap();
        let native = Frame {
            function: "save_list".into(),
            file: "/x/_pickle.so".into(),
            line: None,
        };
        let info = NativeFrameInfo {
            kind: FRAME_NATIVE,
            addr: 0x1234,
            module: "/x/_pickle.so".into(),
            build_id: "abcd".into(),
        };
        let s = w
            .intern_mixed(&[
                (native.clone(), Some(info.clone())),
                (frame("main", 3), None),
            ])
            .unwrap();
        w.finish(&EndInfo::default()).unwrap();
        let r = read_recording(&path).unwrap();
        let ids = &r.stacks[s as usize];
        assert_eq!(r.frames[ids[0] as usize], native);
        assert_eq!(r.frame_native.get(&ids[0]), Some(&info));
        assert_eq!(r.frame_kind(ids[1]), 0);
        // A frame record as the first writers wrote it (no trailing fields) is a Python frame.
        let mut rd = RecordingReader::default();
        let mut file = Vec::new();
        file.extend_from_slice(MAGIC);
        file.extend_from_slice(&VERSION.to_le_bytes());
        let mut meta = serde_json::to_vec(&Meta::default()).unwrap();
        file.push(tag::META);
        put_varint(&mut file, meta.len() as u64);
        file.append(&mut meta);
        let mut p = Vec::new();
        put_varint(&mut p, 0);
        put_varint(&mut p, 0);
        put_str(&mut p, "f");
        put_str(&mut p, "a.py");
        file.push(tag::FRAME);
        put_varint(&mut file, p.len() as u64);
        file.extend_from_slice(&p);
        rd.feed(&file).unwrap();
        assert_eq!(rd.recording.frames.len(), 1);
        assert!(rd.recording.frame_native.is_empty());
    }

    /// Record 18: task changes read back in order; a rotation carries the tasks in progress
    /// (not the threads that ran none) into the new segment at time 0.
    #[test]
    fn task_changes_roundtrip_and_rotate() {
        use crate::cpython::asyncio::RunningTask;
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.esrec"), dir.path().join("b.esrec"));
        let meta = Meta::default();
        let mut w = RecordingWriter::create_rotating(&a, &meta).unwrap();
        w.process(&ProcessInfo {
            pid: 7,
            ..Default::default()
        })
        .unwrap();
        for tid in [7, 8] {
            w.thread(&ThreadInfo {
                pid: 7,
                tid,
                ..Default::default()
            })
            .unwrap();
        }
        let task = RunningTask {
            name: "handler-1".into(),
            coro: "handle_request".into(),
            chain: vec!["handle_request".into(), "render_response".into()],
        };
        let changes = [
            TaskChange {
                t_ns: 10,
                pid: 7,
                tid: 7,
                task: Some(task.clone()),
                prev_seen_ns: None,
            },
            TaskChange {
                t_ns: 20,
                pid: 7,
                tid: 8,
                task: Some(task.clone()),
                prev_seen_ns: None,
            },
            TaskChange {
                t_ns: 30,
                pid: 7,
                tid: 8,
                task: None,
                prev_seen_ns: Some(15),
            },
        ];
        for c in &changes {
            w.task_change(c).unwrap();
        }
        w.flush().unwrap();
        assert_eq!(read_recording(&a).unwrap().task_changes, changes);
        w.rotate(&b, &meta, &EndInfo::default(), &|_, _| true)
            .unwrap();
        w.finish(&EndInfo::default()).unwrap();
        assert_eq!(
            read_recording(&b).unwrap().task_changes,
            vec![TaskChange {
                t_ns: 0,
                ..changes[0].clone()
            }]
        );
    }

    #[test]
    fn roundtrip_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.esrec");
        let meta = Meta {
            rate_hz: 1000,
            backend: "bpf".into(),
            ..Default::default()
        };
        let mut w = RecordingWriter::create(&path, &meta).unwrap();
        w.process(&ProcessInfo {
            pid: 7,
            ..Default::default()
        })
        .unwrap();
        w.thread(&ThreadInfo {
            pid: 7,
            tid: 8,
            name: "main".into(),
            t_ns: 0,
            python_name: None,
        })
        .unwrap();
        let s1 = w
            .intern_stack(&[frame("leaf", 3), frame("main", 10)])
            .unwrap();
        let s2 = w
            .intern_stack(&[frame("leaf", 3), frame("main", 10)])
            .unwrap();
        assert_eq!(s1, s2);
        let s3 = w
            .intern_stack(&[Frame {
                function: "n".into(),
                file: "f".into(),
                line: None,
            }])
            .unwrap();
        for i in 0..100u64 {
            w.sample(&Sample {
                t_ns: i * 1_000_000,
                pid: 7,
                tid: 8,
                stack: s1,
                flags: flags::GIL,
                weight_ns: 1_000_000,
            })
            .unwrap();
        }
        w.offcpu(&OffCpu {
            pid: 7,
            tid: 8,
            start_ns: 5,
            dur_ns: 10,
            stack: s3,
            preempted: false,
        })
        .unwrap();
        let gw = GilWait {
            pid: 7,
            tid: 8,
            start_ns: 100,
            dur_ns: 5_000_000,
            holder_tid: 9,
            holder_stack: s1,
            waiter_stack: s3,
            switch_wait: false,
        };
        w.gil_wait(&gw).unwrap();
        let gp = GcPause {
            pid: 7,
            tid: 9,
            start_ns: 200,
            dur_ns: 1_500_000,
            generation: 2,
            collected: 1234,
        };
        w.gc_pause(&gp).unwrap();
        let eng = EngineInfo {
            id: "engine0".into(),
            api_server_pid: 7,
            api_server_pids: vec![7, 11],
            engine_core_pids: vec![8],
            worker_pids: vec![9, 10],
            metrics_url: "http://127.0.0.1:8000/metrics".into(),
            metrics_url_source: "argv".into(),
            t_ns: 3,
        };
        w.engine(&eng).unwrap();
        let ser = MetricSeries {
            id: 0,
            engine: "engine0".into(),
            name: "vllm:kv_cache_usage_perc".into(),
            labels: [("model_name".to_string(), "m".to_string())].into(),
            kind: "gauge".into(),
        };
        w.series(&ser).unwrap();
        let mp = MetricPoint {
            t_ns: 1_000,
            series: 0,
            value: 0.25,
        };
        w.metric(&mp).unwrap();
        let pr = ProbeInfo {
            id: 0,
            spec: "MessageQueue.enqueue".into(),
            pid: 7,
            function: "MessageQueue.enqueue".into(),
            file: "shm.py".into(),
            firstlineno: 12,
            method: "exact".into(),
            resolution_ns: 30_000,
            t_ns: 4,
        };
        w.probe(&pr).unwrap();
        let call = FunctionCall {
            probe: 0,
            pid: 7,
            tid: 8,
            start_ns: 10,
            dur_ns: 940_000,
        };
        w.call(&call).unwrap();
        let per_sample = {
            let before = w.bytes_written();
            w.sample(&Sample {
                t_ns: 123_456_789,
                pid: 7,
                tid: 8,
                stack: s1,
                flags: 0,
                weight_ns: 1_000_000,
            })
            .unwrap();
            w.bytes_written() - before
        };
        assert!(per_sample <= 16, "{per_sample} bytes per sample");
        w.finish(&EndInfo {
            duration_ns: 5,
            reason: "done".into(),
        })
        .unwrap();

        let r = read_recording(&path).unwrap();
        assert!(!r.truncated);
        assert_eq!(r.meta, meta);
        assert_eq!(r.samples.len(), 101);
        assert_eq!(
            r.stack_frames(s1)
                .map(|f| f.function.as_str())
                .collect::<Vec<_>>(),
            ["leaf", "main"]
        );
        assert_eq!(r.stack_frames(s3).next().unwrap().line, None);
        assert_eq!(r.offcpu.len(), 1);
        assert_eq!(r.gil_waits, vec![gw]);
        assert_eq!(r.gc_pauses, vec![gp]);
        assert_eq!(r.engines, vec![eng]);
        assert_eq!(r.series, vec![ser]);
        assert_eq!(r.metrics, vec![mp]);
        assert_eq!(r.probes, vec![pr]);
        assert_eq!(r.calls, vec![call]);
        assert_eq!(r.thread_name(7, 8), "main");
        assert!(r.end.is_some());

        // Cut the file anywhere: it still reads, up to the last whole record.
        let bytes = std::fs::read(&path).unwrap();
        for cut in [bytes.len() - 1, bytes.len() - 30, bytes.len() / 2] {
            let r = parse_recording(&bytes[..cut]).unwrap();
            assert!(r.truncated || r.end.is_none());
            assert!(r.end.is_none());
        }
        // Fed in pieces of any size, the incremental reader ends with the same recording.
        for chunk in [1, 7, 64, 4096] {
            let mut rd = RecordingReader::default();
            for piece in bytes.chunks(chunk) {
                rd.feed(piece).unwrap();
            }
            assert_eq!(rd.recording.samples, r.samples);
            assert_eq!(rd.recording.calls, r.calls);
            assert!(rd.recording.end.is_some());
        }
        assert!(parse_recording(b"nope").is_err());
        assert!(
            parse_recording(&bytes[..20]).is_err(),
            "cut inside the header record"
        );
    }

    #[test]
    fn rotation_makes_standalone_segments() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.esrec"), dir.path().join("b.esrec"));
        let meta = Meta {
            rate_hz: 99,
            ..Default::default()
        };
        let mut w = RecordingWriter::create_rotating(&a, &meta).unwrap();
        for pid in [7, 8] {
            w.process(&ProcessInfo {
                pid,
                role: format!("r{pid}"),
                ..Default::default()
            })
            .unwrap();
        }
        for (pid, tid, name) in [
            (7, 70, "old"),
            (7, 70, "renamed"),
            (7, 71, "gone"),
            (8, 80, "x"),
        ] {
            w.thread(&ThreadInfo {
                pid,
                tid,
                name: name.into(),
                t_ns: 5,
                python_name: None,
            })
            .unwrap();
        }
        for (id, pids) in [("e0", vec![7]), ("e1", vec![8]), ("remote", vec![])] {
            w.engine(&EngineInfo {
                id: id.into(),
                engine_core_pids: pids,
                t_ns: 9,
                ..Default::default()
            })
            .unwrap();
        }
        // Series under the scraper's ids: engine e1 (process 8) will be gone at the rotation.
        let ser = |id: u32, engine: &str, name: &str| MetricSeries {
            id,
            engine: engine.into(),
            name: name.into(),
            ..Default::default()
        };
        w.series(&ser(0, "e1", "vllm:gone")).unwrap();
        w.series(&ser(1, "e0", "vllm:x")).unwrap();
        let point = |series: u32, value: f64| MetricPoint {
            t_ns: 5,
            series,
            value,
        };
        w.metric(&point(1, 1.0)).unwrap();
        // Probes under the sampler's ids; process 8's will be gone at the rotation.
        for (id, pid) in [(0, 8), (1, 7)] {
            w.probe(&ProbeInfo {
                id,
                pid,
                function: format!("f{pid}"),
                t_ns: 3,
                ..Default::default()
            })
            .unwrap();
        }
        let deep = w
            .intern_stack(&[frame("leaf", 1), frame("mid", 2), frame("main", 3)])
            .unwrap();
        let other = w.intern_stack(&[frame("other", 9)]).unwrap();
        w.sample(&Sample {
            t_ns: 1_000,
            pid: 7,
            tid: 70,
            stack: other,
            flags: 0,
            weight_ns: 10,
        })
        .unwrap();
        // Process 8 and thread 71 have exited by the rotation.
        let alive = |pid: i32, tid: Option<i32>| pid == 7 && tid != Some(71);
        let meta2 = Meta {
            start_mono_ns: 5_000,
            ..meta.clone()
        };
        let carry = w
            .rotate(
                &b,
                &meta2,
                &EndInfo {
                    duration_ns: 2_000,
                    reason: "rotated".into(),
                },
                &alive,
            )
            .unwrap();
        let deep2 = carry.carry(&mut w, deep).unwrap();
        assert_eq!(
            carry.carry(&mut w, 999).unwrap(),
            0,
            "unknown id: empty stack"
        );
        w.sample(&Sample {
            t_ns: 10,
            pid: 7,
            tid: 70,
            stack: deep2,
            flags: 0,
            weight_ns: 10,
        })
        .unwrap();
        for probe in [1, 0] {
            // Probe 0 (process 8's) is gone with its process: its call is dropped.
            w.call(&FunctionCall {
                probe,
                pid: 7,
                tid: 70,
                start_ns: 0,
                dur_ns: 5,
            })
            .unwrap();
        }
        w.metric(&point(1, 2.0)).unwrap();
        w.metric(&point(0, 9.0)).unwrap(); // e1's: dropped with its engine
        w.series(&ser(2, "e0", "vllm:y")).unwrap();
        w.metric(&point(2, 3.0)).unwrap();
        w.finish(&EndInfo {
            duration_ns: 20,
            reason: "done".into(),
        })
        .unwrap();

        let r1 = read_recording(&a).unwrap();
        assert_eq!(r1.end.as_ref().unwrap().reason, "rotated");
        assert_eq!(r1.samples.len(), 1);
        assert_eq!(r1.stacks.len(), 3);
        let r2 = read_recording(&b).unwrap();
        assert_eq!(r2.meta, meta2);
        assert_eq!(r2.processes.len(), 1);
        assert_eq!(r2.processes[0].role, "r7");
        assert_eq!(r2.threads.len(), 1, "{:?}", r2.threads);
        assert_eq!(r2.threads[0].name, "renamed");
        assert_eq!(r2.threads[0].t_ns, 0);
        let ids: Vec<&str> = r2.engines.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["e0", "remote"]);
        // The first segment had both series under dense ids; the second only e0's,
        // numbered afresh, with the points translated.
        let names = |r: &Recording| -> Vec<(u32, String)> {
            r.series.iter().map(|s| (s.id, s.name.clone())).collect()
        };
        assert_eq!(
            names(&r1),
            [(0, "vllm:gone".to_string()), (1, "vllm:x".to_string())]
        );
        assert_eq!(r1.metrics, vec![point(1, 1.0)]);
        assert_eq!(
            names(&r2),
            [(0, "vllm:x".to_string()), (1, "vllm:y".to_string())]
        );
        assert_eq!(r2.metrics, vec![point(0, 2.0), point(1, 3.0)]);
        assert_eq!(r1.probes.len(), 2);
        assert_eq!(r2.probes.len(), 1);
        assert_eq!((r2.probes[0].id, r2.probes[0].function.as_str()), (0, "f7"));
        assert_eq!(r2.calls.len(), 1);
        assert_eq!(
            r2.calls[0].probe, 0,
            "call translated to the segment's probe id"
        );
        // Only the stack carried is in the new table, under a new id, with the same frames.
        assert_eq!(r2.stacks.len(), 2);
        let names: Vec<&str> = r2
            .stack_frames(r2.samples[0].stack)
            .map(|f| f.function.as_str())
            .collect();
        assert_eq!(names, ["leaf", "mid", "main"]);
        assert_eq!(
            r2.samples[0].t_ns, 10,
            "sample times restart with the segment"
        );
        assert!(r2.end.is_some());
        // Not a rotating writer: refused.
        let mut plain = RecordingWriter::create(&dir.path().join("c.esrec"), &meta).unwrap();
        assert!(plain
            .rotate(
                &dir.path().join("d.esrec"),
                &meta,
                &EndInfo::default(),
                &alive
            )
            .is_err());
    }

    #[test]
    fn garbage_never_panics() {
        let mut seed = 42u64;
        let mut base = MAGIC.to_vec();
        base.extend_from_slice(&VERSION.to_le_bytes());
        for n in 0..200 {
            let mut d = base.clone();
            for _ in 0..n {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                d.push(seed as u8);
            }
            let _ = parse_recording(&d);
        }
    }

    fn agg_opts(interval_ns: u64) -> AggregateOptions {
        AggregateOptions {
            interval_ns,
            event_loop_role: "api_server",
            keep_series: |n| n.starts_with("vllm:kept"),
        }
    }

    /// The same events written raw and aggregated: per-thread sums and counts of samples,
    /// off-CPU intervals, GIL waits and calls read back equal; every call duration within the
    /// bucket bound (so every quantile too); the API server's main thread (its event loop)
    /// and a thread seen running a task keep their raw events; the aggregated file is smaller.
    #[test]
    fn aggregated_events_read_back_with_exact_sums_and_counts() {
        use std::collections::BTreeMap;
        let dir = tempfile::tempdir().unwrap();
        let meta = Meta::default();
        let ms = 1_000_000u64;
        let write = |path: &Path, agg: bool| {
            let mut w = RecordingWriter::create(path, &meta).unwrap();
            if agg {
                w.aggregate(agg_opts(100 * ms));
            }
            w.process(&ProcessInfo {
                pid: 7,
                role: "api_server".into(),
                ..Default::default()
            })
            .unwrap();
            w.process(&ProcessInfo {
                pid: 8,
                role: "engine_core".into(),
                ..Default::default()
            })
            .unwrap();
            w.probe(&ProbeInfo {
                id: 0,
                pid: 8,
                function: "step".into(),
                ..Default::default()
            })
            .unwrap();
            w.task_change(&TaskChange {
                t_ns: 0,
                pid: 8,
                tid: 11,
                task: Some(crate::cpython::asyncio::RunningTask {
                    name: "t".into(),
                    coro: "c".into(),
                    chain: vec![],
                }),
                prev_seen_ns: None,
            })
            .unwrap();
            let a = w.intern_stack(&[frame("a", 1)]).unwrap();
            let b = w.intern_stack(&[frame("b", 2), frame("a", 1)]).unwrap();
            let mut seed = 7u64;
            let mut rnd = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed
            };
            for i in 0..2000u64 {
                let t = i * ms / 2;
                w.profile_tick(t).unwrap();
                let (pid, tid) = [(7, 7), (7, 12), (8, 8), (8, 9), (8, 11)][(i % 5) as usize];
                let stack = if rnd() % 3 == 0 { a } else { b };
                w.sample(&Sample {
                    t_ns: t,
                    pid,
                    tid,
                    stack,
                    flags: (rnd() % 2) as u8,
                    weight_ns: 10_000_000 + (rnd() % 1000) as u32,
                })
                .unwrap();
                // Now and then a long block (an event loop's idle wait) of (7, 7) and (8, 11).
                let long = i % 50 == 0 || i % 50 == 4;
                w.offcpu(&OffCpu {
                    pid,
                    tid,
                    start_ns: t,
                    dur_ns: if long { 5 * ms } else { rnd() % 300_000 },
                    stack,
                    preempted: rnd() % 4 == 0,
                })
                .unwrap();
                w.gil_wait(&GilWait {
                    pid,
                    tid,
                    start_ns: t,
                    dur_ns: rnd() % 100_000,
                    holder_tid: 9,
                    holder_stack: a,
                    waiter_stack: stack,
                    switch_wait: false,
                })
                .unwrap();
                w.call(&FunctionCall {
                    start_ns: t,
                    dur_ns: 1000 + rnd() % 50_000_000,
                    pid,
                    tid,
                    probe: 0,
                })
                .unwrap();
            }
            w.finish(&EndInfo {
                duration_ns: 1000 * ms,
                reason: "done".into(),
            })
            .unwrap()
        };
        let (raw_path, agg_path) = (dir.path().join("raw.esrec"), dir.path().join("agg.esrec"));
        let raw_bytes = write(&raw_path, false);
        let agg_bytes = write(&agg_path, true);
        let raw = read_recording(&raw_path).unwrap();
        let agg = read_recording(&agg_path).unwrap();
        assert!(raw.profile_intervals.is_empty());
        assert_eq!(
            agg.profile_intervals.len(),
            10,
            "{:?}",
            agg.profile_intervals
        );
        assert!(
            agg_bytes * 4 < raw_bytes,
            "aggregated {agg_bytes} bytes, raw {raw_bytes}"
        );
        type Tot = BTreeMap<(i32, i32, u32, u8), (u64, u64)>;
        let tot = |r: &Recording| -> [Tot; 4] {
            let mut t: [Tot; 4] = Default::default();
            for s in &r.samples {
                let e = t[0].entry((s.pid, s.tid, s.stack, s.flags)).or_default();
                e.0 += 1;
                e.1 += s.weight_ns as u64;
            }
            for o in &r.offcpu {
                let e = t[1]
                    .entry((o.pid, o.tid, o.stack, o.preempted as u8))
                    .or_default();
                e.0 += 1;
                e.1 += o.dur_ns;
            }
            for g in &r.gil_waits {
                let e = t[2].entry((g.pid, g.tid, g.waiter_stack, 0)).or_default();
                e.0 += 1;
                e.1 += g.dur_ns;
            }
            for c in &r.calls {
                let e = t[3].entry((c.pid, c.tid, c.probe, 0)).or_default();
                e.0 += 1;
            }
            t
        };
        let (tr, ta) = (tot(&raw), tot(&agg));
        assert_eq!(tr[0].len(), 20, "5 threads x 2 stacks x 2 flags");
        for (k, (r, a)) in tr.iter().zip(&ta).enumerate() {
            assert_eq!(r, a, "kind {k}");
        }
        // Raw threads: the API server's main thread (7, 7) and the task thread (8, 11).
        for (pid, tid) in [(7, 7), (8, 11)] {
            let times = |r: &Recording| -> Vec<u64> {
                r.samples
                    .iter()
                    .filter(|s| (s.pid, s.tid) == (pid, tid))
                    .map(|s| s.t_ns)
                    .collect()
            };
            assert_eq!(times(&raw), times(&agg), "({pid}, {tid}) raw");
            // Its long blocks stay raw; the short ones are added up.
            let long = |r: &Recording| -> Vec<(u64, u64)> {
                r.offcpu
                    .iter()
                    .filter(|o| (o.pid, o.tid) == (pid, tid) && o.dur_ns >= 5 * ms)
                    .map(|o| (o.start_ns, o.dur_ns))
                    .collect()
            };
            assert!(!long(&raw).is_empty());
            assert_eq!(long(&raw), long(&agg), "({pid}, {tid}) long blocks raw");
        }
        assert_ne!(
            raw.samples
                .iter()
                .filter(|s| s.tid == 12)
                .map(|s| s.t_ns)
                .collect::<Vec<_>>(),
            agg.samples
                .iter()
                .filter(|s| s.tid == 12)
                .map(|s| s.t_ns)
                .collect::<Vec<_>>(),
            "another thread of the API server is aggregated"
        );
        // Calls: sorted durations pairwise within the bound, so every quantile is.
        let durs = |r: &Recording, tid: i32| -> Vec<u64> {
            let mut v: Vec<u64> = r
                .calls
                .iter()
                .filter(|c| c.tid == tid)
                .map(|c| c.dur_ns)
                .collect();
            v.sort_unstable();
            v
        };
        // Calls are aggregated on every thread (no view needs them one by one).
        for tid in [7, 8, 9, 11, 12] {
            let (a, b) = (durs(&raw, tid), durs(&agg, tid));
            assert_eq!(a.len(), b.len());
            assert!(a.len() >= 400);
            for (x, y) in a.iter().zip(&b) {
                let err = (*x as f64 - *y as f64).abs() / *x as f64;
                assert!(err <= profile::MAX_REL_ERROR, "{x} read back as {y}");
            }
        }
        // Events read back in time order, inside their intervals.
        assert!(agg.samples.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
    }

    /// A rotation writes the interval so far into the ending segment (its stack ids are only
    /// valid there); series an aggregating rotating writer does not keep lose their points.
    #[test]
    fn aggregated_rotation_closes_the_interval_and_keeps_only_read_series() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.esrec"), dir.path().join("b.esrec"));
        let meta = Meta::default();
        let mut w = RecordingWriter::create_rotating(&a, &meta).unwrap();
        w.aggregate(agg_opts(10_000_000_000));
        w.process(&ProcessInfo {
            pid: 8,
            ..Default::default()
        })
        .unwrap();
        w.engine(&EngineInfo {
            id: "engine0".into(),
            ..Default::default()
        })
        .unwrap();
        for (id, name) in ["vllm:kept_total", "vllm:dropped_total"].iter().enumerate() {
            w.series(&MetricSeries {
                id: id as u32,
                engine: "engine0".into(),
                name: name.to_string(),
                labels: Default::default(),
                kind: "counter".into(),
            })
            .unwrap();
            w.metric(&MetricPoint {
                t_ns: 5,
                series: id as u32,
                value: 1.0,
            })
            .unwrap();
        }
        let s = w.intern_stack(&[frame("x", 1)]).unwrap();
        for t in [1, 2, 3] {
            w.sample(&Sample {
                t_ns: t,
                pid: 8,
                tid: 8,
                stack: s,
                flags: 0,
                weight_ns: 7,
            })
            .unwrap();
        }
        w.rotate(
            &b,
            &meta,
            &EndInfo {
                duration_ns: 50,
                reason: "rotated".into(),
            },
            &|_, _| true,
        )
        .unwrap();
        let s2 = w.intern_stack(&[frame("y", 1)]).unwrap();
        w.sample(&Sample {
            t_ns: 4,
            pid: 8,
            tid: 8,
            stack: s2,
            flags: 0,
            weight_ns: 5,
        })
        .unwrap();
        w.finish(&EndInfo {
            duration_ns: 9,
            reason: "done".into(),
        })
        .unwrap();
        let r1 = read_recording(&a).unwrap();
        assert_eq!(r1.profile_intervals, [(0, 50)]);
        assert_eq!(r1.samples.len(), 3);
        assert_eq!(r1.samples.iter().map(|s| s.weight_ns).sum::<u32>(), 21);
        assert_eq!(
            r1.stack_frames(r1.samples[0].stack)
                .next()
                .unwrap()
                .function,
            "x"
        );
        assert_eq!(r1.series.len(), 1);
        assert_eq!(r1.series[0].name, "vllm:kept_total");
        assert_eq!(r1.metrics.len(), 1);
        let r2 = read_recording(&b).unwrap();
        assert_eq!(r2.profile_intervals, [(0, 9)]);
        assert_eq!(r2.samples.len(), 1);
        assert_eq!(
            r2.stack_frames(r2.samples[0].stack)
                .next()
                .unwrap()
                .function,
            "y"
        );
        assert_eq!(r2.series.len(), 1);
    }
}
