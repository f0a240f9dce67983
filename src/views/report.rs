//! The report: per-thread CPU split, per-thread function tables, GIL waits (who blocked whom,
//! doing what) and GC pauses; for vLLM-aware recordings also the engines' metrics, a
//! time-aligned per-window table with correlations and throughput drops, probed function
//! latency and API-server stalls; as versioned JSON (docs/report-schema.md) or Markdown.
//!
//! All times come from integer nanoseconds summed first and divided once, so round inputs
//! give round outputs (300 samples of 1 ms -> `0.3`).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use serde::{Deserialize, Serialize};

use super::engines::{self, EngineImbalance, EngineRow};
use super::gil::{generation_key, thread_name_or_tid, GIL_FREE, RELEASING, UNKNOWN_FUNCTION};
use super::latency::{function_latency, FunctionLatencyRow};
use super::stalls::{api_server_stalls, ApiServerStalls};
use super::timeline::{self, Correlation, ThroughputDrop, WindowRow};
use super::windows::{extent_ns, Windows};
use super::{format_utc, process_name, secs, short_file, Selection};
use crate::accounting::{Acc, FunctionTable, Holder, Sums, ThreadAcc, ThreadKey, TimeCount};
use crate::metrics::MetricIndex;
use crate::record::Recording;

/// Schema identifier. Additive changes (new fields) keep `/1`; renaming, removing or changing
/// the meaning or unit of a field bumps it.
pub(crate) const SCHEMA: &str = "enginescope.report/1";

/// Functions per thread in the Markdown rendering.
pub(crate) const MD_TOP_FUNCTIONS: usize = 15;
/// Rows of the "Waits on other threads" table in Markdown (all of them in the JSON).
const MD_WAITS: usize = 12;
/// Holder functions kept per (waiter, holder) pair in `gil_blocking_pairs[].holder_top`.
pub(crate) const HOLDER_TOP: usize = 5;
/// (waiter, holder) rows in the Markdown "who blocks whom" table.
pub(crate) const MD_GIL_PAIRS: usize = 20;

/// What the report computes beyond the thread selection (`report --window`, `--stall-ms`,
/// `--drop-pct`, `--flame-link`).
#[derive(Debug, Clone, PartialEq)]
pub struct ReportOptions {
    /// Window length of the per-window table, correlations and latency series, ns.
    pub window_ns: u64,
    /// An API-server main-thread run longer than this is a stall, ns.
    pub stall_ns: u64,
    /// A window whose generation throughput is more than this % below the median window's
    /// is a throughput drop.
    pub drop_pct: f64,
    /// Flamegraph files the Markdown report links to, as given (relative to the report).
    pub flame_links: Vec<String>,
}

impl Default for ReportOptions {
    fn default() -> Self {
        ReportOptions {
            window_ns: 10_000_000_000,
            stall_ns: 100_000_000,
            drop_pct: 20.0,
            flame_links: Vec::new(),
        }
    }
}

/// `report` flags for the engine, timeline and stall sections.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ReportArgs {
    /// Window length, s, for the per-window table, correlations and latency series.
    #[arg(long, default_value_t = 10.0, value_name = "S")]
    pub window: f64,
    /// An API-server event-loop run on CPU longer than this is a stall, ms.
    #[arg(long, default_value_t = 100.0, value_name = "MS")]
    pub stall_ms: f64,
    /// A window whose gen tok/s is this % or more below the median window's is a drop.
    #[arg(long, default_value_t = 20.0, value_name = "PCT")]
    pub drop_pct: f64,
    /// Link this flamegraph from the Markdown report (repeatable; the path is written as
    /// given, so give it relative to where the report goes).
    #[arg(long = "flame-link", value_name = "SVG")]
    pub flame_links: Vec<String>,
}

impl ReportArgs {
    pub fn options(&self) -> anyhow::Result<ReportOptions> {
        if !(self.window.is_finite() && self.window > 0.0) {
            anyhow::bail!(
                "--window must be a positive number of seconds, not {}",
                self.window
            );
        }
        if !(self.stall_ms.is_finite() && self.stall_ms >= 0.0) {
            anyhow::bail!("--stall-ms must be 0 or more, not {}", self.stall_ms);
        }
        if !(self.drop_pct.is_finite() && (0.0..=100.0).contains(&self.drop_pct)) {
            anyhow::bail!(
                "--drop-pct must be between 0 and 100, not {}",
                self.drop_pct
            );
        }
        Ok(ReportOptions {
            window_ns: ((self.window * 1e9).round() as u64).max(1),
            stall_ns: (self.stall_ms * 1e6).round() as u64,
            drop_pct: self.drop_pct,
            flame_links: self.flame_links.clone(),
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub schema: String,
    /// enginescope version that made this report.
    pub tool_version: String,
    pub recording: RecordingInfo,
    /// Which threads the report covers (`all threads` or the filter given).
    pub selection: String,
    /// Recording length, s.
    pub duration_s: f64,
    /// The file ended inside a record (recorder killed); everything before the cut is counted.
    pub truncated: bool,
    /// What costs the selected processes their time, highest score first
    /// ([`super::findings`]); empty when nothing passes its kind's thresholds.
    #[serde(default)]
    pub findings: Vec<super::findings::Finding>,
    pub processes: Vec<ProcessRow>,
    pub totals: Totals,
    /// Selected threads, most on-CPU time first.
    pub threads: Vec<ThreadRow>,
    /// (thread, function) rows, most self time first.
    pub functions: Vec<FunctionRow>,
    /// GIL waits of the selected threads by (waiter, holder, holder's innermost function), most
    /// wait first.
    pub gil_blocking: Vec<GilBlockingRow>,
    /// The same waits by (waiter, holder), most wait first, with the holder's top functions.
    pub gil_blocking_pairs: Vec<GilPairRow>,
    /// Time threads slept until another thread of their process woke them (locks, conditions),
    /// by waker and what each side ran (`views::waits`); absent without wake-ups recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<super::waits::WaitRow>,
    /// Garbage collections run by the selected threads.
    pub gc: GcSummary,
    /// Recorder health counters, copied from the recording.
    pub counters: BTreeMap<String, u64>,
    /// What the recording cost inside its targets (kernel's BPF run times, calibrated traps
    /// and watched switches), over the whole recording. Absent without counters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<super::cost::RecordingCost>,
    /// Engines (vLLM-aware recordings): processes and metrics over the whole recording.
    #[serde(default)]
    pub engines: Vec<EngineRow>,
    /// Spread across engines; null with fewer than two.
    #[serde(default)]
    pub engine_imbalance: Option<EngineImbalance>,
    /// Data-parallel engines (one API server, several engine cores; vLLM's `engine` label):
    /// a row per rank, named `<id>/dp<rank>`, and their imbalance. Absent without DP.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engine_ranks: Vec<EngineRow>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_imbalance: Option<EngineImbalance>,
    /// Situations of one engine among several (`views::fleet`): KV memory wall, a queue
    /// while the others idle, TTFT outliers; each names the engine and its EngineCore's CPU,
    /// GIL wait and GC then. Absent when there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fleet_findings: Vec<super::fleet::FleetFinding>,
    /// Calls of probed functions per probe and thread, most calls first.
    #[serde(default)]
    pub function_latency: Vec<FunctionLatencyRow>,
    /// Length of the windows, s (`--window`, widened when there would be more than 10,000).
    #[serde(default)]
    pub window_s: f64,
    /// Threads with per-window columns (`pid:tid name`), busiest first.
    #[serde(default)]
    pub key_threads: Vec<String>,
    /// The recording cut into windows.
    #[serde(default)]
    pub windows: Vec<WindowRow>,
    /// Profiler signals against generation throughput over the windows.
    #[serde(default)]
    pub correlations: Vec<Correlation>,
    /// `--drop-pct`.
    #[serde(default)]
    pub throughput_drop_pct: f64,
    /// Windows with generation throughput more than `throughput_drop_pct` below the median.
    #[serde(default)]
    pub throughput_drops: Vec<ThroughputDrop>,
    /// API-server event-loop stalls and serialization cost.
    #[serde(default)]
    pub api_server_stalls: ApiServerStalls,
    /// Flamegraph files the Markdown links to (`--flame-link`).
    #[serde(default)]
    pub flamegraphs: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RecordingInfo {
    /// enginescope version that wrote the recording.
    pub tool_version: String,
    pub start_unix_s: f64,
    pub start_utc: String,
    pub backend: String,
    pub backend_reason: String,
    pub rate_hz: u32,
    pub hostname: String,
    pub kernel: String,
    pub command: String,
    pub cpus: u32,
    /// Why the recorder stopped; null when it did not finish cleanly.
    pub end_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcessRow {
    pub pid: i32,
    pub name: String,
    pub cmdline: String,
    pub python_version: String,
    pub role: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Totals {
    pub samples: u64,
    pub cpu_s: f64,
    pub python_s: f64,
    pub native_s: f64,
    pub offcpu_s: f64,
    /// Of which taken by the hypervisor while threads ran (`ThreadRow::offcpu_stolen_s`).
    #[serde(default)]
    pub offcpu_stolen_s: f64,
    pub gil_held_s: f64,
    pub gil_wait_s: f64,
    pub gil_switch_wait_s: f64,
    pub gc_s: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ThreadRow {
    pub pid: i32,
    pub tid: i32,
    /// The Python name (`threading.Thread.name`) where the thread has one, else `os_name`.
    pub name: String,
    /// The OS name (`comm`).
    #[serde(default)]
    pub os_name: String,
    /// On-CPU time: sum of sample weights, s.
    pub cpu_s: f64,
    pub samples: u64,
    /// On-CPU time without the NATIVE flag, s.
    pub python_s: f64,
    /// On-CPU time with the NATIVE flag, s.
    pub native_s: f64,
    /// Off-CPU time: sum of interval durations, s.
    pub offcpu_s: f64,
    /// Part of `offcpu_s` where the thread was preempted (runnable), s.
    pub offcpu_preempted_s: f64,
    /// Part of `offcpu_preempted_s` the hypervisor took while the thread was on its (virtual)
    /// CPU: no switch shows it, the thread's runtime stood still (steal; on kernels that
    /// account interrupts apart, interrupts too), s. 0 with the memory backend.
    #[serde(default)]
    pub offcpu_stolen_s: f64,
    /// Share of on-CPU time holding the GIL, 0..1.
    pub gil_held_share: f64,
    /// Share of on-CPU time during a garbage collection, 0..1.
    pub gc_share: f64,
    /// On-CPU time holding the GIL: sum of the weights of samples with the GIL flag, s.
    pub gil_held_s: f64,
    /// Time blocked waiting to take the GIL: sum of its GIL waits (not switch waits), s.
    pub gil_wait_s: f64,
    /// Number of those waits.
    pub gil_waits: u64,
    /// Time the thread, dropping the GIL on request, waited for another thread to take it
    /// (the forced-switch handshake), s.
    pub gil_switch_wait_s: f64,
    /// Time in garbage collections this thread ran, s.
    pub gc_s: f64,
    /// Number of those collections.
    pub gc_pauses: u64,
}

/// GIL wait of one waiter on one holder while the holder ran one function.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GilBlockingRow {
    pub waiter_pid: i32,
    pub waiter_tid: i32,
    pub waiter_name: String,
    /// 0 when the GIL was free (or its holder unreadable) when the wait began.
    pub holder_tid: i32,
    /// The holder's thread name (`tid N` when unnamed); empty for holder 0.
    pub holder_name: String,
    pub wait_s: f64,
    pub waits: u64,
    /// The holder's innermost Python function when the wait began; `<gil free>` for holder 0,
    /// `<releasing>` when the holder is the waiter itself (it was releasing the GIL and waited
    /// for the GIL's internal mutex), `<unknown>` for a holder with no Python frame.
    pub holder_function: String,
    /// Its file; empty for the placeholders.
    pub holder_file: String,
}

/// GIL wait of one waiter on one holder.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GilPairRow {
    pub waiter_pid: i32,
    pub waiter_tid: i32,
    pub waiter_name: String,
    pub holder_tid: i32,
    pub holder_name: String,
    pub wait_s: f64,
    pub waits: u64,
    /// `wait_s` over the waiter's `gil_wait_s`, 0..1.
    pub share_of_wait: f64,
    /// What the holder was running (innermost function), most wait first, at most
    /// [`HOLDER_TOP`].
    pub holder_top: Vec<HolderFunction>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HolderFunction {
    pub function: String,
    pub file: String,
    pub wait_s: f64,
    pub waits: u64,
}

/// Garbage collections: all, by generation, by collecting thread.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GcSummary {
    pub pauses: u64,
    /// Objects freed, where the interpreter's statistics were readable.
    #[serde(default)]
    pub collected: u64,
    pub total_s: f64,
    /// Longest pause, ms.
    pub max_ms: f64,
    /// `total_s` over the recording's duration (summed over processes: with several processes
    /// collecting it can exceed 1).
    pub share: f64,
    /// `"0"`, `"1"`, `"2"` always (zeros when none); `"unknown"` only when a pause's
    /// generation could not be read; any other generation number when one occurs.
    pub by_generation: BTreeMap<String, GcStats>,
    /// Collecting threads, most GC time first.
    pub by_thread: Vec<GcThreadRow>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GcStats {
    pub pauses: u64,
    /// Objects freed by these collections, where the interpreter's statistics were readable.
    #[serde(default)]
    pub collected: u64,
    pub total_s: f64,
    pub max_ms: f64,
    pub share: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GcThreadRow {
    pub pid: i32,
    pub tid: i32,
    pub name: String,
    pub pauses: u64,
    pub total_s: f64,
    pub max_ms: f64,
    pub share: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FunctionRow {
    pub function: String,
    pub file: String,
    pub pid: i32,
    pub tid: i32,
    /// On-CPU time with this function innermost, s.
    pub self_s: f64,
    /// On-CPU time with this function anywhere on the stack, once per sample, s.
    pub total_s: f64,
    /// `self_s` over the thread's `cpu_s`, 0..1.
    pub self_share: f64,
    /// `total_s` over the thread's `cpu_s`, 0..1.
    pub total_share: f64,
    /// Part of `self_s` with the NATIVE flag (native code called from this function), s.
    pub self_native_s: f64,
    pub self_samples: u64,
    pub total_samples: u64,
    /// For a probed function (`record --probe`): its calls in this thread (the probe with the
    /// most calls when it has several, e.g. exact and then sampled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls_per_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<super::latency::LatencyMs>,
    /// `exact` or `sampled` (see `function_latency[]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
}

/// Fill the call fields of each function row that has a probe in the same thread.
fn with_calls(mut rows: Vec<FunctionRow>, lat: &[FunctionLatencyRow]) -> Vec<FunctionRow> {
    for r in rows.iter_mut() {
        if let Some(l) = lat
            .iter()
            .filter(|l| {
                l.pid == r.pid && l.tid == r.tid && l.function == r.function && l.file == r.file
            })
            .max_by_key(|l| l.calls)
        {
            r.calls = Some(l.calls);
            r.calls_per_s = Some(l.calls_per_s);
            r.latency_ms = Some(l.latency_ms.clone());
            r.method = Some(l.method.clone());
        }
    }
    rows
}

#[derive(Default, Clone, Copy)]
struct GcAcc {
    pauses: u64,
    collected: u64,
    total: u64,
    max: u64,
}

impl GcAcc {
    fn add(&mut self, dur: u64, collected: i64) {
        self.pauses += 1;
        self.collected += collected.max(0) as u64;
        self.total += dur;
        self.max = self.max.max(dur);
    }

    fn stats(&self, duration_ns: u64) -> GcStats {
        GcStats {
            collected: self.collected,
            pauses: self.pauses,
            total_s: secs(self.total),
            max_ms: ms(self.max),
            share: share(self.total, duration_ns),
        }
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

impl Report {
    /// The report with default options.
    pub fn build(rec: &Recording, sel: &Selection) -> Report {
        Report::build_with(rec, sel, &ReportOptions::default())
    }

    pub fn build_with(rec: &Recording, sel: &Selection, opts: &ReportOptions) -> Report {
        // What each event contributes is crate::accounting's (the same as top's and the
        // agent's); the report sums it over the whole recording.
        let mut table = FunctionTable::of(rec);
        let mut sums = Sums::default();
        for s in sel.samples(rec) {
            sums.add_sample(s);
        }
        for o in sel.offcpu(rec) {
            sums.add_offcpu(o, o.dur_ns);
        }
        // GIL waits of the selected waiters: per thread, and by (waiter, holder, holder's
        // function) in `sums.blame`.
        for g in sel.gil_waits(rec) {
            sums.add_gil_wait(g, table.holder(rec, g), g.dur_ns, 1);
        }
        let duration_ns = rec.duration_ns();
        let mut gc_all = GcAcc::default();
        let mut gc_gen: BTreeMap<String, GcAcc> = ["0", "1", "2"]
            .into_iter()
            .map(|k| (k.to_string(), GcAcc::default()))
            .collect();
        let mut gc_thread: BTreeMap<(i32, i32), GcAcc> = BTreeMap::new();
        for g in sel.gc_pauses(rec) {
            sums.add_gc_pause(g, g.dur_ns, 1);
            gc_all.add(g.dur_ns, g.collected);
            gc_gen
                .entry(generation_key(g))
                .or_default()
                .add(g.dur_ns, g.collected);
            gc_thread
                .entry((g.pid, g.tid))
                .or_default()
                .add(g.dur_ns, g.collected);
        }

        // Every selected thread has a row, events or not.
        let mut threads: BTreeMap<(i32, i32), ThreadAcc> =
            sel.threads().map(|k| (k, ThreadAcc::default())).collect();
        for (k, t) in &sums.threads {
            threads.entry(*k).or_default().add(t);
        }
        // Functions are (name, file); lines are merged.
        sums.expand_stacks(rec, &mut table);
        let functions = function_rows(&sums, &table, &threads);

        let (gil_blocking, gil_blocking_pairs) = gil_tables(rec, &sums.blame, &table, &threads);
        let gc = gc_summary(rec, gc_all, gc_gen, gc_thread, duration_ns);

        let (rows, totals) = thread_rows(rec, threads);

        let end_ns = extent_ns(rec);
        let windows = Windows::new(opts.window_ns, end_ns);
        let ix = MetricIndex::new(rec);
        let engine_ids = engines::engine_ids(rec, &ix);
        let tl = timeline::build(rec, sel, &ix, &engine_ids, &windows, opts.drop_pct);
        let engine_rows = engines::engine_rows(rec, &ix, &engine_ids, &windows, end_ns);
        let ranks_ix = MetricIndex::with_split(rec, crate::metrics::Split::Ranks);
        let rank_ids: Vec<String> = ranks_ix
            .engines()
            .filter(|e| !engine_ids.iter().any(|id| id == e))
            .map(str::to_string)
            .collect();
        let rank_rows = engines::engine_rows(rec, &ranks_ix, &rank_ids, &windows, end_ns);

        let m = &rec.meta;
        let function_latency = function_latency(rec, sel, &windows);
        let mut report = Report {
            schema: SCHEMA.to_string(),
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            recording: RecordingInfo {
                tool_version: m.tool_version.clone(),
                start_unix_s: m.start_unix_s,
                start_utc: format_utc(m.start_unix_s),
                backend: m.backend.clone(),
                backend_reason: m.backend_reason.clone(),
                rate_hz: m.rate_hz,
                hostname: m.hostname.clone(),
                kernel: m.kernel.clone(),
                command: m.command.clone(),
                cpus: m.cpus,
                end_reason: rec.end.as_ref().map(|e| e.reason.clone()),
            },
            selection: sel.description().to_string(),
            duration_s: secs(rec.duration_ns()),
            truncated: rec.truncated,
            findings: Vec::new(),
            processes: sel
                .pids()
                .into_iter()
                .map(|pid| {
                    let p = rec.processes.iter().rev().find(|p| p.pid == pid);
                    ProcessRow {
                        pid,
                        name: process_name(rec, pid).to_string(),
                        cmdline: p.map(|p| p.cmdline.clone()).unwrap_or_default(),
                        python_version: p.map(|p| p.python_version.clone()).unwrap_or_default(),
                        role: p.map(|p| p.role.clone()).unwrap_or_default(),
                    }
                })
                .collect(),
            totals,
            threads: rows.into_iter().map(|(_, r)| r).collect(),
            functions: with_calls(
                functions.into_iter().map(|(_, f)| f).collect(),
                &function_latency,
            ),
            gil_blocking,
            gil_blocking_pairs,
            waits: super::waits::waits(rec, sel),
            gc,
            counters: rec.counters.clone(),
            cost: super::cost::RecordingCost::from_counters(
                &rec.counters,
                rec.counters_span_ns.unwrap_or_else(|| rec.duration_ns()),
            ),
            engine_imbalance: engines::imbalance(&engine_rows),
            rank_imbalance: engines::imbalance(&rank_rows),
            engine_ranks: rank_rows,
            fleet_findings: super::fleet::findings(rec, &ix, &engine_rows, &tl.windows, &windows),
            engines: engine_rows,
            function_latency,
            window_s: tl.window_s,
            key_threads: tl.key_threads,
            windows: tl.windows,
            correlations: tl.correlations,
            throughput_drop_pct: opts.drop_pct,
            throughput_drops: tl.throughput_drops,
            api_server_stalls: api_server_stalls(rec, sel, opts.stall_ns),
            flamegraphs: opts.flame_links.clone(),
        };
        // From the tables above, so that a finding's figures are the tables' figures.
        report.findings = super::findings::findings(rec, sel, &report);
        report
    }

    /// The same content as Markdown: a thread table, then the top functions of each thread.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        self.header_markdown(&mut s);
        self.findings_markdown(&mut s);
        self.links_markdown(&mut s);
        self.engines_markdown(&mut s);
        self.threads_markdown(&mut s);
        self.timeline_markdown(&mut s);
        self.latency_markdown(&mut s);
        self.stalls_markdown(&mut s);
        self.gil_markdown(&mut s);
        self.waits_markdown(&mut s);
        self.gc_markdown(&mut s);
        self.top_functions_markdown(&mut s);
        if let Some(c) = &self.cost {
            c.markdown(&mut s);
        }
        self.counters_markdown(&mut s);
        s
    }
}

impl Report {
    /// A process as the tables name it: its role (`worker_tp0`, `engine_core`) or executable.
    pub fn process_name(&self, pid: i32) -> &str {
        self.processes
            .iter()
            .rev()
            .find(|p| p.pid == pid)
            .map_or("process", |p| p.name.as_str())
    }

    /// The title and the recording's facts: when, where, what, its cost, the selection, totals.
    fn header_markdown(&self, s: &mut String) {
        let r = &self.recording;
        let _ = writeln!(s, "# enginescope report\n");
        let _ = writeln!(
            s,
            "- **Recorded:** {} on {}, {:.3} s, {} backend at {} Hz{}",
            r.start_utc,
            if r.hostname.is_empty() {
                "unknown host"
            } else {
                &r.hostname
            },
            self.duration_s,
            if r.backend.is_empty() {
                "unknown"
            } else {
                &r.backend
            },
            r.rate_hz,
            if r.backend_reason.is_empty() {
                String::new()
            } else {
                format!(" ({})", md(&r.backend_reason))
            }
        );
        if !r.command.is_empty() {
            let _ = writeln!(s, "- **Command:** `{}`", r.command.replace('`', "'"));
        }
        for p in &self.processes {
            let _ = writeln!(
                s,
                "- **Process {}:** {}{}{}",
                p.pid,
                md(&p.name),
                if p.python_version.is_empty() {
                    String::new()
                } else {
                    format!(", Python {}", md(&p.python_version))
                },
                if p.cmdline.is_empty() {
                    String::new()
                } else {
                    format!(", `{}`", p.cmdline.replace('`', "'"))
                }
            );
        }
        if let Some(c) = &self.cost {
            let _ = writeln!(
                s,
                "- **What recording cost its targets:** {} ([details](#what-recording-cost))",
                c.headline()
            );
        }
        let _ = writeln!(s, "- **Selection:** {}", md(&self.selection));
        let _ = writeln!(
            s,
            "- **Totals:** {} samples, {:.3} s on CPU ({:.3} s Python, {:.3} s native), {:.3} s off CPU{}",
            self.totals.samples,
            self.totals.cpu_s,
            self.totals.python_s,
            self.totals.native_s,
            self.totals.offcpu_s,
            if self.shows_steal() {
                format!(
                    " (of which {:.3} s taken by the hypervisor while threads were on CPU: steal)",
                    self.totals.offcpu_stolen_s
                )
            } else {
                String::new()
            }
        );
        if self.truncated {
            let _ = writeln!(
                s,
                "\n> **Truncated recording:** the file ends inside a record (the recorder was \
                 killed); everything before the cut is counted."
            );
        } else if r.end_reason.is_none() {
            let _ = writeln!(
                s,
                "\n> **No end record:** the recorder did not finish cleanly."
            );
        } else if let Some(e) = r
            .end_reason
            .as_deref()
            .and_then(|e| e.strip_prefix("error: "))
        {
            // Stopped by an error (a full filesystem): its window ends there, and says so.
            let _ = writeln!(s, "\n> **Stopped early:** {}.", md(e));
        }
    }

    /// Whether the hypervisor's steal is worth saying: at least 1 ms and 1% of the CPU time.
    fn shows_steal(&self) -> bool {
        self.totals.offcpu_stolen_s >= 0.001
            && self.totals.offcpu_stolen_s >= 0.01 * self.totals.cpu_s
    }

    /// The "Threads" table.
    fn threads_markdown(&self, s: &mut String) {
        let steal = self.shows_steal();
        let _ = writeln!(s, "\n## Threads\n");
        let _ = writeln!(
            s,
            "| pid | process | tid | thread | CPU s | samples | Python s | native s | off-CPU s |{} GIL held | GC |",
            if steal { " of it stolen s |" } else { "" }
        );
        let _ = writeln!(
            s,
            "|---:|---|---:|---|---:|---:|---:|---:|---:|{}---:|---:|",
            if steal { "---:|" } else { "" }
        );
        for t in &self.threads {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.3} | {} | {:.3} | {:.3} | {:.3} |{} {:.1}% | {:.1}% |",
                t.pid,
                md(self.process_name(t.pid)),
                t.tid,
                md(&t.name),
                t.cpu_s,
                t.samples,
                t.python_s,
                t.native_s,
                t.offcpu_s,
                if steal {
                    format!(" {:.3} |", t.offcpu_stolen_s)
                } else {
                    String::new()
                },
                t.gil_held_share * 100.0,
                t.gc_share * 100.0
            );
        }
    }

    /// One "Top functions" table per thread.
    fn top_functions_markdown(&self, s: &mut String) {
        for t in &self.threads {
            let top: Vec<&FunctionRow> = self
                .functions
                .iter()
                .filter(|f| f.pid == t.pid && f.tid == t.tid)
                .take(MD_TOP_FUNCTIONS)
                .collect();
            if top.is_empty() {
                continue;
            }
            let _ = writeln!(
                s,
                "\n## Top functions: {} (tid {}, pid {})\n",
                md(if t.name.is_empty() { "thread" } else { &t.name }),
                t.tid,
                t.pid
            );
            let _ = writeln!(s, "| self s | self % | total s | function | file |");
            let _ = writeln!(s, "|---:|---:|---:|---|---|");
            for f in top {
                let _ = writeln!(
                    s,
                    "| {:.3} | {:.1}% | {:.3} | {} | {} |",
                    f.self_s,
                    f.self_share * 100.0,
                    f.total_s,
                    md(&f.function),
                    md(&f.file)
                );
            }
        }
    }

    /// The recorder's counters.
    fn counters_markdown(&self, s: &mut String) {
        if !self.counters.is_empty() {
            let _ = writeln!(s, "\n## Recorder counters\n");
            let _ = writeln!(s, "| counter | value |");
            let _ = writeln!(s, "|---|---:|");
            for (k, v) in &self.counters {
                let _ = writeln!(s, "| {} | {v} |", md(k));
            }
        }
    }
}

impl Report {
    /// The "GIL" section: per-thread held/wait time, then who blocked whom doing what. Absent
    /// when no selected thread held or waited for the GIL.
    fn gil_markdown(&self, s: &mut String) {
        let mut rows: Vec<&ThreadRow> = self
            .threads
            .iter()
            .filter(|t| t.gil_held_s > 0.0 || t.gil_wait_s > 0.0 || t.gil_switch_wait_s > 0.0)
            .collect();
        if rows.is_empty() {
            return;
        }
        rows.sort_by(|a, b| {
            b.gil_wait_s
                .total_cmp(&a.gil_wait_s)
                .then(b.gil_held_s.total_cmp(&a.gil_held_s))
                .then((a.pid, a.tid).cmp(&(b.pid, b.tid)))
        });
        let _ = writeln!(s, "\n## GIL\n");
        if self.gil_blocking.is_empty() && self.totals.gil_switch_wait_s == 0.0 {
            let _ = writeln!(
                s,
                "No GIL waits in this recording (recorders without GIL tracing write none); \
                 GIL held is from the samples' GIL flag.\n"
            );
        }
        let _ = writeln!(
            s,
            "| pid | tid | thread | CPU s | GIL held s | held % of CPU | GIL wait s | waits | wait % of recording | switch wait s |"
        );
        let _ = writeln!(s, "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|");
        for t in rows {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.3} | {:.3} | {:.1}% | {:.3} | {} | {:.1}% | {:.3} |",
                t.pid,
                t.tid,
                md(&t.name),
                t.cpu_s,
                t.gil_held_s,
                t.gil_held_share * 100.0,
                t.gil_wait_s,
                t.gil_waits,
                if self.duration_s > 0.0 {
                    t.gil_wait_s / self.duration_s * 100.0
                } else {
                    0.0
                },
                t.gil_switch_wait_s
            );
        }
        if self.gil_blocking_pairs.is_empty() {
            return;
        }
        let _ = writeln!(s, "\n### Who blocks whom\n");
        let _ = writeln!(
            s,
            "Time each thread waited for the GIL, by the thread holding it when the wait began \
             and what that thread was running (its innermost Python function).\n"
        );
        let _ = writeln!(
            s,
            "| waiter | holder | wait s | waits | % of waiter's GIL wait | holder was running |"
        );
        let _ = writeln!(s, "|---|---|---:|---:|---:|---|");
        for p in self.gil_blocking_pairs.iter().take(MD_GIL_PAIRS) {
            let holder = if p.holder_tid == 0 {
                super::gil::GIL_FREE.to_string()
            } else if p.holder_tid == p.waiter_tid {
                format!("itself, {}", super::gil::RELEASING)
            } else {
                format!("{} (tid {})", p.holder_name, p.holder_tid)
            };
            let running: Vec<String> = p
                .holder_top
                .iter()
                .take(3)
                .map(|f| {
                    let file = short_file(&f.file);
                    if file.is_empty() {
                        format!("{} {:.3} s", f.function, f.wait_s)
                    } else {
                        format!("{} ({file}) {:.3} s", f.function, f.wait_s)
                    }
                })
                .collect();
            let _ = writeln!(
                s,
                "| {} (tid {}) | {} | {:.3} | {} | {:.1}% | {} |",
                md(if p.waiter_name.is_empty() {
                    "thread"
                } else {
                    &p.waiter_name
                }),
                p.waiter_tid,
                md(&holder),
                p.wait_s,
                p.waits,
                p.share_of_wait * 100.0,
                md(&running.join("; "))
            );
        }
        if self.gil_blocking_pairs.len() > MD_GIL_PAIRS {
            let _ = writeln!(
                s,
                "\n{} more (waiter, holder) pairs in the JSON report.",
                self.gil_blocking_pairs.len() - MD_GIL_PAIRS
            );
        }
    }

    /// The "Waits on other threads" section: absent without wake-ups recorded.
    fn waits_markdown(&self, s: &mut String) {
        if self.waits.is_empty() {
            return;
        }
        let _ = writeln!(s, "\n## {}\n", super::waits::HEADING);
        let _ = writeln!(
            s,
            "Time each thread slept until another thread of its process woke it (a lock released, \
             a condition notified: the kernel's wake-up inside the waker's futex call), by where it \
             waited and what the waker was running when it let it go; `lock`: the thread blocked \
             in its own code, `event`: in the standard library's wait for work. The last column is \
             what the waker did while the thread waited.\n"
        );
        let _ = writeln!(
            s,
            "| waiter | waited in | kind | woken by | waker was leaving | waits | wait s | % of recording | max ms | waker during the waits |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---:|---:|---:|---:|---|");
        for w in self.waits.iter().take(MD_WAITS) {
            let during: Vec<String> = w
                .waker_during
                .iter()
                .map(|d| {
                    format!(
                        "{} {} {:.3} s",
                        d.function,
                        if d.off_cpu { "(off CPU)" } else { "(on CPU)" },
                        d.s
                    )
                })
                .collect();
            let _ = writeln!(
                s,
                "| {} (tid {}) | {} | {} | {} (tid {}) | {} | {} | {:.3} | {:.1}% | {:.1} | {} |",
                md(&w.thread),
                w.tid,
                md(&w.function),
                w.kind,
                md(&w.waker),
                w.waker_tid,
                md(&w.waker_function),
                w.waits,
                w.wait_s,
                w.share * 100.0,
                w.max_wait_ms,
                md(&during.join("; "))
            );
        }
        if self.waits.len() > MD_WAITS {
            let _ = writeln!(
                s,
                "\n{} more rows in the JSON report (`waits[]`).",
                self.waits.len() - MD_WAITS
            );
        }
    }

    /// The "GC" section: pauses by generation, and by thread when several collected. Absent
    /// when the selected threads ran no collection.
    fn gc_markdown(&self, s: &mut String) {
        let gc = &self.gc;
        if gc.pauses == 0 {
            return;
        }
        let _ = writeln!(s, "\n## GC\n");
        let procs = self
            .gc
            .by_thread
            .iter()
            .map(|t| t.pid)
            .collect::<std::collections::BTreeSet<_>>()
            .len();
        let _ = writeln!(
            s,
            "{} collections, {:.3} s in total ({:.1}% of the recording{}), longest {:.3} ms.\n",
            gc.pauses,
            gc.total_s,
            gc.share * 100.0,
            if procs > 1 {
                format!(", summed over {procs} processes")
            } else {
                String::new()
            },
            gc.max_ms
        );
        let _ = writeln!(
            s,
            "| generation | pauses | total s | mean ms | max ms | share of recording |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|");
        let row = |s: &mut String, name: &str, g: &GcStats| {
            let _ = writeln!(
                s,
                "| {} | {} | {:.3} | {:.3} | {:.3} | {:.2}% |",
                name,
                g.pauses,
                g.total_s,
                if g.pauses > 0 {
                    g.total_s * 1e3 / g.pauses as f64
                } else {
                    0.0
                },
                g.max_ms,
                g.share * 100.0
            );
        };
        for (k, g) in &gc.by_generation {
            row(s, k, g);
        }
        row(
            s,
            "all",
            &GcStats {
                pauses: gc.pauses,
                collected: gc.collected,
                total_s: gc.total_s,
                max_ms: gc.max_ms,
                share: gc.share,
            },
        );
        if gc.by_thread.len() > 1 {
            let _ = writeln!(
                s,
                "\n| pid | tid | collecting thread | pauses | total s | max ms |"
            );
            let _ = writeln!(s, "|---:|---:|---|---:|---:|---:|");
            for t in &gc.by_thread {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {:.3} | {:.3} |",
                    t.pid,
                    t.tid,
                    md(&t.name),
                    t.pauses,
                    t.total_s,
                    t.max_ms
                );
            }
        }
    }
}

/// The two GIL tables from waits aggregated by (waiter pid, waiter tid, holder tid, holder
/// frame) -> (ns, waits).
fn gil_tables(
    rec: &Recording,
    blame: &HashMap<(ThreadKey, i32, Holder), TimeCount>,
    table: &FunctionTable,
    threads: &BTreeMap<(i32, i32), ThreadAcc>,
) -> (Vec<GilBlockingRow>, Vec<GilPairRow>) {
    // Functions are (name, file), lines merged (the function table's ids).
    // (waiter pid, waiter tid, holder tid, function, file) -> (ns, waits)
    type FnKey<'r> = (i32, i32, i32, &'r str, &'r str);
    let mut by_fn: BTreeMap<FnKey, (u64, u64)> = BTreeMap::new();
    for (&((pid, tid), holder, h), tc) in blame {
        let (function, file) = match h {
            Holder::Free => (GIL_FREE, ""),
            Holder::Releasing => (RELEASING, ""),
            Holder::Unknown => (UNKNOWN_FUNCTION, ""),
            Holder::Function(f) => table.name(f),
        };
        let e = by_fn.entry((pid, tid, holder, function, file)).or_default();
        e.0 += tc.ns;
        e.1 += tc.count;
    }
    let mut names: HashMap<(i32, i32), String> = HashMap::new();
    let mut name = |pid: i32, tid: i32| {
        names
            .entry((pid, tid))
            .or_insert_with(|| thread_name_or_tid(rec, pid, tid))
            .clone()
    };
    let mut rows: Vec<(u64, GilBlockingRow)> = by_fn
        .iter()
        .map(|(&(pid, tid, holder, function, file), &(ns, n))| {
            (
                ns,
                GilBlockingRow {
                    waiter_pid: pid,
                    waiter_tid: tid,
                    waiter_name: rec.thread_name(pid, tid).to_string(),
                    holder_tid: holder,
                    holder_name: name(pid, holder),
                    wait_s: secs(ns),
                    waits: n,
                    holder_function: function.to_string(),
                    holder_file: file.to_string(),
                },
            )
        })
        .collect();
    // by_fn iterates in key order, so a stable sort by time leaves ties in (waiter, holder,
    // function, file) order.
    rows.sort_by(|(a, _), (b, _)| b.cmp(a));

    // (waiter pid, waiter tid, holder tid) -> (ns, waits, its rows, most wait first)
    type PairAcc<'r> = (u64, u64, Vec<(u64, &'r GilBlockingRow)>);
    let mut pairs: BTreeMap<(i32, i32, i32), PairAcc> = BTreeMap::new();
    for (ns, r) in &rows {
        let e = pairs
            .entry((r.waiter_pid, r.waiter_tid, r.holder_tid))
            .or_default();
        e.0 += ns;
        e.1 += r.waits;
        e.2.push((*ns, r));
    }
    let mut pair_rows: Vec<(u64, GilPairRow)> = pairs
        .into_iter()
        .map(|((pid, tid, holder), (ns, n, fns))| {
            let waited = threads.get(&(pid, tid)).map_or(0, |t| t.gil_wait_ns);
            (
                ns,
                GilPairRow {
                    waiter_pid: pid,
                    waiter_tid: tid,
                    waiter_name: rec.thread_name(pid, tid).to_string(),
                    holder_tid: holder,
                    holder_name: name(pid, holder),
                    wait_s: secs(ns),
                    waits: n,
                    share_of_wait: share(ns, waited),
                    holder_top: fns
                        .into_iter()
                        .take(HOLDER_TOP)
                        .map(|(ns, r)| HolderFunction {
                            function: r.holder_function.clone(),
                            file: r.holder_file.clone(),
                            wait_s: secs(ns),
                            waits: r.waits,
                        })
                        .collect(),
                },
            )
        })
        .collect();
    pair_rows.sort_by(|(a, _), (b, _)| b.cmp(a));
    (
        rows.into_iter().map(|(_, r)| r).collect(),
        pair_rows.into_iter().map(|(_, r)| r).collect(),
    )
}

/// Escape text for a Markdown table cell. `<` and `>` too: `<module>` or `<gil free>` would
/// otherwise be taken for HTML tags (and dropped by GitHub's renderer).
pub(super) fn md(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('|', "\\|")
        .replace('<', "\\<")
        .replace('>', "\\>")
        .replace(['\n', '\r'], " ")
}

/// A row per selected thread and function (name, file; lines merged), the largest self time
/// first.
fn function_rows(
    sums: &Sums,
    table: &FunctionTable,
    threads: &BTreeMap<(i32, i32), ThreadAcc>,
) -> Vec<(u64, FunctionRow)> {
    let mut functions: Vec<(u64, FunctionRow)> = sums
        .functions
        .iter()
        .map(|(&((pid, tid), f), a)| {
            let (function, file) = table.name(f);
            let cpu = threads.get(&(pid, tid)).map_or(0, |t| t.cpu_ns);
            (
                a.self_ns,
                FunctionRow {
                    function: function.to_string(),
                    file: file.to_string(),
                    pid,
                    tid,
                    self_s: secs(a.self_ns),
                    total_s: secs(a.total_ns),
                    self_share: share(a.self_ns, cpu),
                    total_share: share(a.total_ns, cpu),
                    self_native_s: secs(a.self_native_ns),
                    self_samples: a.self_samples,
                    total_samples: a.total_samples,
                    calls: None,
                    calls_per_s: None,
                    latency_ms: None,
                    method: None,
                },
            )
        })
        .collect();
    functions.sort_by(|(a_ns, a), (b_ns, b)| {
        b_ns.cmp(a_ns)
            .then(b.total_s.total_cmp(&a.total_s))
            .then((a.pid, a.tid).cmp(&(b.pid, b.tid)))
            .then(a.function.cmp(&b.function))
            .then(a.file.cmp(&b.file))
    });
    functions
}

/// The GC section: all pauses, by generation and by thread (most time first).
fn gc_summary(
    rec: &Recording,
    gc_all: GcAcc,
    gc_gen: BTreeMap<String, GcAcc>,
    gc_thread: BTreeMap<(i32, i32), GcAcc>,
    duration_ns: u64,
) -> GcSummary {
    let mut by_thread: Vec<(u64, GcThreadRow)> = gc_thread
        .into_iter()
        .map(|((pid, tid), a)| {
            let st = a.stats(duration_ns);
            (
                a.total,
                GcThreadRow {
                    pid,
                    tid,
                    name: rec.thread_name(pid, tid).to_string(),
                    pauses: st.pauses,
                    total_s: st.total_s,
                    max_ms: st.max_ms,
                    share: st.share,
                },
            )
        })
        .collect();
    by_thread
        .sort_by(|(a_ns, a), (b_ns, b)| b_ns.cmp(a_ns).then((a.pid, a.tid).cmp(&(b.pid, b.tid))));
    let all = gc_all.stats(duration_ns);
    GcSummary {
        pauses: all.pauses,
        collected: all.collected,
        total_s: all.total_s,
        max_ms: all.max_ms,
        share: all.share,
        by_generation: gc_gen
            .into_iter()
            .map(|(k, a)| (k, a.stats(duration_ns)))
            .collect(),
        by_thread: by_thread.into_iter().map(|(_, r)| r).collect(),
    }
}

/// A row per selected thread (most CPU first), and the totals over them.
fn thread_rows(
    rec: &Recording,
    threads: BTreeMap<(i32, i32), ThreadAcc>,
) -> (Vec<(u64, ThreadRow)>, Totals) {
    let mut totals = Totals::default();
    let (mut cpu, mut native, mut off, mut stolen) = (0u64, 0u64, 0u64, 0u64);
    let (mut gil_held, mut gil_wait, mut gil_switch, mut gc_ns) = (0u64, 0u64, 0u64, 0u64);
    let mut rows: Vec<(u64, ThreadRow)> = threads
        .into_iter()
        .map(|((pid, tid), t)| {
            totals.samples += t.samples;
            cpu += t.cpu_ns;
            native += t.native_ns;
            off += t.off_ns;
            stolen += t.off_stolen_ns;
            gil_held += t.gil_held_ns;
            gil_wait += t.gil_wait_ns;
            gil_switch += t.switch_wait_ns;
            gc_ns += t.gc_ns;
            (
                t.cpu_ns,
                ThreadRow {
                    pid,
                    tid,
                    name: rec.thread_name(pid, tid).to_string(),
                    os_name: rec.os_thread_name(pid, tid).to_string(),
                    cpu_s: secs(t.cpu_ns),
                    samples: t.samples,
                    python_s: secs(t.cpu_ns - t.native_ns),
                    native_s: secs(t.native_ns),
                    offcpu_s: secs(t.off_ns),
                    offcpu_preempted_s: secs(t.off_preempted_ns),
                    offcpu_stolen_s: secs(t.off_stolen_ns),
                    gil_held_share: share(t.gil_held_ns, t.cpu_ns),
                    gc_share: share(t.gc_cpu_ns, t.cpu_ns),
                    gil_held_s: secs(t.gil_held_ns),
                    gil_wait_s: secs(t.gil_wait_ns),
                    gil_waits: t.gil_waits,
                    gil_switch_wait_s: secs(t.switch_wait_ns),
                    gc_s: secs(t.gc_ns),
                    gc_pauses: t.gc_pauses,
                },
            )
        })
        .collect();
    rows.sort_by(|(a_ns, a), (b_ns, b)| b_ns.cmp(a_ns).then((a.pid, a.tid).cmp(&(b.pid, b.tid))));
    totals.cpu_s = secs(cpu);
    totals.python_s = secs(cpu - native);
    totals.native_s = secs(native);
    totals.offcpu_s = secs(off);
    totals.offcpu_stolen_s = secs(stolen);
    totals.gil_held_s = secs(gil_held);
    totals.gil_wait_s = secs(gil_wait);
    totals.gil_switch_wait_s = secs(gil_switch);
    totals.gc_s = secs(gc_ns);
    (rows, totals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md_escapes_cells() {
        assert_eq!(md("a|b\nc"), "a\\|b c");
        assert_eq!(md("<module>"), "\\<module\\>");
    }

    #[test]
    fn shares_without_time_are_zero() {
        assert_eq!(share(0, 0), 0.0);
        assert_eq!(share(1, 4), 0.25);
    }
}
