//! What a recording cost the processes it watched, from the kernel's own figures and the
//! costs enginescope calibrated at start (issue 34): the time the kernel counted in each BPF
//! program (`BPF_ENABLE_STATS`), the probes' debug traps times the calibrated trap cost, the
//! context switches of threads holding watchpoints times the calibrated switch cost, and the
//! GC watchpoint's traps. Read from the recorder's counters, so `report`, `top` and any other
//! view give the same figures.
//!
//! What each part covers, honestly: BPF programs on `sched_switch` run for every task the
//! machine switches, and the sampling program on every CPU's clock tick, so their time is the
//! machine's, an upper bound of the targets' share; traps and watched switches are the
//! targets' own. Work enginescope does in its own threads (reading the targets' memory,
//! draining events) is not in it: that is enginescope's CPU, not the targets'.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One BPF program's time, as the kernel counted it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BpfProgramCost {
    /// The program's name (`on_sample`, `on_switch`, ...).
    pub program: String,
    pub runs: u64,
    /// Total run time, s.
    pub run_s: f64,
    /// Mean per run, µs.
    pub mean_us: f64,
}

/// What the recording cost inside its targets (and, for BPF, the machine).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RecordingCost {
    /// The span the counters cover, s (the whole recording, whatever a view selects).
    pub span_s: f64,
    /// BPF programs with runs, most time first; empty when the kernel did not time them
    /// (`ENGINESCOPE_BPF_STATS=0`, a recording made before enginescope asked it to, or the
    /// memory backend).
    pub bpf: Vec<BpfProgramCost>,
    /// Whether BPF programs were timed at all.
    pub bpf_timed: bool,
    /// Debug traps taken on probe watchpoints, and the calibrated cost of one, ns.
    pub probe_traps: u64,
    pub trap_cost_ns: u64,
    /// Context switches of threads holding probe watchpoints, and what they cost, s.
    pub watched_switches: u64,
    pub watched_switch_s: f64,
    /// The GC watchpoint's traps (stripped interpreters, two per collection), and their time
    /// at the calibrated trap cost, s.
    #[serde(default)]
    pub gc_watchpoint_traps: u64,
    pub gc_watchpoint_s: f64,
    /// GC uprobe hits (interpreters with symbols): an int3 each, not calibrated, so counted
    /// but not costed.
    pub gc_uprobe_hits: u64,
    /// BPF + traps + watched switches + GC watchpoint, s.
    pub total_s: f64,
    /// `total_s` over the span, as a share of one CPU.
    pub share_of_cpu: f64,
}

/// A time in s as a person reads it: ms below a second.
pub fn secs(x: f64) -> String {
    if x >= 1.0 {
        format!("{x:.2} s")
    } else {
        format!("{:.1} ms", x * 1e3)
    }
}

fn get(c: &BTreeMap<String, u64>, k: &str) -> u64 {
    c.get(k).copied().unwrap_or(0)
}

impl RecordingCost {
    /// From a recording's counters over `span_ns`; None when they hold nothing to cost (a
    /// recording whose recorder wrote no counters).
    pub(crate) fn from_counters(c: &BTreeMap<String, u64>, span_ns: u64) -> Option<RecordingCost> {
        if c.is_empty() {
            return None;
        }
        let mut bpf: Vec<BpfProgramCost> = c
            .iter()
            .filter_map(|(k, &ns)| {
                let name = k.strip_prefix("bpf_prog_")?.strip_suffix("_run_ns")?;
                let runs = get(c, &format!("bpf_prog_{name}_runs"));
                (runs > 0).then(|| BpfProgramCost {
                    program: name.to_string(),
                    runs,
                    run_s: ns as f64 / 1e9,
                    mean_us: ns as f64 / runs as f64 / 1e3,
                })
            })
            .collect();
        bpf.sort_by(|a, b| b.run_s.total_cmp(&a.run_s).then(a.program.cmp(&b.program)));
        let bpf_timed = c.contains_key("bpf_prog_run_ns");
        // The kernel side's count of watchpoint hits: every one was a debug trap.
        let probe_traps = get(c, "bpf_probe_hits");
        let trap_cost_ns = get(c, "probe_trap_cost_ns");
        let watched_switch_s = get(c, "probe_watched_switch_ns") as f64 / 1e9;
        // `gc_watchpoint_cost_ns` is the calibrated cost of one trap; `bpf_gc_edges` counts the
        // watchpoint's hits (the uprobe method counts its own).
        let gc_watchpoint_traps = get(c, "bpf_gc_edges");
        let gc_watchpoint_s =
            gc_watchpoint_traps as f64 * get(c, "gc_watchpoint_cost_ns") as f64 / 1e9;
        let bpf_s: f64 = bpf.iter().map(|p| p.run_s).sum();
        let total_s = bpf_s
            + probe_traps as f64 * trap_cost_ns as f64 / 1e9
            + watched_switch_s
            + gc_watchpoint_s;
        let span_s = span_ns as f64 / 1e9;
        Some(RecordingCost {
            span_s,
            bpf,
            bpf_timed,
            probe_traps,
            trap_cost_ns,
            watched_switches: get(c, "probe_watched_switches"),
            watched_switch_s,
            gc_watchpoint_traps,
            gc_watchpoint_s,
            gc_uprobe_hits: get(c, "bpf_gc_uprobe_hits"),
            total_s,
            share_of_cpu: if span_s > 0.0 { total_s / span_s } else { 0.0 },
        })
    }

    /// Debug traps on probe watchpoints, s.
    pub(crate) fn probe_trap_s(&self) -> f64 {
        self.probe_traps as f64 * self.trap_cost_ns as f64 / 1e9
    }

    /// One line: the total, its share of a CPU, and its largest parts.
    pub fn headline(&self) -> String {
        let mut parts: Vec<(f64, String)> = Vec::new();
        let bpf_s: f64 = self.bpf.iter().map(|p| p.run_s).sum();
        if self.bpf_timed {
            parts.push((bpf_s, format!("BPF {}", secs(bpf_s))));
        }
        if self.probe_traps > 0 {
            parts.push((
                self.probe_trap_s(),
                format!("probe traps {}", secs(self.probe_trap_s())),
            ));
        }
        if self.watched_switches > 0 {
            parts.push((
                self.watched_switch_s,
                format!("watched switches {}", secs(self.watched_switch_s)),
            ));
        }
        if self.gc_watchpoint_s > 0.0 {
            parts.push((
                self.gc_watchpoint_s,
                format!("GC watchpoint {}", secs(self.gc_watchpoint_s)),
            ));
        }
        parts.sort_by(|a, b| b.0.total_cmp(&a.0));
        let list: Vec<String> = parts.into_iter().map(|(_, s)| s).collect();
        format!(
            "{} of CPU in {:.1} s ({:.2}% of one CPU){}{}",
            secs(self.total_s),
            self.span_s,
            self.share_of_cpu * 100.0,
            if list.is_empty() {
                String::new()
            } else {
                format!(": {}", list.join(", "))
            },
            if self.bpf_timed {
                ""
            } else {
                " (BPF programs not timed)"
            }
        )
    }

    /// The Markdown section.
    pub fn markdown(&self, s: &mut String) {
        use std::fmt::Write;
        let pct = |x: f64| {
            if self.span_s > 0.0 {
                format!("{:.3}%", x / self.span_s * 100.0)
            } else {
                "-".into()
            }
        };
        let _ = writeln!(s, "\n## What recording cost\n");
        let _ = writeln!(
            s,
            "By the kernel's own figures and the costs calibrated at start, over the whole recording \
             ({:.1} s, whatever the selection): **{}**. BPF programs on `sched_switch` and the \
             sampling clock run for every task and CPU of the machine, so their time is an upper \
             bound of the targets' share; traps and watched switches are the targets' own. \
             enginescope's own threads (memory reads, draining) are not in it.\n",
            self.span_s,
            self.headline()
        );
        let _ = writeln!(s, "| where | count | each µs | total ms | % of one CPU |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|");
        for p in &self.bpf {
            let _ = writeln!(
                s,
                "| BPF `{}` (kernel's run time) | {} | {:.2} | {:.1} | {} |",
                p.program,
                p.runs,
                p.mean_us,
                p.run_s * 1e3,
                pct(p.run_s)
            );
        }
        if !self.bpf_timed {
            let _ = writeln!(
                s,
                "| BPF programs | not timed (memory backend, `ENGINESCOPE_BPF_STATS=0` or an older recording) | | | |"
            );
        }
        if self.probe_traps > 0 || self.trap_cost_ns > 0 {
            let _ = writeln!(
                s,
                "| debug traps on probe watchpoints (calibrated cost) | {} | {:.2} | {:.1} | {} |",
                self.probe_traps,
                self.trap_cost_ns as f64 / 1e3,
                self.probe_trap_s() * 1e3,
                pct(self.probe_trap_s())
            );
        }
        if self.watched_switches > 0 {
            let _ = writeln!(
                s,
                "| context switches holding watchpoints (calibrated cost) | {} | {:.2} | {:.1} | {} |",
                self.watched_switches,
                self.watched_switch_s * 1e6 / self.watched_switches as f64,
                self.watched_switch_s * 1e3,
                pct(self.watched_switch_s)
            );
        }
        if self.gc_watchpoint_s > 0.0 {
            let _ = writeln!(
                s,
                "| GC watchpoint traps (calibrated cost) | {} | {:.2} | {:.1} | {} |",
                self.gc_watchpoint_traps,
                self.gc_watchpoint_s * 1e6 / self.gc_watchpoint_traps.max(1) as f64,
                self.gc_watchpoint_s * 1e3,
                pct(self.gc_watchpoint_s)
            );
        }
        if self.gc_uprobe_hits > 0 {
            let _ = writeln!(
                s,
                "| GC uprobes (int3; not calibrated, not in the total) | {} | | | |",
                self.gc_uprobe_hits
            );
        }
        let _ = writeln!(
            s,
            "| **total** | | | {:.1} | {} |",
            self.total_s * 1e3,
            pct(self.total_s)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(kv: &[(&str, u64)]) -> BTreeMap<String, u64> {
        kv.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn adds_up_the_kernels_figures_and_the_calibrated_costs() {
        let c = counters(&[
            ("bpf_prog_on_sample_run_ns", 30_000_000),
            ("bpf_prog_on_sample_runs", 5_000),
            ("bpf_prog_on_switch_run_ns", 50_000_000),
            ("bpf_prog_on_switch_runs", 40_000),
            ("bpf_prog_on_probe_hit_run_ns", 0),
            ("bpf_prog_on_probe_hit_runs", 0),
            ("bpf_prog_run_ns", 80_000_000),
            ("bpf_prog_runs", 45_000),
            ("bpf_probe_hits", 2_000),
            ("probe_trap_cost_ns", 10_000),
            ("probe_watched_switches", 1_000),
            ("probe_watched_switch_ns", 2_000_000),
            ("gc_watchpoint_cost_ns", 10_000),
            ("bpf_gc_edges", 100),
            ("bpf_gc_uprobe_hits", 7),
        ]);
        let k = RecordingCost::from_counters(&c, 10_000_000_000).unwrap();
        // Programs without runs are left out; the dearest first.
        let names: Vec<&str> = k.bpf.iter().map(|p| p.program.as_str()).collect();
        assert_eq!(names, ["on_switch", "on_sample"]);
        assert!((k.bpf[0].mean_us - 1.25).abs() < 1e-9);
        // 0.08 s BPF + 2,000 × 10 µs + 2 ms + 1 ms = 0.103 s in 10 s: 1.03% of one CPU.
        assert!((k.total_s - 0.103).abs() < 1e-9, "{}", k.total_s);
        assert!((k.share_of_cpu - 0.0103).abs() < 1e-9);
        assert!(k.bpf_timed);
        assert_eq!(k.gc_uprobe_hits, 7);
        let mut md = String::new();
        k.markdown(&mut md);
        assert!(
            md.contains("| BPF `on_switch` (kernel's run time) | 40000 | 1.25 | 50.0 | 0.500% |"),
            "{md}"
        );
        assert!(md.contains("| **total** | | | 103.0 | 1.030% |"), "{md}");
        assert!(
            k.headline().starts_with(
                "103.0 ms of CPU in 10.0 s (1.03% of one CPU): BPF 80.0 ms, probe traps 20.0 ms"
            ),
            "{}",
            k.headline()
        );
    }

    #[test]
    fn says_when_bpf_was_not_timed() {
        let c = counters(&[("bpf_samples", 10), ("bpf_probe_hits", 0)]);
        let k = RecordingCost::from_counters(&c, 1_000_000_000).unwrap();
        assert!(!k.bpf_timed);
        assert_eq!(k.total_s, 0.0);
        assert!(
            k.headline().ends_with("(BPF programs not timed)"),
            "{}",
            k.headline()
        );
        assert!(RecordingCost::from_counters(&BTreeMap::new(), 1).is_none());
    }
}
