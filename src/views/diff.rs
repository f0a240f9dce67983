//! `enginescope diff A.esrec B.esrec`: what changed from recording A to recording B, and
//! whether each change is larger than the recordings' own run-to-run noise.
//!
//! Threads are matched by process (its role, e.g. `EngineCore`, else its executable) and
//! thread name, never by pid or tid, so two runs of the same deployment line up; threads with
//! the same process and name are added together. Functions are matched by qualified name and
//! file, the file taken from `site-packages/` (or `dist-packages/`) on so that two
//! virtualenvs match. Probes by process and probe spec, engines by id.
//!
//! Figures are normalised by each recording's own length (CPU % of one CPU, calls/s, tok/s),
//! so recordings of different lengths compare. Noise: every figure is also computed over each
//! recording's first and second half; the half-to-half difference is that run's own
//! variation. A change is **beyond noise** only when it is larger than both A's and B's.
//!
//! The differential flamegraph (inferno's differential folding) draws B's on-CPU stacks,
//! widths in µs of CPU per second of recording, coloured by the change from A: red grew, blue
//! shrank. Stacks only A has do not show (they have no width in B).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::folded::clean;
use super::latency::nearest_rank;
use super::report::md;
use super::windows::extent_ns;
use super::{flag_leaves, format_utc, frame_label, process_name, short_file, ReportFormat};
use super::{PARTIAL_FRAME, SHAPE_FLAGS};
use crate::metrics::{names, Family, MetricIndex};
use crate::record::{flags, Frame, Recording};

/// Schema of the JSON diff. Additive changes keep `/1`.
pub(crate) const SCHEMA: &str = "enginescope.diff/1";

/// `enginescope diff` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct DiffArgs {
    /// Baseline recording (.esrec).
    pub a: PathBuf,
    /// Recording compared with the baseline (.esrec).
    pub b: PathBuf,
    #[arg(long, short, value_enum, default_value = "md")]
    pub format: ReportFormat,
    /// Output file; stdout when absent.
    #[arg(long, short)]
    pub output: Option<PathBuf>,
    /// Also write a differential flamegraph SVG (B's stacks; red grew, blue shrank).
    #[arg(long, value_name = "SVG")]
    pub flame: Option<PathBuf>,
    /// Functions listed, largest change first.
    #[arg(long, default_value_t = 20)]
    pub top: usize,
    /// Hide native (C/C++) and kernel frames (recordings made with `--native`).
    #[arg(long)]
    pub no_native: bool,
}

/// One figure in A and B: whole-recording values, the change, and each run's own variation.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Figure {
    /// Null where the recording has no such figure (no calls, no scrapes).
    pub a: Option<f64>,
    pub b: Option<f64>,
    /// `b - a`.
    pub delta: Option<f64>,
    /// `|first half - second half|` within A, and within B.
    pub noise_a: Option<f64>,
    pub noise_b: Option<f64>,
    /// `|delta|` is larger than both `noise_a` and `noise_b` (and, for a probe estimated
    /// from part of a recording, the two 95% intervals do not overlap).
    pub beyond_noise: bool,
    /// A probe's figure estimated from part of its recording (watched in phases): its 95%
    /// interval in A and in B (`report`'s `function_latency[].uncertainty`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ci_a: Option<[f64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ci_b: Option<[f64; 2]>,
}

/// A figure over a whole recording and its two halves.
type Thirds = [Option<f64>; 3];

impl Figure {
    fn new(a: Thirds, b: Thirds) -> Figure {
        let noise = |t: Thirds| Some((t[1]? - t[2]?).abs());
        let delta = a[0].zip(b[0]).map(|(a, b)| b - a);
        let (noise_a, noise_b) = (noise(a), noise(b));
        Figure {
            a: a[0],
            b: b[0],
            delta,
            noise_a,
            noise_b,
            beyond_noise: match (delta, noise_a, noise_b) {
                (Some(d), Some(na), Some(nb)) => d.abs() > na && d.abs() > nb,
                _ => false,
            },
            ci_a: None,
            ci_b: None,
        }
    }

    fn abs_delta(&self) -> f64 {
        self.delta.map_or(0.0, f64::abs)
    }

    /// With the 95% intervals of an estimated figure (either side may have none: its point
    /// then stands for itself): a change is not real when the two overlap.
    fn with_intervals(mut self, ci_a: Option<[f64; 2]>, ci_b: Option<[f64; 2]>) -> Figure {
        let span = |ci: Option<[f64; 2]>, v: Option<f64>| ci.or(v.map(|v| [v, v]));
        if let (Some(a), Some(b)) = (span(ci_a, self.a), span(ci_b, self.b)) {
            if (ci_a.is_some() || ci_b.is_some()) && a[0] <= b[1] && b[0] <= a[1] {
                self.beyond_noise = false;
            }
        }
        self.ci_a = ci_a;
        self.ci_b = ci_b;
        self
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Side {
    pub file: String,
    pub start_utc: String,
    pub duration_s: f64,
    pub hostname: String,
    pub command: String,
    pub samples: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ThreadDelta {
    /// Process role (or executable name).
    pub process: String,
    /// Thread name (empty when unknown).
    pub thread: String,
    /// Threads with this process and name in A and in B.
    pub threads_a: usize,
    pub threads_b: usize,
    /// On-CPU time over the recording's length, % of one CPU.
    pub cpu_pct: Figure,
    /// GIL wait (not switch waits) over the recording's length, %.
    pub gil_wait_pct: Figure,
    /// Garbage collection run over the recording's length, %.
    pub gc_pct: Figure,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FunctionDelta {
    pub function: String,
    /// From `site-packages/` on where the path has it.
    pub file: String,
    /// Self (innermost) and total (anywhere on the stack) on-CPU time, % of all on-CPU time.
    pub self_pct: Figure,
    pub total_pct: Figure,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ProbeDelta {
    pub process: String,
    /// The probe spec (or the function where the spec is unknown).
    pub probe: String,
    /// Per-call latency, ms (nearest-rank over all calls of the probe's threads).
    pub p50_ms: Figure,
    pub p90_ms: Figure,
    pub calls_per_s: Figure,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EngineDelta {
    pub engine: String,
    pub gen_tok_s: Figure,
    /// KV-cache usage, 0..1.
    pub kv_usage: Figure,
    pub ttft_p50_ms: Figure,
    pub itl_p50_ms: Figure,
    /// Mean time per output token per request (`_sum` over `_count`: exact, where a
    /// quantile is only as fine as vLLM's 10 ms-wide first bucket).
    #[serde(default)]
    pub tpot_mean_ms: Figure,
}

/// A finding ([`super::findings`]) in A, B or both, matched by kind, process (role or
/// executable), thread name and function (not for GIL contention and GC pressure, which are
/// the waiting thread's and the process's whatever function was running).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FindingDelta {
    pub kind: String,
    pub process: String,
    pub thread: String,
    pub function: String,
    /// `appeared` (in B only), `vanished` (in A only), `changed` (in both, its score moved
    /// beyond noise) or `unchanged`.
    pub status: String,
    /// Its score, % (of the affected thread's or process's time); 0 in a recording or half
    /// where it did not pass its thresholds.
    pub score_pct: Figure,
    /// Its verdict in A and in B (empty where absent).
    pub verdict_a: String,
    pub verdict_b: String,
    /// The finding's own figure where a fix moves that rather than the score: per-request
    /// growth's slope, µs more per running request (a faster engine's per-request part can
    /// take the same share of a thread at a quarter of the slope). Its status then follows
    /// this figure. Absent for other kinds (their score is their figure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub figure: Option<FindingFigure>,
}

/// A finding's own figure in A and B ([`FindingDelta::figure`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FindingFigure {
    /// What it is, with its unit.
    pub name: String,
    pub value: Figure,
}

/// The figure of a finding kind that is not its score: (name, value from the finding).
fn own_figure(f: &super::findings::Finding) -> Option<(&'static str, f64)> {
    match f.kind.as_str() {
        "per_request_growth" => f
            .evidence
            .get("slope_ms_per_request")
            .and_then(|v| v.as_f64())
            .map(|ms| ("µs per running request", ms * 1e3)),
        _ => None,
    }
}

type FindingKey = (String, String, String, String);

/// A finding's score (%) over a recording and its halves, its own figure likewise where it
/// has one, and its verdict over the whole.
struct Scored {
    score: Thirds,
    figure: Option<(&'static str, Thirds)>,
    verdict: String,
}

/// Each finding of a recording by key: its score over the whole recording and each half (%),
/// and its verdict over the whole.
fn finding_scores(rec: &Recording) -> BTreeMap<FindingKey, Scored> {
    let d = rec.duration_ns();
    let mid = d / 2;
    let mut out: BTreeMap<FindingKey, Scored> = BTreeMap::new();
    for (i, (from, to)) in [(0, u64::MAX), (0, mid), (mid, d.max(mid + 1))]
        .into_iter()
        .enumerate()
    {
        let part = if i == 0 {
            std::borrow::Cow::Borrowed(rec)
        } else {
            let mut r = rec.clone();
            r.trim(from, to);
            r.end = Some(crate::record::EndInfo {
                duration_ns: to - from,
                reason: "half".into(),
            });
            std::borrow::Cow::Owned(r)
        };
        let report = super::report::Report::build(&part, &super::Selection::all(&part));
        for f in report.findings {
            let process = if f.pid == 0 {
                f.evidence
                    .get("engine")
                    .and_then(|e| e.as_str())
                    .unwrap_or_default()
                    .to_string()
            } else {
                process_name(rec, f.pid).to_string()
            };
            // A GIL waiter or a collecting process is the same finding whatever function its
            // holder or its collections ran most (that is what a fix changes).
            let function = match f.kind.as_str() {
                "gil_contention" | "gc_pressure" => String::new(),
                _ => f.function.clone(),
            };
            let key = (f.kind.clone(), process, f.thread.clone(), function);
            let e = out.entry(key).or_insert(Scored {
                score: [None, Some(0.0), Some(0.0)],
                figure: None,
                verdict: String::new(),
            });
            // Several of one key (two processes of one role) add up; their own figures
            // (a slope each) do not: the largest stands.
            e.score[i] = Some(e.score[i].unwrap_or(0.0) + f.score * 100.0);
            if let Some((name, v)) = own_figure(&f) {
                let t = &mut e.figure.get_or_insert((name, [None; 3])).1;
                t[i] = Some(t[i].map_or(v, |w: f64| w.max(v)));
            }
            if i == 0 && e.verdict.is_empty() {
                e.verdict = f.verdict;
            }
        }
    }
    // A finding seen in a half only is not one of the recording's.
    out.retain(|_, v| v.score[0].is_some());
    out
}

/// Findings of A and B side by side, the largest score first.
pub(crate) fn finding_deltas(a: &Recording, b: &Recording) -> Vec<FindingDelta> {
    let (fa, fb) = (finding_scores(a), finding_scores(b));
    let mut keys: Vec<&FindingKey> = fa.keys().chain(fb.keys()).collect();
    keys.sort();
    keys.dedup();
    let absent: Thirds = [Some(0.0); 3];
    let mut out: Vec<FindingDelta> = keys
        .into_iter()
        .map(|k| {
            let (sa, sb) = (fa.get(k), fb.get(k));
            let score = Figure::new(
                sa.map_or(absent, |s| s.score),
                sb.map_or(absent, |s| s.score),
            );
            let fig_a = sa.and_then(|s| s.figure);
            let fig_b = sb.and_then(|s| s.figure);
            let figure = fig_a.or(fig_b).map(|(name, _)| FindingFigure {
                name: name.to_string(),
                value: Figure::new(
                    fig_a.map_or([None; 3], |f| f.1),
                    fig_b.map_or([None; 3], |f| f.1),
                ),
            });
            let moved = match &figure {
                Some(f) => f.value.beyond_noise,
                None => score.beyond_noise,
            };
            let status = match (sa.is_some(), sb.is_some()) {
                (false, true) => "appeared",
                (true, false) => "vanished",
                _ if moved => "changed",
                _ => "unchanged",
            };
            let verdict = |s: Option<&Scored>| s.map(|s| s.verdict.clone()).unwrap_or_default();
            let (va, vb) = (verdict(sa), verdict(sb));
            FindingDelta {
                kind: k.0.clone(),
                process: k.1.clone(),
                thread: k.2.clone(),
                function: k.3.clone(),
                status: status.into(),
                score_pct: score,
                verdict_a: va,
                verdict_b: vb,
                figure,
            }
        })
        .collect();
    out.sort_by(|x, y| {
        let top = |f: &FindingDelta| {
            f.score_pct
                .a
                .unwrap_or(0.0)
                .max(f.score_pct.b.unwrap_or(0.0))
        };
        top(y).total_cmp(&top(x)).then(x.kind.cmp(&y.kind))
    });
    out
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Diff {
    pub schema: String,
    pub tool_version: String,
    pub a: Side,
    pub b: Side,
    /// How noise is estimated, in words.
    pub noise: String,
    /// Engines in either recording, by id.
    pub engines: Vec<EngineDelta>,
    /// Threads in either recording, largest CPU change first.
    pub threads: Vec<ThreadDelta>,
    /// The functions with the largest change of self or total share, at most `--top`.
    pub functions: Vec<FunctionDelta>,
    /// Probes in either recording.
    pub probes: Vec<ProbeDelta>,
    /// Findings of either recording: which appeared, vanished or changed beyond noise.
    #[serde(default)]
    pub findings: Vec<FindingDelta>,
}

pub(crate) const NOISE_METHOD: &str =
    "each figure is also computed over each recording's first and \
second half; noise_a and noise_b are the half-to-half differences, and a change is beyond \
noise only when it is larger than both";

/// `[whole, first half, second half]` of a recording of length `d`.
#[derive(Clone, Copy)]
struct Halves {
    d: u64,
    mid: u64,
}

impl Halves {
    fn new(d: u64) -> Halves {
        Halves { d, mid: d / 2 }
    }
    fn half(&self, t: u64) -> usize {
        if t < self.mid {
            1
        } else {
            2
        }
    }
    fn len(&self, i: usize) -> u64 {
        match i {
            0 => self.d,
            1 => self.mid,
            _ => self.d - self.mid,
        }
    }
    fn range(&self, i: usize) -> (u64, u64) {
        match i {
            0 => (0, self.d),
            1 => (0, self.mid),
            _ => (self.mid, self.d),
        }
    }
    /// `[start, start + dur)` split into whole and halves.
    fn spread(&self, start: u64, dur: u64, acc: &mut [u64; 3]) {
        let end = start.saturating_add(dur);
        for (i, slot) in acc.iter_mut().enumerate() {
            let (a, b) = self.range(i);
            *slot += end.min(b).saturating_sub(start.max(a));
        }
    }
    /// `v` per period as % of the period's length.
    fn pct(&self, v: &[u64; 3]) -> Thirds {
        std::array::from_fn(|i| {
            let len = self.len(i);
            (len > 0).then(|| v[i] as f64 * 100.0 / len as f64)
        })
    }
}

/// The file from `site-packages/` or `dist-packages/` on, else as is.
pub(crate) fn package_path(file: &str) -> &str {
    for marker in ["site-packages/", "dist-packages/"] {
        if let Some(i) = file.rfind(marker) {
            return &file[i + marker.len()..];
        }
    }
    file
}

#[derive(Default)]
struct ThreadTally {
    tids: std::collections::BTreeSet<(i32, i32)>,
    cpu: [u64; 3],
    gil: [u64; 3],
    gc: [u64; 3],
}

#[derive(Default, Clone, Copy)]
struct FnTally {
    self_ns: [u64; 3],
    total_ns: [u64; 3],
}

/// A probed call: its end and duration (ns) and the calls it stands for (1, or more for a
/// probe that took turns for its thread's debug registers).
type TimedCall = (u64, u64, f64);

/// Everything `diff` compares, from one recording.
struct Profile {
    halves: Halves,
    threads: BTreeMap<(String, String), ThreadTally>,
    cpu: [u64; 3],
    fns: HashMap<(String, String), FnTally>,
    /// (process, probe) -> its calls
    probes: BTreeMap<(String, String), Vec<TimedCall>>,
    /// (process, probe) -> the 95% intervals of its estimate, where it was watched in part on
    /// one thread (views::latency::uncertainty).
    intervals: BTreeMap<(String, String), super::latency::Uncertainty>,
    engines: BTreeMap<String, [Thirds; 5]>,
}

impl Profile {
    fn new(rec: &Recording) -> Profile {
        let halves = Halves::new(extent_ns(rec));
        let mut threads: BTreeMap<(String, String), ThreadTally> = BTreeMap::new();
        let mut key_of: HashMap<(i32, i32), (String, String)> = HashMap::new();
        let mut key = |pid: i32, tid: i32| {
            key_of
                .entry((pid, tid))
                .or_insert_with(|| {
                    (
                        process_name(rec, pid).to_string(),
                        rec.thread_name(pid, tid).to_string(),
                    )
                })
                .clone()
        };
        let mut cpu = [0u64; 3];
        let mut by_stack: HashMap<(u32, usize), u64> = HashMap::new();
        for s in &rec.samples {
            let w = u64::from(s.weight_ns);
            let h = halves.half(s.t_ns);
            let t = threads.entry(key(s.pid, s.tid)).or_default();
            t.tids.insert((s.pid, s.tid));
            t.cpu[0] += w;
            t.cpu[h] += w;
            cpu[0] += w;
            cpu[h] += w;
            *by_stack.entry((s.stack, h)).or_default() += w;
        }
        for g in rec.gil_waits.iter().filter(|g| !g.switch_wait) {
            let t = threads.entry(key(g.pid, g.tid)).or_default();
            t.tids.insert((g.pid, g.tid));
            halves.spread(g.start_ns, g.dur_ns, &mut t.gil);
        }
        for g in &rec.gc_pauses {
            let t = threads.entry(key(g.pid, g.tid)).or_default();
            t.tids.insert((g.pid, g.tid));
            halves.spread(g.start_ns, g.dur_ns, &mut t.gc);
        }

        let mut fns: HashMap<(String, String), FnTally> = HashMap::new();
        for (&(stack, h), &ns) in &by_stack {
            let frames: Vec<&Frame> = rec.stack_frames(stack).collect();
            let mut seen: Vec<(&str, &str)> = Vec::new();
            for (i, f) in frames.iter().enumerate() {
                let k = (f.function.as_str(), package_path(&f.file));
                let first = !seen.contains(&k);
                if !first && i > 0 {
                    continue;
                }
                let e = fns.entry((k.0.to_string(), k.1.to_string())).or_default();
                if i == 0 {
                    e.self_ns[0] += ns;
                    e.self_ns[h] += ns;
                }
                if first {
                    e.total_ns[0] += ns;
                    e.total_ns[h] += ns;
                    seen.push(k);
                }
            }
        }

        // A probe that took turns for a thread's debug registers was watched part of the
        // time: each timed call stands for `weight` calls (views/latency.rs).
        let cov = super::latency::coverages(rec, extent_ns(rec));
        let strata = super::latency::strata_of(&cov);
        let mut probes: BTreeMap<(String, String), Vec<TimedCall>> = BTreeMap::new();
        // The (probe, thread) pairs of each key, for its estimate's intervals.
        let mut pairs: BTreeMap<(String, String), std::collections::BTreeSet<(u32, i32)>> =
            BTreeMap::new();
        let by_id: BTreeMap<u32, &crate::record::ProbeInfo> =
            rec.probes.iter().map(|p| (p.id, p)).collect();
        for p in by_id.values() {
            probes.entry(probe_key(rec, p)).or_default();
        }
        for c in &rec.calls {
            let k = match by_id.get(&c.probe) {
                Some(p) => probe_key(rec, p),
                None => (
                    process_name(rec, c.pid).to_string(),
                    format!("probe {}", c.probe),
                ),
            };
            let w = strata
                .get(&(c.probe, c.tid))
                .map_or(1.0, |st| st.weight(c.start_ns, c.dur_ns));
            pairs.entry(k.clone()).or_default().insert((c.probe, c.tid));
            probes
                .entry(k)
                .or_default()
                .push((c.start_ns.saturating_add(c.dur_ns), c.dur_ns, w));
        }
        // An estimate from one (probe, thread) carries the report's intervals; a probe on
        // several threads sums estimates whose intervals are not combined here.
        let estimates = super::latency::estimate_intervals(rec, &cov);
        let intervals = pairs
            .into_iter()
            .filter_map(|(k, ks)| Some((k, super::latency::single_estimate(&estimates, ks)?)))
            .collect();

        let ix = MetricIndex::new(rec);
        let mut engines = BTreeMap::new();
        for id in super::engines::engine_ids(rec, &ix) {
            let kv = ix.gauge(&id, &names::KV_CACHE_USAGE);
            let f = |i: usize| -> [Option<f64>; 5] {
                let (t0, t1) = halves.range(i);
                let t1 = t1.max(t0 + 1);
                let in_range: Vec<f64> = kv
                    .iter()
                    .filter(|&&(t, _)| i == 0 || halves.half(t) == i)
                    .map(|&(_, v)| v)
                    .collect();
                let p50 = |family: &Family| {
                    ix.histogram(&id, family, t0, t1)
                        .and_then(|h| h.quantile(0.5))
                        .map(|s| s * 1e3)
                };
                [
                    ix.rate(&id, &names::GENERATION_TOKENS, t0, t1),
                    (!in_range.is_empty())
                        .then(|| in_range.iter().sum::<f64>() / in_range.len() as f64),
                    p50(&names::TTFT),
                    p50(&names::ITL),
                    ix.histogram(&id, &names::TPOT, t0, t1)
                        .and_then(|h| h.mean_ms()),
                ]
            };
            let (w, h1, h2) = (f(0), f(1), f(2));
            engines.insert(id, std::array::from_fn(|k| [w[k], h1[k], h2[k]]));
        }

        Profile {
            halves,
            threads,
            cpu,
            fns,
            probes,
            intervals,
            engines,
        }
    }

    fn fn_pct(&self, v: &[u64; 3]) -> Thirds {
        std::array::from_fn(|i| (self.cpu[i] > 0).then(|| v[i] as f64 * 100.0 / self.cpu[i] as f64))
    }

    /// p50, p90 and calls/s of a probe's calls (end, duration, weight: the calls each stands
    /// for), whole and per half. Unweighted calls (every call timed) take nearest ranks.
    fn probe_figures(&self, calls: &[TimedCall]) -> [Thirds; 3] {
        let mut per: [Vec<(u64, f64)>; 3] = Default::default();
        for &(end, d, w) in calls {
            per[0].push((d, w));
            per[self.halves.half(end)].push((d, w));
        }
        let mut out: [Thirds; 3] = [[None; 3]; 3];
        for (i, v) in per.iter_mut().enumerate() {
            let n: f64 = v.iter().map(|&(_, w)| w).sum();
            if v.iter().all(|&(_, w)| w == 1.0) {
                let mut d: Vec<u64> = v.iter().map(|&(d, _)| d).collect();
                d.sort_unstable();
                out[0][i] = nearest_rank(&d, 0.5).map(|ns| ns as f64 / 1e6);
                out[1][i] = nearest_rank(&d, 0.9).map(|ns| ns as f64 / 1e6);
            } else if let Some(l) = super::latency::LatencyMs::of_weighted(v) {
                out[0][i] = Some(l.p50);
                out[1][i] = Some(l.p90);
            }
            let len = self.halves.len(i);
            out[2][i] = (len > 0).then(|| n / (len as f64 / 1e9));
        }
        out
    }
}

fn probe_key(rec: &Recording, p: &crate::record::ProbeInfo) -> (String, String) {
    (
        process_name(rec, p.pid).to_string(),
        if p.spec.is_empty() {
            p.function.clone()
        } else {
            p.spec.clone()
        },
    )
}

fn side(file: &Path, rec: &Recording) -> Side {
    Side {
        file: file.display().to_string(),
        start_utc: format_utc(rec.meta.start_unix_s),
        duration_s: super::secs(extent_ns(rec)),
        hostname: rec.meta.hostname.clone(),
        command: rec.meta.command.clone(),
        samples: rec.samples.len() as u64,
    }
}

impl Diff {
    /// Compare B with A; `top` functions are kept.
    pub fn build(a_path: &Path, a: &Recording, b_path: &Path, b: &Recording, top: usize) -> Diff {
        let (pa, pb) = (Profile::new(a), Profile::new(b));
        let none: Thirds = [None; 3];

        let mut thread_keys: Vec<&(String, String)> =
            pa.threads.keys().chain(pb.threads.keys()).collect();
        thread_keys.sort();
        thread_keys.dedup();
        let zero = ThreadTally::default();
        let mut threads: Vec<ThreadDelta> = thread_keys
            .into_iter()
            .map(|k| {
                let ta = pa.threads.get(k).unwrap_or(&zero);
                let tb = pb.threads.get(k).unwrap_or(&zero);
                ThreadDelta {
                    process: k.0.clone(),
                    thread: k.1.clone(),
                    threads_a: ta.tids.len(),
                    threads_b: tb.tids.len(),
                    cpu_pct: Figure::new(pa.halves.pct(&ta.cpu), pb.halves.pct(&tb.cpu)),
                    gil_wait_pct: Figure::new(pa.halves.pct(&ta.gil), pb.halves.pct(&tb.gil)),
                    gc_pct: Figure::new(pa.halves.pct(&ta.gc), pb.halves.pct(&tb.gc)),
                }
            })
            .collect();
        threads.sort_by(|x, y| {
            y.cpu_pct
                .abs_delta()
                .total_cmp(&x.cpu_pct.abs_delta())
                .then((&x.process, &x.thread).cmp(&(&y.process, &y.thread)))
        });

        let mut fn_keys: Vec<&(String, String)> = pa.fns.keys().chain(pb.fns.keys()).collect();
        fn_keys.sort();
        fn_keys.dedup();
        let zf = FnTally::default();
        let mut functions: Vec<FunctionDelta> = fn_keys
            .into_iter()
            .map(|k| {
                let fa = pa.fns.get(k).unwrap_or(&zf);
                let fb = pb.fns.get(k).unwrap_or(&zf);
                FunctionDelta {
                    function: k.0.clone(),
                    file: k.1.clone(),
                    self_pct: Figure::new(pa.fn_pct(&fa.self_ns), pb.fn_pct(&fb.self_ns)),
                    total_pct: Figure::new(pa.fn_pct(&fa.total_ns), pb.fn_pct(&fb.total_ns)),
                }
            })
            .collect();
        let change = |f: &FunctionDelta| f.self_pct.abs_delta().max(f.total_pct.abs_delta());
        functions.sort_by(|x, y| {
            change(y)
                .total_cmp(&change(x))
                .then((&x.function, &x.file).cmp(&(&y.function, &y.file)))
        });
        functions.truncate(top);

        let mut probe_keys: Vec<&(String, String)> =
            pa.probes.keys().chain(pb.probes.keys()).collect();
        probe_keys.sort();
        probe_keys.dedup();
        let probes = probe_keys
            .into_iter()
            .map(|k| {
                let fa = pa.probes.get(k).map_or([none; 3], |c| pa.probe_figures(c));
                let fb = pb.probes.get(k).map_or([none; 3], |c| pb.probe_figures(c));
                let (ua, ub) = (pa.intervals.get(k), pb.intervals.get(k));
                ProbeDelta {
                    process: k.0.clone(),
                    probe: k.1.clone(),
                    p50_ms: Figure::new(fa[0], fb[0])
                        .with_intervals(ua.map(|u| u.p50_ms), ub.map(|u| u.p50_ms)),
                    p90_ms: Figure::new(fa[1], fb[1])
                        .with_intervals(ua.map(|u| u.p90_ms), ub.map(|u| u.p90_ms)),
                    calls_per_s: Figure::new(fa[2], fb[2]),
                }
            })
            .collect();

        let mut engine_ids: Vec<&String> = pa.engines.keys().chain(pb.engines.keys()).collect();
        engine_ids.sort();
        engine_ids.dedup();
        let engines = engine_ids
            .into_iter()
            .map(|id| {
                let ea = pa.engines.get(id).copied().unwrap_or([none; 5]);
                let eb = pb.engines.get(id).copied().unwrap_or([none; 5]);
                EngineDelta {
                    engine: id.clone(),
                    gen_tok_s: Figure::new(ea[0], eb[0]),
                    kv_usage: Figure::new(ea[1], eb[1]),
                    ttft_p50_ms: Figure::new(ea[2], eb[2]),
                    itl_p50_ms: Figure::new(ea[3], eb[3]),
                    tpot_mean_ms: Figure::new(ea[4], eb[4]),
                }
            })
            .collect();

        Diff {
            schema: SCHEMA.into(),
            tool_version: env!("CARGO_PKG_VERSION").into(),
            a: side(a_path, a),
            b: side(b_path, b),
            noise: NOISE_METHOD.into(),
            engines,
            threads,
            functions,
            probes,
            findings: finding_deltas(a, b),
        }
    }

    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# enginescope diff\n");
        for (label, x) in [("A", &self.a), ("B", &self.b)] {
            let _ = writeln!(
                s,
                "- **{label}:** {}, {}, {:.3} s, {} samples{}",
                md(&x.file),
                x.start_utc,
                x.duration_s,
                x.samples,
                if x.hostname.is_empty() {
                    String::new()
                } else {
                    format!(", on {}", md(&x.hostname))
                }
            );
        }
        let _ = writeln!(
            s,
            "\nCells read `A → B (change; noise A/B)`. Noise: {NOISE_METHOD}. Changes beyond \
             noise are **bold**.\n"
        );
        if !self.findings.is_empty() {
            let _ = writeln!(s, "## Findings\n");
            let _ = writeln!(
                s,
                "| finding | process | thread | function | score % | its own figure | status |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|---|");
            for f in &self.findings {
                let own = f
                    .figure
                    .as_ref()
                    .map(|g| format!("{} {}", cell(&g.value, 1), g.name))
                    .unwrap_or_default();
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    f.kind,
                    md(&f.process),
                    md(&f.thread),
                    md(&f.function),
                    cell(&f.score_pct, 1),
                    own,
                    f.status
                );
            }
            let _ = writeln!(s);
        }
        if !self.engines.is_empty() {
            let _ = writeln!(s, "## Engines\n");
            let _ = writeln!(
                s,
                "| engine | gen tok/s | KV usage % | TTFT p50 ms | TPOT mean ms | ITL p50 ms |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|");
            for e in &self.engines {
                let kv = scaled(&e.kv_usage, 100.0);
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} |",
                    md(&e.engine),
                    cell(&e.gen_tok_s, 1),
                    cell(&kv, 1),
                    cell(&e.ttft_p50_ms, 1),
                    cell(&e.tpot_mean_ms, 2),
                    cell(&e.itl_p50_ms, 2)
                );
            }
            s.push('\n');
        }
        let _ = writeln!(s, "## Threads\n");
        let _ = writeln!(
            s,
            "Matched by process and thread name; % of one CPU over each recording's length.\n"
        );
        let _ = writeln!(
            s,
            "| process | thread | threads A/B | CPU % | GIL wait % | GC % |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for t in &self.threads {
            let _ = writeln!(
                s,
                "| {} | {} | {}/{} | {} | {} | {} |",
                md(&t.process),
                md(if t.thread.is_empty() { "?" } else { &t.thread }),
                t.threads_a,
                t.threads_b,
                cell(&t.cpu_pct, 1),
                cell(&t.gil_wait_pct, 1),
                cell(&t.gc_pct, 1)
            );
        }
        if !self.functions.is_empty() {
            let _ = writeln!(s, "\n## Functions\n");
            let _ = writeln!(
                s,
                "% of all on-CPU time; the {} largest changes of self or total share.\n",
                self.functions.len()
            );
            let _ = writeln!(s, "| function | file | self % | total % |");
            let _ = writeln!(s, "|---|---|---|---|");
            for f in &self.functions {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} |",
                    md(&f.function),
                    md(short_file(&f.file)),
                    cell(&f.self_pct, 1),
                    cell(&f.total_pct, 1)
                );
            }
        }
        if !self.probes.is_empty() {
            let _ = writeln!(s, "\n## Probes\n");
            let _ = writeln!(s, "| process | probe | p50 ms | p90 ms | calls/s |");
            let _ = writeln!(s, "|---|---|---|---|---|");
            for p in &self.probes {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} |",
                    md(&p.process),
                    md(&p.probe),
                    cell(&p.p50_ms, 3),
                    cell(&p.p90_ms, 3),
                    cell(&p.calls_per_s, 2)
                );
            }
        }
        s
    }
}

fn scaled(f: &Figure, k: f64) -> Figure {
    let m = |v: Option<f64>| v.map(|x| x * k);
    Figure {
        a: m(f.a),
        b: m(f.b),
        delta: m(f.delta),
        noise_a: m(f.noise_a),
        noise_b: m(f.noise_b),
        beyond_noise: f.beyond_noise,
        ci_a: f.ci_a.map(|c| c.map(|x| x * k)),
        ci_b: f.ci_b.map(|c| c.map(|x| x * k)),
    }
}

/// `A → B (+change; noise a/b)`, bold when beyond noise.
fn cell(f: &Figure, prec: usize) -> String {
    if f.a.is_none() && f.b.is_none() {
        return "-".into();
    }
    let n = |v: Option<f64>| match v {
        Some(x) => format!("{x:.prec$}"),
        None => "-".into(),
    };
    let change = match f.delta {
        Some(d) => format!("{d:+.prec$}"),
        None => "-".into(),
    };
    // An estimate says how sure it is: ± the larger side of its 95% interval.
    let pm = |v: Option<f64>, ci: Option<[f64; 2]>| match (v, ci) {
        (Some(x), Some(ci)) => {
            format!("{x:.prec$} ±{:.prec$}", crate::estimate::larger_side(x, ci))
        }
        (v, _) => n(v),
    };
    let text = format!(
        "{} → {} ({change}; noise {}/{})",
        pm(f.a, f.ci_a),
        pm(f.b, f.ci_b),
        n(f.noise_a),
        n(f.noise_b)
    );
    if f.beyond_noise {
        format!("**{text}**")
    } else {
        text
    }
}

/// On-CPU folded stacks for the differential flamegraph: `process;thread;frames` without
/// pids, tids or line numbers (so two runs line up), weighted in µs of CPU per second of
/// recording.
pub fn diff_folded(rec: &Recording) -> String {
    let d = extent_ns(rec).max(1);
    let mut by: HashMap<(i32, i32, u32, u8), u64> = HashMap::new();
    for s in &rec.samples {
        *by.entry((s.pid, s.tid, s.stack, s.flags & SHAPE_FLAGS))
            .or_default() += u64::from(s.weight_ns);
    }
    let labels: Vec<String> = rec
        .frames
        .iter()
        .map(|f| {
            clean(&frame_label(&Frame {
                line: None,
                ..f.clone()
            }))
            .into_owned()
        })
        .collect();
    let mut lines: BTreeMap<String, u128> = BTreeMap::new();
    for ((pid, tid, stack, bits), ns) in by {
        let name = rec.thread_name(pid, tid);
        let mut line = format!(
            "{};{}",
            clean(process_name(rec, pid)),
            clean(if name.is_empty() { "thread" } else { name })
        );
        if bits & flags::PARTIAL != 0 {
            line.push(';');
            line.push_str(PARTIAL_FRAME);
        }
        let ids = rec
            .stacks
            .get(stack as usize)
            .map_or(&[][..], Vec::as_slice);
        for &f in ids.iter().rev() {
            if let Some(l) = labels.get(f as usize) {
                line.push(';');
                line.push_str(l);
            }
        }
        for leaf in flag_leaves(bits) {
            line.push(';');
            line.push_str(leaf);
        }
        *lines.entry(line).or_default() += u128::from(ns);
    }
    let mut out = String::new();
    for (line, ns) in lines {
        // ns of CPU per s of recording = ns * 1e9 / d; in µs: ns * 1e6 / d.
        let v = ns * 1_000_000 / u128::from(d);
        if v > 0 {
            let _ = writeln!(out, "{line} {v}");
        }
    }
    out
}

/// Differential flamegraph SVG of B against A.
pub(crate) fn render_flame(a: &Recording, b: &Recording, title: &str) -> anyhow::Result<Vec<u8>> {
    let (fa, fb) = (diff_folded(a), diff_folded(b));
    if fb.is_empty() {
        anyhow::bail!("nothing to draw: the second recording has no on-CPU samples");
    }
    let mut folded = Vec::new();
    inferno::differential::from_readers(
        inferno::differential::Options::default(),
        fa.as_bytes(),
        fb.as_bytes(),
        &mut folded,
    )
    .context("folding the two recordings")?;
    let text = String::from_utf8_lossy(&folded);
    let mut opt = inferno::flamegraph::Options::default();
    opt.title = title.to_string();
    opt.subtitle =
        Some("widths: B's CPU (µs per s of recording); red grew from A, blue shrank".to_string());
    opt.count_name = "µs/s".into();
    opt.deterministic = true;
    let mut svg = Vec::new();
    inferno::flamegraph::from_lines(&mut opt, text.lines(), &mut svg)
        .context("drawing the differential flamegraph")?;
    Ok(svg)
}

/// `enginescope diff`: read both recordings, write the diff (and the flamegraph).
pub fn run(args: &DiffArgs) -> anyhow::Result<()> {
    let filter = super::FilterArgs {
        no_native: args.no_native,
        ..Default::default()
    };
    let a = super::open(&args.a, &filter)?.0;
    let b = super::open(&args.b, &filter)?.0;
    let d = Diff::build(&args.a, &a, &args.b, &b, args.top);
    let bytes = match args.format {
        ReportFormat::Json => {
            let mut v = serde_json::to_vec_pretty(&d).context("serializing the diff")?;
            v.push(b'\n');
            v
        }
        ReportFormat::Md => d.to_markdown().into_bytes(),
    };
    if let Some(svg_path) = &args.flame {
        let title = format!(
            "Differential on-CPU: {} → {}",
            short_file(&d.a.file),
            short_file(&d.b.file)
        );
        let svg = render_flame(&a, &b, &title)?;
        super::write_output(svg_path, &svg)?;
    }
    super::write_output(args.output.as_deref().unwrap_or(Path::new("-")), &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_intervals_of_an_estimate_are_no_change() {
        let f = || {
            Figure::new(
                [Some(10.0), Some(9.0), Some(11.0)],
                [Some(20.0), Some(19.0), Some(21.0)],
            )
        };
        assert!(f().beyond_noise);
        // A probe estimated from phases on both sides: the intervals overlap, so however far
        // apart the points and the halves, it is not called a change.
        let g = f().with_intervals(Some([6.0, 16.0]), Some([15.0, 30.0]));
        assert!(!g.beyond_noise);
        assert!(
            cell(&g, 1).contains("10.0 ±6.0 → 20.0 ±10.0"),
            "{}",
            cell(&g, 1)
        );
        // Apart: the change stands.
        let g = f().with_intervals(Some([8.0, 12.0]), Some([18.0, 22.0]));
        assert!(g.beyond_noise);
        // One side watched throughout (no interval): its point against the other's interval.
        assert!(!f().with_intervals(None, Some([9.0, 25.0])).beyond_noise);
        assert!(f().with_intervals(None, Some([12.0, 25.0])).beyond_noise);
        // No interval at all: the figure serializes as before.
        let j = serde_json::to_string(&f()).unwrap();
        assert!(!j.contains("ci_a"), "{j}");
    }

    #[test]
    fn noise_gates_the_change() {
        // A: 10 overall, halves 9 and 11 (noise 2); B: 20, halves 19 and 21.
        let f = Figure::new(
            [Some(10.0), Some(9.0), Some(11.0)],
            [Some(20.0), Some(19.0), Some(21.0)],
        );
        assert_eq!(
            (f.delta, f.noise_a, f.noise_b),
            (Some(10.0), Some(2.0), Some(2.0))
        );
        assert!(f.beyond_noise);
        // B's own halves differ by more than the change.
        let f = Figure::new(
            [Some(10.0), Some(9.0), Some(11.0)],
            [Some(13.0), Some(6.0), Some(20.0)],
        );
        assert!(!f.beyond_noise);
        // Missing on one side: no change to judge.
        let f = Figure::new([None; 3], [Some(1.0), Some(1.0), Some(1.0)]);
        assert_eq!((f.delta, f.beyond_noise), (None, false));
    }

    /// A probe watched half of the time (rotated registers) is compared by the calls it
    /// stands for: 5 of 10 timed, 10 a second over the recording.
    #[test]
    fn rotated_probe_rates_are_scaled() {
        use crate::record::{EndInfo, FunctionCall, ProbeInfo, ProbeWatch};
        const S: u64 = 1_000_000_000;
        let mut rec = Recording {
            end: Some(EndInfo {
                duration_ns: 10 * S,
                reason: String::new(),
            }),
            ..Recording::default()
        };
        rec.probes.push(ProbeInfo {
            id: 0,
            spec: "step".into(),
            pid: 1,
            function: "step".into(),
            method: "exact".into(),
            ..Default::default()
        });
        for k in 0..=10u64 {
            rec.probe_watches.push(ProbeWatch {
                t_ns: k * S,
                probe: 0,
                tid: 2,
                on: k % 2 == 0,
            });
        }
        for k in (0..10u64).step_by(2) {
            for i in 0..10u64 {
                rec.calls.push(FunctionCall {
                    probe: 0,
                    pid: 1,
                    tid: 2,
                    start_ns: k * S + i * S / 10,
                    dur_ns: S / 1000,
                });
            }
        }
        let p = Profile::new(&rec);
        let calls = p.probes.values().next().unwrap();
        let f = p.probe_figures(calls);
        let rate = f[2][0].unwrap();
        assert!((rate - 10.0).abs() < 0.2, "{rate}");
        assert_eq!(f[0][0], Some(1.0));
    }

    #[test]
    fn package_paths() {
        assert_eq!(
            package_path("/opt/venv/lib/python3.11/site-packages/vllm/x.py"),
            "vllm/x.py"
        );
        assert_eq!(package_path("/usr/lib/python3/dist-packages/a.py"), "a.py");
        assert_eq!(package_path("/srv/app.py"), "/srv/app.py");
        let h = Halves::new(10);
        let mut acc = [0; 3];
        h.spread(3, 4, &mut acc);
        assert_eq!(acc, [4, 2, 2]);
        assert_eq!(h.pct(&[5, 5, 0]), [Some(50.0), Some(100.0), Some(0.0)]);
    }
}
