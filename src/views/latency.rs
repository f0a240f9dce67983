//! Function latency from probed calls (`record --probe`, `Recording::probes` and `calls`): per
//! probe and thread, exact percentiles of the recorded call durations, and the same per time
//! window so that latency can be set against engine throughput.
//!
//! Percentiles are nearest-rank: pN is the smallest recorded duration such that at least N%
//! of the calls took at most that long, so it is always a duration that occurred (calls of 1,
//! 2, …, 10 ms have p50 5 ms, p90 9 ms, p99 10 ms). A call belongs to the window in which it
//! ended (when its latency became known, as a Prometheus histogram observes it).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::windows::Windows;
use super::{secs, Selection};
use crate::record::{ProbeInfo, Recording};

/// Nearest-rank percentile of sorted values, `q` in 0..=1; None when empty.
pub fn nearest_rank(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    // The epsilon keeps float error (0.7 * 10 = 7.000000000000001) from skipping a rank.
    let rank = (q * sorted.len() as f64 - 1e-9).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

/// Latency statistics of a set of calls, ms.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LatencyMs {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl LatencyMs {
    /// Statistics of call durations (ns), sorted in place; None without calls.
    pub fn of(durs: &mut [u64]) -> Option<LatencyMs> {
        durs.sort_unstable();
        let max = *durs.last()?;
        let total: u128 = durs.iter().map(|&d| u128::from(d)).sum();
        let pct = |q| nearest_rank(durs, q).map_or(0.0, ms);
        Some(LatencyMs {
            p50: pct(0.5),
            p90: pct(0.9),
            p99: pct(0.99),
            max: ms(max),
            mean: total as f64 / durs.len() as f64 / 1e6,
        })
    }
}

/// Calls of one window.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LatencyPoint {
    /// Window start, s since the recording's start.
    pub start_s: f64,
    pub calls: u64,
    /// Null when the window has no call.
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
}

/// Calls of one probed function by one thread.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FunctionLatencyRow {
    /// The probe as asked for (`record --probe`).
    pub probe: String,
    /// Qualified name and file of the matched code object.
    pub function: String,
    pub file: String,
    pub pid: i32,
    pub tid: i32,
    /// Thread name (empty when unknown).
    pub thread: String,
    pub calls: u64,
    /// Calls over the time the probe was attached (from its attach time to the end), per s.
    pub calls_per_s: f64,
    /// Summed duration of the calls, s.
    pub total_s: f64,
    /// Statistics of the calls' durations.
    pub latency_ms: LatencyMs,
    /// `exact` (every call timed) or `sampled` (calls followed across samples: only calls
    /// longer than `resolution_ms` are seen, and durations are in sampling periods).
    pub method: String,
    /// Smallest duration the method resolves, ms.
    pub resolution_ms: f64,
    /// Per window of the report (`window_s`): calls ending in it and their p50/p90.
    pub latency_series: Vec<LatencyPoint>,
}

/// Probes by id; a probe written twice keeps its latest description.
pub fn probes_by_id(rec: &Recording) -> BTreeMap<u32, &ProbeInfo> {
    rec.probes.iter().map(|p| (p.id, p)).collect()
}

/// Rows of `function_latency`: per probe and selected thread, most calls first (ties by
/// probe, pid, tid).
pub fn function_latency(
    rec: &Recording,
    sel: &Selection,
    windows: &Windows,
) -> Vec<FunctionLatencyRow> {
    let probes = probes_by_id(rec);
    // One row per function and thread whatever the method over time: a probe switched to
    // sampling mid-run is a second probe record on the same function, whose calls join the
    // first's row (keyed by the first probe of that function in that process).
    let mut first_of: BTreeMap<(i32, &str, &str), u32> = BTreeMap::new();
    for p in &rec.probes {
        first_of
            .entry((p.pid, p.function.as_str(), p.file.as_str()))
            .or_insert(p.id);
    }
    let row_of = |probe: u32| {
        probes
            .get(&probe)
            .and_then(|p| first_of.get(&(p.pid, p.function.as_str(), p.file.as_str())))
            .copied()
            .unwrap_or(probe)
    };
    let mut by_key: BTreeMap<(u32, i32, i32), Vec<(u64, u64)>> = BTreeMap::new();
    let mut methods: BTreeMap<(u32, i32, i32), Vec<u32>> = BTreeMap::new();
    for c in rec.calls.iter().filter(|c| sel.contains(c.pid, c.tid)) {
        let key = (row_of(c.probe), c.pid, c.tid);
        by_key
            .entry(key)
            .or_default()
            .push((c.start_ns.saturating_add(c.dur_ns), c.dur_ns));
        let m = methods.entry(key).or_default();
        if !m.contains(&c.probe) {
            m.push(c.probe);
        }
    }
    let mut rows: Vec<FunctionLatencyRow> = by_key
        .into_iter()
        .filter_map(|((probe, pid, tid), calls)| {
            let p = probes.get(&probe).copied();
            // The methods that produced the row's calls, in probe order: `exact`, `sampled`,
            // or `exact, then sampled` (a rate cap or a lost register switched it).
            let mut used: Vec<&ProbeInfo> = methods
                .get(&(probe, pid, tid))
                .into_iter()
                .flatten()
                .filter_map(|id| probes.get(id).copied())
                .collect();
            used.sort_by_key(|p| p.id);
            let mut method: Vec<&str> = Vec::new();
            for u in &used {
                if !method.contains(&u.method.as_str()) {
                    method.push(u.method.as_str());
                }
            }
            let method = method.join(", then ");
            let resolution_ns = used.iter().map(|p| p.resolution_ns).max().unwrap_or(0);
            let mut durs: Vec<u64> = calls.iter().map(|&(_, d)| d).collect();
            let latency_ms = LatencyMs::of(&mut durs)?;
            let attached = p.map_or(0, |p| p.t_ns);
            let observed = windows.end_ns.saturating_sub(attached);
            let mut per_window: Vec<Vec<u64>> = vec![Vec::new(); windows.count];
            for &(end, d) in &calls {
                if let Some(i) = windows.index(end) {
                    per_window[i].push(d);
                }
            }
            Some(FunctionLatencyRow {
                probe: p.map(|p| p.spec.clone()).unwrap_or_default(),
                function: p.map(|p| p.function.clone()).unwrap_or_default(),
                file: p.map(|p| p.file.clone()).unwrap_or_default(),
                pid,
                tid,
                thread: rec.thread_name(pid, tid).to_string(),
                calls: calls.len() as u64,
                calls_per_s: if observed == 0 {
                    0.0
                } else {
                    calls.len() as f64 / secs(observed)
                },
                total_s: secs(durs.iter().sum()),
                latency_ms,
                method,
                resolution_ms: ms(resolution_ns),
                latency_series: per_window
                    .iter_mut()
                    .enumerate()
                    .map(|(i, d)| window_point(windows, i, d))
                    .collect(),
            })
        })
        .collect();
    rows.sort_by(|a, b| {
        b.calls
            .cmp(&a.calls)
            .then(a.probe.cmp(&b.probe))
            .then((a.pid, a.tid).cmp(&(b.pid, b.tid)))
    });
    rows
}

/// The p50/p90 of one window's call durations.
pub fn window_point(windows: &Windows, i: usize, durs: &mut [u64]) -> LatencyPoint {
    durs.sort_unstable();
    LatencyPoint {
        start_s: secs(windows.bounds(i).0),
        calls: durs.len() as u64,
        p50_ms: nearest_rank(durs, 0.5).map(ms),
        p90_ms: nearest_rank(durs, 0.9).map(ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=10).collect();
        assert_eq!(nearest_rank(&v, 0.5), Some(5));
        assert_eq!(nearest_rank(&v, 0.9), Some(9));
        assert_eq!(nearest_rank(&v, 0.99), Some(10));
        assert_eq!(nearest_rank(&v, 0.0), Some(1));
        assert_eq!(nearest_rank(&[], 0.5), None);
        let mut d: Vec<u64> = (1..=10).rev().map(|m| m * 1_000_000).collect();
        let l = LatencyMs::of(&mut d).unwrap();
        assert_eq!(
            (l.p50, l.p90, l.p99, l.max, l.mean),
            (5.0, 9.0, 10.0, 10.0, 5.5)
        );
    }
}
