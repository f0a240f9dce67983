//! What the dashboard shows, computed from the window's running sums: a plain value
//! ([`Snapshot`]) that the view draws and the plain-text mode prints. Computing it reads the
//! window's totals (one entry per thread, function, holder, probe), never the recording's
//! events, so its cost does not grow with the recording.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::window::{Holder, ThreadKey, Window};
use crate::metrics::{maths, names, Family};
use crate::record::{EngineInfo, Recording};
use crate::views::findings::{self as fd, Finding};
use crate::views::gil::{GIL_FREE, RELEASING, UNKNOWN_FUNCTION};
use serde_json::json;

/// Functions kept per thread and list.
pub(crate) const TOP_FUNCTIONS: usize = 20;
/// Holders kept per waiting thread.
pub(crate) const TOP_BLAME: usize = 10;

/// Roles and engines known from outside the recording: the hook for `top --vllm`, whose
/// discovery knows which process is the API server, an EngineCore or a worker before the
/// recording says so. The recording's own `processes[].role` and `engines[]` win where both
/// name something.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Topology {
    /// pid -> role (`APIServer`, `EngineCore`, `Worker`, …).
    pub roles: BTreeMap<i32, String>,
    pub engines: Vec<EngineInfo>,
}

/// Shares of the window's wall time (0..1 for a thread; a process's are its threads' sums).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// On-CPU (sample weight).
    pub cpu: f64,
    /// On-CPU outside the interpreter core.
    pub native: f64,
    /// On-CPU holding the GIL (sampled).
    pub gil_held: f64,
    /// Waiting for the GIL (exact).
    pub gil_wait: f64,
    /// Forced-switch handshakes (exact).
    pub switch_wait: f64,
    /// Running a garbage collection (exact).
    pub gc: f64,
    /// Off CPU (exact intervals; written when the thread runs again, so a thread blocked for
    /// longer than the window shows its wait only once it wakes).
    pub offcpu: f64,
    pub samples: u64,
    pub gil_waits: u64,
    pub gc_pauses: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        self.cpu += o.cpu;
        self.native += o.native;
        self.gil_held += o.gil_held;
        self.gil_wait += o.gil_wait;
        self.switch_wait += o.switch_wait;
        self.gc += o.gc;
        self.offcpu += o.offcpu;
        self.samples += o.samples;
        self.gil_waits += o.gil_waits;
        self.gc_pauses += o.gc_pauses;
    }
}

/// A function's time in one thread.
#[derive(Debug, Clone, PartialEq)]
pub struct FnRow {
    pub function: String,
    pub file: String,
    pub self_ns: u64,
    pub total_ns: u64,
    /// Of the thread's on-CPU time, 0..1.
    pub self_share: f64,
    pub total_share: f64,
}

/// Who held the GIL while a thread waited for it, running what.
#[derive(Debug, Clone, PartialEq)]
pub struct BlameRow {
    /// 0: nobody held it.
    pub holder_tid: i32,
    /// Holder thread's name (`tid N` when unnamed; empty for none).
    pub holder: String,
    /// The holder's innermost function when the wait began, or `<gil free>`, `<releasing>`,
    /// `<unknown>`.
    pub function: String,
    pub file: String,
    pub wait_ns: u64,
    pub waits: u64,
    /// Of the waiter's GIL wait in the window, 0..1.
    pub share: f64,
}

/// GC pauses of one generation in one process.
#[derive(Debug, Clone, PartialEq)]
pub struct GcRow {
    /// -1: unknown.
    pub generation: i8,
    pub pauses: u64,
    pub total_ns: u64,
    /// Longest pause that began in the window.
    pub max_ns: u64,
    /// Of the window's wall time.
    pub share: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ThreadRow {
    pub pid: i32,
    pub tid: i32,
    pub name: String,
    pub stats: Stats,
    /// On-CPU share per bucket, permille, oldest first.
    pub cpu_history: Vec<u64>,
    /// By self time, then by total time.
    pub top_self: Vec<FnRow>,
    pub top_total: Vec<FnRow>,
    pub blame: Vec<BlameRow>,
    /// No event of this thread in the window.
    pub idle: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessRow {
    pub pid: i32,
    /// Role where known, else the executable.
    pub name: String,
    pub cmdline: String,
    /// Sums over its threads.
    pub stats: Stats,
    pub threads: Vec<ThreadRow>,
    /// By generation.
    pub gc: Vec<GcRow>,
    /// Its asyncio event loop's stalls in the window (an API server, or a process seen
    /// running a loop), as `report`'s `api_server_stalls` finds them.
    pub event_loop: Option<LoopStalls>,
}

/// An event loop's stalls over the window: runs of callbacks longer than the threshold.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoopStalls {
    pub tid: i32,
    pub stalls: u64,
    /// Summed, ns (a stall cut by the window's start counts from there).
    pub stalled_ns: u64,
    pub longest_ns: u64,
    pub threshold_ns: u64,
}

/// An engine's processes (or, with `engine` None, the processes of no engine).
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    pub engine: Option<String>,
    /// `engine0: API server 100, EngineCore 101, workers 102 103`.
    pub label: String,
    pub processes: Vec<ProcessRow>,
}

/// One probed function in one thread.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LatencyRow {
    pub probe: u32,
    pub spec: String,
    pub function: String,
    pub pid: i32,
    pub tid: i32,
    pub thread: String,
    /// `exact` or `sampled`.
    pub method: String,
    pub resolution_ns: u64,
    pub calls: u64,
    pub calls_per_s: f64,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    /// Where the probe was watched for part of the window: the 95% intervals of its calls
    /// (over the window, as `calls`) and p50/p90 (ms), as `report` prints them
    /// (`estimate::uncertainty`); None where every call in the window was timed.
    pub interval: Option<crate::estimate::Uncertainty>,
}

/// A metric's value now and its history (one point per scrape) for a sparkline.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricView {
    pub now: Option<f64>,
    pub history: Vec<f64>,
}

impl MetricView {
    /// A gauge's mean and largest value over the window (its scrapes in it): on a closed-loop
    /// load `requests running` flips between 0 and its limit from one scrape to the next, so
    /// the last value alone says little.
    pub(crate) fn window_mean_max(&self) -> Option<(f64, f64)> {
        let n = self.history.len();
        (n > 0).then(|| {
            let mean = self.history.iter().sum::<f64>() / n as f64;
            let max = self.history.iter().copied().fold(f64::MIN, f64::max);
            (mean, max)
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    pub engine: String,
    pub metrics_url: String,
    /// Generated tokens per second (rate of the counter over the window).
    pub gen_tokens_per_s: MetricView,
    /// 0..1.
    pub kv_cache: MetricView,
    pub running: MetricView,
    pub waiting: MetricView,
    /// Time to first token and time per output token (per request) over the window, from
    /// the histograms' bucket increases in it.
    pub ttft: maths::LatencyQuantiles,
    pub tpot: maths::LatencyQuantiles,
    /// The latest failed scrape, if any.
    pub scrape_error: Option<String>,
    /// Scrapes in the window that got a page, and those that failed.
    pub scrapes: usize,
    pub scrape_failures: usize,
}

/// Everything one frame shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// ns since the recording's start.
    pub now_ns: u64,
    pub window_start_ns: u64,
    pub wall_ns: u64,
    pub groups: Vec<Group>,
    pub latency: Vec<LatencyRow>,
    pub engines: Vec<EngineMetrics>,
    /// The recorder finished: its reason.
    pub ended: Option<String>,
    /// Failure counters of the recorder that are not zero (`bpf_ringbuf_full_lost`, …).
    pub problems: Vec<(String, u64)>,
    /// What the recording has cost its targets so far (from its counters, over the time
    /// since it began: [`crate::views::cost`]).
    pub cost: Option<crate::views::cost::RecordingCost>,
    /// Sleeps on a lock another thread of the process released, over the window
    /// (`views::waits`' `lock` kind), most first.
    pub lock_waits: Vec<LockWaitRow>,
    /// What costs the targets their time over the window, highest score first
    /// ([`window_findings`]: the report's GIL, GC, polling and lock kinds, same thresholds).
    pub findings: Vec<crate::views::findings::Finding>,
    /// Probe rows of earlier windows for the processes with none in this one ([`Recall`]).
    pub recalled: Vec<Recalled>,
}

/// A probe's row from an earlier window and how long ago that window ended.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recalled {
    pub row: LatencyRow,
    pub age_ns: u64,
}

/// Each process's latest probe rows, for its line when a window has none: threads that take
/// turns under the probe budget can go unwatched for a whole window (on a TP=2 engine the
/// EngineCore and its two workers' main threads share one budget), and the line would lose
/// its step or model-run figure every other window.
#[derive(Debug, Default)]
pub(crate) struct Recall {
    last: BTreeMap<(i32, String), (LatencyRow, u64)>,
}

impl Recall {
    /// Remember `snap`'s rows, and give it those remembered for processes it has none of.
    pub fn apply(&mut self, snap: &mut Snapshot) {
        // A replay sought back: what was remembered lies ahead.
        if self.last.values().any(|&(_, t)| t > snap.now_ns) {
            self.last.clear();
        }
        let mut have = BTreeSet::new();
        for l in snap.latency.iter().filter(|l| l.calls > 0) {
            have.insert(l.pid);
            self.last
                .insert((l.pid, l.function.clone()), (l.clone(), snap.now_ns));
        }
        snap.recalled = self
            .last
            .iter()
            .filter(|((pid, _), _)| !have.contains(pid))
            .map(|(_, (row, t))| Recalled {
                row: row.clone(),
                age_ns: snap.now_ns.saturating_sub(*t),
            })
            .collect();
    }
}

impl Snapshot {
    pub fn threads(&self) -> impl Iterator<Item = &ThreadRow> {
        self.groups
            .iter()
            .flat_map(|g| &g.processes)
            .flat_map(|p| &p.threads)
    }

    pub fn processes(&self) -> impl Iterator<Item = &ProcessRow> {
        self.groups.iter().flat_map(|g| &g.processes)
    }

    pub fn thread(&self, key: ThreadKey) -> Option<&ThreadRow> {
        self.threads().find(|t| (t.pid, t.tid) == key)
    }

    pub fn process(&self, pid: i32) -> Option<&ProcessRow> {
        self.processes().find(|p| p.pid == pid)
    }
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Executable name from a command line.
fn exe_name(cmdline: &str) -> &str {
    let first = cmdline.split_whitespace().next().unwrap_or("");
    first.rsplit('/').next().unwrap_or(first)
}

/// Counters whose non-zero value means something was lost or could not be read.
const PROBLEM_COUNTERS: [&str; 4] = [
    "bpf_ringbuf_full_lost",
    "bpf_read_frame_errors",
    "bpf_truncated_stacks",
    "unresolved_frames",
];

/// Latest description of every engine: the recording's, then the topology's for ids the
/// recording does not describe.
fn engines(rec: &Recording, topo: &Topology) -> Vec<EngineInfo> {
    let mut by_id: BTreeMap<String, EngineInfo> = BTreeMap::new();
    for e in &topo.engines {
        by_id.insert(e.id.clone(), e.clone());
    }
    for e in &rec.engines {
        by_id.insert(e.id.clone(), e.clone());
    }
    by_id.into_values().collect()
}

fn engine_role(e: &EngineInfo, pid: i32) -> Option<&'static str> {
    if e.is_api_server(pid) {
        Some("APIServer")
    } else if e.engine_core_pids.contains(&pid) {
        Some("EngineCore")
    } else if e.worker_pids.contains(&pid) {
        Some("Worker")
    } else {
        None
    }
}

fn engine_label(e: &EngineInfo) -> String {
    let mut parts = Vec::new();
    match e.api_servers().as_slice() {
        [] => {}
        [one] => parts.push(format!("API server {one}")),
        many => {
            let p: Vec<String> = many.iter().map(|p| p.to_string()).collect();
            parts.push(format!("API servers {}", p.join(" ")));
        }
    }
    if !e.engine_core_pids.is_empty() {
        let p: Vec<String> = e.engine_core_pids.iter().map(|p| p.to_string()).collect();
        parts.push(format!("EngineCore {}", p.join(" ")));
    }
    if !e.worker_pids.is_empty() {
        let p: Vec<String> = e.worker_pids.iter().map(|p| p.to_string()).collect();
        parts.push(format!("workers {}", p.join(" ")));
    }
    if parts.is_empty() {
        e.id.clone()
    } else {
        format!("{}: {}", e.id, parts.join(", "))
    }
}

/// Percentile by nearest rank over sorted values.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A family's label sets (each one's points in time order) as shown: a counter as its rate
/// (summed over label sets), a gauge combined per scrape as the family says.
fn metric_view(
    series: &[Vec<(u64, f64)>],
    family: &Family,
    counter: bool,
    from_ns: u64,
) -> MetricView {
    if counter {
        let rates: Vec<Vec<(u64, f64)>> = series.iter().map(|p| maths::rates(p)).collect();
        MetricView {
            now: series
                .iter()
                .filter_map(|p| maths::rate_since(p, from_ns))
                .reduce(|a, b| a + b),
            history: maths::combine(rates.iter().map(Vec::as_slice), names::GaugeAgg::Sum)
                .into_iter()
                .map(|(_, v)| v)
                .collect(),
        }
    } else {
        let points = maths::combine(series.iter().map(Vec::as_slice), family.agg);
        MetricView {
            now: points.last().map(|&(_, v)| v),
            history: points.iter().map(|&(_, v)| v).collect(),
        }
    }
}

/// Compute what the dashboard shows from the window (already updated to the recording).
/// A run of an event loop's callbacks longer than this is a stall (`report --stall-ms`'s
/// default).
pub(crate) const LOOP_STALL_NS: u64 = 100_000_000;

pub fn snapshot(w: &Window, rec: &Recording, topo: &Topology) -> Snapshot {
    let wall = w.wall_ns();
    let start = w.start_ns();
    let names = ThreadNames::of_recording(rec);
    let engines = engines(rec, topo);
    let groups = process_groups(w, rec, topo, &engines, thread_rows(w, &names));
    let latency = latency_rows(w, rec, &names);
    let engine_metrics = engine_metrics(w, rec, &engines);
    let mut snap = Snapshot {
        now_ns: w.now_ns(),
        window_start_ns: start,
        wall_ns: wall,
        groups,
        latency,
        engines: engine_metrics,
        ended: rec.end.as_ref().map(|e| e.reason.clone()),
        problems: PROBLEM_COUNTERS
            .iter()
            .filter_map(|&k| {
                rec.counters
                    .get(k)
                    .filter(|&&v| v > 0)
                    .map(|&v| (k.to_string(), v))
            })
            .collect(),
        // The counters come every few seconds and add up from the start: over the time
        // they cover, not the window.
        cost: crate::views::cost::RecordingCost::from_counters(&rec.counters, w.now_ns()),
        lock_waits: lock_wait_rows(w, &names),
        findings: Vec::new(),
        recalled: Vec::new(),
    };
    snap.findings = window_findings(&snap);
    snap
}

/// The latest name of every thread (its newest thread record).
/// A thread's sleeps on a lock that one other thread released, over the window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LockWaitRow {
    pub pid: i32,
    pub tid: i32,
    pub thread: String,
    /// Where it waited (its innermost Python function).
    pub function: String,
    pub waker_tid: i32,
    pub waker: String,
    /// What the waker was leaving when it released the lock.
    pub waker_function: String,
    pub wait_ns: u64,
    pub waits: u64,
}

fn lock_wait_rows(w: &Window, names: &ThreadNames) -> Vec<LockWaitRow> {
    let name = |f: Option<crate::accounting::FnId>| {
        f.map(|f| w.fns.name(f).0.to_string())
            .unwrap_or_else(|| "<no Python frame>".into())
    };
    let mut rows: Vec<LockWaitRow> = w
        .totals
        .lock_waits
        .iter()
        .map(
            |(&((pid, tid), waiter, waker_tid, waker), tc)| LockWaitRow {
                pid,
                tid,
                thread: names.of(pid, tid),
                function: name(waiter),
                waker_tid,
                waker: names.of(pid, waker_tid),
                waker_function: name(waker),
                wait_ns: tc.ns,
                waits: tc.count,
            },
        )
        .collect();
    rows.sort_by(|a, b| {
        b.wait_ns
            .cmp(&a.wait_ns)
            .then((a.pid, a.tid, a.waker_tid).cmp(&(b.pid, b.tid, b.waker_tid)))
    });
    rows
}

struct ThreadNames<'a>(HashMap<ThreadKey, &'a str>);

impl<'a> ThreadNames<'a> {
    fn of_recording(rec: &'a Recording) -> Self {
        let mut names = HashMap::new();
        for t in &rec.threads {
            names.insert((t.pid, t.tid), t.display_name());
        }
        ThreadNames(names)
    }

    /// A thread's name, `tid N` when it has none (nothing for tid 0).
    fn of(&self, pid: i32, tid: i32) -> String {
        match self.0.get(&(pid, tid)) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ if tid == 0 => String::new(),
            _ => format!("tid {tid}"),
        }
    }
}

/// The Threads panel's rows, per process: every thread named or seen, with its shares of the
/// window, its CPU history, top functions and what held the GIL while it waited.
fn thread_rows(w: &Window, names: &ThreadNames) -> BTreeMap<i32, Vec<ThreadRow>> {
    let wall = w.wall_ns();
    let start = w.start_ns();
    let stats_of = |key: &ThreadKey| -> Stats {
        let Some(a) = w.totals.threads.get(key) else {
            return Stats::default();
        };
        Stats {
            cpu: share(a.cpu_ns, wall),
            native: share(a.native_ns, wall),
            gil_held: share(a.gil_held_ns, wall),
            gil_wait: share(a.gil_wait_ns, wall),
            switch_wait: share(a.switch_wait_ns, wall),
            gc: share(a.gc_ns, wall),
            offcpu: share(a.off_ns, wall),
            samples: a.samples,
            gil_waits: a.gil_waits,
            gc_pauses: a.gc_pauses,
        }
    };
    let mut threads: BTreeSet<ThreadKey> = names.0.keys().copied().collect();
    threads.extend(w.totals.threads.keys().copied());
    threads.extend(w.last_seen.keys().copied());

    // Per thread: functions and blame, from the totals (one pass each).
    let mut fns: HashMap<ThreadKey, Vec<(u32, u64, u64)>> = HashMap::new();
    for (&(key, f), a) in &w.totals.functions {
        fns.entry(key).or_default().push((f, a.self_ns, a.total_ns));
    }
    let mut blame: HashMap<ThreadKey, Vec<(i32, Holder, u64, u64)>> = HashMap::new();
    for (&(key, holder_tid, holder), tc) in &w.totals.blame {
        blame
            .entry(key)
            .or_default()
            .push((holder_tid, holder, tc.ns, tc.count));
    }
    let fn_row = |f: u32, self_ns: u64, total_ns: u64, cpu: u64| {
        let (function, file) = w.fns.name(f);
        FnRow {
            function: function.to_string(),
            file: file.to_string(),
            self_ns,
            total_ns,
            self_share: share(self_ns, cpu),
            total_share: share(total_ns, cpu),
        }
    };
    let mut thread_rows: BTreeMap<i32, Vec<ThreadRow>> = BTreeMap::new();
    for &(pid, tid) in &threads {
        let key = (pid, tid);
        let stats = stats_of(&key);
        let acc = w.totals.threads.get(&key).copied().unwrap_or_default();
        let mut f = fns.remove(&key).unwrap_or_default();
        f.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.cmp(&a.2)).then(a.0.cmp(&b.0)));
        let top_self = f
            .iter()
            .filter(|x| x.1 > 0)
            .take(TOP_FUNCTIONS)
            .map(|&(id, s, t)| fn_row(id, s, t, acc.cpu_ns))
            .collect();
        f.sort_by(|a, b| b.2.cmp(&a.2).then(b.1.cmp(&a.1)).then(a.0.cmp(&b.0)));
        let top_total = f
            .iter()
            .take(TOP_FUNCTIONS)
            .map(|&(id, s, t)| fn_row(id, s, t, acc.cpu_ns))
            .collect();
        let mut b = blame.remove(&key).unwrap_or_default();
        b.sort_by(|x, y| y.2.cmp(&x.2).then((x.0, x.1).cmp(&(y.0, y.1))));
        let blame_rows = b
            .into_iter()
            .take(TOP_BLAME)
            .map(|(holder_tid, holder, ns, count)| {
                let (function, file) = match holder {
                    Holder::Free => (GIL_FREE.to_string(), String::new()),
                    Holder::Releasing => (RELEASING.to_string(), String::new()),
                    Holder::Unknown => (UNKNOWN_FUNCTION.to_string(), String::new()),
                    Holder::Function(f) => {
                        let (a, b) = w.fns.name(f);
                        (a.to_string(), b.to_string())
                    }
                };
                BlameRow {
                    holder_tid,
                    holder: names.of(pid, holder_tid),
                    function,
                    file,
                    wait_ns: ns,
                    waits: count,
                    share: share(ns, acc.gil_wait_ns),
                }
            })
            .collect();
        let cpu_history = w
            .thread_cpu_history(key)
            .into_iter()
            .zip(w.bucket_spans())
            .map(|(ns, (_, span))| (share(ns, span) * 1000.0).round() as u64)
            .collect();
        thread_rows.entry(pid).or_default().push(ThreadRow {
            pid,
            tid,
            name: names.of(pid, tid),
            stats,
            cpu_history,
            top_self,
            top_total,
            blame: blame_rows,
            idle: w.last_seen.get(&key).is_none_or(|&t| t < start),
        });
    }
    thread_rows
}

/// The processes of the window, with their roles, GC pauses and event-loop stalls, grouped by
/// engine (the rest last).
fn process_groups(
    w: &Window,
    rec: &Recording,
    topo: &Topology,
    engines: &[EngineInfo],
    mut thread_rows: BTreeMap<i32, Vec<ThreadRow>>,
) -> Vec<Group> {
    let wall = w.wall_ns();
    // Processes, with their roles and GC pauses.
    let mut pids: BTreeSet<i32> = rec.processes.iter().map(|p| p.pid).collect();
    pids.extend(thread_rows.keys().copied());
    pids.extend(topo.roles.keys().copied());
    let gc_max = w.gc_max();
    let mut gc_rows: BTreeMap<i32, Vec<GcRow>> = BTreeMap::new();
    for (&(pid, generation), tc) in &w.totals.gc {
        gc_rows.entry(pid).or_default().push(GcRow {
            generation,
            pauses: tc.count,
            total_ns: tc.ns,
            max_ns: gc_max.get(&(pid, generation)).copied().unwrap_or(0),
            share: share(tc.ns, wall),
        });
    }
    // The API servers' event-loop stalls in the window, as `report` finds them (its default
    // threshold), over their threads seen in the window.
    let loops = {
        let threads: Vec<(i32, i32)> = thread_rows
            .iter()
            .filter(|(&pid, _)| crate::views::stalls::is_api_server(rec, pid))
            .flat_map(|(&pid, ts)| ts.iter().map(move |t| (pid, t.tid)))
            .collect();
        if threads.is_empty() {
            Default::default()
        } else {
            let sel = crate::views::Selection::of_threads(threads, "API servers")
                .during(w.start_ns(), w.now_ns());
            crate::views::stalls::api_server_stalls(rec, &sel, LOOP_STALL_NS)
        }
    };
    let mut processes: BTreeMap<i32, ProcessRow> = BTreeMap::new();
    for pid in pids {
        let info = rec.processes.iter().rev().find(|p| p.pid == pid);
        let cmdline = info.map(|p| p.cmdline.clone()).unwrap_or_default();
        let role = info
            .map(|p| p.role.as_str())
            .filter(|r| !r.is_empty())
            .or_else(|| topo.roles.get(&pid).map(String::as_str))
            .or_else(|| engines.iter().find_map(|e| engine_role(e, pid)));
        let name = match role {
            Some(r) => r.to_string(),
            None if !exe_name(&cmdline).is_empty() => exe_name(&cmdline).to_string(),
            None => "process".to_string(),
        };
        let threads = thread_rows.remove(&pid).unwrap_or_default();
        let mut stats = Stats::default();
        for t in &threads {
            stats.add(&t.stats);
        }
        let mut gc = gc_rows.remove(&pid).unwrap_or_default();
        gc.sort_by_key(|g| g.generation);
        // The process's busiest loop (most stalled, then most CPU).
        let event_loop = loops
            .servers
            .iter()
            .filter(|r| r.pid == pid)
            .max_by(|a, b| {
                a.stalled_s
                    .total_cmp(&b.stalled_s)
                    .then(a.main_thread_cpu_s.total_cmp(&b.main_thread_cpu_s))
            })
            .map(|r| LoopStalls {
                tid: r.main_tid,
                stalls: r.stalls,
                stalled_ns: (r.stalled_s * 1e9).round() as u64,
                longest_ns: (r.longest_ms * 1e6).round() as u64,
                threshold_ns: LOOP_STALL_NS,
            });
        processes.insert(
            pid,
            ProcessRow {
                pid,
                name,
                cmdline,
                stats,
                threads,
                gc,
                event_loop,
            },
        );
    }

    // Group by engine.
    let mut groups = Vec::new();
    for e in engines {
        let members: Vec<i32> = processes
            .keys()
            .copied()
            .filter(|&pid| engine_role(e, pid).is_some())
            .collect();
        let procs: Vec<ProcessRow> = members
            .iter()
            .filter_map(|pid| processes.remove(pid))
            .collect();
        groups.push(Group {
            engine: Some(e.id.clone()),
            label: engine_label(e),
            processes: procs,
        });
    }
    if !processes.is_empty() {
        groups.push(Group {
            engine: None,
            label: if engines.is_empty() {
                String::new()
            } else {
                "other processes".to_string()
            },
            processes: processes.into_values().collect(),
        });
    }
    groups
}

/// The Latency panel's rows: per probe and thread, its calls and percentiles over the window
/// (scaled as `report` scales them where the probe was watched part of the window).
fn latency_rows(w: &Window, rec: &Recording, names: &ThreadNames) -> Vec<LatencyRow> {
    let wall = w.wall_ns();
    // Function latency. A probe that took turns for its thread's debug registers is scaled
    // by the share of the window it was watched, as `report` does (views/latency.rs).
    let cov = crate::views::latency::window_coverages(rec, w.start_ns(), w.now_ns());
    let first_watch = crate::views::latency::first_watches(rec);
    let mut latency = Vec::new();
    let mut keys: BTreeSet<(u32, ThreadKey)> = w.totals.calls.keys().copied().collect();
    keys.extend(w.call_durations.keys().copied());
    for key in keys {
        let (probe, (pid, tid)) = key;
        let info = rec.probes.get(probe as usize);
        let ends: Vec<(u64, u64)> = w
            .call_durations
            .get(&key)
            .map(|q| q.iter().copied().collect())
            .unwrap_or_default();
        let mut d: Vec<u64> = ends.iter().map(|&(_, d)| d).collect();
        d.sort_unstable();
        let mut calls = w.totals.calls.get(&key).map_or(0, |c| c.count);
        let mut method = info.map(|p| p.method.clone()).unwrap_or_default();
        let (mut p50, mut p90, mut p99) = (
            percentile(&d, 0.50),
            percentile(&d, 0.90),
            percentile(&d, 0.99),
        );
        let mut interval = None;
        if let Some(c) = cov.get(&(probe, tid)) {
            let strata = c.strata();
            let started: Vec<crate::estimate::StartedCall> = ends
                .iter()
                .map(|&(end, x)| {
                    let start = end.saturating_sub(x);
                    (start, x, strata.weight(start, x))
                })
                .collect();
            let mut wd: Vec<(u64, f64)> = started.iter().map(|&(_, x, w)| (x, w)).collect();
            // As `report` estimates it (the calls kept stand for all of the window's, in
            // proportion where the window held more than are kept).
            let kept = wd.len().max(1) as f64;
            let weighed: f64 = wd.iter().map(|&(_, w)| w).sum();
            let scale = calls as f64 / kept;
            calls = (weighed * scale).round() as u64;
            // How sure: the same intervals as `report`'s, the count's scaled as the count is.
            interval = crate::estimate::uncertainty(&started, c).map(|mut u| {
                u.calls = u.calls.map(|x| x * scale);
                u
            });
            if let Some(l) = crate::views::latency::LatencyMs::of_weighted(&mut wd) {
                (p50, p90, p99) = (
                    (l.p50 * 1e6) as u64,
                    (l.p90 * 1e6) as u64,
                    (l.p99 * 1e6) as u64,
                );
            }
            method = format!("{method}, {:.0}% of the window", c.share() * 100.0);
        }
        // Attached after the window's start (a process or thread that came later, a probe
        // found late): its figures say from when, its rate is over that span (as `report`).
        let attached = info.map_or(0, |p| {
            crate::views::latency::attached_ns(&first_watch, p, tid)
        });
        let mut span = wall;
        if let Some(share) = crate::views::latency::late_share(attached, w.start_ns(), w.now_ns()) {
            let base = info.map(|p| p.method.clone()).unwrap_or_default();
            let c = cov.get(&(probe, tid)).map(|c| c.share());
            method = crate::views::latency::late_method(&base, attached, share, c);
            span = w.now_ns().saturating_sub(attached);
        }
        latency.push(LatencyRow {
            probe,
            spec: info.map(|p| p.spec.clone()).unwrap_or_default(),
            function: info
                .map(|p| p.function.clone())
                .unwrap_or_else(|| format!("probe {probe}")),
            pid,
            tid,
            thread: names.of(pid, tid),
            method,
            resolution_ns: info.map_or(0, |p| p.resolution_ns),
            calls,
            calls_per_s: if span == 0 {
                0.0
            } else {
                calls as f64 / (span as f64 / 1e9)
            },
            p50_ns: p50,
            p90_ns: p90,
            p99_ns: p99,
            max_ns: d.last().copied().unwrap_or(0),
            interval,
        });
    }
    latency
}

/// The engines' metrics over the window: tokens/s, KV cache, queue, TTFT/TPOT and scrapes.
fn engine_metrics(w: &Window, rec: &Recording, engines: &[EngineInfo]) -> Vec<EngineMetrics> {
    let start = w.start_ns();
    // Engine metrics.
    let mut engine_ids: BTreeSet<String> = engines.iter().map(|e| e.id.clone()).collect();
    engine_ids.extend(rec.series.iter().map(|s| s.engine.clone()));
    // A family's label sets under the first of its spellings that has points.
    let family = |engine: &str, f: &Family| -> Vec<Vec<(u64, f64)>> {
        let of = |name: &str| -> Vec<Vec<(u64, f64)>> {
            rec.series
                .iter()
                .filter(|s| s.engine == engine && s.name == name)
                .filter_map(|s| w.metric_points.get(&s.id))
                .map(|q| q.iter().copied().collect())
                .collect()
        };
        f.resolve(|n| !of(n).is_empty()).map(of).unwrap_or_default()
    };
    // Times in the window the engine's scrapes got a page (every point of one scrape has one).
    let scrape_times = |engine: &str| -> BTreeSet<u64> {
        rec.series
            .iter()
            .filter(|s| s.engine == engine)
            .filter_map(|s| w.metric_points.get(&s.id))
            .flat_map(|q| q.iter().map(|&(t, _)| t))
            .filter(|&t| t >= start)
            .collect()
    };
    let view = |engine: &str, f: &Family, counter: bool| {
        metric_view(&family(engine, f), f, counter, start)
    };
    // A latency histogram over the window: each series' increase between its first and last
    // point in it, buckets added up by bound (label sets: DP ranks).
    let histogram = |engine: &str, f: &Family| -> maths::LatencyQuantiles {
        let ours = || rec.series.iter().filter(|s| s.engine == engine);
        let Some(base) = f.resolve(|n| ours().any(|s| s.name.strip_suffix("_bucket") == Some(n)))
        else {
            return maths::LatencyQuantiles::default();
        };
        let increase = |id: u32| {
            w.metric_points.get(&id).map_or(0.0, |q| {
                let pts: Vec<(u64, f64)> = q.iter().copied().collect();
                maths::series_increase(&pts, start, u64::MAX).0
            })
        };
        let mut buckets = Vec::new();
        let (mut sum, mut count) = (0.0, 0.0);
        for s in ours() {
            match s.name.strip_prefix(base) {
                Some("_bucket") => {
                    if let Some(le) = s.labels.get("le").and_then(|l| maths::parse_le(l)) {
                        buckets.push((le, increase(s.id)));
                    }
                }
                Some("_sum") => sum += increase(s.id),
                Some("_count") => count += increase(s.id),
                _ => {}
            }
        }
        maths::HistogramDelta::from_increases(buckets, sum, count).quantiles_ms()
    };
    engine_ids
        .into_iter()
        .map(|id| EngineMetrics {
            metrics_url: engines
                .iter()
                .find(|e| e.id == id)
                .map(|e| e.metrics_url.clone())
                .unwrap_or_default(),
            gen_tokens_per_s: view(&id, &names::GENERATION_TOKENS, true),
            kv_cache: view(&id, &names::KV_CACHE_USAGE, false),
            running: view(&id, &names::RUNNING, false),
            waiting: view(&id, &names::WAITING, false),
            ttft: histogram(&id, &names::TTFT),
            tpot: histogram(&id, &names::TPOT),
            scrape_error: rec
                .scrape_errors
                .iter()
                .rev()
                .find(|e| e.engine == id && e.t_ns >= start)
                .map(|e| e.error.clone()),
            scrapes: scrape_times(&id).len(),
            scrape_failures: {
                let ok = scrape_times(&id);
                rec.scrape_errors
                    .iter()
                    .filter(|e| e.engine == id && e.t_ns >= start && !ok.contains(&e.t_ns))
                    .count()
            },
            engine: id,
        })
        .collect()
}

/// The findings of a window, from its rows (the shared accounting's sums), with the report's
/// thresholds ([`crate::views::findings`]): GIL contention (with the holder the thread waited
/// on most and what it ran), GC pressure per process (by generation), busy-spinning pollers
/// and lock contention. The report's other kinds need the recording's calls and stacks.
pub fn window_findings(s: &Snapshot) -> Vec<Finding> {
    let wall_s = s.wall_ns as f64 / 1e9;
    if wall_s <= 0.0 {
        return Vec::new();
    }
    let step_threads = step_threads(s);
    let mut out = Vec::new();
    for p in s.processes() {
        for t in &p.threads {
            out.extend(gil_finding(p, t, &step_threads));
            out.extend(spin_finding(p, t));
        }
        out.extend(gc_finding(p, wall_s));
    }
    out.extend(
        s.lock_waits
            .iter()
            .filter_map(|l| lock_finding(s, l, wall_s)),
    );
    fd::rank(&mut out);
    out
}

/// The threads that ran an engine's step in the window (its EngineCore's step, its workers'
/// execute_model), as the report's step anatomy finds them.
fn step_threads(s: &Snapshot) -> Vec<(i32, i32)> {
    s.latency
        .iter()
        .filter(|l| l.calls > 0 && crate::vllm::probes::is_headline(&l.function))
        .map(|l| (l.pid, l.tid))
        .collect()
}

/// A thread that waits for the GIL a large share of the window, with the holder it waited on
/// most and what that holder ran.
fn gil_finding(p: &ProcessRow, t: &ThreadRow, step_threads: &[(i32, i32)]) -> Option<Finding> {
    let st = &t.stats;
    if st.gil_wait < fd::GIL_MIN_SHARE || st.gil_waits < fd::GIL_MIN_WAITS {
        return None;
    }
    let idle = (1.0 - st.cpu - st.gil_wait).max(0.0);
    let keeps_up = fd::keeps_up_off_step(step_threads, t.pid, t.tid, idle);
    let holder = t
        .blame
        .iter()
        .find(|b| b.holder_tid != 0 && b.holder_tid != t.tid);
    let mut verdict = format!(
        "{} waits for the GIL {:.1}% of the window ({} waits)",
        fd::thread_label(&t.name, t.tid, &p.name, t.pid),
        st.gil_wait * 100.0,
        st.gil_waits
    );
    if let Some(h) = holder {
        verdict.push_str(&format!(
            ", {:.1}% of it behind {} (tid {}) running {}",
            h.share * 100.0,
            h.holder,
            h.holder_tid,
            h.function
        ));
    }
    if keeps_up {
        verdict.push_str(&format!(
            "; off the engine's step loop and idle {:.1}% of the window, it keeps up",
            idle * 100.0
        ));
    }
    Some(Finding {
        kind: "gil_contention".into(),
        score: if keeps_up {
            fd::MIN_SCORE
        } else {
            st.gil_wait.min(1.0)
        },
        pid: t.pid,
        tid: Some(t.tid),
        thread: t.name.clone(),
        function: holder.map(|h| h.function.clone()).unwrap_or_default(),
        verdict,
        evidence: [
            ("gil_wait_share".to_string(), json!(st.gil_wait)),
            ("waits".to_string(), json!(st.gil_waits)),
        ]
        .into_iter()
        .collect(),
        see: "Who blocks whom".into(),
    })
}

/// A thread on CPU most of the window, most of it in a polling function (the one with the
/// largest share of its CPU).
fn spin_finding(p: &ProcessRow, t: &ThreadRow) -> Option<Finding> {
    let st = &t.stats;
    let poller = t
        .top_total
        .iter()
        .filter(|f| fd::is_polling(&f.function))
        .max_by(|a, b| a.total_share.total_cmp(&b.total_share))?;
    if st.cpu < fd::SPIN_MIN_CPU_SHARE
        || poller.total_share < fd::SPIN_MIN_POLL_SHARE
        || st.samples < fd::SPIN_MIN_SAMPLES
    {
        return None;
    }
    let (f, polling) = (poller.function.clone(), poller.total_share);
    Some(Finding {
        kind: "busy_spin".into(),
        score: (st.cpu * polling).min(1.0),
        pid: t.pid,
        tid: Some(t.tid),
        thread: t.name.clone(),
        verdict: format!(
            "{} is on CPU {:.1}% of the window, {:.1}% of it polling in {f}",
            fd::thread_label(&t.name, t.tid, &p.name, t.pid),
            st.cpu * 100.0,
            polling * 100.0
        ),
        function: f,
        evidence: Default::default(),
        see: format!("Top functions: {} (tid {}, pid {})", t.name, t.tid, t.pid),
    })
}

/// A process whose collections take a share of the window, by generation.
fn gc_finding(p: &ProcessRow, wall_s: f64) -> Option<Finding> {
    let gc_ns: u64 = p.gc.iter().map(|g| g.total_ns).sum();
    let pauses: u64 = p.gc.iter().map(|g| g.pauses).sum();
    let share = gc_ns as f64 / 1e9 / wall_s;
    if share < fd::GC_MIN_SHARE || pauses < fd::GC_MIN_PAUSES {
        return None;
    }
    let gens: Vec<String> =
        p.gc.iter()
            .rev()
            .filter(|g| g.pauses > 0)
            .map(|g| fd::generation_pauses(g.generation, g.pauses, g.total_ns, g.max_ns))
            .collect();
    Some(Finding {
        kind: "gc_pressure".into(),
        score: share.min(1.0),
        pid: p.pid,
        tid: None,
        thread: String::new(),
        function: String::new(),
        verdict: format!(
            "{} (pid {}) collects garbage {:.1}% of the window ({} pauses; {})",
            p.name,
            p.pid,
            share * 100.0,
            pauses,
            gens.join(", ")
        ),
        evidence: [
            ("gc_s".to_string(), json!(gc_ns as f64 / 1e9)),
            ("pauses".to_string(), json!(pauses)),
        ]
        .into_iter()
        .collect(),
        see: "GC".into(),
    })
}

/// A thread that sleeps on a lock a share of the window, with the thread that woke it and what
/// that thread was leaving.
fn lock_finding(s: &Snapshot, l: &LockWaitRow, wall_s: f64) -> Option<Finding> {
    let share = l.wait_ns as f64 / 1e9 / wall_s;
    if share < fd::LOCK_MIN_SHARE || l.waits < fd::LOCK_MIN_WAITS {
        return None;
    }
    let process = s
        .processes()
        .find(|p| p.pid == l.pid)
        .map(|p| p.name.clone())
        .unwrap_or_default();
    Some(Finding {
        kind: "lock_contention".into(),
        score: share.min(1.0),
        pid: l.pid,
        tid: Some(l.tid),
        thread: l.thread.clone(),
        function: l.function.clone(),
        verdict: format!(
            "{} sleeps on a lock in {} {:.1}% of the window ({} waits), released by {} (tid {}) leaving {}",
            fd::thread_label(&l.thread, l.tid, &process, l.pid),
            l.function,
            share * 100.0,
            l.waits,
            l.waker,
            l.waker_tid,
            l.waker_function
        ),
        evidence: [
            ("wait_s".to_string(), json!(l.wait_ns as f64 / 1e9)),
            ("waits".to_string(), json!(l.waits)),
            ("waker_tid".to_string(), json!(l.waker_tid)),
            ("waker_function".to_string(), json!(l.waker_function)),
        ]
        .into_iter()
        .collect(),
        see: crate::views::waits::HEADING.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::synth::*;
    use crate::record::{MetricPoint, MetricSeries};

    fn approx(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    fn window() -> Window {
        Window::new(10 * S, 40, 10 * S)
    }

    fn snap_at(rec: &Recording, now: u64) -> Snapshot {
        let mut w = window();
        w.update(rec, now);
        snapshot(&w, rec, &Topology::default())
    }

    /// The live window's lock waits are the report's, and the same finding leads.
    #[test]
    fn lock_waits_in_the_window_are_the_reports() {
        let rec = crate::views::waits::tests::lock_fight(500);
        // The window holds the whole recording (waits that began before a window are not
        // its waits).
        let window = || Window::new(20 * S, 40, 20 * S);
        let mut w = window();
        w.update(&rec, 10 * S);
        let snap = snapshot(&w, &rec, &Topology::default());
        let sel = crate::views::Selection::all(&rec);
        let report: Vec<_> = crate::views::waits::waits(&rec, &sel)
            .into_iter()
            .filter(|w| w.kind == "lock")
            .collect();
        assert_eq!(snap.lock_waits.len(), 1, "{:#?}", snap.lock_waits);
        let (l, r) = (&snap.lock_waits[0], &report[0]);
        assert_eq!(
            (
                l.tid,
                l.function.as_str(),
                l.waker_tid,
                l.waker_function.as_str()
            ),
            (
                r.tid,
                r.function.as_str(),
                r.waker_tid,
                r.waker_function.as_str()
            )
        );
        assert_eq!(l.waits, r.waits);
        assert!((l.wait_ns as f64 / 1e9 - r.wait_s).abs() < 1e-6);
        let f = &snap.findings[0];
        assert_eq!((f.kind.as_str(), f.tid), ("lock_contention", Some(2)));
        // A window that updates often (live): the same sums.
        let mut w = window();
        for t in (1..=100).map(|i| i * S / 10) {
            w.update(&rec, t);
        }
        let live = snapshot(&w, &rec, &Topology::default());
        assert_eq!(live.lock_waits, snap.lock_waits);
    }

    /// An API server's loop stalls in the window: what `report` finds over the same span,
    /// and the process's headline says it (a 300 ms callback in a 9.75 s window: 3.1%).
    #[test]
    fn api_server_loop_stalls_in_the_window() {
        let mut b =
            Rec::new()
                .process(100, "vllm serve", "api_server")
                .thread(100, 100, "MainThread");
        let idle = b.stack(&["select", "run"], "/usr/lib/python3.12/selectors.py");
        let work = b.stack(&["render", "handler"], "/srv/api.py");
        // Idle 10 ms samples, then 30 x 10 ms in a callback from 5 s, then idle again; the
        // loop's idle waits are what a traced recording has between callbacks.
        b.samples((100, 100), 250 * MS, 475, 10 * MS, idle, 0);
        b.samples((100, 100), 5 * S, 30, 10 * MS, work, GIL);
        b.samples((100, 100), 5300 * MS, 470, 10 * MS, idle, 0);
        b.0.samples.sort_by_key(|s| s.t_ns);
        let s = snap_at(&b.0, 10 * S);
        let p = &s.groups[0].processes[0];
        let l = p.event_loop.as_ref().expect("the API server's loop");
        assert_eq!((l.tid, l.stalls), (100, 1));
        let sel = crate::views::Selection::all(&b.0).during(250 * MS, 10 * S);
        let r = crate::views::stalls::api_server_stalls(&b.0, &sel, LOOP_STALL_NS);
        assert_eq!(r.stalls.len(), 1);
        assert_eq!(l.stalled_ns, (r.servers[0].stalled_s * 1e9).round() as u64);
        assert_eq!(l.longest_ns, 300 * MS);
        let h = crate::tui::app::process_headline(p, &s, false).unwrap();
        assert!(
            h.starts_with("loop stalled 3.1% (1 over 100 ms, longest 300 ms)"),
            "{h}"
        );
        let h = crate::tui::app::process_headline(p, &s, true).unwrap();
        assert_eq!(h, "loop stalled 3.1%");
    }

    #[test]
    fn cpu_and_gil_held_are_shares_of_the_window() {
        let mut b = Rec::new()
            .process(100, "/usr/bin/python3.12 app.py", "")
            .thread(100, 101, "worker")
            .thread(100, 102, "sleeper");
        let st = b.stack(&["hot", "main"], "/srv/app.py");
        // 600 of the first 1000 ms on CPU, half of it holding the GIL, 100 ms of it native.
        b.samples((100, 101), 0, 300, MS, st, GIL);
        b.samples((100, 101), 300 * MS, 200, MS, st, 0);
        b.samples(
            (100, 101),
            500 * MS,
            100,
            MS,
            st,
            crate::record::flags::NATIVE,
        );
        b.offcpu(100, 102, 0, 900 * MS);
        let s = snap_at(&b.0, S);
        assert_eq!(s.wall_ns, S);
        let t = s.thread((100, 101)).expect("worker");
        assert_eq!(t.name, "worker");
        assert!(approx(t.stats.cpu, 0.6), "{}", t.stats.cpu);
        assert!(approx(t.stats.gil_held, 0.3));
        assert!(approx(t.stats.native, 0.1));
        assert_eq!(t.stats.samples, 600);
        assert!(!t.idle);
        let sl = s.thread((100, 102)).expect("sleeper");
        assert!(approx(sl.stats.offcpu, 0.9));
        assert_eq!(sl.stats.cpu, 0.0);
        let p = s.process(100).expect("process");
        assert_eq!(p.name, "python3.12");
        assert!(approx(p.stats.cpu, 0.6));
        assert_eq!(s.groups.len(), 1);
        assert_eq!(s.groups[0].label, "");
        // Per-bucket history: 25 ms buckets... (10 s / 40 = 250 ms): 1000‰ for the first two
        // buckets, 400‰ for the third (100 of 250 ms), 0 after.
        assert_eq!(&t.cpu_history[..4], &[1000, 1000, 400, 0]);
    }

    #[test]
    fn the_window_slides_and_old_buckets_leave_it() {
        let mut b = Rec::new().thread(1, 2, "busy");
        let st = b.stack(&["spin"], "a.py");
        // 100% on CPU for 20 s: 2000 samples of 10 ms.
        b.samples((1, 2), 0, 2000, 10 * MS, st, 0);
        let mut w = window();
        w.update(&b.0, 20 * S);
        // 40 buckets of 250 ms, the last one holding `now`: the window is 10.25..20 s.
        assert_eq!(w.start_ns(), 10_250 * MS);
        assert_eq!(w.wall_ns(), 9_750 * MS);
        let s = snapshot(&w, &b.0, &Topology::default());
        let t = s.thread((1, 2)).unwrap();
        assert!(approx(t.stats.cpu, 1.0), "{}", t.stats.cpu);
        assert_eq!(t.stats.samples, 975);
        // Nothing new for 30 s: the thread's time leaves the window and it becomes idle.
        w.update(&b.0, 50 * S);
        let s = snapshot(&w, &b.0, &Topology::default());
        let t = s.thread((1, 2)).unwrap();
        assert_eq!(t.stats.cpu, 0.0);
        assert!(t.idle);
        assert!(w.totals.threads.is_empty() && w.totals.functions.is_empty());
    }

    /// A recording with every kind of event over 20 s, and the order a live follower reads it
    /// in (by the time each event is written: a sample at its time, an interval at its end).
    fn busy_recording() -> Recording {
        let mut b = Rec::new()
            .process(1, "python3 x.py", "")
            .thread(1, 2, "launcher")
            .thread(1, 3, "aux-writer");
        let a = b.stack(&["execute_model", "loop"], "w.py");
        let h = b.stack(&["_evict_to_fit", "put"], "aux.py");
        let probe = b.probe(1, "w.py:execute_model", "execute_model", "exact");
        for i in 0..200u64 {
            let t0 = i * 100 * MS;
            b.samples((1, 2), t0, 30, MS, a, GIL);
            b.samples((1, 3), t0 + 30 * MS, 60, MS, h, GIL);
            b.gil_wait(1, 2, t0 + 30 * MS, 55 * MS, 3, h);
            b.offcpu(1, 2, t0 + 30 * MS, 70 * MS);
            b.call(probe, 1, 2, t0, (1 + i % 10) * MS);
            if i % 7 == 0 {
                b.gc(1, 3, t0 + 95 * MS, 3 * MS, (i % 3) as i8);
            }
        }
        b.0
    }

    #[test]
    fn incremental_updates_equal_one_pass() {
        let full = busy_recording();
        let mut w_once = window();
        w_once.update(&full, 20 * S);
        let once = snapshot(&w_once, &full, &Topology::default());

        // The same events appended in the order they would be written, 250 ms at a time.
        let mut live = Recording {
            frames: full.frames.clone(),
            stacks: full.stacks.clone(),
            threads: full.threads.clone(),
            processes: full.processes.clone(),
            probes: full.probes.clone(),
            ..Recording::default()
        };
        let mut w = window();
        let mut t = 0;
        while t < 20 * S {
            t += 250 * MS;
            let until = |end: u64| end > t - 250 * MS && end <= t;
            live.samples
                .extend(full.samples.iter().filter(|s| until(s.t_ns)));
            live.offcpu
                .extend(full.offcpu.iter().filter(|o| until(o.start_ns + o.dur_ns)));
            live.gil_waits.extend(
                full.gil_waits
                    .iter()
                    .filter(|g| until(g.start_ns + g.dur_ns)),
            );
            live.gc_pauses.extend(
                full.gc_pauses
                    .iter()
                    .filter(|g| until(g.start_ns + g.dur_ns)),
            );
            live.calls
                .extend(full.calls.iter().filter(|c| until(c.start_ns + c.dur_ns)));
            w.update(&live, t);
        }
        let inc = snapshot(&w, &live, &Topology::default());
        assert_eq!(inc, once);
        // And trimming what the window has read changes nothing it shows.
        let before = live.samples.len();
        w.trim(&mut live, 10 * S);
        assert!(live.samples.len() < before);
        w.update(&live, 20 * S);
        assert_eq!(snapshot(&w, &live, &Topology::default()), once);
    }

    #[test]
    fn gil_waits_are_clipped_to_the_window_and_blamed_on_the_holder() {
        let full = busy_recording();
        let s = snap_at(&full, 20 * S);
        let wall = s.wall_ns as f64;
        let l = s.thread((1, 2)).unwrap();
        // The window (10.25..20 s) holds the waits of periods 103..=199 whole (55 ms each)
        // and the last 35 ms of period 102's (10.23..10.285 s), which began before it.
        assert_eq!(s.wall_ns, 9_750 * MS);
        assert_eq!(l.stats.gil_waits, 97);
        let waited = (97 * 55 + 35) * MS;
        assert!(
            approx(l.stats.gil_wait, waited as f64 / wall),
            "{}",
            l.stats.gil_wait
        );
        assert_eq!(l.blame.len(), 1);
        let b = &l.blame[0];
        assert_eq!((b.holder_tid, b.holder.as_str()), (3, "aux-writer"));
        assert_eq!(
            (b.function.as_str(), b.file.as_str()),
            ("_evict_to_fit", "aux.py")
        );
        assert_eq!((b.wait_ns, b.waits), (waited, 97));
        assert!(approx(b.share, 1.0));
        // Functions: self and total of the launcher's single stack.
        assert_eq!(l.top_self.len(), 1);
        assert_eq!(l.top_self[0].function, "execute_model");
        assert!(approx(l.top_self[0].self_share, 1.0));
        let total: Vec<&str> = l.top_total.iter().map(|f| f.function.as_str()).collect();
        assert_eq!(total, ["execute_model", "loop"]);
        // A wait cut by the window's start: from 10.2 s, 55 ms long, 5 ms after 10.25 s.
        let mut b2 = Rec::new().thread(1, 2, "w");
        b2.gil_wait(1, 2, 10_200 * MS, 55 * MS, 0, 0);
        let s2 = snap_at(&b2.0, 20 * S);
        let t2 = s2.thread((1, 2)).unwrap();
        assert!(approx(
            t2.stats.gil_wait,
            (5 * MS) as f64 / (9_750 * MS) as f64
        ));
        assert_eq!(t2.stats.gil_waits, 0, "it began before the window");
        assert_eq!(t2.blame[0].function, GIL_FREE);
    }

    #[test]
    fn gc_pauses_by_generation() {
        let full = busy_recording();
        let s = snap_at(&full, 20 * S);
        let p = s.process(1).unwrap();
        // Pauses at periods i % 7 == 0 from 103 (10.3 s) to 196: 105 112 119 … 196 = 14.
        let gens: Vec<(i8, u64)> = p.gc.iter().map(|g| (g.generation, g.pauses)).collect();
        // i % 3 of 105,112,…,196: generations 0,1,2 cycle.
        let count = |g: i8| {
            (103..200u64)
                .filter(|i| i % 7 == 0 && (i % 3) as i8 == g)
                .count() as u64
        };
        assert_eq!(gens, vec![(0, count(0)), (1, count(1)), (2, count(2))]);
        assert!(p
            .gc
            .iter()
            .all(|g| g.max_ns == 3 * MS && g.total_ns == g.pauses * 3 * MS));
        let aux = s.thread((1, 3)).unwrap();
        assert_eq!(aux.stats.gc_pauses, 14);
        assert!(approx(
            aux.stats.gc,
            (14 * 3 * MS) as f64 / s.wall_ns as f64
        ));
    }

    #[test]
    fn an_interval_counts_once_now_has_passed_its_end() {
        let mut b = Rec::new().thread(1, 2, "t");
        b.offcpu(1, 2, 500 * MS, S);
        let mut w = window();
        w.update(&b.0, S);
        let s = snapshot(&w, &b.0, &Topology::default());
        assert_eq!(s.thread((1, 2)).unwrap().stats.offcpu, 0.0);
        w.update(&b.0, 2 * S);
        let s = snapshot(&w, &b.0, &Topology::default());
        assert!(approx(s.thread((1, 2)).unwrap().stats.offcpu, 0.5));
    }

    #[test]
    fn function_latency_percentiles() {
        let mut b = Rec::new().thread(1, 2, "caller");
        let p = b.probe(1, "x.py:step", "step", "sampled");
        // 100 calls of 1..=100 ms, all ending inside the window (0.25..10 s).
        for i in 1..=100u64 {
            b.call(p, 1, 2, 300 * MS + i * 50 * MS, i * MS);
        }
        let s = snap_at(&b.0, 10 * S);
        assert_eq!(s.latency.len(), 1);
        let l = &s.latency[0];
        assert_eq!(
            (l.function.as_str(), l.method.as_str()),
            ("step", "sampled")
        );
        assert_eq!((l.thread.as_str(), l.calls), ("caller", 100));
        assert_eq!(
            (l.p50_ns, l.p90_ns, l.p99_ns, l.max_ns),
            (50 * MS, 90 * MS, 99 * MS, 100 * MS)
        );
        assert!(approx(l.calls_per_s, 100.0 / 9.75));
    }

    /// A probe first watched halfway through the window says from when; its count is what
    /// was seen, its rate over the span since.
    #[test]
    fn late_probe_says_from_when() {
        let mut b = Rec::new().thread(1, 2, "caller");
        let p = b.probe(1, "x.py:step", "step", "exact");
        b.0.probe_watches.push(crate::record::ProbeWatch {
            t_ns: 5 * S,
            probe: p,
            tid: 2,
            on: true,
        });
        for i in 0..50u64 {
            b.call(p, 1, 2, 5 * S + i * 100 * MS + MS, MS);
        }
        // The window is 0.25..10 s: 5 s of its 9.75 s.
        let s = snap_at(&b.0, 10 * S);
        let l = &s.latency[0];
        assert_eq!(l.method, "exact, from 5.0 s (51% of the window)");
        // Every call timed since it was placed: no interval.
        assert_eq!(l.interval, None);
        assert_eq!(l.calls, 50);
        assert!(approx(l.calls_per_s, 10.0), "{}", l.calls_per_s);
    }

    /// A probe watched on and off (it took turns for the thread's debug registers) half of
    /// the window: its count is scaled and its method says the share.
    #[test]
    fn rotated_probe_counts_scale_with_the_share_watched() {
        let mut b = Rec::new().thread(1, 2, "caller");
        let p = b.probe(1, "x.py:step", "step", "exact");
        // Watched in alternate seconds from 0 to 10 s; one 1 ms call every 100 ms while
        // watched (50 calls).
        for k in 0..10u64 {
            b.0.probe_watches.push(crate::record::ProbeWatch {
                t_ns: k * S,
                probe: p,
                tid: 2,
                on: k % 2 == 0,
            });
        }
        for k in (0..10u64).step_by(2) {
            for i in 0..10u64 {
                b.call(p, 1, 2, k * S + i * 100 * MS + MS, MS);
            }
        }
        let s = snap_at(&b.0, 10 * S);
        let l = &s.latency[0];
        // The window starts at 0.25 s (its first bucket); the recording is still being
        // written, so the thread's span runs through its off-phase to the window's end (10 s,
        // not its last watch edge at 9 s): watched 4.75 of 9.75 s, 47 calls timed (those
        // ending from 0.25 s on), standing for 10 calls/s over the window: 97.5 calls. Each
        // weighs as `report` weighs it (its stratum's length over the room a 1 ms call had in
        // it), a little more than the share alone (47 / 0.487 = 96.5), for the calls a watch
        // edge would have cut.
        assert_eq!(l.method, "exact, 49% of the window");
        assert_eq!(l.calls, 97);
        assert!((l.calls_per_s - 10.0).abs() < 0.2, "{}", l.calls_per_s);
        assert_eq!(l.p50_ns, MS);
        // And says how sure it is, as `report` does: five phases of alike counts, so the
        // interval is the 47 timed calls' own Poisson error, 1.96 * 97 / sqrt(47) narrowed by
        // the share unwatched (sqrt(1 - 0.487)): about +-20.
        let u = l.interval.as_ref().expect("an estimate's interval");
        assert_eq!(u.method, "phases");
        let half = (97.0 - u.calls[0]).max(u.calls[1] - 97.0);
        assert!(u.calls[0] < 97.0 && u.calls[1] > 97.0, "{:?}", u.calls);
        assert!((half - 19.9).abs() < 1.5, "half-width {half:.1}");
        assert!(u.p50_ms[0] <= 1.0 && u.p50_ms[1] >= 1.0, "{:?}", u.p50_ms);
    }

    #[test]
    fn processes_group_by_engine_with_metrics() {
        let mut b = Rec::new()
            .process(100, "python3 -m vllm.entrypoints.openai.api_server", "")
            .process(200, "python3", "")
            .process(300, "python3 other.py", "")
            .thread(100, 100, "MainThread")
            .thread(200, 200, "MainThread")
            .thread(300, 300, "MainThread");
        b.0.engines.push(EngineInfo {
            id: "engine0".into(),
            api_server_pid: 100,
            engine_core_pids: vec![200],
            metrics_url: "http://127.0.0.1:8000/metrics".into(),
            ..EngineInfo::default()
        });
        let series = [
            ("vllm:generation_tokens_total", "counter"),
            ("vllm:kv_cache_usage_perc", "gauge"),
            ("vllm:num_requests_running", "gauge"),
            ("vllm:num_requests_waiting", "gauge"),
        ];
        for (i, (name, kind)) in series.iter().enumerate() {
            b.0.series.push(MetricSeries {
                id: i as u32,
                engine: "engine0".into(),
                name: name.to_string(),
                kind: kind.to_string(),
                ..MetricSeries::default()
            });
        }
        for k in 0..=10u64 {
            let t = k * S;
            for (series, value) in [
                (0, 1000.0 + 250.0 * k as f64),
                (1, k as f64 / 20.0),
                (2, 3.0),
                (3, k as f64),
            ] {
                b.0.metrics.push(MetricPoint {
                    t_ns: t,
                    series,
                    value,
                });
            }
        }
        let s = snap_at(&b.0, 10 * S);
        assert_eq!(s.groups.len(), 2);
        let g = &s.groups[0];
        assert_eq!(g.engine.as_deref(), Some("engine0"));
        assert_eq!(g.label, "engine0: API server 100, EngineCore 200");
        let names: Vec<(i32, &str)> = g
            .processes
            .iter()
            .map(|p| (p.pid, p.name.as_str()))
            .collect();
        assert_eq!(names, [(100, "APIServer"), (200, "EngineCore")]);
        assert_eq!(s.groups[1].label, "other processes");
        assert_eq!(s.groups[1].processes[0].name, "python3");
        let e = &s.engines[0];
        assert_eq!(e.engine, "engine0");
        assert_eq!(e.gen_tokens_per_s.now, Some(250.0));
        assert_eq!(e.gen_tokens_per_s.history, vec![250.0; 10]);
        assert_eq!(e.kv_cache.now, Some(0.5));
        assert_eq!(e.running.now, Some(3.0));
        assert_eq!(e.waiting.now, Some(10.0));
        assert_eq!(e.metrics_url, "http://127.0.0.1:8000/metrics");
        // A topology from discovery names a process the recording does not.
        let mut w = window();
        w.update(&b.0, 10 * S);
        let topo = Topology {
            roles: [(300, "Worker".to_string())].into_iter().collect(),
            engines: vec![],
        };
        let s = snapshot(&w, &b.0, &topo);
        assert_eq!(s.process(300).unwrap().name, "Worker");
    }

    /// TTFT over the window from its histogram's increases in it: from 5 s on, 10 first
    /// tokens a second, 9 of them <= 100 ms, 200 ms on average; before that, first tokens of
    /// 5 s that must not count. No TPOT series: nothing.
    #[test]
    fn latency_histograms_over_the_window() {
        let mut b = Rec::new().process(100, "python3 -m vllm.entrypoints.openai.api_server", "");
        let base = "vllm:time_to_first_token_seconds";
        let series = [
            (format!("{base}_bucket"), Some("0.1")),
            (format!("{base}_bucket"), Some("+Inf")),
            (format!("{base}_sum"), None),
            (format!("{base}_count"), None),
        ];
        for (i, (name, le)) in series.iter().enumerate() {
            b.0.series.push(MetricSeries {
                id: i as u32,
                engine: "engine0".into(),
                name: name.clone(),
                labels: le
                    .map(|l| [("le".to_string(), l.to_string())].into())
                    .unwrap_or_default(),
                kind: "histogram".into(),
            });
        }
        for k in 0..=20u64 {
            let (slow, fast) = (k.min(5) as f64, k.saturating_sub(5) as f64);
            let (n, fast_n, sum) = (10.0 * (slow + fast), 9.0 * fast, 50.0 * slow + 2.0 * fast);
            for (series, value) in [(0, fast_n), (1, n), (2, sum), (3, n)] {
                b.0.metrics.push(MetricPoint {
                    t_ns: k * S,
                    series,
                    value,
                });
            }
        }
        let s = snap_at(&b.0, 20 * S);
        assert!(s.window_start_ns >= 5 * S, "{}", s.window_start_ns);
        let seconds = (20 * S - s.window_start_ns) as f64 / S as f64;
        let t = &s.engines[0].ttft;
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-6);
        assert!(close(Some(t.count), 10.0 * seconds), "{t:?}");
        assert!(close(t.mean, 200.0), "{t:?}");
        assert!(close(t.p50, 100.0 * 50.0 / 90.0), "{t:?}");
        assert_eq!(t.p50_bucket, Some(maths::QuantileBucket(0.0, Some(100.0))));
        assert_eq!(t.p99_bucket, Some(maths::QuantileBucket(100.0, None)));
        let e = &s.engines[0];
        assert_eq!(e.tpot, maths::LatencyQuantiles::default());
    }
}
