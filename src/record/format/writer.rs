//! Appending records to a file: interning frames and stacks, the aggregated form
//! (`record::profile`), what a rotating writer carries into each new segment, and the disk
//! reserve that keeps a full disk from cutting the recording's end.

use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::sys::FastMap;

use anyhow::Context;

use super::layout::{
    CallHistRec, FrameRec, GcHistRec, GilWaitSumRec, IntervalRec, Layout, OffCpuRunRec,
    OffCpuSumRec, SampleRec, SamplesRec, StackRec,
};
use super::{tag, MAGIC, VERSION};
use crate::record::model::*;
use crate::record::profile::{
    self, Accumulator, AggregateOptions, CallKey, GcKey, GilKey, OffCpuKey, SampleKey,
};

/// Spaces after the header's JSON, for [`RecordingWriter::restart_meta`].
const META_SLACK: usize = 48;

/// Appends records to a recording file. Stacks and frames are interned: each distinct frame
/// and stack is written once and referred to by index.
pub struct RecordingWriter {
    out: BufWriter<std::fs::File>,
    frames: FastMap<Frame, u32>,
    stacks: FastMap<Vec<u32>, u32>,
    /// Native and kernel frames: written with their description when first interned (kept
    /// across rotations, so a carried stack keeps its kinds).
    native: FastMap<Frame, NativeFrameInfo>,
    buf: Vec<u8>,
    bytes: u64,
    samples: u64,
    last_sample_ns: u64,
    /// Set for a rotating recording: the tables a new segment starts with.
    carried: Option<Carried>,
    /// Rotations so far: frame and stack ids are only valid within one generation.
    generation: u64,
    /// Await chains of record 18 written so far in this file, by id ([`super::TaskWire`]).
    task_chains: FastMap<Vec<String>, u32>,
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
    /// Per raw thread, its off-CPU intervals since its last sample ([`LoopHold`]).
    holds: HashMap<(i32, i32), LoopHold>,
}

/// An event-loop thread's long off-CPU intervals between two of its samples: the first is
/// written at once, the latest is held (it may be the last before the next sample), and those
/// between, which no view needs one by one, are written merged: one record per run of the same
/// stack and kind, at the run's first start, lasting their sum. What `views::stalls` reads of
/// them is the same (the first blocked interval after a sample, the last before the next, and
/// whether the thread went idle between two samples), and the thread's off-CPU time by stack
/// is exact; where in the stretch between two samples it was spent is not. An API server under
/// load blocks ~250 times a second between samples taken ~1.4 times a second (its loop is
/// mostly idle): 4.9 KB/s of an agent's 10.5 on a real `vllm serve`.
#[derive(Default)]
struct LoopHold {
    /// The first interval since the thread's last sample has been written.
    first_written: bool,
    /// The run of merged intervals being added up, and how many it holds.
    merged: Option<(OffCpu, u64)>,
    /// The latest interval.
    held: Option<OffCpu>,
}

impl LoopHold {
    /// Take the thread's next long interval; what to write now, if anything: the interval
    /// itself (the first since a sample), or a run the one held before it did not continue.
    fn add(&mut self, o: OffCpu) -> Option<(OffCpu, u64)> {
        if !self.first_written {
            self.first_written = true;
            return Some((o, 1));
        }
        // The held one is between two others now: into the run it continues, or a new one.
        let mid = self.held.replace(o)?;
        match self.merged.as_mut() {
            Some((m, n))
                if m.stack == mid.stack
                    && m.preempted == mid.preempted
                    && m.stolen == mid.stolen =>
            {
                m.dur_ns = m.dur_ns.saturating_add(mid.dur_ns);
                *n += 1;
                None
            }
            _ => self.merged.replace((mid, 1)),
        }
    }

    /// What is still to write, in time order: the run being added up, then the held interval.
    fn rest(self) -> impl Iterator<Item = (OffCpu, u64)> {
        self.merged.into_iter().chain(self.held.map(|o| (o, 1)))
    }
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
            frames: FastMap::default(),
            native: FastMap::default(),
            stacks: FastMap::default(),
            buf: Vec::with_capacity(256),
            bytes: 0,
            samples: 0,
            last_sample_ns: 0,
            carried: None,
            generation: 0,
            task_chains: FastMap::default(),
            profile: None,
            meta_at: (0, 0),
            reserved_to: Some(0),
        };
        w.header(meta)?;
        w.keep_reserve()?;
        Ok(w)
    }

    /// A writer whose recording can be continued in a new file ([`Self::rotate`]).
    pub(crate) fn create_rotating(path: &Path, meta: &Meta) -> anyhow::Result<Self> {
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
            holds: HashMap::new(),
        });
    }

    /// `now_ns` (since the segment's start): write the interval when it is over.
    /// Whether the aggregation interval ends by `now_ns` (what [`Self::profile_tick`] writes).
    pub(crate) fn profile_due(&self, now_ns: u64) -> bool {
        self.profile
            .as_ref()
            .is_some_and(|p| now_ns >= p.start_ns.saturating_add(p.opts.interval_ns))
    }

    pub(crate) fn profile_tick(&mut self, now_ns: u64) -> anyhow::Result<()> {
        match &self.profile {
            Some(p) if now_ns >= p.start_ns.saturating_add(p.opts.interval_ns) => {
                self.write_profile(now_ns)
            }
            _ => Ok(()),
        }
    }

    /// End the aggregation interval at `now_ns` whatever its length (a no-op unaggregated).
    pub(crate) fn profile_cut(&mut self, now_ns: u64) -> anyhow::Result<()> {
        self.write_profile(now_ns)
    }

    /// Write what the interval added up, as ending at `end_ns`, and start the next there.
    fn write_profile(&mut self, end_ns: u64) -> anyhow::Result<()> {
        self.release_holds(None)?;
        let Some(p) = self.profile.as_mut() else {
            return Ok(());
        };
        let start = p.start_ns;
        p.start_ns = end_ns.max(start);
        if p.acc.is_empty() {
            return Ok(());
        }
        let acc = std::mem::take(&mut p.acc);
        self.put(&IntervalRec {
            start_ns: start,
            end_ns: end_ns.max(start),
        })?;
        let mut samples: Vec<_> = acc.samples.iter().collect();
        samples.sort_unstable_by_key(|(k, _)| **k);
        for (k, v) in samples {
            self.samples += v.count;
            self.put(&SamplesRec {
                key: *k,
                count: v.count,
                weight_ns: v.sum_ns,
            })?;
        }
        let mut off: Vec<_> = acc.offcpu.iter().collect();
        off.sort_unstable_by_key(|(k, _)| **k);
        for (k, v) in off {
            self.put(&OffCpuSumRec {
                key: *k,
                count: v.count,
                dur_ns: v.sum_ns,
            })?;
        }
        let mut gil: Vec<_> = acc.gil.iter().collect();
        gil.sort_unstable_by_key(|(k, _)| **k);
        for (k, v) in gil {
            self.put(&GilWaitSumRec {
                key: *k,
                count: v.count,
                dur_ns: v.sum_ns,
            })?;
        }
        for (k, h) in acc.call_hists() {
            self.put(&CallHistRec {
                key: k,
                count: h.count,
                sum_ns: h.sum_ns,
                buckets: h.buckets,
            })?;
        }
        for (k, h) in acc.gc_hists() {
            self.put(&GcHistRec {
                key: k,
                count: h.pauses.count,
                sum_ns: h.pauses.sum_ns,
                collected: h.collected,
                buckets: h.pauses.buckets,
            })?;
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
    pub(crate) fn restart_meta(&mut self, meta: &Meta) -> anyhow::Result<()> {
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
        self.task_chains.clear();
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
                let t = TaskChange {
                    t_ns: 0,
                    ..t.clone()
                };
                let wire = super::TaskWire::of(&t, &mut self.task_chains);
                self.json(tag::TASK, &wire)?;
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

    /// A binary record, in its one layout ([`layout`]).
    fn put<L: Layout>(&mut self, rec: &L) -> anyhow::Result<()> {
        self.buf.clear();
        rec.put(&mut self.buf);
        self.record(L::TAG)
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
    pub(crate) fn task_change(&mut self, t: &TaskChange) -> anyhow::Result<()> {
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
        let wire = super::TaskWire::of(t, &mut self.task_chains);
        self.json(tag::TASK, &wire)
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
    pub(crate) fn frame_id(&mut self, f: &Frame) -> anyhow::Result<u32> {
        self.intern_frame(f)
    }

    fn intern_frame(&mut self, f: &Frame) -> anyhow::Result<u32> {
        if let Some(&id) = self.frames.get(f) {
            return Ok(id);
        }
        let id = self.frames.len() as u32;
        self.put(&FrameRec {
            id: u64::from(id),
            line: f.line,
            function: f.function.clone(),
            file: f.file.clone(),
            native: self.native.get(f).cloned(),
        })?;
        self.frames.insert(f.clone(), id);
        Ok(id)
    }

    /// The id of a stack of Python, native and kernel frames (innermost first).
    pub(crate) fn intern_mixed(
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
        let rec = StackRec {
            id: u64::from(id),
            frames: ids,
        };
        self.put(&rec)?;
        self.stacks.insert(rec.frames, id);
        Ok(id)
    }

    /// Write what an event-loop thread's [`LoopHold`] holds (`thread` None: every thread's), and
    /// begin afresh: at its sample, and where an interval or the file ends.
    fn release_holds(&mut self, thread: Option<(i32, i32)>) -> anyhow::Result<()> {
        let Some(p) = self.profile.as_mut() else {
            return Ok(());
        };
        let holds: Vec<LoopHold> = match thread {
            Some(k) => p.holds.remove(&k).into_iter().collect(),
            None => {
                let mut all: Vec<_> = p.holds.drain().collect();
                all.sort_unstable_by_key(|(k, _)| *k);
                all.into_iter().map(|(_, h)| h).collect()
            }
        };
        for run in holds.into_iter().flat_map(LoopHold::rest) {
            self.put_run(run)?;
        }
        Ok(())
    }

    /// A run of off-CPU intervals: record 28, or record 7 where it holds one.
    fn put_run(&mut self, (run, count): (OffCpu, u64)) -> anyhow::Result<()> {
        if count == 1 {
            return self.put(&run);
        }
        self.put(&OffCpuRunRec { run, count })
    }

    pub fn sample(&mut self, s: &Sample) -> anyhow::Result<()> {
        self.release_holds(Some((s.pid, s.tid)))?;
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
        let delta_ns = s.t_ns as i64 - self.last_sample_ns as i64;
        self.last_sample_ns = s.t_ns;
        self.samples += 1;
        self.put(&SampleRec {
            delta_ns,
            pid: s.pid,
            tid: s.tid,
            stack: s.stack,
            flags: s.flags,
            weight_ns: s.weight_ns,
        })
    }

    pub fn offcpu(&mut self, o: &OffCpu) -> anyhow::Result<()> {
        if let Some(p) = self.profile.as_mut() {
            if p.raw(o.pid, o.tid) && o.dur_ns >= profile::LOOP_RAW_MIN_OFFCPU_NS {
                return match p.holds.entry((o.pid, o.tid)).or_default().add(*o) {
                    Some(run) => self.put_run(run),
                    None => Ok(()),
                };
            }
        }
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
                    stolen: o.stolen,
                },
                o.dur_ns,
            );
            return Ok(());
        }
        self.put(o)
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
        self.put(g)
    }

    /// A wake-up between threads of a process. Aggregated files keep those of threads whose
    /// events stay raw (event loops) only: the others' off-CPU intervals are sums, with nothing
    /// to end.
    pub fn wake(&mut self, w: &Wake) -> anyhow::Result<()> {
        if self.profile.as_ref().is_some_and(|p| !p.raw(w.pid, w.tid)) {
            return Ok(());
        }
        self.put(w)
    }

    /// A collection: added up by thread and generation in an aggregating writer (a gen-0
    /// collection every few milliseconds is most of a busy engine's records otherwise), raw
    /// on threads whose events stay raw.
    pub fn gc_pause(&mut self, g: &GcPause) -> anyhow::Result<()> {
        if let Some(p) = self.profile.as_mut().filter(|p| !p.raw(g.pid, g.tid)) {
            p.acc.gc_pause(
                GcKey {
                    pid: g.pid,
                    tid: g.tid,
                    generation: g.generation,
                },
                g.dur_ns,
                g.collected,
            );
            return Ok(());
        }
        self.put(g)
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
        self.put(&MetricPoint { series, ..*m })
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
    pub(crate) fn gc_method(&mut self, g: &GcMethodInfo) -> anyhow::Result<()> {
        if let Some(c) = &mut self.carried {
            c.gc_methods.insert(g.pid, g.clone());
        }
        self.json(tag::GC_METHOD, g)
    }

    /// An exact probe's watch set on or removed from a thread (record 20).
    pub(crate) fn probe_watch(&mut self, w: &ProbeWatch) -> anyhow::Result<()> {
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
        self.put(w)
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
        self.put(&FunctionCall { probe, ..*c })
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

    pub(crate) fn bytes_written(&self) -> u64 {
        self.bytes
    }
}
