//! The report's time-aligned view: the recording cut into windows (`--window`, default 10 s),
//! each with the engines' throughput, KV-cache usage and queue, the key threads' CPU, GIL wait
//! and GC time, and each probe's calls and latency; then which profiler signals move with
//! generation throughput (Pearson r over the windows), and the windows where throughput fell
//! well below its median with the signals that changed most there.
//!
//! Window `k` is `[k·w, (k+1)·w)` from the recording's start; the last one ends with the
//! recording and may be shorter, so every figure is a rate or a share of the window's own
//! length. A sample counts in the window of its time; GIL waits and GC pauses are split
//! exactly across the windows they overlap; a probed call counts in the window it ended in.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::latency::{nearest_rank, probes_by_id};
use super::windows::Windows;
use super::{secs, Selection};
use crate::metrics::{names, MetricIndex};
use crate::record::Recording;

/// Threads given per-window columns: the busiest by on-CPU time.
pub(crate) const KEY_THREADS: usize = 8;
/// Signals listed per throughput drop.
pub(crate) const DROP_SIGNALS: usize = 5;
/// Below this many windows a correlation is noted as not meaningful.
pub(crate) const MIN_CORRELATION_WINDOWS: usize = 5;
/// `pid:tid name` (`pid:tid` when unnamed): how the timeline names a thread.
pub(crate) fn thread_key(rec: &Recording, pid: i32, tid: i32) -> String {
    let name = rec.thread_name(pid, tid);
    if name.is_empty() {
        format!("{pid}:{tid}")
    } else {
        format!("{pid}:{tid} {name}")
    }
}

/// `pid:spec` (the function's name when the spec is unknown): how the timeline names a probe.
pub(crate) fn probe_key(rec: &Recording, probe: u32, pid: i32) -> String {
    let p = rec.probes.iter().rev().find(|p| p.id == probe);
    match p {
        Some(p) if !p.spec.is_empty() => format!("{pid}:{}", p.spec),
        Some(p) => format!("{pid}:{}", p.function),
        None => format!("{pid}:probe {probe}"),
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EngineWindow {
    pub id: String,
    pub gen_tok_s: Option<f64>,
    pub prompt_tok_s: Option<f64>,
    pub kv_usage: Option<f64>,
    pub running: Option<f64>,
    pub waiting: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ThreadWindow {
    /// `pid:tid name`, as in `key_threads`.
    pub thread: String,
    /// On-CPU time in the window over its length, % of one CPU.
    pub cpu_pct: f64,
    /// GIL wait (not switch waits) in the window over its length, %.
    pub gil_wait_pct: f64,
    /// Garbage collection run by the thread in the window over its length, %.
    pub gc_pct: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ProbeWindow {
    /// `pid:spec`.
    pub probe: String,
    /// Calls (of selected threads) that ended in the window.
    pub calls: u64,
    pub calls_per_s: f64,
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct WindowRow {
    /// s since the recording's start.
    pub start_s: f64,
    pub end_s: f64,
    /// Generated tokens per s, summed over engines; null when no engine's counter covers
    /// the window.
    pub gen_tok_s: Option<f64>,
    pub prompt_tok_s: Option<f64>,
    /// KV-cache usage (0..1), mean of the scrapes in the window, averaged over engines.
    pub kv_usage: Option<f64>,
    /// Requests running and waiting, mean of the scrapes in the window, summed over engines.
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// The same per engine.
    pub engines: Vec<EngineWindow>,
    /// The key threads, in `key_threads` order.
    pub threads: Vec<ThreadWindow>,
    /// Each probe (all selected threads together).
    pub probes: Vec<ProbeWindow>,
}

/// Pearson correlation of one profiler signal with generation throughput over the windows.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Correlation {
    /// `cpu_pct`, `gil_wait_pct`, `gc_pct` (of a thread), `p50_ms`, `calls_per_s` (of a probe).
    pub signal: String,
    /// The thread (`pid:tid name`) or probe (`pid:spec`).
    pub subject: String,
    /// Null when either series is constant over the windows both have.
    pub r: Option<f64>,
    /// Windows with both values.
    pub n: usize,
    /// Why `r` means little, when it does.
    pub note: String,
}

/// One signal's value in a throughput-drop window against its median over all windows.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SignalChange {
    /// As in `correlations`, plus `kv_usage`, `running`, `waiting`, `prompt_tok_s` (engines).
    pub signal: String,
    pub subject: String,
    pub value: f64,
    pub median: f64,
    /// `value - median`.
    pub change: f64,
    /// `|change|` in standard deviations of the signal over the windows.
    pub score: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ThroughputDrop {
    pub start_s: f64,
    pub end_s: f64,
    pub gen_tok_s: f64,
    pub median_gen_tok_s: f64,
    /// How far below the median, %.
    pub drop_pct: f64,
    /// What changed: the signals furthest from their medians, at most [`DROP_SIGNALS`].
    pub changed: Vec<SignalChange>,
}

/// Everything the report's time-aligned sections hold.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    pub window_s: f64,
    pub key_threads: Vec<String>,
    pub windows: Vec<WindowRow>,
    pub correlations: Vec<Correlation>,
    pub throughput_drops: Vec<ThroughputDrop>,
}

/// A gauge's time-weighted mean by window, linear between scrapes (`maths::series_mean`): a
/// window a slow scrape left without a point of its own gets the line between its neighbours,
/// as a counter's rate does.
fn gauge_by_window(points: &[(u64, f64)], w: &Windows) -> Vec<Option<f64>> {
    (0..w.count)
        .map(|i| {
            let (t0, t1) = w.bounds(i);
            crate::metrics::maths::series_mean(points, t0, t1).map(|(m, _)| m)
        })
        .collect()
}

fn sum_some(v: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    v.into_iter()
        .flatten()
        .fold(None, |a, x| Some(a.unwrap_or(0.0) + x))
}

fn mean_some(v: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let (n, s) = v
        .into_iter()
        .flatten()
        .fold((0u32, 0.0), |(n, s), x| (n + 1, s + x));
    (n > 0).then(|| s / f64::from(n))
}

/// Per-engine values of every window.
pub fn engine_windows(ix: &MetricIndex, engines: &[String], w: &Windows) -> Vec<Vec<EngineWindow>> {
    let mut rows: Vec<Vec<EngineWindow>> = vec![Vec::new(); w.count];
    for id in engines {
        let kv = gauge_by_window(&ix.gauge(id, &names::KV_CACHE_USAGE), w);
        let running = gauge_by_window(&ix.gauge(id, &names::RUNNING), w);
        let waiting = gauge_by_window(&ix.gauge(id, &names::WAITING), w);
        for (i, row) in rows.iter_mut().enumerate() {
            let (t0, t1) = w.bounds(i);
            row.push(EngineWindow {
                id: id.clone(),
                gen_tok_s: ix.rate(id, &names::GENERATION_TOKENS, t0, t1),
                prompt_tok_s: ix.rate(id, &names::PROMPT_TOKENS, t0, t1),
                kv_usage: kv[i],
                running: running[i],
                waiting: waiting[i],
            });
        }
    }
    rows
}

/// The busiest selected threads by on-CPU time (ties by pid, tid), at most `n`.
pub fn key_threads(rec: &Recording, sel: &Selection, n: usize) -> Vec<(i32, i32)> {
    let mut cpu: BTreeMap<(i32, i32), u64> = BTreeMap::new();
    for s in sel.samples(rec) {
        *cpu.entry((s.pid, s.tid)).or_default() += u64::from(s.weight_ns);
    }
    let mut v: Vec<((i32, i32), u64)> = cpu.into_iter().filter(|&(_, ns)| ns > 0).collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v.into_iter().take(n).map(|(k, _)| k).collect()
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

/// Build the windows, correlations and throughput drops. `engines` are the engine ids to
/// show, `drop_pct` how far below the median a window's throughput must fall to count.
pub fn build(
    rec: &Recording,
    sel: &Selection,
    ix: &MetricIndex,
    engines: &[String],
    w: &Windows,
    drop_pct: f64,
) -> Timeline {
    let keys = key_threads(rec, sel, KEY_THREADS);
    let slot: BTreeMap<(i32, i32), usize> = keys.iter().enumerate().map(|(i, &k)| (k, i)).collect();
    let n = w.count;
    // [thread][window] ns
    let mut cpu = vec![vec![0u64; n]; keys.len()];
    let mut gil = vec![vec![0u64; n]; keys.len()];
    let mut gc = vec![vec![0u64; n]; keys.len()];
    for s in sel.samples(rec) {
        if let (Some(&j), Some(i)) = (slot.get(&(s.pid, s.tid)), w.index(s.t_ns)) {
            cpu[j][i] += u64::from(s.weight_ns);
        }
    }
    for g in sel.gil_waits(rec).filter(|g| !g.switch_wait) {
        if let Some(&j) = slot.get(&(g.pid, g.tid)) {
            w.spread(g.start_ns, g.dur_ns, &mut gil[j]);
        }
    }
    for g in sel.gc_pauses(rec) {
        if let Some(&j) = slot.get(&(g.pid, g.tid)) {
            w.spread(g.start_ns, g.dur_ns, &mut gc[j]);
        }
    }
    // Probes: (probe id, pid) -> [window] durations of calls ending there.
    let known = probes_by_id(rec);
    let mut calls: BTreeMap<(u32, i32), Vec<Vec<u64>>> = BTreeMap::new();
    for p in known.values() {
        calls
            .entry((p.id, p.pid))
            .or_insert_with(|| vec![Vec::new(); n]);
    }
    for c in rec.calls.iter().filter(|c| sel.contains(c.pid, c.tid)) {
        if let Some(i) = w.index(c.start_ns.saturating_add(c.dur_ns)) {
            calls
                .entry((c.probe, c.pid))
                .or_insert_with(|| vec![Vec::new(); n])[i]
                .push(c.dur_ns);
        }
    }
    // Probes attached in a process no selected thread belongs to are left out.
    let pids = sel.pids();
    calls.retain(|&(_, pid), v| pids.contains(&pid) || v.iter().any(|d| !d.is_empty()));
    for v in calls.values_mut().flatten() {
        v.sort_unstable();
    }
    let probe_names: Vec<String> = calls
        .keys()
        .map(|&(id, pid)| probe_key(rec, id, pid))
        .collect();
    let thread_names: Vec<String> = keys
        .iter()
        .map(|&(pid, tid)| thread_key(rec, pid, tid))
        .collect();

    let per_engine = engine_windows(ix, engines, w);
    let windows: Vec<WindowRow> = per_engine
        .into_iter()
        .enumerate()
        .map(|(i, eng)| {
            let (t0, t1) = w.bounds(i);
            let len = w.len_ns(i);
            WindowRow {
                start_s: secs(t0),
                end_s: secs(t1),
                gen_tok_s: sum_some(eng.iter().map(|e| e.gen_tok_s)),
                prompt_tok_s: sum_some(eng.iter().map(|e| e.prompt_tok_s)),
                kv_usage: mean_some(eng.iter().map(|e| e.kv_usage)),
                running: sum_some(eng.iter().map(|e| e.running)),
                waiting: sum_some(eng.iter().map(|e| e.waiting)),
                engines: eng,
                threads: thread_names
                    .iter()
                    .enumerate()
                    .map(|(j, name)| ThreadWindow {
                        thread: name.clone(),
                        cpu_pct: pct(cpu[j][i], len),
                        gil_wait_pct: pct(gil[j][i], len),
                        gc_pct: pct(gc[j][i], len),
                    })
                    .collect(),
                probes: calls
                    .values()
                    .zip(&probe_names)
                    .map(|(v, name)| {
                        let d = &v[i];
                        ProbeWindow {
                            probe: name.clone(),
                            calls: d.len() as u64,
                            calls_per_s: if len == 0 {
                                0.0
                            } else {
                                d.len() as f64 / secs(len)
                            },
                            p50_ms: nearest_rank(d, 0.5).map(|ns| ns as f64 / 1e6),
                            p90_ms: nearest_rank(d, 0.9).map(|ns| ns as f64 / 1e6),
                        }
                    })
                    .collect(),
            }
        })
        .collect();

    let signals = signals(&windows);
    let gen: Vec<Option<f64>> = windows.iter().map(|r| r.gen_tok_s).collect();
    Timeline {
        window_s: secs(w.width_ns),
        key_threads: thread_names,
        correlations: correlations(&signals, &gen),
        throughput_drops: throughput_drops(&windows, &signals, drop_pct),
        windows,
    }
}

/// One signal's value in every window (None where it has none).
pub struct Signal {
    pub signal: &'static str,
    pub subject: String,
    /// A profiler signal (thread or probe), as opposed to an engine metric.
    pub profiler: bool,
    pub values: Vec<Option<f64>>,
}

/// Every signal of the windows: per key thread CPU, GIL wait and GC %; per probe p50 and
/// calls/s; the engines' KV-cache usage, running, waiting and prompt tokens/s.
pub fn signals(windows: &[WindowRow]) -> Vec<Signal> {
    let mut out = Vec::new();
    let Some(first) = windows.first() else {
        return out;
    };
    type ThreadGetter = fn(&ThreadWindow) -> f64;
    let thread_signals: [(&'static str, ThreadGetter); 3] = [
        ("cpu_pct", |t| t.cpu_pct),
        ("gil_wait_pct", |t| t.gil_wait_pct),
        ("gc_pct", |t| t.gc_pct),
    ];
    for (j, t) in first.threads.iter().enumerate() {
        for (name, get) in thread_signals {
            out.push(Signal {
                signal: name,
                subject: t.thread.clone(),
                profiler: true,
                values: windows.iter().map(|r| r.threads.get(j).map(get)).collect(),
            });
        }
    }
    for (k, p) in first.probes.iter().enumerate() {
        out.push(Signal {
            signal: "p50_ms",
            subject: p.probe.clone(),
            profiler: true,
            values: windows
                .iter()
                .map(|r| r.probes.get(k).and_then(|p| p.p50_ms))
                .collect(),
        });
        out.push(Signal {
            signal: "calls_per_s",
            subject: p.probe.clone(),
            profiler: true,
            values: windows
                .iter()
                .map(|r| r.probes.get(k).map(|p| p.calls_per_s))
                .collect(),
        });
    }
    type EngineGetter = fn(&WindowRow) -> Option<f64>;
    let engine_signals: [(&'static str, EngineGetter); 4] = [
        ("kv_usage", |r| r.kv_usage),
        ("running", |r| r.running),
        ("waiting", |r| r.waiting),
        ("prompt_tok_s", |r| r.prompt_tok_s),
    ];
    for (name, get) in engine_signals {
        out.push(Signal {
            signal: name,
            subject: "engines".into(),
            profiler: false,
            values: windows.iter().map(get).collect(),
        });
    }
    out
}

/// Pearson's r; None with fewer than 2 points or a constant series.
pub(crate) fn pearson(x: &[f64], y: &[f64]) -> Option<f64> {
    let n = x.len().min(y.len());
    if n < 2 {
        return None;
    }
    let mx = x[..n].iter().sum::<f64>() / n as f64;
    let my = y[..n].iter().sum::<f64>() / n as f64;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x[..n].iter().zip(&y[..n]) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx) * (a - mx);
        syy += (b - my) * (b - my);
    }
    if sxx <= 0.0 || syy <= 0.0 {
        return None;
    }
    Some((sxy / (sxx * syy).sqrt()).clamp(-1.0, 1.0))
}

/// Correlations of the profiler signals with `gen` (throughput per window). Signals constant
/// over the windows are left out; most strongly correlated (either sign) first.
pub fn correlations(signals: &[Signal], gen: &[Option<f64>]) -> Vec<Correlation> {
    if gen.iter().all(Option::is_none) {
        return Vec::new();
    }
    let mut out: Vec<Correlation> = signals
        .iter()
        .filter(|s| s.profiler)
        .filter_map(|s| {
            let (x, y): (Vec<f64>, Vec<f64>) = s
                .values
                .iter()
                .zip(gen)
                .filter_map(|(a, b)| Some(((*a)?, (*b)?)))
                .unzip();
            let n = x.len();
            // A signal that never varies says nothing either way.
            if n > 1 && x.iter().all(|v| *v == x[0]) {
                return None;
            }
            let r = pearson(&x, &y);
            let note = if n < MIN_CORRELATION_WINDOWS {
                format!("{n} windows with both values: too few (< {MIN_CORRELATION_WINDOWS}) for r to mean much")
            } else if r.is_none() {
                "throughput constant over these windows".to_string()
            } else {
                String::new()
            };
            Some(Correlation {
                signal: s.signal.to_string(),
                subject: s.subject.clone(),
                r,
                n,
                note,
            })
        })
        .collect();
    out.sort_by(|a, b| {
        let abs = |c: &Correlation| c.r.map_or(-1.0, f64::abs);
        abs(b)
            .total_cmp(&abs(a))
            .then(a.subject.cmp(&b.subject))
            .then(a.signal.cmp(&b.signal))
    });
    out
}

/// Median of values; None when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return None;
    }
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    Some(if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    })
}

fn std_dev(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = v.iter().sum::<f64>() / v.len() as f64;
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64).sqrt()
}

/// Windows whose throughput is more than `drop_pct` % below the median window's, each with
/// the signals furthest (in standard deviations) from their own medians.
pub fn throughput_drops(
    windows: &[WindowRow],
    signals: &[Signal],
    drop_pct: f64,
) -> Vec<ThroughputDrop> {
    let gen: Vec<f64> = windows.iter().filter_map(|r| r.gen_tok_s).collect();
    let Some(med) = median(&gen) else {
        return Vec::new();
    };
    if med <= 0.0 {
        return Vec::new();
    }
    // Per signal: median and spread over the windows that have it.
    let stats: Vec<(f64, f64)> = signals
        .iter()
        .map(|s| {
            let v: Vec<f64> = s.values.iter().flatten().copied().collect();
            (median(&v).unwrap_or(0.0), std_dev(&v))
        })
        .collect();
    let limit = med * (1.0 - drop_pct / 100.0);
    windows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            let g = r.gen_tok_s?;
            if g >= limit {
                return None;
            }
            let mut changed: Vec<SignalChange> = signals
                .iter()
                .zip(&stats)
                .filter_map(|(s, &(m, sd))| {
                    let v = (*s.values.get(i)?)?;
                    if sd <= 0.0 || v == m {
                        return None;
                    }
                    Some(SignalChange {
                        signal: s.signal.to_string(),
                        subject: s.subject.clone(),
                        value: v,
                        median: m,
                        change: v - m,
                        score: (v - m).abs() / sd,
                    })
                })
                .collect();
            changed.sort_by(|a, b| {
                b.score
                    .total_cmp(&a.score)
                    .then(a.subject.cmp(&b.subject))
                    .then(a.signal.cmp(&b.signal))
            });
            changed.truncate(DROP_SIGNALS);
            Some(ThroughputDrop {
                start_s: r.start_s,
                end_s: r.end_s,
                gen_tok_s: g,
                median_gen_tok_s: med,
                drop_pct: (med - g) / med * 100.0,
                changed,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pearson_known_answers() {
        assert_eq!(pearson(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0]), Some(1.0));
        assert_eq!(pearson(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]), Some(-1.0));
        assert_eq!(pearson(&[1.0, 1.0, 1.0], &[3.0, 2.0, 1.0]), None);
        // x = 1..4, y = 1, 3, 2, 4: r = 0.8.
        let r = pearson(&[1.0, 2.0, 3.0, 4.0], &[1.0, 3.0, 2.0, 4.0]).unwrap();
        assert!((r - 0.8).abs() < 1e-12, "{r}");
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn drops_name_what_changed() {
        let row = |gen: f64, cpu: f64, gc: f64| WindowRow {
            gen_tok_s: Some(gen),
            threads: vec![ThreadWindow {
                thread: "1:1 MainThread".into(),
                cpu_pct: cpu,
                gil_wait_pct: 0.0,
                gc_pct: gc,
            }],
            ..Default::default()
        };
        let w = vec![
            row(100.0, 50.0, 1.0),
            row(100.0, 50.0, 1.0),
            row(40.0, 52.0, 30.0),
            row(100.0, 48.0, 1.0),
        ];
        let s = signals(&w);
        let d = throughput_drops(&w, &s, 20.0);
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].gen_tok_s, d[0].median_gen_tok_s), (40.0, 100.0));
        assert_eq!(d[0].drop_pct, 60.0);
        assert_eq!(d[0].changed[0].signal, "gc_pct");
        assert_eq!(d[0].changed[0].change, 29.0);
        let c = correlations(&s, &w.iter().map(|r| r.gen_tok_s).collect::<Vec<_>>());
        // gil_wait_pct is constant: left out.
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].signal, "gc_pct");
        assert!(c[0].r.unwrap() < -0.99);
        assert_eq!(c[0].n, 4);
        assert!(c[0].note.contains("4 windows with both values: too few"));
    }
}
