//! `enginescope record`: sample target processes and write a recording.
//!
//! Two backends feed the same pipeline: `bpf` (cpu-clock perf events and sched_switch with the
//! Python stack walked in the kernel) and `memory` (user-space polling through the same CPython
//! reader; for machines without BPF). See ARCHITECTURE.md for one sample's path end to end.

pub mod memory;
pub mod probes;
pub mod target;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::bpf::abi::{self, kind};
use crate::bpf::{BpfSampler, EsThread};
use crate::cpython::PythonProcess;
use crate::record::rotate::RotationPolicy;
use crate::record::EngineInfo;
use crate::record::{
    flags, EndInfo, GcPause, GilWait, Meta, OffCpu, ProcessInfo, RecordingWriter, Sample,
    ThreadInfo,
};
use target::Target;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Auto,
    Bpf,
    Memory,
}

#[derive(Debug, Clone)]
pub struct RecordOptions {
    pub pids: Vec<i32>,
    pub duration: Option<Duration>,
    pub rate_hz: u32,
    pub output: PathBuf,
    pub backend: Backend,
    pub offcpu: bool,
    /// Exact GIL waits (futex tracing; bpf backend).
    pub gil: bool,
    /// Exact GC pauses (write watchpoint on gcstate->collecting; bpf backend).
    pub gc: bool,
    pub quiet: bool,
    /// `record --probe` specs (`[FILE:]QUALNAME`).
    pub probes: Vec<String>,
    /// Calls per second above which an exact probe switches to sampling (0: never).
    pub probe_max_rate: u64,
    /// Find vLLM engines and record all their processes, roles and metrics (`--vllm`).
    pub vllm: bool,
    /// Metrics URL instead of the one discovered.
    pub metrics_url: Option<String>,
    /// How often engine metrics are scraped.
    pub scrape_interval: Duration,
    /// With `vllm`: also probe `probes::VLLM_DEFAULT_PROBES`.
    pub default_probes: bool,
    /// With `vllm`: only the engine whose API server (or offline script) has this pid.
    pub vllm_root_pid: Option<i32>,
}

impl RecordOptions {
    /// Options for `pids` with the defaults `record` uses.
    pub fn new(pids: Vec<i32>, output: PathBuf) -> Self {
        RecordOptions {
            pids,
            duration: None,
            rate_hz: 99,
            output,
            backend: Backend::Auto,
            offcpu: true,
            gil: true,
            gc: true,
            quiet: false,
            probes: Vec::new(),
            probe_max_rate: 2000,
            vllm: false,
            metrics_url: None,
            scrape_interval: Duration::from_secs(1),
            default_probes: true,
            vllm_root_pid: None,
        }
    }
}

/// What a finished recording contains, for the closing line and tests.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RecordSummary {
    pub backend: String,
    pub samples: u64,
    pub offcpu_intervals: u64,
    pub bytes: u64,
    pub duration_s: f64,
    pub lost: u64,
    pub counters: BTreeMap<String, u64>,
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Ask a running [`record`] to stop and finish its file, as SIGINT would.
pub fn request_stop() {
    STOP.store(true, Ordering::SeqCst);
}

/// Whether a stop was asked for (SIGINT, SIGTERM or [`request_stop`]).
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Stop cleanly (finish the file) on SIGINT and SIGTERM.
pub fn install_stop_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we pass.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Per-thread off-CPU bookkeeping: the pending switch-out, or the stack read at start.
#[derive(Default)]
struct ThreadTimeline {
    /// (switch-out time, stack id, preempted)
    pending_out: Option<(u64, u32, bool)>,
    /// Stack at recording start, for a thread that had not run yet.
    initial_stack: Option<u32>,
    seen_event: bool,
    /// The thread's latest known stack (sample or blocking switch-out).
    last_stack: u32,
}

/// A GIL wait that has begun and not yet ended.
struct PendingGilWait {
    start_ns: u64,
    holder_tid: i32,
    holder_stack: u32,
    waiter_stack: Option<u32>,
    switch_wait: bool,
}

/// A collection that has begun: when, in which thread, and the statistics then.
struct PendingGc {
    /// Absolute (CLOCK_MONOTONIC): a pause that spans a rotation is written whole in the
    /// segment where it ends.
    start_abs_ns: u64,
    tid: i32,
    stats: abi::GcStats,
}

/// Shared by both backends: turns resolved events into recording records.
pub struct Pipeline {
    pub writer: RecordingWriter,
    pub start_ns: u64,
    pub weight_ns: u32,
    timelines: HashMap<(i32, i32), ThreadTimeline>,
    gil_waits: HashMap<(i32, i32), PendingGilWait>,
    gc: HashMap<i32, PendingGc>,
    pub samples: u64,
    pub offcpu: u64,
    pub gil_wait_records: u64,
    pub gc_pause_records: u64,
    /// Measured cost of one watchpoint hit, subtracted from each GC pause (probe effect).
    pub gc_trap_ns: u64,
    /// Engine metrics from the scraper thread (`record --vllm`).
    pub metrics: Option<std::sync::mpsc::Receiver<crate::vllm::metrics::ScrapeEvent>>,
    pub metric_points: u64,
    pub scrape_errors: u64,
    /// Set for a rotating recording (the agent).
    pub rotation: Option<Rotator>,
    /// Counters of targets that exited and were dropped, so that totals never go back.
    pub exited_unresolved_frames: u64,
    pub exited_code_rereads: u64,
}

/// How often a rotating recording writes its counters (for a live reader's lost-sample and
/// error counts; unchanged counters are not written again).
const LIVE_COUNTERS_EVERY: Duration = Duration::from_secs(5);

/// State of a rotating recording: the policy, the current segment and its start.
pub struct Rotator {
    pub policy: RotationPolicy,
    /// The segment being written.
    pub path: PathBuf,
    meta: Meta,
    seq: u64,
    started: Instant,
    last_counters: Instant,
    written_counters: BTreeMap<String, u64>,
    pub rotations: u64,
    pub segments_removed: u64,
}

impl Pipeline {
    /// Work a rotating recording does between event batches (every 200 ms): end the segment
    /// when it is full or old enough (or rotation is asked for), else write the counters when
    /// they changed and a while has passed. `counters` gives the recording's counters now.
    pub fn periodic(
        &mut self,
        counters: &dyn Fn(&Pipeline) -> BTreeMap<String, u64>,
    ) -> anyhow::Result<()> {
        let Some(r) = &self.rotation else {
            return Ok(());
        };
        let forced = r.policy.rotate_now.swap(false, Ordering::SeqCst);
        if forced
            || self.writer.bytes_written() >= r.policy.max_segment_bytes
            || r.started.elapsed() >= r.policy.max_segment_age
        {
            let c = counters(self);
            return self.rotate(&c);
        }
        if r.last_counters.elapsed() >= LIVE_COUNTERS_EVERY {
            let c = counters(self);
            let changed = c != r.written_counters;
            if changed {
                self.writer.counters(&c)?;
            }
            if let Some(r) = &mut self.rotation {
                r.last_counters = Instant::now();
                if changed {
                    r.written_counters = c;
                }
            }
        }
        Ok(())
    }

    /// End the current segment and start the next, which reads on its own: intervals still
    /// open (off CPU, GIL waits) are split at the rotation, their part so far written into the
    /// ending segment; threads and processes that exited are forgotten (a dead thread's last
    /// switch-out is its exit, not a wait); old segments beyond the caps are removed.
    fn rotate(&mut self, counters: &BTreeMap<String, u64>) -> anyhow::Result<()> {
        let Some(mut r) = self.rotation.take() else {
            return Ok(());
        };
        let res = self.rotate_with(&mut r, counters);
        self.rotation = Some(r);
        res
    }

    fn rotate_with(
        &mut self,
        r: &mut Rotator,
        counters: &BTreeMap<String, u64>,
    ) -> anyhow::Result<()> {
        let now = monotonic_ns();
        let end = self.rel(now);
        let thread_alive =
            |pid: i32, tid: i32| std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists();
        self.timelines
            .retain(|&(pid, tid), _| thread_alive(pid, tid));
        self.gil_waits
            .retain(|&(pid, tid), _| thread_alive(pid, tid));
        self.gc.retain(|&pid, _| crate::procinfo::is_running(pid));
        self.write_open_offcpu(end, false)?;
        let mut waits: Vec<(i32, i32)> = self.gil_waits.keys().copied().collect();
        waits.sort();
        for (pid, tid) in waits {
            if let Some(w) = self.gil_waits.get(&(pid, tid)) {
                self.gil_wait_records += 1;
                self.writer.gil_wait(&GilWait {
                    pid,
                    tid,
                    start_ns: w.start_ns,
                    dur_ns: end.saturating_sub(w.start_ns),
                    holder_tid: w.holder_tid,
                    holder_stack: w.holder_stack,
                    waiter_stack: w.waiter_stack.unwrap_or(0),
                    switch_wait: w.switch_wait,
                })?;
            }
        }
        self.writer.counters(counters)?;
        let unix_now = r.meta.start_unix_s + now.saturating_sub(r.meta.start_mono_ns) as f64 / 1e9;
        let path = crate::record::rotate::next_segment_path(&r.policy.dir, unix_now, &mut r.seq)
            .with_context(|| format!("naming a segment in {}", r.policy.dir.display()))?;
        let meta = Meta {
            start_mono_ns: now,
            start_unix_s: unix_now,
            ..r.meta.clone()
        };
        let carry = self.writer.rotate(
            &path,
            &meta,
            &EndInfo {
                duration_ns: end,
                reason: "rotated".into(),
            },
            &|pid, tid| match tid {
                None => crate::procinfo::is_running(pid),
                Some(tid) => thread_alive(pid, tid),
            },
        )?;
        self.start_ns = now;
        // Open intervals go on in the new segment from its start, at their stacks.
        for tl in self.timelines.values_mut() {
            if let Some((_, stack, preempted)) = tl.pending_out {
                tl.pending_out = Some((0, carry.carry(&mut self.writer, stack)?, preempted));
            }
            if let Some(stack) = tl.initial_stack {
                tl.initial_stack = Some(carry.carry(&mut self.writer, stack)?);
            }
            tl.last_stack = carry.carry(&mut self.writer, tl.last_stack)?;
        }
        for w in self.gil_waits.values_mut() {
            w.start_ns = 0;
            w.holder_stack = carry.carry(&mut self.writer, w.holder_stack)?;
            if let Some(s) = w.waiter_stack {
                w.waiter_stack = Some(carry.carry(&mut self.writer, s)?);
            }
        }
        self.writer.flush()?;
        r.path = path;
        r.started = Instant::now();
        r.written_counters.clear();
        r.rotations += 1;
        let cap = r
            .policy
            .max_total_bytes
            .saturating_sub(r.policy.max_segment_bytes);
        let removed =
            crate::record::rotate::prune(&r.policy.dir, &r.path, cap, r.policy.max_segments)
                .with_context(|| format!("removing old segments in {}", r.policy.dir.display()))?;
        r.segments_removed += removed.len() as u64;
        Ok(())
    }

    /// Write whatever the metrics scraper has sent since the last call.
    pub fn poll_metrics(&mut self) -> anyhow::Result<()> {
        use crate::vllm::metrics::ScrapeEvent;
        let Some(rx) = &self.metrics else {
            return Ok(());
        };
        let events: Vec<ScrapeEvent> = rx.try_iter().collect();
        for ev in events {
            match ev {
                ScrapeEvent::Series(s) => self.writer.series(&s)?,
                ScrapeEvent::Points(ps) => {
                    for p in &ps {
                        self.writer.metric(p)?;
                    }
                    self.metric_points += ps.len() as u64;
                }
                ScrapeEvent::Error(e) => {
                    self.scrape_errors += 1;
                    self.writer.scrape_error(&e)?;
                }
            }
        }
        Ok(())
    }

    fn rel(&self, t: u64) -> u64 {
        t.saturating_sub(self.start_ns)
    }

    pub fn sample(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        stack: u32,
        fl: u8,
    ) -> anyhow::Result<()> {
        let tl = self.timelines.entry((pid, tid)).or_default();
        tl.seen_event = true;
        tl.initial_stack = None;
        tl.last_stack = stack;
        self.sample_weighted(pid, tid, t_ns, stack, fl, self.weight_ns as u64)
    }

    /// The thread's latest known stack: what a preempted switch-out (recorded without a stack
    /// walk) is attributed to. 0 (empty) when none is known yet.
    pub fn last_stack(&self, pid: i32, tid: i32) -> u32 {
        self.timelines.get(&(pid, tid)).map_or(0, |t| {
            if t.last_stack != 0 {
                t.last_stack
            } else {
                t.initial_stack.unwrap_or(0)
            }
        })
    }

    /// A sample standing for `weight_ns` of CPU time (the memory backend's measured CPU time).
    pub fn sample_weighted(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        stack: u32,
        fl: u8,
        weight_ns: u64,
    ) -> anyhow::Result<()> {
        let t = self.rel(t_ns);
        self.samples += 1;
        self.writer.sample(&Sample {
            t_ns: t,
            pid,
            tid,
            stack,
            flags: fl,
            weight_ns: weight_ns.min(u32::MAX as u64) as u32,
        })
    }

    /// An off-CPU interval known as a whole (the memory backend's share of a tick off CPU).
    pub fn offcpu_interval(
        &mut self,
        pid: i32,
        tid: i32,
        start_ns: u64,
        dur_ns: u64,
        stack: u32,
    ) -> anyhow::Result<()> {
        self.offcpu += 1;
        self.writer.offcpu(&OffCpu {
            pid,
            tid,
            start_ns: self.rel(start_ns),
            dur_ns,
            stack,
            preempted: false,
        })
    }

    pub fn switch_out(&mut self, pid: i32, tid: i32, t_ns: u64, stack: u32, preempted: bool) {
        let t = self.rel(t_ns);
        if let Some(w) = self.gil_waits.get_mut(&(pid, tid)) {
            w.waiter_stack.get_or_insert(stack);
        }
        let tl = self.timelines.entry((pid, tid)).or_default();
        tl.seen_event = true;
        tl.initial_stack = None;
        if stack != 0 {
            tl.last_stack = stack;
        }
        tl.pending_out = Some((t, stack, preempted));
    }

    pub fn switch_in(&mut self, pid: i32, tid: i32, t_ns: u64) -> anyhow::Result<()> {
        let t = self.rel(t_ns);
        let tl = self.timelines.entry((pid, tid)).or_default();
        let first = !tl.seen_event;
        tl.seen_event = true;
        let iv = match (tl.pending_out.take(), tl.initial_stack.take()) {
            (Some((start, stack, preempted)), _) => Some((start, stack, preempted)),
            // Blocked since before the recording started: off CPU from the start.
            (None, Some(stack)) if first => Some((0, stack, false)),
            _ => None,
        };
        if let Some((start, stack, preempted)) = iv {
            self.offcpu += 1;
            self.writer.offcpu(&OffCpu {
                pid,
                tid,
                start_ns: start,
                dur_ns: t.saturating_sub(start),
                stack,
                preempted,
            })?;
        }
        Ok(())
    }

    /// Remember a thread's stack at start: if its first event is a switch-in, it was off CPU
    /// (there) from the start; if it never has an event, for the whole recording.
    pub fn initial_stack(&mut self, pid: i32, tid: i32, stack: u32) {
        let tl = self.timelines.entry((pid, tid)).or_default();
        if !tl.seen_event {
            tl.initial_stack = Some(stack);
        }
    }

    pub fn gil_wait_start(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        holder_tid: i32,
        holder_stack: u32,
        switch_wait: bool,
    ) {
        let start_ns = self.rel(t_ns);
        self.gil_waits.insert(
            (pid, tid),
            PendingGilWait {
                start_ns,
                holder_tid,
                holder_stack,
                waiter_stack: None,
                switch_wait,
            },
        );
    }

    /// Returns false when no wait was open (the recorder attached during it).
    pub fn gil_wait_end(&mut self, pid: i32, tid: i32, t_ns: u64) -> anyhow::Result<bool> {
        let end = self.rel(t_ns);
        let Some(w) = self.gil_waits.remove(&(pid, tid)) else {
            return Ok(false);
        };
        self.write_gil_wait(pid, tid, w, end)?;
        Ok(true)
    }

    fn write_gil_wait(
        &mut self,
        pid: i32,
        tid: i32,
        w: PendingGilWait,
        end: u64,
    ) -> anyhow::Result<()> {
        self.gil_wait_records += 1;
        self.writer.gil_wait(&GilWait {
            pid,
            tid,
            start_ns: w.start_ns,
            dur_ns: end.saturating_sub(w.start_ns),
            holder_tid: w.holder_tid,
            holder_stack: w.holder_stack,
            waiter_stack: w.waiter_stack.unwrap_or(0),
            switch_wait: w.switch_wait,
        })
    }

    /// A write to a target's `gcstate->collecting`: 1 starts a pause, 0 ends it.
    pub fn gc_edge(
        &mut self,
        pid: i32,
        tid: i32,
        t_ns: u64,
        value: i64,
        stats: abi::GcStats,
    ) -> anyhow::Result<()> {
        if value != 0 {
            self.gc.entry(pid).or_insert(PendingGc {
                start_abs_ns: t_ns,
                tid,
                stats,
            });
            return Ok(());
        }
        let Some(p) = self.gc.remove(&pid) else {
            return Ok(());
        };
        // The generation whose `collections` counter moved; the oldest one if several did.
        let generation = (0..3)
            .rev()
            .find(|&g| stats.collections[g] > p.stats.collections[g])
            .map(|g| g as i8)
            .unwrap_or(-1);
        let collected = if generation >= 0 {
            let g = generation as usize;
            stats.collected[g]
                .checked_sub(p.stats.collected[g])
                .map(|d| d as i64)
                .unwrap_or(-1)
        } else {
            -1
        };
        self.gc_pause_records += 1;
        self.writer.gc_pause(&GcPause {
            pid,
            tid: p.tid,
            start_ns: self.rel(p.start_abs_ns),
            // The watchpoint's own trap (the end of the first hit, the start of the second) is
            // inside the interval but is not the collector's: take it out.
            dur_ns: t_ns
                .saturating_sub(p.start_abs_ns)
                .saturating_sub(self.gc_trap_ns),
            generation,
            collected,
        })
    }

    /// Write every thread's off-CPU interval still open (switched out, or blocked since before
    /// the recording) up to `end`, in (pid, tid) order. `close`: they end here; otherwise
    /// (a segment rotation) they stay open and the next segment goes on with them.
    fn write_open_offcpu(&mut self, end: u64, close: bool) -> anyhow::Result<()> {
        let mut open = Vec::new();
        for (&(pid, tid), tl) in self.timelines.iter_mut() {
            let (pending, initial) = if close {
                (tl.pending_out.take(), tl.initial_stack.take())
            } else {
                (tl.pending_out, tl.initial_stack)
            };
            if let Some((start, stack, preempted)) = pending {
                open.push((pid, tid, start, stack, preempted));
            } else if let (Some(stack), false) = (initial, tl.seen_event) {
                open.push((pid, tid, 0, stack, false));
            }
        }
        open.sort_by_key(|x| (x.0, x.1));
        for (pid, tid, start, stack, preempted) in open {
            self.offcpu += 1;
            self.writer.offcpu(&OffCpu {
                pid,
                tid,
                start_ns: start,
                dur_ns: end.saturating_sub(start),
                stack,
                preempted,
            })?;
        }
        Ok(())
    }

    /// Close intervals still open at the end.
    pub fn close(&mut self, end_ns: u64) -> anyhow::Result<()> {
        let end = self.rel(end_ns);
        let mut waits: Vec<_> = self.gil_waits.drain().collect();
        waits.sort_by_key(|(k, _)| *k);
        for ((pid, tid), w) in waits {
            self.write_gil_wait(pid, tid, w, end)?;
        }
        self.write_open_offcpu(end, true)?;
        Ok(())
    }
}

fn sample_flags(ev_flags: u8) -> u8 {
    let mut f = 0;
    if ev_flags & abi::ev::GIL != 0 {
        f |= flags::GIL;
    }
    if ev_flags & abi::ev::GC != 0 {
        f |= flags::GC;
    }
    if ev_flags & abi::ev::NATIVE != 0 {
        f |= flags::NATIVE;
    }
    if ev_flags & abi::ev::KERNEL != 0 {
        f |= flags::KERNEL;
    }
    if ev_flags & (abi::ev::PARTIAL | abi::ev::TRUNCATED | abi::ev::NO_TSTATE) != 0 {
        f |= flags::PARTIAL;
    }
    f
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Attach to every pid, choose a backend, record until the duration ends or SIGINT/SIGTERM.
pub fn record(opts: &RecordOptions) -> anyhow::Result<RecordSummary> {
    record_rotating(opts, None)
}

/// [`record`], into a directory of rotating segments when `rotation` is given (`opts.output`
/// is then not used): the always-on agent records this way.
pub fn record_rotating(
    opts: &RecordOptions,
    rotation: Option<RotationPolicy>,
) -> anyhow::Result<RecordSummary> {
    let discovery = if opts.vllm {
        let mut d = crate::vllm::discover::discover_engines(opts.metrics_url.as_deref())?;
        if let Some(root) = opts.vllm_root_pid {
            restrict_to_engine(&mut d, root);
        }
        if !opts.quiet {
            for w in &d.warnings {
                eprintln!("enginescope: {w}");
            }
            for e in &d.engines {
                eprintln!(
                    "enginescope: {}: API server {}, engine core {:?}, workers {:?}, metrics {}",
                    e.id,
                    if e.api_server_pid == 0 {
                        "-".to_string()
                    } else {
                        e.api_server_pid.to_string()
                    },
                    e.engine_core_pids,
                    e.worker_pids,
                    if e.metrics_url.is_empty() {
                        "-"
                    } else {
                        &e.metrics_url
                    }
                );
            }
        }
        anyhow::ensure!(
            !d.engines.is_empty() || !opts.pids.is_empty(),
            "no vLLM engine found on this host (looked for `vllm serve` API servers, VLLM::EngineCore and VLLM::Worker processes); start one, pass --pid, or give --metrics-url for a remote engine"
        );
        Some(d)
    } else {
        None
    };
    // Processes asked for by pid must attach; discovered ones may exit while we attach.
    let asked = opts.pids.clone();
    let mut opts = opts.clone();
    if let Some(d) = &discovery {
        for pid in d.pids() {
            if !opts.pids.contains(&pid) {
                opts.pids.push(pid);
            }
        }
        if opts.default_probes {
            for p in probes::VLLM_DEFAULT_PROBES {
                if !opts.probes.iter().any(|q| q == p) {
                    opts.probes.push(p.to_string());
                }
            }
        }
    }
    let opts = &opts;
    anyhow::ensure!(
        !opts.pids.is_empty() || discovery.is_some(),
        "no target: pass --pid PID[,PID…] or --vllm"
    );
    anyhow::ensure!(
        (1..=20_000).contains(&opts.rate_hz),
        "--rate must be 1..=20000 Hz"
    );
    let mut targets = Vec::new();
    for &pid in &opts.pids {
        match PythonProcess::attach(pid) {
            Ok(p) => targets.push(Target::new(p)),
            // An engine process that exits between discovery and attach (or cannot be read)
            // is skipped; rediscovery attaches the processes that replace it.
            Err(e) if discovery.is_some() && !asked.contains(&pid) => {
                if !opts.quiet {
                    eprintln!("enginescope: engine process {pid} skipped: {e}");
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    anyhow::ensure!(
        !targets.is_empty() || discovery.as_ref().is_some_and(|d| !d.engines.is_empty()),
        "no process to record"
    );
    install_stop_handlers();

    let (backend, reason, mut bpf) = match opts.backend {
        Backend::Memory => (
            "memory",
            "asked for with --backend memory".to_string(),
            None,
        ),
        Backend::Bpf => (
            "bpf",
            "asked for with --backend bpf".to_string(),
            Some(
                BpfSampler::start_with(opts.rate_hz, opts.offcpu, opts.gil)
                    .context("starting the BPF sampler (try --backend memory)")?,
            ),
        ),
        Backend::Auto => match crate::bpf::unavailable_reason() {
            Some(why) => ("memory", format!("BPF unavailable: {why}"), None),
            None => match BpfSampler::start_with(opts.rate_hz, opts.offcpu, opts.gil) {
                Ok(b) => ("bpf", "BPF available".to_string(), Some(b)),
                Err(e) => ("memory", format!("BPF failed to start: {e:#}"), None),
            },
        },
    };
    let rate = if backend == "memory" {
        opts.rate_hz.min(memory::MAX_RATE_HZ)
    } else {
        opts.rate_hz
    };
    let output = match &rotation {
        Some(r) => {
            std::fs::create_dir_all(&r.dir)
                .with_context(|| format!("creating {}", r.dir.display()))?;
            format!("{}/ (rotating segments)", r.dir.display())
        }
        None => opts.output.display().to_string(),
    };
    if !opts.quiet {
        eprintln!(
            "enginescope: recording {} process(es) with the {backend} backend ({reason}) at {rate} Hz{} -> {output}",
            targets.len(),
            opts.duration.map(|d| format!(" for {:.1} s", d.as_secs_f64())).unwrap_or_default(),
        );
        if rate != opts.rate_hz {
            eprintln!(
                "enginescope: the memory backend samples at most {} Hz",
                memory::MAX_RATE_HZ
            );
        }
    }

    let start_ns = monotonic_ns();
    let meta = Meta {
        tool_version: env!("CARGO_PKG_VERSION").into(),
        start_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
        start_mono_ns: start_ns,
        rate_hz: rate,
        backend: backend.into(),
        backend_reason: reason,
        hostname: hostname(),
        kernel: crate::doctor::machine_facts().kernel,
        command: std::env::args().collect::<Vec<_>>().join(" "),
        cpus: aya::util::online_cpus()
            .map(|c| c.len() as u32)
            .unwrap_or(0),
    };
    let specs = opts
        .probes
        .iter()
        .map(|s| probes::ProbeSpec::parse(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut probes = probes::Probes::new(specs, 1_000_000_000 / rate as u64, opts.quiet);
    if !probes.is_empty() {
        if backend != "bpf" && !opts.quiet {
            eprintln!(
                "enginescope: --probe needs the bpf backend; no function calls will be recorded"
            );
        }
        for t in targets.iter_mut() {
            t.collect_new_code = true;
        }
    }
    let (writer, rotator) = match rotation {
        None => (RecordingWriter::create(&opts.output, &meta)?, None),
        Some(policy) => {
            let mut seq = 0;
            let path =
                crate::record::rotate::next_segment_path(&policy.dir, meta.start_unix_s, &mut seq)
                    .with_context(|| format!("naming a segment in {}", policy.dir.display()))?;
            let cap = policy
                .max_total_bytes
                .saturating_sub(policy.max_segment_bytes);
            let removed =
                crate::record::rotate::prune(&policy.dir, &path, cap, policy.max_segments)
                    .with_context(|| {
                        format!("removing old segments in {}", policy.dir.display())
                    })?;
            let w = RecordingWriter::create_rotating(&path, &meta)?;
            let now = Instant::now();
            let r = Rotator {
                policy,
                path,
                meta: meta.clone(),
                seq,
                started: now,
                last_counters: now,
                written_counters: BTreeMap::new(),
                rotations: 0,
                segments_removed: removed.len() as u64,
            };
            (w, Some(r))
        }
    };
    let mut pipe = Pipeline {
        writer,
        start_ns,
        weight_ns: (1_000_000_000u64 / rate as u64) as u32,
        timelines: HashMap::new(),
        gil_waits: HashMap::new(),
        gc: HashMap::new(),
        samples: 0,
        offcpu: 0,
        gil_wait_records: 0,
        gc_pause_records: 0,
        gc_trap_ns: 0,
        metrics: None,
        metric_points: 0,
        scrape_errors: 0,
        rotation: rotator,
        exited_unresolved_frames: 0,
        exited_code_rereads: 0,
    };
    for t in &targets {
        pipe.writer.process(&ProcessInfo {
            pid: t.pid,
            cmdline: t.cmdline.clone(),
            python_version: t.proc.version.to_string(),
            role: discovery
                .as_ref()
                .and_then(|d| d.roles.get(&t.pid).cloned())
                .unwrap_or_default(),
        })?;
    }
    let mut session = match discovery {
        Some(d) => {
            for e in &d.engines {
                pipe.writer.engine(&EngineInfo {
                    t_ns: 0,
                    ..e.clone()
                })?;
            }
            let (scraper, rx) = crate::vllm::metrics::Scraper::spawn(
                d.engines.clone(),
                opts.scrape_interval,
                start_ns,
            )?;
            pipe.metrics = Some(rx);
            Some(EngineSession {
                discovery: d,
                scraper,
                last: Instant::now(),
            })
        }
        None => None,
    };

    let deadline = opts.duration.map(|d| Instant::now() + d);
    let result = match bpf.as_mut() {
        Some(b) => run_bpf(
            b,
            &mut targets,
            &mut pipe,
            &mut probes,
            session.as_mut(),
            opts,
            deadline,
        ),
        None => {
            announce_started(opts.quiet);
            memory::run(&mut targets, &mut pipe, rate, deadline, &STOP)
        }
    };
    let end_ns = monotonic_ns();
    if let Some(s) = session.take() {
        s.scraper.stop();
        pipe.poll_metrics()?;
    }
    probes.close(bpf.as_mut(), &mut pipe)?;
    pipe.close(end_ns)?;
    let counters = collect_counters(bpf.as_ref(), &targets, &pipe, &probes);
    pipe.writer.counters(&counters)?;
    let reason = match &result {
        Ok(r) => r.clone(),
        Err(e) => format!("error: {e:#}"),
    };
    let samples = pipe.samples;
    let offcpu = pipe.offcpu;
    // The last segment's own length when rotating (each segment's times start at its start).
    let bytes = pipe.writer.finish(&EndInfo {
        duration_ns: end_ns.saturating_sub(pipe.start_ns),
        reason,
    })?;
    drop(bpf);
    result?;
    Ok(RecordSummary {
        backend: backend.into(),
        samples,
        offcpu_intervals: offcpu,
        bytes,
        duration_s: (end_ns - start_ns) as f64 / 1e9,
        lost: counters.get("bpf_ringbuf_full_lost").copied().unwrap_or(0),
        counters,
    })
}

/// The recording's failure-path and health counters now (docs/recording-format.md, record 8).
pub(crate) fn collect_counters(
    bpf: Option<&BpfSampler>,
    targets: &[Target],
    pipe: &Pipeline,
    probes: &probes::Probes,
) -> BTreeMap<String, u64> {
    let mut counters = BTreeMap::new();
    if let Some(b) = bpf {
        for (k, v) in b.counters() {
            counters.insert(k.to_string(), v);
        }
    }
    counters.insert(
        "unresolved_frames".into(),
        pipe.exited_unresolved_frames + targets.iter().map(|t| t.unresolved_frames).sum::<u64>(),
    );
    counters.insert(
        "code_object_rereads".into(),
        pipe.exited_code_rereads + targets.iter().map(|t| t.code_rereads).sum::<u64>(),
    );
    counters.insert("gc_watchpoint_cost_ns".into(), pipe.gc_trap_ns);
    counters.insert("gc_watch_attach_failures".into(), probes.gc_attach_failures);
    if pipe.metrics.is_some() {
        counters.insert("metric_points".into(), pipe.metric_points);
        counters.insert("scrape_errors".into(), pipe.scrape_errors);
    }
    if !probes.is_empty() {
        counters.insert("probe_trap_cost_ns".into(), probes.trap_ns);
        counters.insert("probe_calls".into(), probes.calls);
        counters.insert("probe_calls_unfinished".into(), probes.unfinished);
        counters.insert("probe_unmatched_returns".into(), probes.unmatched_returns);
        counters.insert("probe_attach_failures".into(), probes.attach_failures);
        counters.insert("probe_thread_attaches".into(), probes.thread_attaches);
        counters.insert("probes_switched_to_sampling".into(), probes.demoted);
    }
    if let Some(r) = &pipe.rotation {
        counters.insert("segments_rotated".into(), r.rotations);
        counters.insert("segments_removed".into(), r.segments_removed);
    }
    counters
}

/// Say (on stderr) that events are being collected from now on: scripts and tests that need
/// the whole of some activity recorded start it after this line.
fn announce_started(quiet: bool) {
    if !quiet {
        eprintln!("enginescope: sampling started");
    }
}

/// Push thread changes of every target to the BPF threads map and the recording.
fn sync_threads(
    b: &mut BpfSampler,
    targets: &mut [Target],
    pipe: &mut Pipeline,
    probes: &mut probes::Probes,
) -> anyhow::Result<()> {
    let now = monotonic_ns();
    for t in targets.iter_mut() {
        let (changed, gone) = t.refresh_threads();
        for (tid, tstate, name) in changed {
            b.set_thread(
                tid as u32,
                &EsThread {
                    tstate,
                    tgid: t.pid as u32,
                    pad: 0,
                },
            )?;
            probes.thread_added(b, t.pid, tid);
            pipe.writer.thread(&ThreadInfo {
                pid: t.pid,
                tid,
                name,
                t_ns: now.saturating_sub(pipe.start_ns),
                python_name: t.python_names.get(&tid).cloned(),
            })?;
        }
        for tid in gone {
            b.remove_thread(tid as u32);
            probes.thread_gone(b, tid);
        }
        for (tid, name) in std::mem::take(&mut t.native_changes) {
            pipe.writer.thread(&ThreadInfo {
                pid: t.pid,
                tid,
                name,
                t_ns: now.saturating_sub(pipe.start_ns),
                python_name: None,
            })?;
        }
    }
    Ok(())
}

fn run_bpf(
    b: &mut BpfSampler,
    targets: &mut Vec<Target>,
    pipe: &mut Pipeline,
    probes: &mut probes::Probes,
    mut session: Option<&mut EngineSession>,
    opts: &RecordOptions,
    deadline: Option<Instant>,
) -> anyhow::Result<String> {
    // Threads first, then targets: once a target is in the map its threads' samples count.
    sync_threads(b, targets, pipe, probes)?;
    // Stacks at start, for threads that are blocked when we begin.
    for t in targets.iter_mut() {
        if let Ok(snap) = t.proc.snapshot() {
            for th in snap.threads {
                if let Some(tid) = th.tid {
                    let stack = pipe.writer.intern_stack(&th.frames)?;
                    pipe.initial_stack(t.pid, tid, stack);
                }
            }
        }
    }
    let mut index: HashMap<i32, usize> = targets
        .iter()
        .enumerate()
        .map(|(i, t)| (t.pid, i))
        .collect();
    let mut failed = Vec::new();
    for t in targets.iter() {
        if let Err(e) = configure_target(b, t, probes, opts) {
            // A discovered engine process that exits while we attach is skipped; a --pid
            // target that cannot be configured is an error.
            if session.is_none() {
                return Err(e);
            }
            if !opts.quiet {
                eprintln!("enginescope: engine process {} skipped: {e:#}", t.pid);
            }
            failed.push(t.pid);
        }
    }
    if !failed.is_empty() {
        drop_exited(b, targets, &mut index, pipe, probes, &failed, opts.quiet)?;
    }
    if opts.gc || !probes.is_empty() {
        match b.watchpoint_cost_ns() {
            Ok(ns) => {
                pipe.gc_trap_ns = ns;
                probes.trap_ns = ns;
            }
            Err(e) if !opts.quiet => {
                eprintln!("enginescope: could not time a watchpoint hit: {e:#}")
            }
            Err(_) => {}
        }
    }
    announce_started(opts.quiet);
    let poll = Duration::from_millis(20);
    let mut last_threads = Instant::now();
    let mut last_flush = Instant::now();
    let reason = loop {
        if STOP.load(Ordering::SeqCst) {
            break "stopped by signal".to_string();
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break "duration reached".to_string();
        }
        std::thread::sleep(poll);
        drain_events(b, targets, &index, pipe, probes)?;
        consider_new_code(b, targets, pipe, probes)?;
        if opts.probe_max_rate > 0 {
            probes.enforce_rate(b, monotonic_ns(), opts.probe_max_rate, pipe)?;
        }
        if last_threads.elapsed() >= Duration::from_millis(100) {
            last_threads = Instant::now();
            sync_threads(b, targets, pipe, probes)?;
            let exited: Vec<i32> = targets
                .iter()
                .filter(|t| !crate::procinfo::is_running(t.pid))
                .map(|t| t.pid)
                .collect();
            if !exited.is_empty() {
                drop_exited(b, targets, &mut index, pipe, probes, &exited, opts.quiet)?;
            }
            if targets.is_empty() && session.is_none() {
                break "all targets exited".to_string();
            }
        }
        pipe.poll_metrics()?;
        if let Some(sess) = session.as_deref_mut() {
            if sess.last.elapsed() >= Duration::from_secs(2) {
                sess.last = Instant::now();
                for (pid, role) in sess.rediscover(pipe, opts)? {
                    if index.contains_key(&pid) {
                        continue;
                    }
                    match PythonProcess::attach(pid) {
                        Ok(p) => {
                            let t = Target::new(p);
                            pipe.writer.process(&ProcessInfo {
                                pid,
                                cmdline: t.cmdline.clone(),
                                python_version: t.proc.version.to_string(),
                                role,
                            })?;
                            targets.push(t);
                            let i = targets.len() - 1;
                            if !probes.is_empty() {
                                targets[i].collect_new_code = true;
                            }
                            index.insert(pid, i);
                            let setup = sync_threads(b, &mut targets[i..], pipe, probes)
                                .and_then(|()| configure_target(b, &targets[i], probes, opts));
                            match setup {
                                Ok(()) if !opts.quiet => {
                                    eprintln!("enginescope: attached to new engine process {pid}")
                                }
                                Ok(()) => {}
                                // It exited right after attaching (workers come and go):
                                // forget it; not a reason to stop recording.
                                Err(e) => {
                                    if !opts.quiet {
                                        eprintln!(
                                            "enginescope: new engine process {pid} skipped: {e:#}"
                                        );
                                    }
                                    drop_exited(
                                        b,
                                        targets,
                                        &mut index,
                                        pipe,
                                        probes,
                                        &[pid],
                                        true,
                                    )?;
                                }
                            }
                        }
                        Err(e) => {
                            if !opts.quiet {
                                eprintln!("enginescope: new engine process {pid}: {e}");
                            }
                        }
                    }
                }
            }
        }
        if last_flush.elapsed() >= Duration::from_millis(200) {
            last_flush = Instant::now();
            pipe.writer.flush()?;
            pipe.periodic(&|p: &Pipeline| collect_counters(Some(&*b), targets, p, probes))?;
        }
    };
    // Stop new events, then drain what is left.
    for t in targets.iter() {
        b.remove_target(t.pid as u32);
    }
    drain_events(b, targets, &index, pipe, probes)?;
    Ok(reason)
}

/// Keep only the engine rooted at `root` (its API server or offline script).
fn restrict_to_engine(d: &mut crate::vllm::discover::Discovery, root: i32) {
    let keep: Option<String> = d
        .processes
        .iter()
        .find(|p| p.pid == root)
        .map(|p| p.engine.clone());
    d.engines.retain(|e| Some(&e.id) == keep.as_ref());
    d.processes.retain(|p| Some(&p.engine) == keep.as_ref());
    let pids: std::collections::BTreeSet<i32> = d.processes.iter().map(|p| p.pid).collect();
    d.roles.retain(|pid, _| pids.contains(pid));
}

/// Forget processes that exited: their last events are drained first, then their BPF state,
/// probes and caches (code objects, ELF tables) go, so that a long recording with processes
/// coming and going stays the same size in memory.
fn drop_exited(
    b: &mut BpfSampler,
    targets: &mut Vec<Target>,
    index: &mut HashMap<i32, usize>,
    pipe: &mut Pipeline,
    probes: &mut probes::Probes,
    exited: &[i32],
    quiet: bool,
) -> anyhow::Result<()> {
    for &pid in exited {
        b.remove_target(pid as u32);
    }
    drain_events(b, targets, index, pipe, probes)?;
    for t in targets.iter().filter(|t| exited.contains(&t.pid)) {
        for &tid in t.threads.keys() {
            b.remove_thread(tid as u32);
            probes.thread_gone(b, tid);
        }
        probes.process_gone(b, t.pid);
        pipe.exited_unresolved_frames += t.unresolved_frames;
        pipe.exited_code_rereads += t.code_rereads;
        if !quiet {
            eprintln!("enginescope: process {} exited", t.pid);
        }
    }
    targets.retain(|t| !exited.contains(&t.pid));
    *index = targets
        .iter()
        .enumerate()
        .map(|(i, t)| (t.pid, i))
        .collect();
    Ok(())
}

/// A `record --vllm` session: the engines as last discovered and the metrics scraper.
pub struct EngineSession {
    discovery: crate::vllm::discover::Discovery,
    scraper: crate::vllm::metrics::Scraper,
    last: Instant,
}

impl EngineSession {
    /// Discover again; write changed engines and roles, point the scraper at the engines now
    /// present, and return the processes that appeared (pid, role).
    fn rediscover(
        &mut self,
        pipe: &mut Pipeline,
        opts: &RecordOptions,
    ) -> anyhow::Result<Vec<(i32, String)>> {
        let fresh = match crate::vllm::discover::discover_engines(opts.metrics_url.as_deref()) {
            Ok(mut d) => {
                if let Some(root) = opts.vllm_root_pid {
                    restrict_to_engine(&mut d, root);
                }
                d
            }
            // /proc raced with exiting processes: try again next time.
            Err(_) => return Ok(Vec::new()),
        };
        let (fresh, change) = crate::vllm::discover::reconcile(&self.discovery, fresh);
        if change.is_empty() {
            return Ok(Vec::new());
        }
        let now = monotonic_ns().saturating_sub(pipe.start_ns);
        for e in &change.changed_engines {
            pipe.writer.engine(&EngineInfo {
                t_ns: now,
                ..e.clone()
            })?;
        }
        if !change.changed_engines.is_empty() || !change.gone_engines.is_empty() {
            self.scraper.set_engines(fresh.engines.clone());
        }
        for (pid, role) in &change.role_changes {
            if let Some(p) = fresh.processes.iter().find(|p| p.pid == *pid) {
                pipe.writer.process(&ProcessInfo {
                    pid: *pid,
                    cmdline: p.cmdline.clone(),
                    python_version: String::new(),
                    role: role.clone(),
                })?;
            }
        }
        if !opts.quiet {
            for e in &change.changed_engines {
                eprintln!(
                    "enginescope: engine {} changed: engine core {:?}, workers {:?}",
                    e.id, e.engine_core_pids, e.worker_pids
                );
            }
            for id in &change.gone_engines {
                eprintln!("enginescope: engine {id} is gone");
            }
        }
        self.discovery = fresh;
        let mut new = change.new_pids;
        if let Some(root) = opts.vllm_root_pid {
            new.retain(|(pid, _)| crate::procinfo::descends_from(*pid, root));
        }
        Ok(new)
    }
}

/// Push one target's configuration to BPF, with its GC watchpoints.
fn configure_target(
    b: &mut BpfSampler,
    t: &Target,
    probes: &mut probes::Probes,
    opts: &RecordOptions,
) -> anyhow::Result<()> {
    let mut fl = 0;
    if opts.offcpu {
        fl |= abi::TARGET_OFFCPU;
    }
    if opts.gil {
        fl |= abi::TARGET_GIL;
    }
    let mut cfg = t.bpf_config(fl)?;
    if opts.gc {
        let tids: Vec<i32> = t.threads.keys().copied().collect();
        match probes.watch_gc(b, t.pid, cfg.gc_collecting_addr, &tids) {
            Ok(()) => cfg.flags |= abi::TARGET_GC,
            Err(e) => {
                if !opts.quiet {
                    eprintln!(
                        "enginescope: no exact GC pauses for process {}: {e:#}",
                        t.pid
                    );
                }
            }
        }
    }
    b.set_target(t.pid as u32, &cfg)
}

/// Offer code objects met for the first time to the probes.
fn consider_new_code(
    b: &mut BpfSampler,
    targets: &mut [Target],
    pipe: &mut Pipeline,
    probes: &mut probes::Probes,
) -> anyhow::Result<()> {
    if probes.is_empty() {
        return Ok(());
    }
    let now = monotonic_ns().saturating_sub(pipe.start_ns);
    for t in targets.iter_mut() {
        if t.new_code.is_empty() {
            continue;
        }
        let fresh = std::mem::take(&mut t.new_code);
        for (code, info, tid) in fresh {
            probes.consider(Some(&mut *b), &t.proc, tid, code, &info, now, pipe)?;
        }
    }
    Ok(())
}

/// Resolve and record every event waiting in the ring buffer.
fn drain_events(
    b: &mut BpfSampler,
    targets: &mut [Target],
    index: &HashMap<i32, usize>,
    pipe: &mut Pipeline,
    probes: &mut probes::Probes,
) -> anyhow::Result<()> {
    let mut err = None;
    let mut attach = Vec::new();
    b.drain(usize::MAX, |bytes| {
        if err.is_some() {
            return;
        }
        let Some((h, frames)) = abi::parse_event(bytes) else {
            return;
        };
        let pid = h.tgid as i32;
        let tid = h.tid as i32;
        let Some(&ti) = index.get(&pid) else { return };
        targets[ti].resolving_tid = tid;
        if matches!(h.kind, kind::SAMPLE | kind::SWITCH_OUT) && probes.wants_stacks(pid) {
            let codes: Vec<u64> = frames.iter().map(|f| f.code).collect();
            if probes.needs_attach(pid, tid, &codes) && attach.len() < 1024 {
                attach.push((pid, tid, codes));
            }
        }
        let r = match h.kind {
            kind::SAMPLE => {
                let resolved = targets[ti].resolve(&frames);
                pipe.writer
                    .intern_stack(&resolved)
                    .and_then(|s| pipe.sample(pid, tid, h.time_ns, s, sample_flags(h.flags)))
                    .and_then(|()| probes.stack(pid, tid, h.time_ns, &resolved, false, pipe))
            }
            kind::PROBE_HIT => match abi::parse_probe_frame(bytes) {
                Some(frame) => probes.hit(pid, tid, h.time_ns, h.ip, frame, pipe),
                None => Ok(()),
            },
            kind::SWITCH_OUT if frames.is_empty() && h.flags & abi::ev::PREEMPTED != 0 => {
                // Still runnable (preempted, yielded): no stack walked; its latest known one.
                let s = pipe.last_stack(pid, tid);
                pipe.switch_out(pid, tid, h.time_ns, s, true);
                Ok(())
            }
            kind::SWITCH_OUT => {
                let resolved = targets[ti].resolve(&frames);
                pipe.writer
                    .intern_stack(&resolved)
                    .map(|s| {
                        pipe.switch_out(pid, tid, h.time_ns, s, h.flags & abi::ev::PREEMPTED != 0)
                    })
                    .and_then(|()| probes.stack(pid, tid, h.time_ns, &resolved, true, pipe))
            }
            kind::SWITCH_IN => pipe.switch_in(pid, tid, h.time_ns),
            kind::GIL_WAIT_START => {
                let holder_tid = targets[ti].tid_of_tstate(h.ip).unwrap_or(0);
                // The frames are the holder's stack: code objects first met here belong to
                // the holder's thread (0: unknown, no probe is set from them).
                targets[ti].resolving_tid = holder_tid;
                let resolved = targets[ti].resolve(&frames);
                pipe.writer.intern_stack(&resolved).map(|s| {
                    pipe.gil_wait_start(
                        pid,
                        tid,
                        h.time_ns,
                        holder_tid,
                        s,
                        h.flags & abi::ev::SWITCH_WAIT != 0,
                    )
                })
            }
            kind::GIL_WAIT_END => pipe.gil_wait_end(pid, tid, h.time_ns).map(|_| ()),
            kind::GC_EDGE => match abi::parse_gc_stats(bytes) {
                Some(st) => pipe.gc_edge(pid, tid, h.time_ns, h.ip as i64, st),
                None => Ok(()),
            },
            _ => Ok(()),
        };
        if let Err(e) = r {
            err = Some(e);
        }
    });
    for (pid, tid, codes) in attach {
        probes.observe(b, pid, tid, &codes);
    }
    err.map_or(Ok(()), Err)
}

/// A short BPF check for `doctor`: load and attach the programs, sample `pid` for `duration`,
/// and return the counters plus how many events came back (by kind).
pub fn bpf_selftest(pid: i32, duration: Duration) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut target = Target::new(PythonProcess::attach(pid)?);
    let mut b = BpfSampler::start(997, true)?;
    let (changed, _) = target.refresh_threads();
    for (tid, tstate, _) in changed {
        b.set_thread(
            tid as u32,
            &EsThread {
                tstate,
                tgid: pid as u32,
                pad: 0,
            },
        )?;
    }
    b.set_target(pid as u32, &target.bpf_config(abi::TARGET_OFFCPU)?)?;
    std::thread::sleep(duration);
    b.remove_target(pid as u32);
    let mut out: BTreeMap<String, u64> = b
        .counters()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let mut frames = 0u64;
    let mut unresolved = 0u64;
    b.drain(usize::MAX, |bytes| {
        if let Some((h, f)) = abi::parse_event(bytes) {
            let key = match h.kind {
                kind::SAMPLE => "events_sample",
                kind::SWITCH_OUT => "events_switch_out",
                kind::SWITCH_IN => "events_switch_in",
                _ => "events_other",
            };
            *out.entry(key.into()).or_default() += 1;
            let resolved = target.resolve(&f);
            frames += resolved.len() as u64;
            unresolved += resolved
                .iter()
                .filter(|fr| fr.function == "<unknown>")
                .count() as u64;
        }
    });
    out.insert("frames_resolved".into(), frames - unresolved);
    out.insert("frames_unresolved".into(), unresolved);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Frame;

    fn frame(f: &str) -> Frame {
        Frame {
            function: f.into(),
            file: "x.py".into(),
            line: Some(1),
        }
    }

    #[test]
    fn rotation_splits_open_intervals_and_forgets_exited_threads() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id() as i32;
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let dead = (me, i32::MAX - 7); // no such thread
        let t0 = monotonic_ns() - 1_000_000_000;
        let meta = Meta {
            start_mono_ns: t0,
            start_unix_s: 1_700_000_000.0,
            ..Default::default()
        };
        let mut seq = 0;
        let first = crate::record::rotate::next_segment_path(dir.path(), 1.0, &mut seq).unwrap();
        let policy = RotationPolicy::new(dir.path().to_path_buf());
        let rotate_now = policy.rotate_now.clone();
        let mut pipe = Pipeline {
            writer: RecordingWriter::create_rotating(&first, &meta).unwrap(),
            start_ns: t0,
            weight_ns: 10_000_000,
            timelines: HashMap::new(),
            gil_waits: HashMap::new(),
            gc: HashMap::new(),
            samples: 0,
            offcpu: 0,
            gil_wait_records: 0,
            gc_pause_records: 0,
            gc_trap_ns: 0,
            metrics: None,
            metric_points: 0,
            scrape_errors: 0,
            rotation: Some(Rotator {
                policy,
                path: first.clone(),
                meta: meta.clone(),
                seq,
                started: Instant::now(),
                last_counters: Instant::now(),
                written_counters: BTreeMap::new(),
                rotations: 0,
                segments_removed: 0,
            }),
            exited_unresolved_frames: 0,
            exited_code_rereads: 0,
        };
        pipe.writer
            .process(&ProcessInfo {
                pid: me,
                ..Default::default()
            })
            .unwrap();
        // Stacks the new segment will not carry, so that carried ids differ from the old ones.
        for f in ["x1", "x2"] {
            pipe.writer.intern_stack(&[frame(f)]).unwrap();
        }
        let blocked = pipe
            .writer
            .intern_stack(&[frame("wait"), frame("main")])
            .unwrap();
        let holder = pipe.writer.intern_stack(&[frame("hold")]).unwrap();
        let ms = 1_000_000;
        let running = pipe.writer.intern_stack(&[frame("spin")]).unwrap();
        pipe.sample(me, tid, t0 + 50 * ms, running, 0).unwrap();
        pipe.switch_out(me, tid, t0 + 100 * ms, blocked, false);
        pipe.switch_out(dead.0, dead.1, t0 + 150 * ms, blocked, false);
        pipe.gil_wait_start(me, tid, t0 + 200 * ms, 1, holder, false);
        let stats0 = abi::GcStats::default();
        pipe.gc_edge(me, tid, t0 + 300 * ms, 1, stats0).unwrap();

        rotate_now.store(true, Ordering::SeqCst);
        pipe.periodic(&|_| BTreeMap::from([("bpf_ringbuf_full_lost".to_string(), 3)]))
            .unwrap();
        let rot = pipe.start_ns;
        assert!(rot > t0 + 300 * ms);
        let second = pipe.rotation.as_ref().unwrap().path.clone();
        assert_ne!(second, first);

        // The thread's last known stack (for preempted switch-outs recorded without a walk)
        // names the same frames in the new segment.
        pipe.switch_in(me, tid, rot + 5 * ms).unwrap();
        let last = pipe.last_stack(me, tid);
        pipe.switch_out(me, tid, rot + 10 * ms, last, true);
        pipe.switch_in(me, tid, rot + 20 * ms).unwrap();
        pipe.switch_out(me, tid, rot + 20 * ms, last, false);
        let end = rot + 50 * ms;
        let stats1 = abi::GcStats {
            collections: [1, 1, 0],
            collected: [5, 9, 0],
        };
        pipe.gc_edge(me, tid, end, 0, stats1).unwrap();
        pipe.gil_wait_end(me, tid, end).unwrap();
        pipe.switch_in(me, tid, end).unwrap();
        pipe.close(end).unwrap();
        let Pipeline { writer, .. } = pipe;
        writer
            .finish(&EndInfo {
                duration_ns: 50 * ms,
                reason: "done".into(),
            })
            .unwrap();

        let r1 = crate::record::read_recording(&first).unwrap();
        let split = (rot - t0) - 100 * ms;
        assert_eq!(r1.end.as_ref().unwrap().reason, "rotated");
        assert_eq!(r1.end.as_ref().unwrap().duration_ns, rot - t0);
        assert_eq!(r1.counters.get("bpf_ringbuf_full_lost"), Some(&3));
        // The exited thread's pending switch-out is not a wait: nothing for it.
        assert_eq!(r1.offcpu.len(), 1, "{:?}", r1.offcpu);
        assert_eq!((r1.offcpu[0].tid, r1.offcpu[0].start_ns), (tid, 100 * ms));
        assert_eq!(r1.offcpu[0].dur_ns, split);
        assert_eq!(r1.gil_waits.len(), 1);
        assert_eq!(r1.gil_waits[0].dur_ns, (rot - t0) - 200 * ms);
        assert!(r1.gc_pauses.is_empty());

        let r2 = crate::record::read_recording(&second).unwrap();
        assert_eq!(r2.meta.start_mono_ns, rot);
        assert!((r2.meta.start_unix_s - (1_700_000_000.0 + (rot - t0) as f64 / 1e9)).abs() < 1e-6);
        assert_eq!(r2.offcpu.len(), 3, "{:?}", r2.offcpu);
        assert_eq!((r2.offcpu[0].start_ns, r2.offcpu[0].dur_ns), (0, 5 * ms));
        let names =
            |s: u32| -> Vec<&str> { r2.stack_frames(s).map(|f| f.function.as_str()).collect() };
        assert_eq!(
            names(r2.offcpu[0].stack),
            ["wait", "main"],
            "the blocked stack carried over"
        );
        assert_eq!(
            names(r2.offcpu[1].stack),
            ["wait", "main"],
            "last known stack carried"
        );
        assert_eq!(
            (r2.offcpu[1].start_ns, r2.offcpu[1].dur_ns),
            (10 * ms, 10 * ms)
        );
        assert_eq!(
            (r2.offcpu[2].start_ns, r2.offcpu[2].dur_ns),
            (20 * ms, 30 * ms)
        );
        assert_eq!(r2.gil_waits.len(), 1);
        assert_eq!(
            (r2.gil_waits[0].start_ns, r2.gil_waits[0].dur_ns),
            (0, 50 * ms)
        );
        let names: Vec<&str> = r2
            .stack_frames(r2.gil_waits[0].holder_stack)
            .map(|f| f.function.as_str())
            .collect();
        assert_eq!(names, ["hold"]);
        // The GC pause is written whole where it ends.
        assert_eq!(r2.gc_pauses.len(), 1);
        let g = r2.gc_pauses[0];
        assert_eq!((g.start_ns, g.generation, g.collected), (0, 1, 9));
        assert_eq!(g.dur_ns, end - (t0 + 300 * ms));
        assert_eq!(r2.processes.len(), 1);
    }
}
