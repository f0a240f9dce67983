//! What a recording holds, in memory. Views (report, flame, export, TUI replay) work on this.

use std::collections::BTreeMap;

/// One frame of a Python stack, as recorded (and as `dump` prints it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Frame {
    /// Qualified name (`Class.method`, `outer.<locals>.inner`); `co_name` on 3.10.
    pub function: String,
    pub file: String,
    /// `null` where the instruction has no line (rare: artificial instructions).
    pub line: Option<i32>,
}

/// Fixed facts about a recording session.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Meta {
    /// enginescope version that wrote it.
    pub tool_version: String,
    /// Wall-clock start, seconds since the Unix epoch.
    pub start_unix_s: f64,
    /// `CLOCK_MONOTONIC` at start, ns; all event times in the file are relative to this.
    pub start_mono_ns: u64,
    /// Sampling rate asked for, Hz.
    pub rate_hz: u32,
    /// "bpf" or "memory".
    pub backend: String,
    /// Why this backend was chosen.
    pub backend_reason: String,
    pub hostname: String,
    pub kernel: String,
    /// The command line that made the recording.
    pub command: String,
    /// Number of CPUs sampled.
    pub cpus: u32,
}

impl Meta {
    /// The sampling period of the rate asked for (None for a recording without one).
    pub fn period(&self) -> Option<Period> {
        (self.rate_hz > 0).then(|| Period::of_hz(self.rate_hz))
    }
}

/// The time between two samples at a rate: the one place where Hz become ns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Period(u64);

impl Period {
    /// The period of `hz` samples per second (at least 1 Hz).
    pub(crate) fn of_hz(hz: u32) -> Period {
        Period(1_000_000_000 / u64::from(hz.max(1)))
    }

    pub fn ns(self) -> u64 {
        self.0
    }

    pub fn duration(self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.0)
    }
}

/// The asyncio task a thread is running (`cpython::asyncio` reads it; record 18 carries it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunningTask {
    /// The task's name (`Task.get_name()`: `create_task(..., name=...)`, else `Task-N`).
    pub name: String,
    /// Qualified name of the task's coroutine (`Task.get_coro().__qualname__`).
    pub coro: String,
    /// The await chain: qualified names of the coroutine frames on the thread's stack,
    /// outermost (the task's coroutine) first.
    pub chain: Vec<String>,
}

/// A target process.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ProcessInfo {
    pub pid: i32,
    pub cmdline: String,
    pub python_version: String,
    /// Role, where known (e.g. vLLM `EngineCore`); empty otherwise.
    #[serde(default)]
    pub role: String,
}

/// A target thread; written when first seen and again when its name changes.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ThreadInfo {
    pub pid: i32,
    pub tid: i32,
    /// OS name (`comm`).
    pub name: String,
    /// When it was first seen (ns since start).
    pub t_ns: u64,
    /// Python name (`threading.Thread.name`), where the interpreter's `threading` module knows
    /// the thread. Absent in older recordings and for native threads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python_name: Option<String>,
}

impl ThreadInfo {
    /// The name to show: the Python name where there is one, else the OS name.
    pub(crate) fn display_name(&self) -> &str {
        self.python_name.as_deref().unwrap_or(&self.name)
    }
}

/// Sample flags.
pub mod flags {
    /// The thread held the GIL at the sample.
    pub const GIL: u8 = 1;
    /// A garbage collection was running in the thread's interpreter.
    pub const GC: u8 = 2;
    /// The CPU was executing outside the interpreter core (extension modules, libc, kernel):
    /// "on-CPU native" rather than "on-CPU Python".
    pub const NATIVE: u8 = 4;
    /// The CPU was in kernel mode.
    pub const KERNEL: u8 = 8;
    /// The Python stack could not be read completely (the frames present are right).
    pub const PARTIAL: u8 = 16;
    /// The stack holds the sample's native and kernel frames (`record --native`): views do not
    /// add the synthetic `[native]` / `[kernel]` leaves, the frames say it.
    pub const NATIVE_FRAMES: u8 = 32;
}

/// One on-CPU sample of one thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// ns since the recording's start.
    pub t_ns: u64,
    pub pid: i32,
    pub tid: i32,
    /// Index into `Recording::stacks`.
    pub stack: u32,
    /// [`flags`] bits.
    pub flags: u8,
    /// CPU time this sample stands for (the sampling period), ns.
    pub weight_ns: u32,
}

/// One interval a thread spent off CPU (switched out until switched back in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffCpu {
    pub pid: i32,
    pub tid: i32,
    /// Switch-out time, ns since start.
    pub start_ns: u64,
    pub dur_ns: u64,
    /// Python stack at switch-out: where it blocked.
    pub stack: u32,
    /// 0 = blocked (sleeping, waiting), 1 = preempted (still runnable when switched out).
    pub preempted: bool,
    /// Not a switch: time the hypervisor ran something else on the thread's vCPU while the
    /// thread was on it (its runtime stood still), gathered over a stay on its CPU and placed
    /// at the stay's end, `stack` what it ran (`preempted` too: runnable, not running). With
    /// on-CPU time and the other intervals it makes up the thread's time.
    pub stolen: bool,
}

/// One interval a thread spent blocked on the GIL (a futex wait inside the GIL's struct),
/// exact from the kernel, with who held the GIL when the wait began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GilWait {
    pub pid: i32,
    pub tid: i32,
    pub start_ns: u64,
    pub dur_ns: u64,
    /// Thread holding the GIL when the wait began (0: free or unknown).
    pub holder_tid: i32,
    /// The holder's Python stack when the wait began.
    pub holder_stack: u32,
    /// The waiting thread's Python stack.
    pub waiter_stack: u32,
    /// false: waiting to take the GIL (cond/mutex); true: a dropping thread waiting for the
    /// forced switch to happen (switch_cond/switch_mutex).
    pub switch_wait: bool,
}

/// A thread woken from a futex wait (not the GIL's) by another thread of its process: a lock
/// released, a condition notified, a semaphore raised. It ends the woken thread's off-CPU
/// interval that holds `t_ns` (its switch-in follows). Exact from the kernel (`sched_waking`
/// inside the waker's futex call), with the waker's Python stack at that moment: the function
/// that held the lock or made the event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wake {
    pub t_ns: u64,
    pub pid: i32,
    /// The woken thread.
    pub tid: i32,
    pub waker_tid: i32,
    pub waker_stack: u32,
}

/// One garbage collection: from `collecting = 1` to `collecting = 0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcPause {
    pub pid: i32,
    /// The thread that ran the collection.
    pub tid: i32,
    pub start_ns: u64,
    pub dur_ns: u64,
    /// Collected generation (0–2), -1 when it could not be read.
    pub generation: i8,
    /// Objects the collection freed (`generation_stats[g].collected` delta), -1 when unknown.
    pub collected: i64,
}

/// One inference engine: an API server (or an offline `LLM` script), its EngineCore
/// process(es) and its workers. Written when discovered and again when its processes change.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct EngineInfo {
    /// Stable within a recording: "engine0", "engine1", … or the name the user gave.
    pub id: String,
    /// 0 when there is no API server (offline `LLM` script); the first of `api_server_pids`.
    pub api_server_pid: i32,
    /// Every API server process (`vllm serve --api-server-count N` runs N, sharing one port);
    /// empty in older recordings, where `api_server_pid` is the only one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub api_server_pids: Vec<i32>,
    pub engine_core_pids: Vec<i32>,
    pub worker_pids: Vec<i32>,
    /// Where its Prometheus metrics are scraped; empty when none.
    pub metrics_url: String,
    /// How `metrics_url` was found: "argv", "socket", "--metrics-url", "default" (vLLM's
    /// port 8000, nothing better known), "".
    #[serde(default)]
    pub metrics_url_source: String,
    /// ns since start when this description was written.
    #[serde(default)]
    pub t_ns: u64,
}

impl EngineInfo {
    /// Whether `pid` is one of its API servers.
    pub fn is_api_server(&self, pid: i32) -> bool {
        pid != 0 && (self.api_server_pid == pid || self.api_server_pids.contains(&pid))
    }

    /// Its API servers (none for an offline script).
    pub(crate) fn api_servers(&self) -> Vec<i32> {
        if self.api_server_pids.is_empty() {
            (self.api_server_pid != 0)
                .then_some(self.api_server_pid)
                .into_iter()
                .collect()
        } else {
            self.api_server_pids.clone()
        }
    }

    /// Its processes: API servers, engine cores, workers (each once, no 0).
    pub fn pids(&self) -> Vec<i32> {
        let mut v: Vec<i32> = std::iter::once(self.api_server_pid)
            .chain(self.api_server_pids.iter().copied())
            .chain(self.engine_core_pids.iter().copied())
            .chain(self.worker_pids.iter().copied())
            .filter(|&p| p > 0)
            .collect();
        let mut seen = std::collections::HashSet::new();
        v.retain(|p| seen.insert(*p));
        v
    }
}

/// A metric series scraped from an engine's `/metrics`: one family + label set. Counters
/// are stored raw (cumulative); views turn them into rates. Histograms are stored as their
/// `_bucket{le=…}`, `_sum` and `_count` series.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct MetricSeries {
    /// Index into `Recording::series`.
    pub id: u32,
    /// `EngineInfo::id`.
    pub engine: String,
    /// Sample name as exposed, e.g. `vllm:generation_tokens_total`,
    /// `vllm:time_to_first_token_seconds_bucket`.
    pub name: String,
    /// Labels, sorted by name (includes `le` for histogram buckets).
    pub labels: BTreeMap<String, String>,
    /// Prometheus type of the family: "counter", "gauge", "histogram", "summary", "untyped".
    pub kind: String,
}

/// One scraped value of one series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetricPoint {
    /// ns since start, when the scrape's response arrived.
    pub t_ns: u64,
    pub series: u32,
    pub value: f64,
}

/// A scrape that failed (shown, never fatal).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ScrapeError {
    pub t_ns: u64,
    pub engine: String,
    pub url: String,
    pub error: String,
}

/// A function whose calls are timed (`record --probe`), in one process.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ProbeInfo {
    /// Index into `Recording::probes`; `FunctionCall::probe` refers to it.
    pub id: u32,
    /// The probe as asked for, e.g. `shm_broadcast.py:MessageQueue.dequeue`.
    pub spec: String,
    pub pid: i32,
    /// Qualified name and file of the matched code object.
    pub function: String,
    pub file: String,
    pub firstlineno: i32,
    /// "exact" (every call, from a hardware watchpoint) or "sampled" (calls followed across
    /// samples; only calls longer than the sampling interval are seen).
    pub method: String,
    /// Smallest duration this method resolves, ns (exact: the trap cost; sampled: the
    /// sampling period).
    pub resolution_ns: u64,
    /// ns since start when the probe attached (pending probes attach when the code object
    /// appears).
    pub t_ns: u64,
}

/// An exact probe's watchpoint set on (`on`) or removed from a thread (record 20). A thread
/// wants a register per exactly probed function it runs; when it wants more than it has,
/// the registers rotate among its probes, and these edges say when each was watched, so that
/// views scale its counts by the share of the window it was watched. A watch with no later
/// edge lasts to the end of the recording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeWatch {
    pub t_ns: u64,
    pub probe: u32,
    pub tid: i32,
    pub on: bool,
}

/// How a process's GC pauses are timed (record 19): `uprobe` (a uprobe and a uretprobe on
/// the collector function, named in `function`), `watchpoint` (a hardware write watchpoint on
/// `gcstate->collecting` in every thread) or `none`, and why.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct GcMethodInfo {
    pub pid: i32,
    pub method: String,
    #[serde(default)]
    pub function: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub t_ns: u64,
}

/// One call of a probed function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionCall {
    pub probe: u32,
    pub pid: i32,
    pub tid: i32,
    pub start_ns: u64,
    pub dur_ns: u64,
}

/// Frame kinds ([`NativeFrameInfo::kind`]); a frame without a description is a Python frame.
pub(crate) const FRAME_NATIVE: u8 = 1;
pub const FRAME_KERNEL: u8 = 2;

/// What makes a frame native or kernel: written after the frame record's fields (older
/// readers skip them), docs/recording-format.md.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct NativeFrameInfo {
    /// [`FRAME_NATIVE`] or [`FRAME_KERNEL`].
    pub kind: u8,
    /// The function's start: offset in the module's file address space (ELF vaddr) for user
    /// code, the kernel address for kernel code.
    pub addr: u64,
    /// The module's path as the target maps it (`[kernel.kallsyms]` for the kernel).
    pub module: String,
    /// GNU build-id, hex; empty when unknown.
    pub build_id: String,
}

/// The asyncio task an event-loop thread runs from `t_ns` on (`task` None: none), as the
/// recorder read it (record 18): written when it changes.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct TaskChange {
    pub t_ns: u64,
    pub pid: i32,
    pub tid: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<RunningTask>,
    /// When the thread's previous state was last read (the reads between `prev_seen_ns` and
    /// `t_ns` did not happen: a reader held off the CPU). Absent: the previous read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev_seen_ns: Option<u64>,
}

/// A recording, fully read.
#[derive(Debug, Clone, Default)]
pub struct Recording {
    pub meta: Meta,
    pub processes: Vec<ProcessInfo>,
    pub threads: Vec<ThreadInfo>,
    /// Frame table; stacks refer to indices.
    pub frames: Vec<Frame>,
    /// Stack table: frame indices, innermost first. Stack 0 is the empty stack.
    pub stacks: Vec<Vec<u32>>,
    /// Native and kernel frames by frame id (absent: a Python frame).
    pub frame_native: std::collections::HashMap<u32, NativeFrameInfo>,
    pub samples: Vec<Sample>,
    pub offcpu: Vec<OffCpu>,
    pub gil_waits: Vec<GilWait>,
    /// Wake-ups between threads of a process (record 26; absent in older files).
    pub wakes: Vec<Wake>,
    pub gc_pauses: Vec<GcPause>,
    /// Engines (vLLM-aware recordings); the latest description of each id wins in views.
    pub engines: Vec<EngineInfo>,
    pub series: Vec<MetricSeries>,
    pub metrics: Vec<MetricPoint>,
    pub scrape_errors: Vec<ScrapeError>,
    pub probes: Vec<ProbeInfo>,
    pub calls: Vec<FunctionCall>,
    /// Exact probes' watch edges per thread (record 20; absent in older files: every exact
    /// probe was watched from its attach on).
    pub probe_watches: Vec<ProbeWatch>,
    /// How each process's GC pauses were timed (record 19; absent in older files).
    pub gc_methods: Vec<GcMethodInfo>,
    /// Running asyncio tasks of event-loop threads, as they changed (in time order).
    pub task_changes: Vec<TaskChange>,
    /// The intervals (start, end ns) of aggregated records (`record::profile`): their events
    /// are read back spread evenly over their interval, with exact counts and sums. Empty for
    /// a recording of raw events.
    pub profile_intervals: Vec<(u64, u64)>,
    /// Failure-path and health counters (last value written wins).
    pub counters: BTreeMap<String, u64>,
    /// The span the counters cover, ns, once [`Recording::trim`] has cut the events to part
    /// of the recording (None: the recording's duration).
    pub counters_span_ns: Option<u64>,
    /// Present when the recorder finished cleanly.
    pub end: Option<EndInfo>,
    /// True when the file ended inside a record (recorder killed): everything before it is
    /// intact and was read.
    pub truncated: bool,
}

/// Written last by a recorder that exits cleanly.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct EndInfo {
    pub duration_ns: u64,
    pub reason: String,
}

impl Recording {
    /// The kind of frame `id`: 0 Python, [`FRAME_NATIVE`], [`FRAME_KERNEL`].
    pub fn frame_kind(&self, id: u32) -> u8 {
        self.frame_native.get(&id).map_or(0, |n| n.kind)
    }

    /// Frames of a stack, innermost first.
    pub fn stack_frames(&self, stack: u32) -> impl Iterator<Item = &Frame> {
        self.stacks
            .get(stack as usize)
            .into_iter()
            .flatten()
            .filter_map(|&f| self.frames.get(f as usize))
    }

    /// The Python frames of a stack, innermost first (its native and kernel frames passed
    /// over).
    pub(crate) fn python_frames(&self, stack: u32) -> impl Iterator<Item = &Frame> {
        self.stacks
            .get(stack as usize)
            .into_iter()
            .flatten()
            .filter(|&&id| self.frame_kind(id) == 0)
            .filter_map(|&id| self.frames.get(id as usize))
    }

    /// Latest known name of a thread: its Python name where it has one, else its OS name.
    pub fn thread_name(&self, pid: i32, tid: i32) -> &str {
        self.threads
            .iter()
            .rev()
            .find(|t| t.pid == pid && t.tid == tid)
            .map(|t| t.display_name())
            .unwrap_or("")
    }

    /// Latest known OS name (`comm`) of a thread.
    pub(crate) fn os_thread_name(&self, pid: i32, tid: i32) -> &str {
        self.threads
            .iter()
            .rev()
            .find(|t| t.pid == pid && t.tid == tid)
            .map(|t| t.name.as_str())
            .unwrap_or("")
    }

    /// Keep only `[from_ns, to_ns)` (ns since start): events inside it, intervals clipped to it,
    /// metric points inside it; times are shifted so the range starts at 0. Tables (processes,
    /// threads, frames, stacks, engines, series, probes) are kept whole.
    pub fn trim(&mut self, from_ns: u64, to_ns: u64) {
        let whole = self.duration_ns();
        self.counters_span_ns.get_or_insert(whole);
        let inside = |t: u64| t >= from_ns && t < to_ns;
        self.samples.retain(|s| inside(s.t_ns));
        for s in &mut self.samples {
            s.t_ns -= from_ns;
        }
        // Intervals: clip to the range.
        let clip = |start: u64, dur: u64| -> Option<(u64, u64)> {
            let s = start.max(from_ns);
            let e = (start + dur).min(to_ns);
            (e > s || (dur == 0 && inside(start))).then(|| (s - from_ns, e.saturating_sub(s)))
        };
        self.offcpu
            .retain_mut(|o| match clip(o.start_ns, o.dur_ns) {
                Some((s, d)) => {
                    o.start_ns = s;
                    o.dur_ns = d;
                    true
                }
                None => false,
            });
        self.gil_waits
            .retain_mut(|g| match clip(g.start_ns, g.dur_ns) {
                Some((s, d)) => {
                    g.start_ns = s;
                    g.dur_ns = d;
                    true
                }
                None => false,
            });
        self.wakes.retain_mut(|w| match clip(w.t_ns, 0) {
            Some((s, _)) => {
                w.t_ns = s;
                true
            }
            None => false,
        });
        // Pauses and calls are whole events: kept when they start inside the range.
        self.gc_pauses.retain(|g| inside(g.start_ns));
        for g in &mut self.gc_pauses {
            g.start_ns -= from_ns;
        }
        self.calls.retain(|c| inside(c.start_ns));
        for c in &mut self.calls {
            c.start_ns -= from_ns;
        }
        self.metrics.retain(|m| inside(m.t_ns));
        for m in &mut self.metrics {
            m.t_ns -= from_ns;
        }
        self.scrape_errors.retain(|e| inside(e.t_ns));
        for e in &mut self.scrape_errors {
            e.t_ns -= from_ns;
        }
        for t in &mut self.threads {
            t.t_ns = t.t_ns.saturating_sub(from_ns);
        }
        // Task changes are states that hold until the next: each thread's change in force at
        // `from_ns` is kept (from 0), then those inside the range.
        let mut in_force: BTreeMap<(i32, i32), TaskChange> = BTreeMap::new();
        let mut inside_changes = Vec::new();
        for c in std::mem::take(&mut self.task_changes) {
            if c.t_ns <= from_ns {
                in_force.insert((c.pid, c.tid), c);
            } else if c.t_ns < to_ns {
                inside_changes.push(c);
            }
        }
        self.task_changes = in_force.into_values().chain(inside_changes).collect();
        for c in &mut self.task_changes {
            c.t_ns = c.t_ns.saturating_sub(from_ns);
            c.prev_seen_ns = c.prev_seen_ns.map(|p| p.saturating_sub(from_ns));
        }
        for p in &mut self.probes {
            p.t_ns = p.t_ns.saturating_sub(from_ns);
        }
        for e in &mut self.engines {
            e.t_ns = e.t_ns.saturating_sub(from_ns);
        }
        self.meta.start_mono_ns += from_ns;
        self.meta.start_unix_s += from_ns as f64 / 1e9;
        let end = self.end.get_or_insert_with(|| EndInfo {
            duration_ns: 0,
            reason: "cut short".into(),
        });
        end.duration_ns = to_ns - from_ns;
    }

    /// Recording length: the clean end's duration, else the last event's time.
    pub fn duration_ns(&self) -> u64 {
        if let Some(e) = &self.end {
            return e.duration_ns;
        }
        let s = self.samples.iter().map(|s| s.t_ns).max().unwrap_or(0);
        let o = self
            .offcpu
            .iter()
            .map(|o| o.start_ns + o.dur_ns)
            .max()
            .unwrap_or(0);
        s.max(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trim_keeps_and_clips_the_range() {
        let mut r = Recording::default();
        r.meta.start_mono_ns = 1_000;
        r.end = Some(EndInfo {
            duration_ns: 100,
            reason: "done".into(),
        });
        for t in [5, 20, 59, 60, 90] {
            r.samples.push(Sample {
                t_ns: t,
                pid: 1,
                tid: 1,
                stack: 0,
                flags: 0,
                weight_ns: 1,
            });
        }
        // 10..30 clipped to 20..30; 50..70 clipped to 50..60; 70..80 dropped.
        for (s, d) in [(10, 20), (50, 20), (70, 10)] {
            r.offcpu.push(OffCpu {
                pid: 1,
                tid: 1,
                start_ns: s,
                dur_ns: d,
                stack: 0,
                preempted: false,
                stolen: false,
            });
        }
        r.metrics.push(MetricPoint {
            t_ns: 25,
            series: 0,
            value: 1.0,
        });
        r.metrics.push(MetricPoint {
            t_ns: 65,
            series: 0,
            value: 2.0,
        });
        r.trim(20, 60);
        assert_eq!(
            r.samples.iter().map(|s| s.t_ns).collect::<Vec<_>>(),
            [0, 39]
        );
        assert_eq!(
            r.offcpu
                .iter()
                .map(|o| (o.start_ns, o.dur_ns))
                .collect::<Vec<_>>(),
            [(0, 10), (30, 10)]
        );
        assert_eq!(r.metrics.len(), 1);
        assert_eq!(r.metrics[0].t_ns, 5);
        assert_eq!(r.meta.start_mono_ns, 1_020);
        assert_eq!(r.duration_ns(), 40);
    }
}
