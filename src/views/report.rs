//! The report: per-thread CPU split and per-thread function tables, as versioned JSON
//! (docs/report-schema.md) or Markdown.
//!
//! All times come from integer nanoseconds summed first and divided once, so round inputs
//! give round outputs (300 samples of 1 ms -> `0.3`).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use serde::{Deserialize, Serialize};

use super::{format_utc, process_name, secs, Selection};
use crate::record::{flags, Recording};

/// Schema identifier. Additive changes (new fields) keep `/1`; renaming, removing or changing
/// the meaning or unit of a field bumps it.
pub const SCHEMA: &str = "enginescope.report/1";

/// Functions per thread in the Markdown rendering.
pub const MD_TOP_FUNCTIONS: usize = 15;

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
    pub processes: Vec<ProcessRow>,
    pub totals: Totals,
    /// Selected threads, most on-CPU time first.
    pub threads: Vec<ThreadRow>,
    /// (thread, function) rows, most self time first.
    pub functions: Vec<FunctionRow>,
    /// Recorder health counters, copied from the recording.
    pub counters: BTreeMap<String, u64>,
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
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ThreadRow {
    pub pid: i32,
    pub tid: i32,
    pub name: String,
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
    /// Share of on-CPU time holding the GIL, 0..1.
    pub gil_held_share: f64,
    /// Share of on-CPU time during a garbage collection, 0..1.
    pub gc_share: f64,
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
}

#[derive(Default)]
struct ThreadAcc {
    samples: u64,
    cpu: u64,
    native: u64,
    gil: u64,
    gc: u64,
    off: u64,
    off_preempted: u64,
}

#[derive(Default, Clone, Copy)]
struct FnAcc {
    self_ns: u64,
    self_native_ns: u64,
    total_ns: u64,
    self_samples: u64,
    total_samples: u64,
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

impl Report {
    pub fn build(rec: &Recording, sel: &Selection) -> Report {
        let mut threads: BTreeMap<(i32, i32), ThreadAcc> =
            sel.threads().map(|k| (k, ThreadAcc::default())).collect();
        // (pid, tid, stack, native) -> (samples, ns): one pass over samples, then per stack.
        let mut by_stack: HashMap<(i32, i32, u32, bool), (u64, u64)> = HashMap::new();
        for s in sel.samples(rec) {
            let w = u64::from(s.weight_ns);
            let t = threads.entry((s.pid, s.tid)).or_default();
            t.samples += 1;
            t.cpu += w;
            if s.flags & flags::NATIVE != 0 {
                t.native += w;
            }
            if s.flags & flags::GIL != 0 {
                t.gil += w;
            }
            if s.flags & flags::GC != 0 {
                t.gc += w;
            }
            let e = by_stack
                .entry((s.pid, s.tid, s.stack, s.flags & flags::NATIVE != 0))
                .or_default();
            e.0 += 1;
            e.1 += w;
        }
        for o in sel.offcpu(rec) {
            let t = threads.entry((o.pid, o.tid)).or_default();
            t.off += o.dur_ns;
            if o.preempted {
                t.off_preempted += o.dur_ns;
            }
        }

        // Functions are (name, file); lines are merged.
        let mut fn_keys: HashMap<(&str, &str), usize> = HashMap::new();
        let mut fn_names: Vec<(&str, &str)> = Vec::new();
        let frame_fn: Vec<usize> = rec
            .frames
            .iter()
            .map(|f| {
                let k = (f.function.as_str(), f.file.as_str());
                *fn_keys.entry(k).or_insert_with(|| {
                    fn_names.push(k);
                    fn_names.len() - 1
                })
            })
            .collect();
        // Per stack: innermost function and the distinct functions on it.
        let mut stack_fns: HashMap<u32, (Option<usize>, Vec<usize>)> = HashMap::new();
        let mut fns: HashMap<(i32, i32, usize), FnAcc> = HashMap::new();
        for (&(pid, tid, stack, native), &(n, ns)) in &by_stack {
            let (inner, distinct) = stack_fns.entry(stack).or_insert_with(|| {
                let ids: Vec<usize> = rec
                    .stacks
                    .get(stack as usize)
                    .into_iter()
                    .flatten()
                    .filter_map(|&f| frame_fn.get(f as usize).copied())
                    .collect();
                let mut distinct = ids.clone();
                distinct.sort_unstable();
                distinct.dedup();
                (ids.first().copied(), distinct)
            });
            if let Some(i) = *inner {
                let a = fns.entry((pid, tid, i)).or_default();
                a.self_ns += ns;
                a.self_samples += n;
                if native {
                    a.self_native_ns += ns;
                }
            }
            for &f in distinct.iter() {
                let a = fns.entry((pid, tid, f)).or_default();
                a.total_ns += ns;
                a.total_samples += n;
            }
        }
        let mut functions: Vec<(u64, FunctionRow)> = fns
            .into_iter()
            .map(|((pid, tid, f), a)| {
                let (function, file) = fn_names[f];
                let cpu = threads.get(&(pid, tid)).map_or(0, |t| t.cpu);
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

        let mut totals = Totals::default();
        let (mut cpu, mut native, mut off) = (0u64, 0u64, 0u64);
        let mut rows: Vec<(u64, ThreadRow)> = threads
            .into_iter()
            .map(|((pid, tid), t)| {
                totals.samples += t.samples;
                cpu += t.cpu;
                native += t.native;
                off += t.off;
                (
                    t.cpu,
                    ThreadRow {
                        pid,
                        tid,
                        name: rec.thread_name(pid, tid).to_string(),
                        cpu_s: secs(t.cpu),
                        samples: t.samples,
                        python_s: secs(t.cpu - t.native),
                        native_s: secs(t.native),
                        offcpu_s: secs(t.off),
                        offcpu_preempted_s: secs(t.off_preempted),
                        gil_held_share: share(t.gil, t.cpu),
                        gc_share: share(t.gc, t.cpu),
                    },
                )
            })
            .collect();
        rows.sort_by(|(a_ns, a), (b_ns, b)| {
            b_ns.cmp(a_ns).then((a.pid, a.tid).cmp(&(b.pid, b.tid)))
        });
        totals.cpu_s = secs(cpu);
        totals.python_s = secs(cpu - native);
        totals.native_s = secs(native);
        totals.offcpu_s = secs(off);

        let m = &rec.meta;
        Report {
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
            functions: functions.into_iter().map(|(_, f)| f).collect(),
            counters: rec.counters.clone(),
        }
    }

    /// The same content as Markdown: a thread table, then the top functions of each thread.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
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
        let _ = writeln!(s, "- **Selection:** {}", md(&self.selection));
        let _ = writeln!(
            s,
            "- **Totals:** {} samples, {:.3} s on CPU ({:.3} s Python, {:.3} s native), {:.3} s off CPU",
            self.totals.samples,
            self.totals.cpu_s,
            self.totals.python_s,
            self.totals.native_s,
            self.totals.offcpu_s
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
        }

        let _ = writeln!(s, "\n## Threads\n");
        let _ = writeln!(
            s,
            "| pid | tid | thread | CPU s | samples | Python s | native s | off-CPU s | GIL held | GC |"
        );
        let _ = writeln!(s, "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|");
        for t in &self.threads {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.3} | {} | {:.3} | {:.3} | {:.3} | {:.1}% | {:.1}% |",
                t.pid,
                t.tid,
                md(&t.name),
                t.cpu_s,
                t.samples,
                t.python_s,
                t.native_s,
                t.offcpu_s,
                t.gil_held_share * 100.0,
                t.gc_share * 100.0
            );
        }

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

        if !self.counters.is_empty() {
            let _ = writeln!(s, "\n## Recorder counters\n");
            let _ = writeln!(s, "| counter | value |");
            let _ = writeln!(s, "|---|---:|");
            for (k, v) in &self.counters {
                let _ = writeln!(s, "| {} | {v} |", md(k));
            }
        }
        s
    }
}

/// Escape text for a Markdown table cell.
fn md(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('|', "\\|")
        .replace(['\n', '\r'], " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md_escapes_cells() {
        assert_eq!(md("a|b\nc"), "a\\|b c");
    }

    #[test]
    fn shares_without_time_are_zero() {
        assert_eq!(share(0, 0), 0.0);
        assert_eq!(share(1, 4), 0.25);
    }
}
