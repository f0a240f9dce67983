//! Fleet findings: situations of one engine among several, each naming the engine and what
//! its EngineCore's main thread did meanwhile (CPU, GIL wait, GC), from the report's windows.
//!
//! * `kv_memory_wall`: requests wait (waiting > 0) while the KV cache is full (usage at least
//!   95% on average or at any scrape of the window, or the engine preempted requests for lack
//!   of KV blocks: `vllm:num_preemptions_total` rose) and running stays below 90% of the
//!   engine's own peak (or at most 1): requests queue for KV memory, not compute. (A real
//!   engine at its KV limit swings: it admits until the cache is full, preempts, frees,
//!   admits again; measured on vLLM 0.32 with 24 KV blocks at c=16, window means of KV usage
//!   were 73-89%, with 100% at scrapes and 67 preemptions in 30 s, running 4-7 of a peak of 12,
//!   waiting 9-12. A compute-bound engine runs at its peak.)
//! * `queue_while_others_idle`: the engine has requests waiting (≥ 1) while every other engine
//!   has none (< 0.5): the router sends work where there is no room for it.
//! * `ttft_outlier`: the engine's TTFT p90 over the recording is at least twice the median of
//!   the other engines' and at least 10 ms above it.
//!
//! Consecutive windows of one situation make one finding. Gauges are the windows' means of
//! the scraped values.

use serde::{Deserialize, Serialize};

use super::engines::EngineRow;
use super::timeline::WindowRow;
use super::windows::Windows;
use crate::metrics::index::MetricIndex;
use crate::metrics::names;
use crate::record::Recording;

/// KV usage at or above this is "full".
pub(crate) const KV_FULL: f64 = 0.95;
/// TTFT p90 outlier: at least this many times the others' median...
pub(crate) const TTFT_OUTLIER_RATIO: f64 = 2.0;
/// ...and at least this many ms above it.
pub(crate) const TTFT_OUTLIER_MIN_MS: f64 = 10.0;

/// One situation of one engine.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct FleetFinding {
    /// `kv_memory_wall`, `queue_while_others_idle`, `ttft_outlier`.
    pub kind: String,
    pub engine: String,
    /// s since the recording's start.
    pub start_s: f64,
    pub end_s: f64,
    /// What was seen, with the figures.
    pub detail: String,
    /// The engine's EngineCore main thread(s) over that time, % of one CPU (averaged over
    /// its cores): on CPU, waiting for the GIL, collecting garbage. Null when the recording
    /// has no samples of them.
    pub engine_core_cpu_pct: Option<f64>,
    pub engine_core_gil_wait_pct: Option<f64>,
    pub engine_core_gc_pct: Option<f64>,
}

/// The EngineCore main threads' CPU, GIL-wait and GC shares over `[t0, t1)`, %.
fn core_figures(rec: &Recording, engine: &str, t0: u64, t1: u64) -> [Option<f64>; 3] {
    let cores: Vec<i32> = rec
        .engines
        .iter()
        .rev()
        .find(|e| e.id == engine)
        .map(|e| e.engine_core_pids.clone())
        .unwrap_or_default();
    let sampled = |pid: i32| rec.samples.iter().any(|s| s.pid == pid);
    let cores: Vec<i32> = cores.into_iter().filter(|&p| sampled(p)).collect();
    if cores.is_empty() || t1 <= t0 {
        return [None; 3];
    }
    let overlap = |s: u64, d: u64| s.saturating_add(d).min(t1).saturating_sub(s.max(t0));
    let mine = |pid: i32, tid: i32| tid == pid && cores.contains(&pid);
    let cpu: u64 = rec
        .samples
        .iter()
        .filter(|s| mine(s.pid, s.tid) && (t0..t1).contains(&s.t_ns))
        .map(|s| u64::from(s.weight_ns))
        .sum();
    let gil: u64 = rec
        .gil_waits
        .iter()
        .filter(|g| mine(g.pid, g.tid))
        .map(|g| overlap(g.start_ns, g.dur_ns))
        .sum();
    let gc: u64 = rec
        .gc_pauses
        .iter()
        .filter(|g| mine(g.pid, g.tid))
        .map(|g| overlap(g.start_ns, g.dur_ns))
        .sum();
    let whole = (t1 - t0) as f64 * cores.len() as f64;
    [cpu, gil, gc].map(|v| Some(v as f64 * 100.0 / whole))
}

fn finding(
    rec: &Recording,
    kind: &str,
    engine: &str,
    (t0, t1): (u64, u64),
    detail: String,
) -> FleetFinding {
    let [cpu, gil, gc] = core_figures(rec, engine, t0, t1);
    FleetFinding {
        kind: kind.into(),
        engine: engine.into(),
        start_s: t0 as f64 / 1e9,
        end_s: t1 as f64 / 1e9,
        detail,
        engine_core_cpu_pct: cpu,
        engine_core_gil_wait_pct: gil,
        engine_core_gc_pct: gc,
    }
}

/// Runs of consecutive windows where `hit(i)` holds, as `(first, last)`.
fn runs(n: usize, hit: impl Fn(usize) -> bool) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for i in (0..n).filter(|&i| hit(i)) {
        match out.last_mut() {
            Some(r) if r.1 + 1 == i => r.1 = i,
            _ => out.push((i, i)),
        }
    }
    out
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// Every finding, by kind then engine then time.
pub fn findings(
    rec: &Recording,
    ix: &MetricIndex,
    rows: &[EngineRow],
    windows: &[WindowRow],
    w: &Windows,
) -> Vec<FleetFinding> {
    let mut out = Vec::new();
    let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    // The engine's figures in window i.
    let at = |i: usize, id: &str| windows[i].engines.iter().find(|e| e.id == id);
    let span = |(a, b): (usize, usize)| (w.bounds(a).0, w.bounds(b).1);
    let n = windows.len().min(w.count);

    for &id in &ids {
        let running_pts = ix.gauge(id, &names::RUNNING);
        let kv_pts = ix.gauge(id, &names::KV_CACHE_USAGE);
        // The engine's peak running requests: of every scrape, and of the windows' means.
        let peak = (0..n)
            .filter_map(|i| at(i, id)?.running)
            .chain(running_pts.iter().map(|p| p.1))
            .fold(0.0, f64::max);
        let low = (0.9 * peak).max(1.0);
        let in_window = |pts: &[(u64, f64)], i: usize| {
            let (t0, t1) = w.bounds(i);
            pts.iter()
                .filter(|p| (t0..t1).contains(&p.0))
                .map(|p| p.1)
                .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
        };
        let kv_max = |i: usize| in_window(&kv_pts, i);
        let preempted = |i: usize| {
            let (t0, t1) = w.bounds(i);
            ix.increase(id, &names::PREEMPTIONS, t0, t1)
                .map_or(0.0, |x| x.value)
        };
        let wall = |i: usize| {
            at(i, id).is_some_and(|e| {
                let full = e.kv_usage.is_some_and(|k| k >= KV_FULL)
                    || kv_max(i).is_some_and(|k| k >= KV_FULL)
                    || preempted(i) > 0.0;
                e.waiting.is_some_and(|x| x > 0.0) && full && e.running.is_some_and(|r| r <= low)
            })
        };
        for r in runs(n, wall) {
            let vals = |f: fn(&super::timeline::EngineWindow) -> Option<f64>| {
                let v: Vec<f64> = (r.0..=r.1).filter_map(|i| f(at(i, id)?)).collect();
                v.iter().sum::<f64>() / v.len().max(1) as f64
            };
            let max_kv = (r.0..=r.1)
                .filter_map(|i| kv_max(i).or(at(i, id)?.kv_usage))
                .fold(0.0, f64::max);
            let preemptions: f64 = (r.0..=r.1).map(preempted).sum();
            out.push(finding(
                rec,
                "kv_memory_wall",
                id,
                span(r),
                format!(
                    "waiting {:.1}, KV cache {:.1}% full (at most {:.1}%), {:.0} preemptions, \
                     running {:.1} (its peak {:.1}): requests queue for KV memory, not compute",
                    vals(|e| e.waiting),
                    100.0 * vals(|e| e.kv_usage),
                    100.0 * max_kv,
                    preemptions,
                    vals(|e| e.running),
                    peak
                ),
            ));
        }
    }

    if ids.len() >= 2 {
        for &id in &ids {
            let alone = |i: usize| {
                at(i, id).is_some_and(|e| e.waiting.is_some_and(|x| x >= 1.0))
                    && ids
                        .iter()
                        .filter(|&&o| o != id)
                        .all(|&o| at(i, o).is_some_and(|e| e.waiting.is_some_and(|x| x < 0.5)))
            };
            for r in runs(n, alone) {
                let waiting = |i: usize| at(i, id).and_then(|e| e.waiting).unwrap_or(0.0);
                let (first, last) = (waiting(r.0), waiting(r.1));
                out.push(finding(
                    rec,
                    "queue_while_others_idle",
                    id,
                    span(r),
                    format!(
                        "waiting {first:.1} → {last:.1}{} while the {} other engines had none",
                        if last > first { " (growing)" } else { "" },
                        ids.len() - 1
                    ),
                ));
            }
        }

        let end = w.end_ns;
        for r in rows {
            let Some(p90) = r.ttft_ms.p90 else { continue };
            let Some(others) = median(
                rows.iter()
                    .filter(|o| o.id != r.id)
                    .filter_map(|o| o.ttft_ms.p90)
                    .collect(),
            ) else {
                continue;
            };
            if p90 >= TTFT_OUTLIER_RATIO * others && p90 - others >= TTFT_OUTLIER_MIN_MS {
                out.push(finding(
                    rec,
                    "ttft_outlier",
                    &r.id,
                    (0, end),
                    format!(
                        "TTFT p90 {p90:.1} ms vs {others:.1} ms (median of the other engines'), \
                         {:.1}x",
                        p90 / others.max(f64::MIN_POSITIVE)
                    ),
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::views::timeline::EngineWindow;

    fn ew(id: &str, kv: f64, running: f64, waiting: f64) -> EngineWindow {
        EngineWindow {
            id: id.into(),
            kv_usage: Some(kv),
            running: Some(running),
            waiting: Some(waiting),
            ..Default::default()
        }
    }

    #[test]
    fn detectors_name_the_engine() {
        const S: u64 = 1_000_000_000;
        let rec = Recording::default();
        let w = Windows::new(10 * S, 40 * S);
        // e0: normal (running 8). e1: KV wall in windows 1-2. e2: waiting alone in window 3.
        let windows: Vec<WindowRow> = (0..4)
            .map(|i| WindowRow {
                engines: vec![
                    ew("e0", 0.5, 8.0, 0.0),
                    if i == 1 || i == 2 {
                        ew("e1", 0.97, 0.0, 6.0)
                    } else {
                        ew("e1", 0.5, 8.0, 0.0)
                    },
                    ew("e2", 0.3, 4.0, if i == 3 { 3.0 } else { 0.0 }),
                ],
                ..Default::default()
            })
            .collect();
        let mut rows: Vec<EngineRow> = ["e0", "e1", "e2"]
            .iter()
            .map(|id| EngineRow {
                id: id.to_string(),
                ..Default::default()
            })
            .collect();
        rows[0].ttft_ms.p90 = Some(40.0);
        rows[1].ttft_ms.p90 = Some(50.0);
        rows[2].ttft_ms.p90 = Some(320.0);
        let f = findings(&rec, &MetricIndex::new(&rec), &rows, &windows, &w);
        let got: Vec<(&str, &str, f64, f64)> = f
            .iter()
            .map(|x| (x.kind.as_str(), x.engine.as_str(), x.start_s, x.end_s))
            .collect();
        assert_eq!(
            got,
            [
                ("kv_memory_wall", "e1", 10.0, 30.0),
                ("queue_while_others_idle", "e1", 10.0, 30.0),
                ("queue_while_others_idle", "e2", 30.0, 40.0),
                ("ttft_outlier", "e2", 0.0, 40.0),
            ]
        );
        assert!(
            f[0].detail.contains("KV cache 97.0% full"),
            "{}",
            f[0].detail
        );
        assert!(
            f[3].detail.contains("320.0 ms vs 45.0 ms"),
            "{}",
            f[3].detail
        );
        // Two engines both near zero TTFT: no outlier (absolute floor).
        rows[2].ttft_ms.p90 = Some(3.0);
        rows[0].ttft_ms.p90 = Some(1.0);
        rows[1].ttft_ms.p90 = Some(1.0);
        assert!(
            !findings(&rec, &MetricIndex::new(&rec), &rows, &windows, &w)
                .iter()
                .any(|x| x.kind == "ttft_outlier")
        );
    }
}
