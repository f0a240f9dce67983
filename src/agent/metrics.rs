//! The agent's Prometheus metrics, and the aggregator that turns recording events into them.
//!
//! Every figure comes from the recording the agent writes (the same records `report` reads),
//! so the exporter and the reports agree. Names follow Prometheus conventions: base units
//! (seconds, bytes), `_total` on counters, `enginescope_` prefix; the standard `process_*`
//! metrics describe the agent itself. The full list with label sets is in
//! docs/deployment.md and [`FAMILIES`] (which the dashboard lint checks queries against).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::budget::{Budget, BudgetConfig};
use crate::accounting::ThreadAcc;
use crate::record::Recording;

/// Label value of the aggregate series of keys without a series of their own.
pub(crate) const OTHER: &str = "_other";
/// Function label of samples with no Python frame (a thread in native code only).
pub(crate) const NO_PYTHON: &str = "(no Python frame)";
/// Longest label value kept (longer ones are cut).
const MAX_LABEL_LEN: usize = 120;
/// Most same-named threads of one process told apart by a `#N` suffix.
const MAX_SAME_NAME: usize = 64;

/// Every metric family the agent exposes: (family name as registered, type, label names).
/// Counters are exposed with `_total`, histograms as `_bucket` (with `le`), `_sum`, `_count`.
pub const FAMILIES: &[(&str, &str, &[&str])] = &[
    ("enginescope_thread_cpu_seconds", "counter", THREAD),
    ("enginescope_thread_gil_held_seconds", "counter", THREAD),
    ("enginescope_thread_gil_wait_seconds", "counter", THREAD),
    (
        "enginescope_thread_gil_switch_wait_seconds",
        "counter",
        THREAD,
    ),
    ("enginescope_thread_offcpu_seconds", "counter", THREAD),
    ("enginescope_thread_stolen_seconds", "counter", THREAD),
    (
        "enginescope_function_cpu_seconds",
        "counter",
        &["engine", "role", "function", "file"],
    ),
    ("enginescope_samples", "counter", PROCESS),
    ("enginescope_gc_pause_seconds", "histogram", GC),
    ("enginescope_gc_collected_objects", "counter", GC),
    (
        "enginescope_probe_call_duration_seconds",
        "histogram",
        &["engine", "role", "function", "method"],
    ),
    (
        "enginescope_probe_watched_seconds",
        "counter",
        &["engine", "role", "function", "method"],
    ),
    (
        "enginescope_probe_watch_phases",
        "counter",
        &["engine", "role", "function", "method"],
    ),
    ("enginescope_samples_lost", "counter", &[]),
    ("enginescope_recorder_errors", "counter", &["kind"]),
    ("enginescope_probe_errors", "counter", &["kind"]),
    ("enginescope_probes_switched_to_sampling", "counter", &[]),
    ("enginescope_scrape_errors", "counter", &["engine"]),
    ("enginescope_processes", "gauge", PROCESS),
    ("enginescope_label_sets_aggregated", "counter", &["kind"]),
    ("enginescope_recording_segments", "gauge", &[]),
    ("enginescope_recording_bytes", "gauge", &[]),
    ("enginescope_recording_rotations", "counter", &[]),
    ("enginescope_recorder_restarts", "counter", &[]),
    ("enginescope_profile_pushes", "counter", &["kind"]),
    ("enginescope_info", "gauge", &["version", "backend", "mode"]),
    ("process_resident_memory_bytes", "gauge", &[]),
    ("process_virtual_memory_bytes", "gauge", &[]),
    ("process_cpu_seconds", "counter", &[]),
    ("process_open_fds", "gauge", &[]),
    ("process_start_time_seconds", "gauge", &[]),
];

const THREAD: &[&str] = &["engine", "role", "thread"];
const PROCESS: &[&str] = &["engine", "role"];
const GC: &[&str] = &["engine", "role", "generation"];

/// The sample names a query may use, with their labels: counters with `_total`, histograms
/// with their three series, gauges as they are.
pub fn exposed_names() -> Vec<(String, Vec<&'static str>)> {
    let mut out = Vec::new();
    for (name, kind, labels) in FAMILIES {
        match *kind {
            "counter" => out.push((format!("{name}_total"), labels.to_vec())),
            "histogram" => {
                let mut with_le = labels.to_vec();
                with_le.push("le");
                out.push((format!("{name}_bucket"), with_le));
                out.push((format!("{name}_sum"), labels.to_vec()));
                out.push((format!("{name}_count"), labels.to_vec()));
            }
            _ => out.push((name.to_string(), labels.to_vec())),
        }
    }
    out
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ThreadLabels {
    pub engine: String,
    pub role: String,
    pub thread: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ProcessLabels {
    pub engine: String,
    pub role: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct GcLabels {
    pub engine: String,
    pub role: String,
    pub generation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct FunctionLabels {
    pub engine: String,
    pub role: String,
    pub function: String,
    pub file: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ProbeLabels {
    pub engine: String,
    pub role: String,
    pub function: String,
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabels {
    pub engine: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InfoLabels {
    pub version: String,
    pub backend: String,
    pub mode: String,
}

type Seconds = Counter<f64, AtomicU64>;
type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn gc_histogram() -> Histogram {
    // 50 µs … 2.5 s: young collections are ~0.1-1 ms, full ones tens of ms.
    Histogram::new([
        0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
        1.0, 2.5,
    ])
}

fn call_histogram() -> Histogram {
    // 10 µs … 10 s: queue operations to model steps.
    Histogram::new([
        0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
        0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ])
}

/// The metric families, registered once; cheap to clone (shared handles).
#[derive(Clone)]
pub struct Metrics {
    pub thread_cpu: Family<ThreadLabels, Seconds>,
    pub thread_gil_held: Family<ThreadLabels, Seconds>,
    pub thread_gil_wait: Family<ThreadLabels, Seconds>,
    pub thread_gil_switch_wait: Family<ThreadLabels, Seconds>,
    pub thread_offcpu: Family<ThreadLabels, Seconds>,
    pub thread_stolen: Family<ThreadLabels, Seconds>,
    pub function_cpu: Family<FunctionLabels, Seconds>,
    pub samples: Family<ProcessLabels, Counter>,
    pub gc_pause: HistogramFamily<GcLabels>,
    pub gc_collected: Family<GcLabels, Counter>,
    pub probe_duration: HistogramFamily<ProbeLabels>,
    pub probe_watched: Family<ProbeLabels, Seconds>,
    pub probe_phases: Family<ProbeLabels, Counter>,
    pub samples_lost: Counter,
    pub recorder_errors: Family<KindLabels, Counter>,
    pub probe_errors: Family<KindLabels, Counter>,
    pub probes_demoted: Counter,
    pub scrape_errors: Family<EngineLabels, Counter>,
    pub processes: Family<ProcessLabels, Gauge>,
    pub aggregated: Family<KindLabels, Counter>,
    pub segments: Gauge,
    pub recording_bytes: Gauge,
    pub rotations: Counter,
    pub recorder_restarts: Counter,
    /// Profiles pushed (`--push`), by kind: `sent`, `failed` (kept to retry) and `dropped`.
    pub profile_pushes: Family<KindLabels, Counter>,
    pub info: Family<InfoLabels, Gauge>,
    pub rss: Gauge,
    pub vsize: Gauge,
    pub cpu: Seconds,
    pub open_fds: Gauge,
    pub start_time: Gauge<f64, AtomicU64>,
}

impl Metrics {
    /// Register every family in a new registry.
    pub fn new() -> (Self, Registry) {
        let m = Metrics {
            thread_cpu: Family::default(),
            thread_gil_held: Family::default(),
            thread_gil_wait: Family::default(),
            thread_gil_switch_wait: Family::default(),
            thread_offcpu: Family::default(),
            thread_stolen: Family::default(),
            function_cpu: Family::default(),
            samples: Family::default(),
            gc_pause: Family::new_with_constructor(gc_histogram),
            gc_collected: Family::default(),
            probe_duration: Family::new_with_constructor(call_histogram),
            probe_watched: Family::default(),
            probe_phases: Family::default(),
            samples_lost: Counter::default(),
            recorder_errors: Family::default(),
            probe_errors: Family::default(),
            probes_demoted: Counter::default(),
            scrape_errors: Family::default(),
            processes: Family::default(),
            aggregated: Family::default(),
            segments: Gauge::default(),
            recording_bytes: Gauge::default(),
            rotations: Counter::default(),
            recorder_restarts: Counter::default(),
            profile_pushes: Family::default(),
            info: Family::default(),
            rss: Gauge::default(),
            vsize: Gauge::default(),
            cpu: Seconds::default(),
            open_fds: Gauge::default(),
            start_time: Gauge::default(),
        };
        // Shown at 0 from the start (with or without --push), so a rate over them is defined.
        for kind in ["sent", "failed", "dropped"] {
            let _ = m
                .profile_pushes
                .get_or_create(&KindLabels { kind: kind.into() });
        }
        let mut r = Registry::default();
        register_targets(&mut r, m.clone());
        register_agent(&mut r, m.clone());
        (m, r)
    }
}

/// The families of what the targets did: threads, functions, GC, probe calls.
fn register_targets(reg: &mut Registry, c: Metrics) {
    reg.register(
        "enginescope_thread_cpu_seconds",
        "CPU time of Python threads, from samples (each stands for one sampling period)",
        c.thread_cpu,
    );
    reg.register(
        "enginescope_thread_gil_held_seconds",
        "CPU time during which the thread held the GIL, from samples",
        c.thread_gil_held,
    );
    reg.register(
            "enginescope_thread_gil_wait_seconds",
            "Time threads spent blocked waiting for the GIL (exact: futex waits, counted when each wait ends; a forced switch's handshake, the dropping thread waiting for the taker, is not a wait)",
            c.thread_gil_wait,
        );
    reg.register(
            "enginescope_thread_gil_switch_wait_seconds",
            "Time threads spent in forced-switch handshakes: asked to drop the GIL, the dropping thread waits until the taker has it (exact: futex waits on the switch condition, counted when each ends); report's and top's switch-wait column",
            c.thread_gil_switch_wait,
        );
    reg.register(
            "enginescope_thread_offcpu_seconds",
            "Time threads spent off CPU, blocked or preempted (exact: sched_switch, counted when each interval ends), and taken by the hypervisor while on CPU (enginescope_thread_stolen_seconds)",
            c.thread_offcpu,
        );
    reg.register(
            "enginescope_thread_stolen_seconds",
            "Part of the off-CPU time the hypervisor took while the thread was on its (virtual) CPU: its runtime stood still with no switch (steal; on kernels that account interrupts apart, interrupts too); 0 with the memory backend",
            c.thread_stolen,
        );
    reg.register(
            "enginescope_function_cpu_seconds",
            "CPU time by the innermost Python function (self time), from samples; top functions, the rest in function=\"_other\"",
            c.function_cpu,
        );
    reg.register("enginescope_samples", "On-CPU samples recorded", c.samples);
    reg.register(
            "enginescope_gc_pause_seconds",
            "Garbage-collection pauses by generation (exact: uprobes on the collector, or a watchpoint on its state; generation=\"-1\" when unknown)",
            c.gc_pause,
        );
    reg.register(
        "enginescope_gc_collected_objects",
        "Objects freed by garbage collections",
        c.gc_collected,
    );
    reg.register(
            "enginescope_probe_call_duration_seconds",
            "Duration of calls of probed functions (method=\"exact\": every call, from hardware breakpoints; \"sampled\": runs seen across samples)",
            c.probe_duration,
        );
    reg.register(
            "enginescope_probe_watched_seconds",
            "Seconds an exact probe watched its threads' calls, summed over the threads (under --probe-budget a share of the time, else all of it): its call histogram holds only the calls inside them, so for a function one thread calls, rate(..._count) / rate(this) is its calls per second",
            c.probe_watched,
        );
    reg.register(
            "enginescope_probe_watch_phases",
            "Watches an exact probe began on its threads (its on-phases under --probe-budget): a call is timed only when it lies wholly inside one, so each phase of L seconds times the calls of d seconds that began in its first L - d; the calls per second of a function one thread calls are rate(..._count) / (rate(enginescope_probe_watched_seconds_total) - rate(this) * rate(..._sum) / rate(..._count))",
            c.probe_phases,
        );
}

/// The families of the agent itself: what it lost or failed, what it keeps on disk, its process.
fn register_agent(reg: &mut Registry, c: Metrics) {
    reg.register(
            "enginescope_samples_lost",
            "Events (samples, context switches, GIL and GC edges) dropped because the kernel ring buffer was full",
            c.samples_lost,
        );
    reg.register(
            "enginescope_recorder_errors",
            "Failure paths of the recorder (stack reads, unresolved frames, watchpoint attaches), by kind",
            c.recorder_errors,
        );
    reg.register(
            "enginescope_probe_errors",
            "Probe failures: attach_failed (no free debug register on a thread), unfinished (call left without a return), unmatched_return, ambiguous_edge (direction of a reference-count write inferred)",
            c.probe_errors,
        );
    reg.register(
        "enginescope_probes_switched_to_sampling",
        "Exact probes switched to the sampled method for their call rate",
        c.probes_demoted,
    );
    reg.register(
        "enginescope_scrape_errors",
        "Failed scrapes of an engine's /metrics",
        c.scrape_errors,
    );
    reg.register(
        "enginescope_processes",
        "Target processes being recorded",
        c.processes,
    );
    reg.register(
            "enginescope_label_sets_aggregated",
            "Events added into an aggregate series (thread or function \"_other\") for lack of room under the cardinality cap",
            c.aggregated,
        );
    reg.register(
        "enginescope_recording_segments",
        "Recording segments on disk",
        c.segments,
    );
    reg.register(
        "enginescope_recording_bytes",
        "Bytes of recording segments on disk",
        c.recording_bytes,
    );
    reg.register(
        "enginescope_recording_rotations",
        "Recording segments started after the first",
        c.rotations,
    );
    reg.register(
        "enginescope_recorder_restarts",
        "Times the recorder started again (targets gone, an error, or no engine yet)",
        c.recorder_restarts,
    );
    reg.register(
            "enginescope_profile_pushes",
            "CPU profiles pushed to --push (sent), not accepted and kept to retry (failed), or given up (dropped)",
            c.profile_pushes,
        );
    reg.register(
        "enginescope_info",
        "The agent's version and backend",
        c.info,
    );
    reg.register(
        "process_resident_memory_bytes",
        "Resident memory of the agent",
        c.rss,
    );
    reg.register(
        "process_virtual_memory_bytes",
        "Virtual memory of the agent",
        c.vsize,
    );
    reg.register(
        "process_cpu_seconds",
        "CPU time of the agent (user and system)",
        c.cpu,
    );
    reg.register(
        "process_open_fds",
        "Open file descriptors of the agent",
        c.open_fds,
    );
    reg.register(
        "process_start_time_seconds",
        "Start time of the agent, seconds since the Unix epoch",
        c.start_time,
    );
}

/// Cut a label value to a bounded length (on a character boundary).
fn label(s: &str) -> String {
    if s.len() <= MAX_LABEL_LEN {
        return s.to_string();
    }
    let mut end = MAX_LABEL_LEN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

fn basename(s: &str) -> &str {
    s.rsplit('/').next().unwrap_or(s)
}

/// Cardinality caps.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub threads: BudgetConfig,
    pub functions: BudgetConfig,
    pub probes: BudgetConfig,
    /// For label sets with no cap of their own (GC by engine and role, aggregates): only
    /// idle expiry.
    pub idle_ticks: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            threads: BudgetConfig::new(64),
            functions: BudgetConfig::new(50),
            probes: BudgetConfig::new(32),
            idle_ticks: 600,
        }
    }
}

/// Counters the recorder writes (cumulative within one recorder run) and where they go.
fn counter_target(name: &str) -> Option<(&'static str, String)> {
    Some(match name {
        "bpf_ringbuf_full_lost" => ("lost", String::new()),
        "bpf_no_tstate"
        | "bpf_read_frame_errors"
        | "bpf_read_tstate_errors"
        | "bpf_truncated_stacks"
        | "bpf_gil_read_errors"
        | "bpf_gc_read_errors"
        | "bpf_gil_wait_unpaired"
        | "bpf_probe_no_frame" => ("recorder", name.trim_start_matches("bpf_").to_string()),
        "unresolved_frames" | "gc_watch_attach_failures" => ("recorder", name.to_string()),
        "probe_attach_failures" => ("probe", "attach_failed".into()),
        "probe_calls_unfinished" => ("probe", "unfinished".into()),
        "probe_unmatched_returns" => ("probe", "unmatched_return".into()),
        "probe_ambiguous_edges" => ("probe", "ambiguous_edge".into()),
        "probes_switched_to_sampling" => ("demoted", String::new()),
        "segments_rotated" => ("rotations", String::new()),
        _ => return None,
    })
}

/// Label sets with only idle expiry: last tick each was touched.
struct Touched<K> {
    last: HashMap<K, u64>,
}

impl<K> Default for Touched<K> {
    fn default() -> Self {
        Touched {
            last: HashMap::new(),
        }
    }
}

impl<K: Clone + Eq + std::hash::Hash> Touched<K> {
    fn touch(&mut self, k: &K, tick: u64) {
        if let Some(t) = self.last.get_mut(k) {
            *t = tick;
        } else {
            self.last.insert(k.clone(), tick);
        }
    }
    fn expire(&mut self, tick: u64, idle: u64) -> Vec<K> {
        let gone: Vec<K> = self
            .last
            .iter()
            .filter(|(_, t)| tick.saturating_sub(**t) >= idle)
            .map(|(k, _)| k.clone())
            .collect();
        for k in &gone {
            self.last.remove(k);
        }
        gone
    }
}

/// What one segment's tables say, rebuilt for every segment (each carries its own tables).
#[derive(Default)]
struct SegmentTables {
    /// pid → role label
    roles: HashMap<i32, String>,
    /// pid → engine id
    engines: HashMap<i32, String>,
    /// (pid, tid) → the thread's name and label
    threads: HashMap<(i32, i32), ThreadName>,
    /// How many entries of each table have been read.
    n_processes: usize,
    n_threads: usize,
    n_engines: usize,
}

/// A thread's name as the recording has it, and its `thread` label (the name, or `name#k`).
struct ThreadName {
    name: String,
    label: String,
}

/// Turns recording events into the metrics, with bounded label sets.
pub struct Aggregator {
    pub m: Metrics,
    limits: Limits,
    threads: Budget<ThreadLabels>,
    functions: Budget<FunctionLabels>,
    probes: Budget<ProbeLabels>,
    /// Aggregate thread series (`thread="_other"`) and other uncapped label sets.
    other_threads: Touched<ThreadLabels>,
    other_functions: Touched<FunctionLabels>,
    other_probes: Touched<ProbeLabels>,
    gc_sets: Touched<GcLabels>,
    sample_sets: Touched<ProcessLabels>,
    scrape_sets: Touched<EngineLabels>,
    seg: SegmentTables,
    /// Recorder counters as last seen in this recorder run (baseline for increments).
    last_counters: BTreeMap<String, u64>,
    tick: u64,
    /// Exact probes' watches open on a thread in this segment: (probe, tid) → the time (ns
    /// since the segment's start) up to which their watched time is counted.
    watching: HashMap<(u32, i32), u64>,
    /// The latest event time read from this segment (ns since its start): open watches are
    /// counted up to it (raw events).
    seen_up_to: u64,
    /// The segments hold aggregated intervals (`--profile-seconds`, the default) rather than
    /// raw events: their calls are read when their interval ends, so watched time is counted
    /// up to the last interval's end, not up to the latest watch edge.
    aggregated: bool,
    /// Watch edges read but past what the calls read cover yet (aggregated segments).
    pending_watches: Vec<crate::record::ProbeWatch>,
    /// This segment continues a rotated one: its `on` edges at time 0 restate the watches
    /// open at the rotation (the same phases, not new ones).
    continued: bool,
    /// Whether a process is still there (`/proc/PID`; a test's fake one in unit tests).
    alive: fn(i32) -> bool,
    /// The recorder's backend, from the latest segment's header.
    backend: String,
}

/// Watch edges held back for the calls to catch up with, at most (aggregated segments).
const MAX_PENDING_WATCHES: usize = 1 << 16;

impl Aggregator {
    pub fn new(m: Metrics, limits: Limits) -> Self {
        Aggregator {
            m,
            limits,
            threads: Budget::new(limits.threads),
            functions: Budget::new(limits.functions),
            probes: Budget::new(limits.probes),
            other_threads: Touched::default(),
            other_functions: Touched::default(),
            other_probes: Touched::default(),
            gc_sets: Touched::default(),
            sample_sets: Touched::default(),
            scrape_sets: Touched::default(),
            seg: SegmentTables::default(),
            last_counters: BTreeMap::new(),
            tick: 0,
            watching: HashMap::new(),
            seen_up_to: 0,
            aggregated: false,
            pending_watches: Vec::new(),
            continued: false,
            alive: |pid| std::path::Path::new(&format!("/proc/{pid}")).exists(),
            backend: String::new(),
        }
    }

    /// The segments are aggregated (`--profile-seconds`) rather than raw events.
    pub fn aggregated(mut self, yes: bool) -> Self {
        self.aggregated = yes;
        self
    }

    /// A new segment begins: its tables are read afresh. `same_run`: it continues the previous
    /// segment's recorder run (a rotation), so the recorder's counters continue too; otherwise
    /// they start again from zero.
    pub(crate) fn begin_segment(&mut self, same_run: bool) {
        self.seg = SegmentTables::default();
        // A segment begins with an `on` edge for every watch open at its start.
        self.watching.clear();
        self.pending_watches.clear();
        self.continued = same_run;
        self.seen_up_to = 0;
        if !same_run {
            self.last_counters.clear();
        }
    }

    /// The labels of a process's series (engine and role), as read from its tables so far.
    pub fn process_labels_of(&self, pid: i32) -> ProcessLabels {
        self.process_labels(pid)
    }

    /// The labels a thread's series get, before any cap folds it into `other`.
    pub fn thread_labels_of(&self, pid: i32, tid: i32) -> ThreadLabels {
        let p = self.process_labels(pid);
        ThreadLabels {
            engine: p.engine,
            role: p.role,
            thread: self
                .seg
                .threads
                .get(&(pid, tid))
                .map(|t| t.label.clone())
                .unwrap_or_else(|| format!("tid{tid}")),
        }
    }

    fn process_labels(&self, pid: i32) -> ProcessLabels {
        ProcessLabels {
            engine: self.seg.engines.get(&pid).cloned().unwrap_or_default(),
            role: self
                .seg
                .roles
                .get(&pid)
                .cloned()
                .unwrap_or_else(|| format!("pid{pid}")),
        }
    }

    /// The `thread` label of a thread named `name` (its Python name, else its OS name): the
    /// name, or where another thread of a process with the same engine and role labels already
    /// has it (threads of a pool, or Python threads before 3.14 named only by their OS name),
    /// `name#2`, `name#3`, … (the first free one; `tidN` past [`MAX_SAME_NAME`]). The threads
    /// of processes gone hold no name.
    fn unique_thread_label(&self, pid: i32, tid: i32, name: &str) -> String {
        let name = if name.is_empty() {
            format!("tid{tid}")
        } else {
            label(name)
        };
        let p = self.process_labels(pid);
        // A thread of a process that has exited frees its label: a restarted worker's threads
        // continue its series (same engine and role) instead of adding `#k` ones.
        let taken = |cand: &str| {
            self.seg.threads.iter().any(|(&(op, ot), t)| {
                (op, ot) != (pid, tid)
                    && t.label == cand
                    && self.process_labels(op) == p
                    && (op == pid || (self.alive)(op))
            })
        };
        if !taken(&name) {
            return name;
        }
        for k in 2..=MAX_SAME_NAME {
            let suffix = format!("#{k}");
            let mut end = MAX_LABEL_LEN.saturating_sub(suffix.len()).min(name.len());
            while !name.is_char_boundary(end) {
                end -= 1;
            }
            let cand = format!("{}{suffix}", &name[..end]);
            if !taken(&cand) {
                return cand;
            }
        }
        format!("tid{tid}")
    }

    fn thread_labels(&mut self, pid: i32, tid: i32, activity: f64) -> ThreadLabels {
        let p = self.process_labels(pid);
        let name = self
            .seg
            .threads
            .get(&(pid, tid))
            .map(|t| t.label.clone())
            .unwrap_or_else(|| format!("tid{tid}"));
        let l = ThreadLabels {
            engine: p.engine,
            role: p.role,
            thread: name,
        };
        if self.threads.admit(&l, activity) {
            return l;
        }
        self.m
            .aggregated
            .get_or_create(&KindLabels {
                kind: "thread".into(),
            })
            .inc();
        let o = ThreadLabels {
            thread: OTHER.into(),
            ..l
        };
        self.other_threads.touch(&o, self.tick);
        o
    }

    /// Read the tables added since the last call (processes, threads, engines).
    /// The recorder's backend (`bpf` or `memory`), once a segment header was read.
    pub fn backend(&self) -> Option<&str> {
        (!self.backend.is_empty()).then_some(self.backend.as_str())
    }

    fn read_tables(&mut self, r: &Recording) {
        if !r.meta.backend.is_empty() && r.meta.backend != self.backend {
            self.backend = r.meta.backend.clone();
        }
        for p in r.processes.iter().skip(self.seg.n_processes) {
            let role = if p.role.is_empty() {
                format!("pid{}", p.pid)
            } else {
                label(&p.role)
            };
            self.seg.roles.insert(p.pid, role);
        }
        self.seg.n_processes = r.processes.len();
        // Engines before threads: a thread's label is unique among the threads with its
        // engine and role labels, so a new process's engine must be known first (else every
        // engine's workers share one name space: `MainThread#3` for one engine's worker
        // because other engines' workers came first). A process whose engine is told after
        // its threads (the recorder writes engines once discovered) has its threads named
        // again below, in its engine's name space.
        let mut moved = std::collections::BTreeSet::new();
        for e in r.engines.iter().skip(self.seg.n_engines) {
            for pid in e.pids() {
                let l = label(&e.id);
                if self.seg.engines.get(&pid) != Some(&l) {
                    moved.insert(pid);
                    self.seg.engines.insert(pid, l);
                }
            }
        }
        self.seg.n_engines = r.engines.len();
        let mut renamed: Vec<(i32, i32)> = self
            .seg
            .threads
            .keys()
            .filter(|(pid, _)| moved.contains(pid))
            .copied()
            .collect();
        renamed.sort_unstable();
        // Their old labels hold no name while they are named again (an empty label is
        // nobody's candidate).
        for k in &renamed {
            if let Some(t) = self.seg.threads.get_mut(k) {
                t.label.clear();
            }
        }
        for (pid, tid) in renamed {
            let name = self
                .seg
                .threads
                .get(&(pid, tid))
                .map(|t| t.name.clone())
                .unwrap_or_default();
            let label = self.unique_thread_label(pid, tid, &name);
            self.seg
                .threads
                .insert((pid, tid), ThreadName { name, label });
        }
        // In (pid, tid) order within what was added (a segment begins with every live thread),
        // so which of several same-named threads keeps the bare name does not depend on the
        // order they were written in; a thread's later records (renames) stay after its
        // earlier ones.
        let mut added: Vec<&crate::record::ThreadInfo> =
            r.threads.iter().skip(self.seg.n_threads).collect();
        added.sort_by_key(|t| (t.pid, t.tid));
        for t in added {
            let label = self.unique_thread_label(t.pid, t.tid, t.display_name());
            let name = t.display_name().to_string();
            self.seg
                .threads
                .insert((t.pid, t.tid), ThreadName { name, label });
        }
        self.seg.n_threads = r.threads.len();
    }

    /// Apply every event the reader has gathered since the last call, then drop the events
    /// (the tables stay: later events refer to them). The recording keeps only its tables.
    pub fn apply(&mut self, r: &mut Recording) {
        self.read_tables(r);
        let samples = std::mem::take(&mut r.samples);
        for s in &samples {
            self.seen_up_to = self.seen_up_to.max(s.t_ns);
            let a = ThreadAcc::of_sample(s);
            let secs = a.cpu_ns as f64 / 1e9;
            let t = self.thread_labels(s.pid, s.tid, secs);
            self.m.thread_cpu.get_or_create(&t).inc_by(secs);
            if a.gil_held_ns > 0 {
                self.m
                    .thread_gil_held
                    .get_or_create(&t)
                    .inc_by(a.gil_held_ns as f64 / 1e9);
            }
            let p = self.process_labels(s.pid);
            self.sample_sets.touch(&p, self.tick);
            self.m.samples.get_or_create(&p).inc();
            let leaf = r
                .stacks
                .get(s.stack as usize)
                .and_then(|st| st.first())
                .and_then(|&f| r.frames.get(f as usize));
            let (function, file) = match leaf {
                Some(f) => (label(&f.function), label(basename(&f.file))),
                None => (NO_PYTHON.to_string(), String::new()),
            };
            let fl = FunctionLabels {
                engine: p.engine,
                role: p.role,
                function,
                file,
            };
            let fl = if self.functions.admit(&fl, secs) {
                fl
            } else {
                self.m
                    .aggregated
                    .get_or_create(&KindLabels {
                        kind: "function".into(),
                    })
                    .inc();
                let o = FunctionLabels {
                    function: OTHER.into(),
                    file: String::new(),
                    ..fl
                };
                self.other_functions.touch(&o, self.tick);
                o
            };
            self.m.function_cpu.get_or_create(&fl).inc_by(secs);
        }
        for o in std::mem::take(&mut r.offcpu) {
            let secs = o.dur_ns as f64 / 1e9;
            // Off-CPU time counts as activity a million times less than CPU time: it keeps a
            // blocked thread's series alive, but every idle thread has it, so it ranks last.
            let t = self.thread_labels(o.pid, o.tid, secs * 1e-6);
            self.m.thread_offcpu.get_or_create(&t).inc_by(secs);
            if o.stolen {
                self.m.thread_stolen.get_or_create(&t).inc_by(secs);
            }
        }
        for g in std::mem::take(&mut r.gil_waits) {
            // A forced-switch handshake (the dropping thread waiting for the taker) is not a
            // GIL wait but a series of its own, as in `report` and `top` (crate::accounting).
            let a = ThreadAcc::of_gil_wait(&g, g.dur_ns, 1);
            let (family, ns) = if g.switch_wait {
                (self.m.thread_gil_switch_wait.clone(), a.switch_wait_ns)
            } else {
                (self.m.thread_gil_wait.clone(), a.gil_wait_ns)
            };
            let secs = ns as f64 / 1e9;
            let t = self.thread_labels(g.pid, g.tid, secs);
            family.get_or_create(&t).inc_by(secs);
        }
        for g in std::mem::take(&mut r.gc_pauses) {
            let p = self.process_labels(g.pid);
            let l = GcLabels {
                engine: p.engine,
                role: p.role,
                generation: g.generation.to_string(),
            };
            self.gc_sets.touch(&l, self.tick);
            self.m
                .gc_pause
                .get_or_create(&l)
                .observe(g.dur_ns as f64 / 1e9);
            let freed = self.m.gc_collected.get_or_create(&l);
            if g.collected > 0 {
                freed.inc_by(g.collected as u64);
            }
        }
        let calls = std::mem::take(&mut r.calls);
        for c in &calls {
            self.seen_up_to = self.seen_up_to.max(c.start_ns.saturating_add(c.dur_ns));
            let secs = c.dur_ns as f64 / 1e9;
            if let Some(l) = self.probe_labels(r, c.probe, secs) {
                self.m.probe_duration.get_or_create(&l).observe(secs);
            }
        }
        self.apply_watches(r);
        for e in std::mem::take(&mut r.scrape_errors) {
            let l = EngineLabels {
                engine: label(&e.engine),
            };
            self.scrape_sets.touch(&l, self.tick);
            self.m.scrape_errors.get_or_create(&l).inc();
        }
        // Engine metric points are in the segment for `report`; Prometheus scrapes the engine
        // itself, so they are not re-exported.
        r.metrics.clear();
        r.metrics.shrink_to(1 << 16);
        let counters = std::mem::take(&mut r.counters);
        self.apply_counters(&counters);
    }

    /// The series of probe `probe` (an index into the segment's probes), or its `_other`
    /// where the probe cap folds it; `activity` ranks it for the cap.
    fn probe_labels(&mut self, r: &Recording, probe: u32, activity: f64) -> Option<ProbeLabels> {
        let pr = r.probes.get(probe as usize)?;
        let p = self.process_labels(pr.pid);
        let l = ProbeLabels {
            engine: p.engine,
            role: p.role,
            function: label(&pr.function),
            method: label(&pr.method),
        };
        if self.probes.admit(&l, activity.max(1e-9)) {
            return Some(l);
        }
        let o = ProbeLabels {
            function: OTHER.into(),
            ..l
        };
        self.other_probes.touch(&o, self.tick);
        Some(o)
    }

    /// The exact probes' watch edges read so far, up to what the calls read cover: each
    /// watch's time counts into `enginescope_probe_watched_seconds` when it ends, and a watch
    /// still open up to that point, so that the series advances with the calls it scales and
    /// the one over the other is the calls' rate at any moment. Raw events cover up to the
    /// latest event read; aggregated segments up to their last interval's end (their calls
    /// come when it ends, every `--profile-seconds`, while the edges are written as they
    /// happen: counted up to the edges, a 6 s span between two scrapes read 0 calls in 1.8 s
    /// watched).
    fn apply_watches(&mut self, r: &mut Recording) {
        self.pending_watches.append(&mut r.probe_watches);
        self.pending_watches.sort_by_key(|w| w.t_ns);
        let mut horizon = if self.aggregated {
            r.profile_intervals.last().map_or(0, |&(_, end)| end)
        } else {
            self.pending_watches
                .last()
                .map_or(self.seen_up_to, |w| w.t_ns.max(self.seen_up_to))
        };
        // Bounded: a segment whose events stop (no interval written) keeps the latest edges.
        if let Some(w) = self
            .pending_watches
            .len()
            .checked_sub(MAX_PENDING_WATCHES)
            .and_then(|i| self.pending_watches.get(i))
        {
            horizon = horizon.max(w.t_ns);
        }
        let ready = self.pending_watches.partition_point(|w| w.t_ns <= horizon);
        let edges: Vec<crate::record::ProbeWatch> = self.pending_watches.drain(..ready).collect();
        self.seen_up_to = self.seen_up_to.max(horizon);
        let r: &Recording = r;
        let add = |a: &mut Self, probe: u32, ns: u64| {
            if ns > 0 {
                let secs = ns as f64 / 1e9;
                if let Some(l) = a.probe_labels(r, probe, 0.0) {
                    a.m.probe_watched.get_or_create(&l).inc_by(secs);
                }
            }
        };
        for w in &edges {
            let key = (w.probe, w.tid);
            if let Some(since) = self.watching.remove(&key) {
                add(self, w.probe, w.t_ns.saturating_sub(since));
            }
            if w.on {
                // A segment restates the watches open at its start: the same phase.
                let restated = self.continued && w.t_ns == 0;
                if self.watching.insert(key, w.t_ns).is_none() && !restated {
                    if let Some(l) = self.probe_labels(r, w.probe, 0.0) {
                        self.m.probe_phases.get_or_create(&l).inc();
                    }
                }
            }
        }
        let open: Vec<((u32, i32), u64)> = self.watching.iter().map(|(&k, &v)| (k, v)).collect();
        for ((probe, tid), since) in open {
            if horizon > since {
                add(self, probe, horizon - since);
                self.watching.insert((probe, tid), horizon);
            }
        }
    }

    /// The recorder's counters are cumulative within its run: add what they grew by.
    fn apply_counters(&mut self, c: &BTreeMap<String, u64>) {
        for (name, &v) in c {
            let Some((dest, kind)) = counter_target(name) else {
                continue;
            };
            let prev = self.last_counters.get(name).copied().unwrap_or(0);
            // A smaller value: a new run whose start we did not notice; it counted from 0.
            let inc = if v >= prev { v - prev } else { v };
            self.last_counters.insert(name.clone(), v);
            if inc == 0 {
                // Make the series exist (at 0) so that dashboards and alerts see it.
                match dest {
                    "recorder" => {
                        let _ = self.m.recorder_errors.get_or_create(&KindLabels { kind });
                    }
                    "probe" => {
                        let _ = self.m.probe_errors.get_or_create(&KindLabels { kind });
                    }
                    _ => {}
                }
                continue;
            }
            match dest {
                "lost" => {
                    self.m.samples_lost.inc_by(inc);
                }
                "recorder" => {
                    self.m
                        .recorder_errors
                        .get_or_create(&KindLabels { kind })
                        .inc_by(inc);
                }
                "probe" => {
                    self.m
                        .probe_errors
                        .get_or_create(&KindLabels { kind })
                        .inc_by(inc);
                }
                "demoted" => {
                    self.m.probes_demoted.inc_by(inc);
                }
                "rotations" => {
                    self.m.rotations.inc_by(inc);
                }
                _ => {}
            }
        }
    }

    /// Processes of the current segment that still run, by engine and role.
    pub(crate) fn update_process_gauge(&mut self, alive: &dyn Fn(i32) -> bool) {
        let mut counts: HashMap<ProcessLabels, i64> = HashMap::new();
        let pids: Vec<i32> = self.seg.roles.keys().copied().collect();
        for pid in pids {
            if alive(pid) {
                *counts.entry(self.process_labels(pid)).or_default() += 1;
            }
        }
        self.m.processes.clear();
        for (l, n) in counts {
            self.m.processes.get_or_create(&l).set(n);
        }
    }

    /// End of a poll: expire idle label sets and let busier keys in (see [`Budget`]).
    pub fn tick(&mut self) {
        self.tick += 1;
        for l in self.threads.tick() {
            self.m.thread_cpu.remove(&l);
            self.m.thread_gil_held.remove(&l);
            self.m.thread_gil_wait.remove(&l);
            self.m.thread_gil_switch_wait.remove(&l);
            self.m.thread_offcpu.remove(&l);
            self.m.thread_stolen.remove(&l);
        }
        for l in self.functions.tick() {
            self.m.function_cpu.remove(&l);
        }
        for l in self.probes.tick() {
            self.m.probe_duration.remove(&l);
            self.m.probe_watched.remove(&l);
            self.m.probe_phases.remove(&l);
        }
        let idle = self.limits.idle_ticks;
        for l in self.other_threads.expire(self.tick, idle) {
            self.m.thread_cpu.remove(&l);
            self.m.thread_gil_held.remove(&l);
            self.m.thread_gil_wait.remove(&l);
            self.m.thread_gil_switch_wait.remove(&l);
            self.m.thread_offcpu.remove(&l);
            self.m.thread_stolen.remove(&l);
        }
        for l in self.other_functions.expire(self.tick, idle) {
            self.m.function_cpu.remove(&l);
        }
        for l in self.other_probes.expire(self.tick, idle) {
            self.m.probe_duration.remove(&l);
            self.m.probe_watched.remove(&l);
            self.m.probe_phases.remove(&l);
        }
        for l in self.gc_sets.expire(self.tick, idle) {
            self.m.gc_pause.remove(&l);
            self.m.gc_collected.remove(&l);
        }
        for l in self.sample_sets.expire(self.tick, idle) {
            self.m.samples.remove(&l);
        }
        for l in self.scrape_sets.expire(self.tick, idle) {
            self.m.scrape_errors.remove(&l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::*;

    fn encode(r: &Registry) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, r).unwrap();
        s
    }

    /// The value of the exposed sample `name{labels}` (labels as written, sorted as declared).
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    fn rec() -> Recording {
        let mut r = Recording {
            stacks: vec![vec![], vec![0]],
            frames: vec![Frame {
                function: "Worker.execute_model".into(),
                file: "/x/vllm/worker.py".into(),
                line: Some(3),
            }],
            ..Default::default()
        };
        r.processes.push(ProcessInfo {
            pid: 10,
            role: "worker_tp0".into(),
            ..Default::default()
        });
        r.processes.push(ProcessInfo {
            pid: 20,
            ..Default::default()
        });
        r.engines.push(EngineInfo {
            id: "engine0".into(),
            worker_pids: vec![10],
            ..Default::default()
        });
        r.threads.push(ThreadInfo {
            pid: 10,
            tid: 11,
            name: "MainThread".into(),
            t_ns: 0,
            python_name: None,
        });
        for i in 0..100 {
            r.samples.push(Sample {
                t_ns: i,
                pid: 10,
                tid: 11,
                stack: if i < 70 { 1 } else { 0 },
                flags: if i < 40 { flags::GIL } else { 0 },
                weight_ns: 10_000_000,
            });
        }
        r.samples.push(Sample {
            t_ns: 0,
            pid: 20,
            tid: 21,
            stack: 1,
            flags: 0,
            weight_ns: 10_000_000,
        });
        r.offcpu.push(OffCpu {
            pid: 10,
            tid: 11,
            start_ns: 0,
            dur_ns: 2_000_000_000,
            stack: 0,
            preempted: false,
            stolen: false,
        });
        // Half a second the hypervisor took while it ran: off CPU, and stolen.
        r.offcpu.push(OffCpu {
            pid: 10,
            tid: 11,
            start_ns: 2_000_000_000,
            dur_ns: 500_000_000,
            stack: 1,
            preempted: true,
            stolen: true,
        });
        r.gil_waits.push(GilWait {
            pid: 10,
            tid: 11,
            start_ns: 0,
            dur_ns: 300_000_000,
            holder_tid: 0,
            holder_stack: 0,
            waiter_stack: 0,
            switch_wait: false,
        });
        r.gil_waits.push(GilWait {
            pid: 10,
            tid: 11,
            start_ns: 0,
            dur_ns: 20_000_000,
            holder_tid: 0,
            holder_stack: 0,
            waiter_stack: 0,
            switch_wait: true,
        });
        for (g, d) in [(0i8, 200_000u64), (0, 300_000), (2, 30_000_000)] {
            r.gc_pauses.push(GcPause {
                pid: 10,
                tid: 11,
                start_ns: 0,
                dur_ns: d,
                generation: g,
                collected: 5,
            });
        }
        r.probes.push(ProbeInfo {
            id: 0,
            pid: 10,
            function: "MessageQueue.dequeue".into(),
            method: "exact".into(),
            ..Default::default()
        });
        for d in [40_000u64, 60_000, 2_000_000] {
            r.calls.push(FunctionCall {
                probe: 0,
                pid: 10,
                tid: 11,
                start_ns: 0,
                dur_ns: d,
            });
        }
        for (t_ns, on) in [(0, true), (1_000_000_000, false)] {
            r.probe_watches.push(crate::record::ProbeWatch {
                t_ns,
                probe: 0,
                tid: 11,
                on,
            });
        }
        r.counters.insert("bpf_ringbuf_full_lost".into(), 7);
        r.counters.insert("probe_attach_failures".into(), 2);
        r
    }

    #[test]
    fn events_become_labelled_metrics() {
        let (m, reg) = Metrics::new();
        let mut a = Aggregator::new(m, Limits::default());
        let mut r = rec();
        a.apply(&mut r);
        assert!(r.samples.is_empty() && r.calls.is_empty(), "events dropped");
        assert_eq!(r.stacks.len(), 2, "tables kept");
        let t = encode(&reg);
        let th = r#"{engine="engine0",role="worker_tp0",thread="MainThread"}"#;
        let v = |s: &str| value(&t, s).unwrap_or_else(|| panic!("no {s} in\n{t}"));
        assert!((v(&format!("enginescope_thread_cpu_seconds_total{th}")) - 1.0).abs() < 1e-9);
        assert!((v(&format!("enginescope_thread_gil_held_seconds_total{th}")) - 0.4).abs() < 1e-9);
        assert!((v(&format!("enginescope_thread_offcpu_seconds_total{th}")) - 2.5).abs() < 1e-9);
        assert!((v(&format!("enginescope_thread_stolen_seconds_total{th}")) - 0.5).abs() < 1e-9);
        assert!((v(&format!("enginescope_thread_gil_wait_seconds_total{th}")) - 0.3).abs() < 1e-9);
        assert!(
            (v(&format!(
                "enginescope_thread_gil_switch_wait_seconds_total{th}"
            )) - 0.02)
                .abs()
                < 1e-9
        );
        // A process outside any engine and a thread never named.
        assert!(
            (v(r#"enginescope_thread_cpu_seconds_total{engine="",role="pid20",thread="tid21"}"#)
                - 0.01)
                .abs()
                < 1e-9
        );
        let f = r#"enginescope_function_cpu_seconds_total{engine="engine0",role="worker_tp0",function="Worker.execute_model",file="worker.py"}"#;
        assert!((v(f) - 0.7).abs() < 1e-9);
        let nf = format!(
            r#"enginescope_function_cpu_seconds_total{{engine="engine0",role="worker_tp0",function="{NO_PYTHON}",file=""}}"#
        );
        assert!((v(&nf) - 0.3).abs() < 1e-9);
        let g0 = r#"{engine="engine0",role="worker_tp0",generation="0"}"#;
        assert_eq!(v(&format!("enginescope_gc_pause_seconds_count{g0}")), 2.0);
        assert!((v(&format!("enginescope_gc_pause_seconds_sum{g0}")) - 0.0005).abs() < 1e-12);
        let b = r#"enginescope_gc_pause_seconds_bucket{le="0.00025",engine="engine0",role="worker_tp0",generation="0"}"#;
        assert_eq!(v(b), 1.0);
        assert_eq!(
            v(
                r#"enginescope_gc_collected_objects_total{engine="engine0",role="worker_tp0",generation="2"}"#
            ),
            5.0
        );
        let p = r#"{engine="engine0",role="worker_tp0",function="MessageQueue.dequeue",method="exact"}"#;
        assert_eq!(
            v(&format!("enginescope_probe_call_duration_seconds_count{p}")),
            3.0
        );
        assert_eq!(v("enginescope_samples_lost_total"), 7.0);
        assert_eq!(
            v(r#"enginescope_probe_errors_total{kind="attach_failed"}"#),
            2.0
        );
        assert_eq!(
            v(r#"enginescope_samples_total{engine="engine0",role="worker_tp0"}"#),
            100.0
        );

        // Processes still running, by engine and role.
        a.update_process_gauge(&|pid| pid == 10);
        let t = encode(&reg);
        assert_eq!(
            value(
                &t,
                r#"enginescope_processes{engine="engine0",role="worker_tp0"}"#
            ),
            Some(1.0)
        );
        assert!(!t.contains(r#"enginescope_processes{engine="",role="pid20"}"#));

        // Counters are cumulative per run: only growth counts; a new run starts from 0.
        let mut more = Recording {
            counters: [("bpf_ringbuf_full_lost".to_string(), 10)].into(),
            ..Default::default()
        };
        a.apply(&mut more);
        assert_eq!(
            value(&encode(&reg), "enginescope_samples_lost_total"),
            Some(10.0)
        );
        a.begin_segment(false);
        let mut new_run = Recording {
            counters: [("bpf_ringbuf_full_lost".to_string(), 4)].into(),
            ..Default::default()
        };
        a.apply(&mut new_run);
        assert_eq!(
            value(&encode(&reg), "enginescope_samples_lost_total"),
            Some(14.0)
        );

        // Every family in FAMILIES is registered, and nothing else (families show once they
        // have a series).
        let k = KindLabels { kind: "x".into() };
        a.m.recorder_errors.get_or_create(&k).inc();
        a.m.aggregated.get_or_create(&k).inc();
        a.m.scrape_errors
            .get_or_create(&EngineLabels { engine: "e".into() })
            .inc();
        a.m.processes
            .get_or_create(&ProcessLabels {
                engine: "e".into(),
                role: "r".into(),
            })
            .set(1);
        a.m.info
            .get_or_create(&InfoLabels {
                version: "v".into(),
                backend: "b".into(),
                mode: "m".into(),
            })
            .set(1);
        let text = encode(&reg);
        let mut typed: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.split(' ').next().unwrap_or("").to_string())
            .collect();
        typed.sort();
        let mut want: Vec<String> = FAMILIES.iter().map(|(n, _, _)| n.to_string()).collect();
        want.sort();
        assert_eq!(typed, want);
        // And every exposed sample carries exactly the labels FAMILIES declares.
        let names = exposed_names();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let series = line.rsplit_once(' ').unwrap().0;
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let mut got: Vec<&str> = labels
                .split(',')
                .filter_map(|kv| kv.split_once('=').map(|x| x.0))
                .collect();
            got.sort();
            let mut declared = names
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("{name} not declared"))
                .1
                .clone();
            declared.sort();
            assert_eq!(got, declared, "{line}");
        }
    }

    #[test]
    fn same_named_threads_get_separate_series() {
        use crate::record::{Sample, ThreadInfo};
        let (m, reg) = Metrics::new();
        let mut a = Aggregator::new(m, Limits::default());
        let mut r = Recording::default();
        r.stacks.push(vec![]);
        // Python names tell the writer and the launcher apart; two pool threads share one,
        // and a thread without a Python name keeps its OS name. Listed out of tid order.
        for (tid, os, py) in [
            (4, "python3.12", Some("pool")),
            (2, "python3.12", Some("vllm-step-launcher")),
            (1, "python3.12", Some("vllm-aux-output-writer")),
            (3, "python3.12", Some("pool")),
            (5, "python3.12", None),
        ] {
            r.threads.push(ThreadInfo {
                pid: 1,
                tid,
                name: os.into(),
                t_ns: 0,
                python_name: py.map(String::from),
            });
            r.samples.push(Sample {
                t_ns: 1,
                pid: 1,
                tid,
                stack: 0,
                flags: 0,
                weight_ns: 1_000_000 * tid as u32,
            });
        }
        a.apply(&mut r);
        let t = encode(&reg);
        let cpu = |thread: &str| {
            value(
                &t,
                &format!(
                    r#"enginescope_thread_cpu_seconds_total{{engine="",role="pid1",thread="{thread}"}}"#
                ),
            )
        };
        assert_eq!(cpu("vllm-aux-output-writer"), Some(0.001));
        assert_eq!(cpu("vllm-step-launcher"), Some(0.002));
        // The lower tid keeps the bare name, whatever the order of the records.
        assert_eq!(cpu("pool"), Some(0.003));
        assert_eq!(cpu("pool#2"), Some(0.004));
        assert_eq!(cpu("python3.12"), Some(0.005));
    }

    #[test]
    fn a_probes_watched_seconds_follow_its_watch_edges_across_segments() {
        use crate::record::{FunctionCall, ProbeInfo, ProbeWatch, Sample};
        let (m, reg) = Metrics::new();
        let mut a = Aggregator::new(m, Limits::default());
        let s = 1_000_000_000u64;
        let segment = || {
            let mut r = Recording::default();
            r.stacks.push(vec![]);
            r.probes.push(ProbeInfo {
                pid: 1,
                function: "MessageQueue.dequeue".into(),
                method: "exact".into(),
                ..Default::default()
            });
            r
        };
        let edge = |t: u64, on: bool| ProbeWatch {
            t_ns: t,
            probe: 0,
            tid: 10,
            on,
        };
        let sample = |t: u64| Sample {
            t_ns: t,
            pid: 1,
            tid: 10,
            stack: 0,
            flags: 0,
            weight_ns: 1,
        };
        // A series of the probe's, 0 until it exists.
        let series = |reg: &Registry, family: &str| {
            value(
                &encode(reg),
                &format!(
                    r#"{family}{{engine="",role="pid1",function="MessageQueue.dequeue",method="exact"}}"#
                ),
            )
            .unwrap_or(0.0)
        };
        let watched = |reg: &Registry| series(reg, "enginescope_probe_watched_seconds_total");
        let phases = |reg: &Registry| series(reg, "enginescope_probe_watch_phases_total");
        let mut r = segment();
        // Watched 1-3 s, then from 5 s on; events read up to 8 s.
        r.probe_watches = vec![edge(s, true), edge(3 * s, false), edge(5 * s, true)];
        r.calls.push(FunctionCall {
            probe: 0,
            pid: 1,
            tid: 10,
            start_ns: 2 * s,
            dur_ns: s / 1000,
        });
        r.samples.push(sample(8 * s));
        a.apply(&mut r);
        assert!((watched(&reg) - 5.0).abs() < 1e-9, "{}", watched(&reg));
        assert_eq!(phases(&reg), 2.0);
        // The watch ends at 9 s: one more second, nothing counted twice.
        r.probe_watches.push(edge(9 * s, false));
        r.samples.push(sample(12 * s));
        a.apply(&mut r);
        assert!((watched(&reg) - 6.0).abs() < 1e-9, "{}", watched(&reg));
        // A new segment re-states the watches open at its start; its times start again.
        a.begin_segment(true);
        let mut r = segment();
        r.probe_watches = vec![edge(0, true)];
        r.samples.push(sample(2 * s));
        a.apply(&mut r);
        assert!((watched(&reg) - 8.0).abs() < 1e-9, "{}", watched(&reg));
        // The watch open at the rotation is not a new phase; one begun after it is.
        assert_eq!(phases(&reg), 2.0);
        r.probe_watches = vec![edge(3 * s, false), edge(4 * s, true)];
        r.samples.push(sample(5 * s));
        a.apply(&mut r);
        assert_eq!(phases(&reg), 3.0);
        assert!(encode(&reg).contains("enginescope_probe_call_duration_seconds_count"));

        // Aggregated segments: the calls come when their interval ends, the edges as they
        // happen; watched time follows the calls.
        let (m, reg) = Metrics::new();
        let mut a = Aggregator::new(m, Limits::default()).aggregated(true);
        let calls = |reg: &Registry| series(reg, "enginescope_probe_call_duration_seconds_count");
        let mut r = segment();
        r.probe_watches = vec![edge(s, true), edge(3 * s, false), edge(5 * s, true)];
        r.samples.push(sample(8 * s));
        a.apply(&mut r);
        assert_eq!((watched(&reg), calls(&reg)), (0.0, 0.0));
        // The first interval (0-6 s) ends: its call, and watched 1-3 s and 5-6 s.
        r.profile_intervals.push((0, 6 * s));
        r.calls.push(FunctionCall {
            probe: 0,
            pid: 1,
            tid: 10,
            start_ns: 2 * s,
            dur_ns: s / 1000,
        });
        r.probe_watches.push(edge(9 * s, false));
        a.apply(&mut r);
        assert!((watched(&reg) - 3.0).abs() < 1e-9, "{}", watched(&reg));
        assert_eq!(calls(&reg), 1.0);
        // The next (6-12 s): the watch that ended at 9 s, 3 s more.
        r.profile_intervals.push((6 * s, 12 * s));
        a.apply(&mut r);
        assert!((watched(&reg) - 6.0).abs() < 1e-9, "{}", watched(&reg));
    }

    #[test]
    fn engines_and_restarted_workers_keep_their_thread_names() {
        use crate::record::{EngineInfo, ProcessInfo, Sample, ThreadInfo};
        let (m, reg) = Metrics::new();
        let mut a = Aggregator::new(m, Limits::default());
        // Pid 300, engine0's first worker, has exited; 400 replaced it.
        a.alive = |pid| pid != 300;
        let mut r = Recording::default();
        r.stacks.push(vec![]);
        let mut engines = Vec::new();
        for (pid, engine) in [
            (100, "engine0"),
            (150, "engine1"),
            (300, "engine0"),
            (400, "engine0"),
        ] {
            r.processes.push(ProcessInfo {
                pid,
                role: "worker".into(),
                ..Default::default()
            });
            engines.push(EngineInfo {
                id: engine.into(),
                worker_pids: vec![pid],
                ..Default::default()
            });
        }
        let thread = |r: &mut Recording, pid: i32, ms: u32, with: bool| {
            if with {
                r.threads.push(ThreadInfo {
                    pid,
                    tid: pid,
                    name: "VLLM::Worker".into(),
                    t_ns: 0,
                    python_name: Some("MainThread".into()),
                });
            }
            r.samples.push(Sample {
                t_ns: 1,
                pid,
                tid: pid,
                stack: 0,
                flags: 0,
                weight_ns: 1_000_000 * ms,
            });
        };
        // The threads come before the engines are told (the recorder writes engines once
        // discovered): no engine label yet, so one name space for all.
        for (pid, ms) in [(100, 1), (150, 2), (300, 3)] {
            thread(&mut r, pid, ms, true);
        }
        a.apply(&mut r);
        // Then the engines, and the replacement worker.
        r.engines = engines;
        for (pid, ms) in [(100, 4), (150, 5)] {
            thread(&mut r, pid, ms, false);
        }
        thread(&mut r, 400, 6, true);
        a.apply(&mut r);
        let t = encode(&reg);
        let cpu = |engine: &str, thread: &str| {
            value(
                &t,
                &format!(
                    r#"enginescope_thread_cpu_seconds_total{{engine="{engine}",role="worker",thread="{thread}"}}"#
                ),
            )
        };
        assert_eq!(cpu("", "MainThread"), Some(0.001), "{t}");
        assert_eq!(cpu("", "MainThread#2"), Some(0.002), "{t}");
        assert_eq!(cpu("", "MainThread#3"), Some(0.003), "{t}");
        // Once told, each engine's main threads are named in its own name space: another
        // engine's worker of the same name is no clash.
        assert_eq!(cpu("engine0", "MainThread"), Some(0.004), "{t}");
        assert_eq!(cpu("engine1", "MainThread"), Some(0.005), "{t}");
        // The replacement takes the name of the worker gone (300's), not a new one.
        assert_eq!(cpu("engine0", "MainThread#2"), Some(0.006), "{t}");
        assert_eq!(cpu("engine0", "MainThread#3"), None, "{t}");
    }

    #[test]
    fn thread_cardinality_is_capped_and_idle_series_expire() {
        let (m, reg) = Metrics::new();
        let limits = Limits {
            threads: BudgetConfig {
                cap: 3,
                idle_ticks: 5,
                min_residency: 0,
                max_candidates: 8,
            },
            idle_ticks: 5,
            ..Limits::default()
        };
        let mut a = Aggregator::new(m, limits);
        let mut r = Recording {
            stacks: vec![vec![]],
            ..Default::default()
        };
        // 50 threads with distinct names, 1 s of CPU each.
        for tid in 1..=50 {
            r.threads.push(ThreadInfo {
                pid: 1,
                tid,
                name: format!("Thread-{tid}"),
                t_ns: 0,
                python_name: None,
            });
            r.samples.push(Sample {
                t_ns: 0,
                pid: 1,
                tid,
                stack: 0,
                flags: 0,
                weight_ns: 1_000_000_000,
            });
        }
        a.apply(&mut r);
        let t = encode(&reg);
        let series = t
            .lines()
            .filter(|l| l.starts_with("enginescope_thread_cpu_seconds_total{"))
            .count();
        assert_eq!(series, 4, "3 threads + _other:\n{t}");
        let other = value(
            &t,
            r#"enginescope_thread_cpu_seconds_total{engine="",role="pid1",thread="_other"}"#,
        );
        assert_eq!(other, Some(47.0));
        // Total CPU is conserved.
        let total: f64 = t
            .lines()
            .filter(|l| l.starts_with("enginescope_thread_cpu_seconds_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert!((total - 50.0).abs() < 1e-9);
        for _ in 0..6 {
            a.tick();
        }
        let t = encode(&reg);
        assert!(
            !t.contains("enginescope_thread_cpu_seconds_total{"),
            "idle series gone:\n{t}"
        );
    }
}
