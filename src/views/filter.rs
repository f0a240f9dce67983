//! Which threads a view shows: `--pid`, `--tid`, `--thread-name`, shared by every view.

use std::collections::BTreeSet;

use crate::record::{GcPause, GilWait, OffCpu, Recording, Sample};

/// The selection flags every view command takes.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct FilterArgs {
    /// Only this process.
    #[arg(long)]
    pub pid: Option<i32>,
    /// Only this thread (host thread id).
    #[arg(long)]
    pub tid: Option<i32>,
    /// Only threads whose name matches this regular expression (a plain substring works; an
    /// invalid expression is taken as a literal substring). A thread matches if any name it had
    /// during the recording matches.
    #[arg(long, value_name = "REGEX")]
    pub thread_name: Option<String>,
    /// Only the part of the recording from this many seconds after its start (e.g. the
    /// benchmark's window): every event, interval and metric outside is dropped or clipped.
    #[arg(long, value_name = "SECONDS")]
    pub from: Option<f64>,
    /// Only the part of the recording up to this many seconds after its start.
    #[arg(long, value_name = "SECONDS")]
    pub to: Option<f64>,
    /// Only the last SECONDS of the recording.
    #[arg(long, value_name = "SECONDS", conflicts_with_all = ["from", "to"])]
    pub last: Option<f64>,
    /// Hide native (C/C++) and kernel frames of recordings made with `--native` or
    /// `--kernel-stacks`: Python frames only, native time as `[native]` leaves.
    #[arg(long)]
    pub no_native: bool,
}

impl FilterArgs {
    /// The time range asked for, ns since the recording's start; `None` for all of it.
    pub(crate) fn time_range(&self, duration_ns: u64) -> anyhow::Result<Option<(u64, u64)>> {
        let ns = |s: f64| (s.max(0.0) * 1e9) as u64;
        let (from, to) = match (self.last, self.from, self.to) {
            (Some(l), _, _) => (duration_ns.saturating_sub(ns(l)), duration_ns),
            (None, None, None) => return Ok(None),
            (None, f, t) => (f.map(ns).unwrap_or(0), t.map(ns).unwrap_or(duration_ns)),
        };
        anyhow::ensure!(
            from < to,
            "empty time range: --from {:.3} s is not before --to {:.3} s",
            from as f64 / 1e9,
            to as f64 / 1e9
        );
        Ok(Some((from, to.min(duration_ns.max(from + 1)))))
    }
}

#[derive(Debug, Clone)]
enum NameMatch {
    Regex(regex::Regex),
    Literal(String),
}

impl NameMatch {
    fn is_match(&self, name: &str) -> bool {
        match self {
            NameMatch::Regex(r) => r.is_match(name),
            NameMatch::Literal(s) => name.contains(s.as_str()),
        }
    }
}

/// A thread filter; every criterion given must hold.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pid: Option<i32>,
    tid: Option<i32>,
    name: Option<NameMatch>,
    name_src: Option<String>,
}

impl Filter {
    /// Everything.
    pub fn all() -> Self {
        Filter::default()
    }

    pub fn new(args: &FilterArgs) -> Self {
        let name = args
            .thread_name
            .as_ref()
            .map(|s| match regex::Regex::new(s) {
                Ok(r) => NameMatch::Regex(r),
                Err(_) => NameMatch::Literal(s.clone()),
            });
        Filter {
            pid: args.pid,
            tid: args.tid,
            name,
            name_src: args.thread_name.clone(),
        }
    }

    pub(crate) fn is_all(&self) -> bool {
        self.pid.is_none() && self.tid.is_none() && self.name.is_none()
    }

    /// `pid 12, thread name ~ "Main"`; `all threads` when nothing is filtered.
    pub(crate) fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(p) = self.pid {
            parts.push(format!("pid {p}"));
        }
        if let Some(t) = self.tid {
            parts.push(format!("tid {t}"));
        }
        if let Some(n) = &self.name_src {
            parts.push(format!("thread name ~ {n:?}"));
        }
        if parts.is_empty() {
            "all threads".into()
        } else {
            parts.join(", ")
        }
    }

    /// The threads of `rec` this filter keeps. Threads are those announced in thread records
    /// plus any that only appear in samples, off-CPU intervals, GIL waits (as the waiter) or GC
    /// pauses (a cut file may lack their thread records).
    pub fn select(&self, rec: &Recording) -> Selection {
        let mut all: BTreeSet<(i32, i32)> = rec.threads.iter().map(|t| (t.pid, t.tid)).collect();
        all.extend(rec.samples.iter().map(|s| (s.pid, s.tid)));
        all.extend(rec.offcpu.iter().map(|o| (o.pid, o.tid)));
        all.extend(rec.gil_waits.iter().map(|g| (g.pid, g.tid)));
        all.extend(rec.gc_pauses.iter().map(|g| (g.pid, g.tid)));
        let threads = all
            .iter()
            .copied()
            .filter(|&(pid, tid)| {
                self.pid.is_none_or(|p| p == pid)
                    && self.tid.is_none_or(|t| t == tid)
                    && self.name.as_ref().is_none_or(|m| {
                        let mut names = rec
                            .threads
                            .iter()
                            .filter(|t| t.pid == pid && t.tid == tid)
                            .map(|t| t.name.as_str())
                            .peekable();
                        if names.peek().is_none() {
                            m.is_match("")
                        } else {
                            names.any(|n| m.is_match(n))
                        }
                    })
            })
            .collect();
        Selection {
            threads,
            all_threads: all.len(),
            description: self.describe(),
            filtered: !self.is_all(),
            during: None,
        }
    }
}

/// The threads chosen from one recording.
#[derive(Debug, Clone)]
pub struct Selection {
    threads: BTreeSet<(i32, i32)>,
    all_threads: usize,
    description: String,
    filtered: bool,
    /// Only events in `[from, to)` ns since start ([`Selection::during`]).
    during: Option<(u64, u64)>,
}

impl Selection {
    /// Every thread of `rec`.
    pub fn all(rec: &Recording) -> Self {
        Filter::all().select(rec)
    }

    /// Exactly these threads (a live view's, known without a scan of the recording).
    pub(crate) fn of_threads(
        threads: impl IntoIterator<Item = (i32, i32)>,
        description: &str,
    ) -> Self {
        let threads: BTreeSet<(i32, i32)> = threads.into_iter().collect();
        Selection {
            all_threads: threads.len(),
            threads,
            description: description.to_string(),
            filtered: true,
            during: None,
        }
    }

    pub fn contains(&self, pid: i32, tid: i32) -> bool {
        self.threads.contains(&(pid, tid))
    }

    /// The same threads, their samples taken in `[from_ns, to_ns)` only and their off-CPU
    /// intervals and GIL waits where they overlap it (a live view's sliding window, without
    /// a trimmed copy of the recording).
    pub fn during(mut self, from_ns: u64, to_ns: u64) -> Self {
        self.during = Some((from_ns, to_ns));
        self
    }

    fn at(&self, t_ns: u64) -> bool {
        self.during.is_none_or(|(a, b)| t_ns >= a && t_ns < b)
    }

    /// The part of `[start_ns, start_ns + dur_ns)` inside the time range, ns (all of it
    /// without one).
    pub fn clip(&self, start_ns: u64, dur_ns: u64) -> u64 {
        let (s, e) = self.clip_span(start_ns, dur_ns);
        e - s
    }

    /// The part of `[start_ns, start_ns + dur_ns)` inside the time range, as `(start, end)`
    /// (all of it without one; empty, `start == end`, where none of it is).
    pub(crate) fn clip_span(&self, start_ns: u64, dur_ns: u64) -> (u64, u64) {
        let end = start_ns.saturating_add(dur_ns);
        match self.during {
            None => (start_ns, end),
            Some((a, b)) => {
                let s = start_ns.max(a);
                (s, end.min(b).max(s))
            }
        }
    }

    fn overlaps(&self, start_ns: u64, dur_ns: u64) -> bool {
        self.during
            .is_none_or(|(a, b)| start_ns < b && start_ns.saturating_add(dur_ns) > a)
    }

    /// Selected `(pid, tid)` pairs, sorted.
    pub fn threads(&self) -> impl Iterator<Item = (i32, i32)> + '_ {
        self.threads.iter().copied()
    }

    /// Selected processes, sorted.
    pub fn pids(&self) -> Vec<i32> {
        let mut v: Vec<i32> = self.threads.iter().map(|&(p, _)| p).collect();
        v.dedup();
        v
    }

    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// True when a filter was given (not "all threads").
    pub(crate) fn is_filtered(&self) -> bool {
        self.filtered
    }

    /// What the filter was, for titles and reports.
    pub(crate) fn description(&self) -> &str {
        &self.description
    }

    /// Fail with the list of threads when a filter matched nothing.
    pub(crate) fn ensure_nonempty(&self, rec: &Recording) -> anyhow::Result<()> {
        if !self.threads.is_empty() || self.all_threads == 0 {
            return Ok(());
        }
        let mut known: Vec<String> = Filter::all()
            .select(rec)
            .threads()
            .map(|(pid, tid)| format!("pid {pid} tid {tid} {:?}", rec.thread_name(pid, tid)))
            .collect();
        if known.len() > 20 {
            let more = known.len() - 20;
            known.truncate(20);
            known.push(format!("... and {more} more"));
        }
        anyhow::bail!(
            "no thread matches {}; the recording has: {}",
            self.description,
            known.join("; ")
        )
    }

    /// On-CPU samples of the selected threads, in file order.
    pub fn samples<'a>(&'a self, rec: &'a Recording) -> impl Iterator<Item = &'a Sample> + 'a {
        rec.samples
            .iter()
            .filter(move |s| self.contains(s.pid, s.tid) && self.at(s.t_ns))
    }

    /// Off-CPU intervals of the selected threads, in file order.
    pub fn offcpu<'a>(&'a self, rec: &'a Recording) -> impl Iterator<Item = &'a OffCpu> + 'a {
        rec.offcpu
            .iter()
            .filter(move |o| self.contains(o.pid, o.tid) && self.overlaps(o.start_ns, o.dur_ns))
    }

    /// GIL waits whose *waiting* thread is selected (the holder need not be), in file order.
    pub fn gil_waits<'a>(&'a self, rec: &'a Recording) -> impl Iterator<Item = &'a GilWait> + 'a {
        rec.gil_waits
            .iter()
            .filter(move |g| self.contains(g.pid, g.tid) && self.overlaps(g.start_ns, g.dur_ns))
    }

    /// Probed calls made by a selected thread, in file order.
    pub fn calls<'a>(
        &'a self,
        rec: &'a Recording,
    ) -> impl Iterator<Item = &'a crate::record::FunctionCall> + 'a {
        rec.calls
            .iter()
            .filter(move |c| self.contains(c.pid, c.tid))
    }

    /// GC pauses run by a selected thread, in file order.
    pub fn gc_pauses<'a>(&'a self, rec: &'a Recording) -> impl Iterator<Item = &'a GcPause> + 'a {
        rec.gc_pauses
            .iter()
            .filter(move |g| self.contains(g.pid, g.tid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::ThreadInfo;

    fn rec() -> Recording {
        let mut r = Recording::default();
        for (pid, tid, name) in [
            (1, 1, "MainThread"),
            (1, 2, "worker-0"),
            (1, 2, "renamed"),
            (5, 6, "MainThread"),
            (5, 7, "q(x"),
        ] {
            r.threads.push(ThreadInfo {
                pid,
                tid,
                name: name.into(),
                t_ns: 0,
                python_name: None,
            });
        }
        r.samples.push(Sample {
            t_ns: 0,
            pid: 9,
            tid: 10,
            stack: 0,
            flags: 0,
            weight_ns: 1,
        });
        r
    }

    fn sel(pid: Option<i32>, tid: Option<i32>, name: Option<&str>) -> Vec<(i32, i32)> {
        Filter::new(&FilterArgs {
            pid,
            tid,
            thread_name: name.map(String::from),
            ..Default::default()
        })
        .select(&rec())
        .threads()
        .collect()
    }

    #[test]
    fn selections() {
        assert_eq!(
            sel(None, None, None),
            [(1, 1), (1, 2), (5, 6), (5, 7), (9, 10)]
        );
        assert_eq!(sel(Some(1), None, None), [(1, 1), (1, 2)]);
        assert_eq!(sel(None, Some(6), None), [(5, 6)]);
        assert_eq!(sel(Some(1), Some(6), None), []);
        assert_eq!(sel(None, None, Some("Main")), [(1, 1), (5, 6)]);
        assert_eq!(sel(Some(5), None, Some("^Main")), [(5, 6)]);
        // Any name the thread had matches, old or new.
        assert_eq!(sel(None, None, Some("worker")), [(1, 2)]);
        assert_eq!(sel(None, None, Some("renamed")), [(1, 2)]);
        // Invalid regex: literal substring.
        assert_eq!(sel(None, None, Some("worker-0(")), []);
        assert_eq!(sel(None, None, Some("q(")), [(5, 7)]);
        assert_eq!(sel(None, None, Some("^worker-\\d$")), [(1, 2)]);
    }

    #[test]
    fn empty_selection_lists_threads() {
        let r = rec();
        let s = Filter::new(&FilterArgs {
            pid: Some(42),
            ..Default::default()
        })
        .select(&r);
        let e = s.ensure_nonempty(&r).unwrap_err().to_string();
        assert!(e.contains("pid 42"), "{e}");
        assert!(e.contains("tid 2 \"renamed\""), "{e}");
        assert!(Selection::all(&r).ensure_nonempty(&r).is_ok());
        assert!(Selection::all(&Recording::default())
            .ensure_nonempty(&Recording::default())
            .is_ok());
    }
}
