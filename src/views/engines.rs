//! Engine metrics from the Prometheus scrapes in a recording (`Recording::series`,
//! `Recording::metrics`): token rates from counter deltas (resets handled), gauge statistics,
//! and latency quantiles from histogram bucket deltas, interpolated as Prometheus'
//! `histogram_quantile` does. Every value of a family is summed over its label sets (other
//! than `le`), per engine.
//!
//! Counters are stored raw (cumulative). The increase between two consecutive scrapes is
//! `v1 - v0`, or `v1` when the value went down (the counter restarted from zero), and it is
//! spread evenly over the time between them, so a time range gets its share of every scrape
//! interval it overlaps. A rate over a range is that increase over the part of the range that
//! scrape intervals cover: a range without two scrapes around it has no rate.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::record::Recording;

/// vLLM metric names read here.
pub mod names {
    pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
    pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
    pub const KV_CACHE_USAGE: &str = "vllm:kv_cache_usage_perc";
    pub const RUNNING: &str = "vllm:num_requests_running";
    pub const WAITING: &str = "vllm:num_requests_waiting";
    pub const TTFT: &str = "vllm:time_to_first_token_seconds";
    pub const ITL: &str = "vllm:inter_token_latency_seconds";
    pub const E2E: &str = "vllm:e2e_request_latency_seconds";
    pub const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
    pub const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
}

/// How a gauge's label sets combine into one value per scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GaugeAgg {
    /// Counts (requests running, waiting): summed.
    Sum,
    /// Fractions of something each label set has its own of (KV-cache usage): averaged.
    Mean,
}

/// One series' points in time order.
struct Points<'r> {
    le: Option<&'r str>,
    pts: Vec<(u64, f64)>,
}

/// A recording's metric points by engine and sample name.
pub struct MetricIndex<'r> {
    by_engine: BTreeMap<&'r str, BTreeMap<&'r str, Vec<Points<'r>>>>,
}

/// Increase of a counter over a time range.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Increase {
    /// Summed over the family's label sets.
    pub value: f64,
    /// ns of the range covered by scrape intervals (the most any label set covered).
    pub covered_ns: u64,
}

impl Increase {
    /// Per second over the covered time; None when nothing covered the range.
    pub fn rate(&self) -> Option<f64> {
        (self.covered_ns > 0).then(|| self.value / (self.covered_ns as f64 / 1e9))
    }
}

/// The increase of one raw counter series within `[t0, t1)`, and the ns of it covered.
pub fn series_increase(pts: &[(u64, f64)], t0: u64, t1: u64) -> (f64, u64) {
    let (mut inc, mut covered) = (0.0, 0u64);
    // Points are in time order: start at the last point before the range, stop past it.
    let first = pts.partition_point(|p| p.0 < t0).saturating_sub(1);
    for w in pts[first..].windows(2) {
        let ((ta, va), (tb, vb)) = (w[0], w[1]);
        if ta >= t1 {
            break;
        }
        if !va.is_finite() || !vb.is_finite() {
            continue;
        }
        // A decrease is a restart from zero: everything counted since is `vb`.
        let d = if vb >= va { vb - va } else { vb.max(0.0) };
        if tb <= ta {
            if (t0..t1).contains(&ta) {
                inc += d;
            }
            continue;
        }
        let (lo, hi) = (ta.max(t0), tb.min(t1));
        if hi <= lo {
            continue;
        }
        let part = hi - lo;
        inc += if part == tb - ta {
            d
        } else {
            d * part as f64 / (tb - ta) as f64
        };
        covered += part;
    }
    (inc, covered)
}

/// Prometheus' `histogram_quantile`: `buckets` are cumulative `(le, count)` pairs (any
/// order); the last bound must be `+Inf`. Linear interpolation inside the bucket the rank
/// falls in (from 0 for the first bucket); a rank in the `+Inf` bucket gives the highest
/// finite bound. None without observations or without a `+Inf` bucket.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let mut b: Vec<(f64, f64)> = buckets
        .iter()
        .copied()
        .filter(|(le, c)| !le.is_nan() && c.is_finite())
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    if b.len() < 2 || b.last().is_none_or(|l| l.0 != f64::INFINITY) || !(0.0..=1.0).contains(&q) {
        return None;
    }
    // Counts from deltas of separately scraped series can be slightly non-monotonic.
    for i in 1..b.len() {
        b[i].1 = b[i].1.max(b[i - 1].1);
    }
    let total = b[b.len() - 1].1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let i = b[..b.len() - 1]
        .iter()
        .position(|&(_, c)| c >= rank)
        .unwrap_or(b.len() - 1);
    if i == b.len() - 1 {
        return Some(b[b.len() - 2].0);
    }
    let (end, count) = b[i];
    let (start, below) = if i == 0 {
        if end <= 0.0 {
            return Some(end);
        }
        (0.0, 0.0)
    } else {
        b[i - 1]
    };
    let in_bucket = count - below;
    if in_bucket <= 0.0 {
        return Some(end);
    }
    Some(start + (end - start) * (rank - below) / in_bucket)
}

/// A histogram's increase over a time range: cumulative buckets, sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistogramDelta {
    /// `(le, cumulative count)`, by `le`, the last `+Inf`.
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

/// p50/p90/p99 and mean of a latency histogram, ms; null without observations.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LatencyQuantiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    /// `_sum` increase over `_count` increase.
    pub mean: Option<f64>,
    /// Observations (requests, or tokens for inter-token latency): the `_count` increase.
    pub count: f64,
}

impl HistogramDelta {
    pub fn quantile(&self, q: f64) -> Option<f64> {
        histogram_quantile(q, &self.buckets)
    }

    /// Quantiles in ms of a histogram in seconds.
    pub fn quantiles_ms(&self) -> LatencyQuantiles {
        let ms = |v: Option<f64>| v.map(|s| s * 1e3);
        LatencyQuantiles {
            p50: ms(self.quantile(0.5)),
            p90: ms(self.quantile(0.9)),
            p99: ms(self.quantile(0.99)),
            mean: (self.count > 0.0).then(|| self.sum / self.count * 1e3),
            count: self.count,
        }
    }
}

fn parse_le(le: &str) -> Option<f64> {
    match le.trim() {
        "+Inf" | "Inf" | "inf" | "+inf" => Some(f64::INFINITY),
        s => s.parse::<f64>().ok().filter(|v| !v.is_nan()),
    }
}

impl<'r> MetricIndex<'r> {
    pub fn new(rec: &'r Recording) -> Self {
        // Series by id; a series record written twice keeps its first description.
        let mut slots: BTreeMap<u32, (&'r str, &'r str, Points<'r>)> = BTreeMap::new();
        for s in &rec.series {
            slots.entry(s.id).or_insert((
                s.engine.as_str(),
                s.name.as_str(),
                Points {
                    le: s.labels.get("le").map(String::as_str),
                    pts: Vec::new(),
                },
            ));
        }
        for m in &rec.metrics {
            if let Some((_, _, p)) = slots.get_mut(&m.series) {
                p.pts.push((m.t_ns, m.value));
            }
        }
        let mut by_engine: BTreeMap<&'r str, BTreeMap<&'r str, Vec<Points<'r>>>> = BTreeMap::new();
        for (_, (engine, name, mut p)) in slots {
            p.pts.sort_by_key(|&(t, _)| t);
            by_engine
                .entry(engine)
                .or_default()
                .entry(name)
                .or_default()
                .push(p);
        }
        MetricIndex { by_engine }
    }

    /// Engines that have at least one series, by id.
    pub fn engines(&self) -> impl Iterator<Item = &'r str> + '_ {
        self.by_engine.keys().copied()
    }

    fn series(&self, engine: &str, name: &str) -> &[Points<'r>] {
        self.by_engine
            .get(engine)
            .and_then(|m| m.get(name))
            .map_or(&[], Vec::as_slice)
    }

    /// Whether the engine has any series of this name.
    pub fn has(&self, engine: &str, name: &str) -> bool {
        !self.series(engine, name).is_empty()
    }

    /// Distinct scrape times of the engine (any series).
    pub fn scrapes(&self, engine: &str) -> usize {
        let mut t: Vec<u64> = self
            .by_engine
            .get(engine)
            .into_iter()
            .flat_map(|m| m.values())
            .flatten()
            .flat_map(|p| p.pts.iter().map(|&(t, _)| t))
            .collect();
        t.sort_unstable();
        t.dedup();
        t.len()
    }

    /// Increase of a counter within `[t0, t1)`, summed over its label sets; None when the
    /// engine has no such series.
    pub fn increase(&self, engine: &str, name: &str, t0: u64, t1: u64) -> Option<Increase> {
        let series = self.series(engine, name);
        if series.is_empty() {
            return None;
        }
        let mut out = Increase::default();
        for p in series {
            let (v, c) = series_increase(&p.pts, t0, t1);
            out.value += v;
            out.covered_ns = out.covered_ns.max(c);
        }
        Some(out)
    }

    /// A counter's rate per second within `[t0, t1)`.
    pub fn rate(&self, engine: &str, name: &str, t0: u64, t1: u64) -> Option<f64> {
        self.increase(engine, name, t0, t1)?.rate()
    }

    /// A gauge's value at each scrape, its label sets combined by `agg`, in time order.
    pub fn gauge(&self, engine: &str, name: &str, agg: GaugeAgg) -> Vec<(u64, f64)> {
        let mut by_t: BTreeMap<u64, (f64, u32)> = BTreeMap::new();
        for p in self.series(engine, name) {
            for &(t, v) in p.pts.iter().filter(|(_, v)| v.is_finite()) {
                let e = by_t.entry(t).or_default();
                e.0 += v;
                e.1 += 1;
            }
        }
        by_t.into_iter()
            .map(|(t, (sum, n))| {
                (
                    t,
                    match agg {
                        GaugeAgg::Sum => sum,
                        GaugeAgg::Mean => sum / f64::from(n),
                    },
                )
            })
            .collect()
    }

    /// A histogram's bucket, sum and count increases within `[t0, t1)`, summed over label
    /// sets other than `le`; None when the engine has no buckets for `base` (the family name
    /// without `_bucket`).
    pub fn histogram(&self, engine: &str, base: &str, t0: u64, t1: u64) -> Option<HistogramDelta> {
        let buckets = self.series(engine, &format!("{base}_bucket"));
        if buckets.is_empty() {
            return None;
        }
        let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for p in buckets {
            let Some(le) = p.le.and_then(parse_le) else {
                continue;
            };
            let (v, _) = series_increase(&p.pts, t0, t1);
            // Key by the bound's bits (bounds are non-negative, so bit order is value order).
            by_le.entry(le.to_bits()).or_insert((le, 0.0)).1 += v;
        }
        let inc = |suffix: &str| {
            self.series(engine, &format!("{base}_{suffix}"))
                .iter()
                .map(|p| series_increase(&p.pts, t0, t1).0)
                .sum::<f64>()
        };
        let mut buckets: Vec<(f64, f64)> = by_le.into_values().collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(HistogramDelta {
            buckets,
            sum: inc("sum"),
            count: inc("count"),
        })
    }
}

/// Mean and max of a list of values; None when empty.
pub fn mean_max(v: impl IntoIterator<Item = f64>) -> Option<(f64, f64)> {
    let (mut n, mut sum, mut max) = (0u64, 0.0, f64::NEG_INFINITY);
    for x in v {
        n += 1;
        sum += x;
        max = max.max(x);
    }
    (n > 0).then(|| (sum / n as f64, max))
}

/// Generation rate over the recording: overall, and the lowest and highest window.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct RateStats {
    /// Total increase over the time scrapes cover, per s.
    pub mean: Option<f64>,
    /// Lowest and highest rate of the report's windows (`window_s`).
    pub min: Option<f64>,
    pub max: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct MeanRate {
    pub mean: Option<f64>,
}

/// A gauge over the recording: mean and max of its scraped values.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct GaugeStats {
    pub mean: Option<f64>,
    pub max: Option<f64>,
}

/// One engine over the whole recording.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EngineRow {
    pub id: String,
    /// 0 when there is no API server (offline `LLM` script).
    pub api_server_pid: i32,
    pub engine_core_pids: Vec<i32>,
    pub worker_pids: Vec<i32>,
    /// Empty when its metrics were not scraped.
    pub metrics_url: String,
    /// Scrapes recorded (distinct scrape times).
    pub scrapes: u64,
    /// Generated tokens per s.
    pub gen_tok_s: RateStats,
    /// Prompt tokens per s.
    pub prompt_tok_s: MeanRate,
    /// KV-cache usage, 0..1 (averaged over label sets).
    pub kv_usage: GaugeStats,
    /// Requests running and waiting (summed over label sets).
    pub running: GaugeStats,
    pub waiting: GaugeStats,
    /// Time to first token, inter-token latency, end-to-end request latency, ms, over the
    /// whole recording (bucket increases).
    pub ttft_ms: LatencyQuantiles,
    pub itl_ms: LatencyQuantiles,
    pub e2e_ms: LatencyQuantiles,
    /// Prefix-cache hits over queries (tokens) during the recording; null without queries.
    pub prefix_cache_hit_rate: Option<f64>,
    /// Failed scrapes.
    pub scrape_errors: u64,
    /// The last failure's message (empty when none).
    pub last_scrape_error: String,
}

/// The highest and lowest engine by one figure.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Spread {
    pub max: f64,
    pub max_engine: String,
    pub min: f64,
    pub min_engine: String,
    /// `max / min`; null when `min` is 0.
    pub max_over_min: Option<f64>,
}

/// How unevenly engines are loaded; only with two or more engines.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct EngineImbalance {
    /// Engines with the figure.
    pub engines: usize,
    /// Of `gen_tok_s.mean`; null when fewer than two engines have it.
    pub gen_tok_s: Option<Spread>,
    /// Of `kv_usage.mean`.
    pub kv_usage: Option<Spread>,
    /// Of `running.mean`.
    pub running: Option<Spread>,
}

fn spread<'a>(v: impl IntoIterator<Item = (&'a str, Option<f64>)>) -> Option<Spread> {
    let v: Vec<(&str, f64)> = v.into_iter().filter_map(|(k, x)| Some((k, x?))).collect();
    if v.len() < 2 {
        return None;
    }
    // First of equals wins: engines come sorted by id.
    let mut hi = v[0];
    let mut lo = v[0];
    for &(k, x) in &v[1..] {
        if x > hi.1 {
            hi = (k, x);
        }
        if x < lo.1 {
            lo = (k, x);
        }
    }
    Some(Spread {
        max: hi.1,
        max_engine: hi.0.to_string(),
        min: lo.1,
        min_engine: lo.0.to_string(),
        max_over_min: (lo.1 > 0.0).then(|| hi.1 / lo.1),
    })
}

/// Engine ids of a recording: described ones and any that only have metrics, sorted.
pub fn engine_ids(rec: &Recording, ix: &MetricIndex) -> Vec<String> {
    let mut ids: std::collections::BTreeSet<String> =
        rec.engines.iter().map(|e| e.id.clone()).collect();
    ids.extend(ix.engines().map(str::to_string));
    ids.into_iter().collect()
}

/// One row per engine over `[0, end_ns)`; `min`/`max` rates come from `windows`.
pub fn engine_rows(
    rec: &Recording,
    ix: &MetricIndex,
    ids: &[String],
    windows: &[super::timeline::WindowRow],
    end_ns: u64,
) -> Vec<EngineRow> {
    ids.iter()
        .map(|id| {
            let info = rec.engines.iter().rev().find(|e| &e.id == id);
            let per_window: Vec<f64> = windows
                .iter()
                .filter_map(|w| w.engines.iter().find(|e| &e.id == id)?.gen_tok_s)
                .collect();
            let gauge = |name: &str, agg: GaugeAgg| {
                let (mean, max) = mean_max(ix.gauge(id, name, agg).into_iter().map(|(_, v)| v))
                    .map_or((None, None), |(m, x)| (Some(m), Some(x)));
                GaugeStats { mean, max }
            };
            let latency = |base: &str| {
                ix.histogram(id, base, 0, end_ns.max(1))
                    .map(|h| h.quantiles_ms())
                    .unwrap_or_default()
            };
            let queries = ix.increase(id, names::PREFIX_QUERIES, 0, end_ns.max(1));
            let hits = ix.increase(id, names::PREFIX_HITS, 0, end_ns.max(1));
            let errors: Vec<&crate::record::ScrapeError> = rec
                .scrape_errors
                .iter()
                .filter(|e| &e.engine == id)
                .collect();
            EngineRow {
                id: id.clone(),
                api_server_pid: info.map_or(0, |e| e.api_server_pid),
                engine_core_pids: info.map(|e| e.engine_core_pids.clone()).unwrap_or_default(),
                worker_pids: info.map(|e| e.worker_pids.clone()).unwrap_or_default(),
                metrics_url: info.map(|e| e.metrics_url.clone()).unwrap_or_default(),
                scrapes: ix.scrapes(id) as u64,
                gen_tok_s: RateStats {
                    mean: ix.rate(id, names::GENERATION_TOKENS, 0, end_ns.max(1)),
                    min: per_window.iter().copied().reduce(f64::min),
                    max: per_window.iter().copied().reduce(f64::max),
                },
                prompt_tok_s: MeanRate {
                    mean: ix.rate(id, names::PROMPT_TOKENS, 0, end_ns.max(1)),
                },
                kv_usage: gauge(names::KV_CACHE_USAGE, GaugeAgg::Mean),
                running: gauge(names::RUNNING, GaugeAgg::Sum),
                waiting: gauge(names::WAITING, GaugeAgg::Sum),
                ttft_ms: latency(names::TTFT),
                itl_ms: latency(names::ITL),
                e2e_ms: latency(names::E2E),
                prefix_cache_hit_rate: match (queries, hits) {
                    (Some(q), Some(h)) if q.value > 0.0 => Some(h.value / q.value),
                    _ => None,
                },
                scrape_errors: errors.len() as u64,
                last_scrape_error: errors.last().map(|e| e.error.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

/// Spread of throughput, KV usage and running requests across engines; None with fewer
/// than two engines.
pub fn imbalance(rows: &[EngineRow]) -> Option<EngineImbalance> {
    if rows.len() < 2 {
        return None;
    }
    Some(EngineImbalance {
        engines: rows.len(),
        gen_tok_s: spread(rows.iter().map(|r| (r.id.as_str(), r.gen_tok_s.mean))),
        kv_usage: spread(rows.iter().map(|r| (r.id.as_str(), r.kv_usage.mean))),
        running: spread(rows.iter().map(|r| (r.id.as_str(), r.running.mean))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{MetricPoint, MetricSeries};

    const S: u64 = 1_000_000_000;

    #[test]
    fn counter_increase_spreads_and_handles_resets() {
        // 100/s for 10 s.
        let pts: Vec<(u64, f64)> = (0..=10).map(|i| (i * S, i as f64 * 100.0)).collect();
        assert_eq!(series_increase(&pts, 0, 10 * S), (1000.0, 10 * S));
        // Half of the interval 2..3 s.
        assert_eq!(series_increase(&pts, 2 * S, 2 * S + S / 2), (50.0, S / 2));
        // Nothing outside the scrapes.
        assert_eq!(series_increase(&pts, 10 * S, 20 * S), (0.0, 0));
        // 1000 -> 40: the counter restarted; 40 counted since.
        let reset = [(0, 900.0), (S, 1000.0), (2 * S, 40.0), (3 * S, 70.0)];
        assert_eq!(
            series_increase(&reset, 0, 3 * S),
            (100.0 + 40.0 + 30.0, 3 * S)
        );
    }

    #[test]
    fn quantiles_interpolate_like_prometheus() {
        // 20 observations <= 0.1, 40 in (0.1, 0.2], 40 in (0.2, 0.4].
        let b = [
            (0.1, 20.0),
            (0.2, 60.0),
            (0.4, 100.0),
            (f64::INFINITY, 100.0),
        ];
        assert_eq!(histogram_quantile(0.5, &b), Some(0.175));
        assert_eq!(histogram_quantile(0.1, &b), Some(0.05));
        assert_eq!(histogram_quantile(0.8, &b), Some(0.30000000000000004));
        // Rank in +Inf: the highest finite bound.
        let tail = [(0.1, 10.0), (f64::INFINITY, 20.0)];
        assert_eq!(histogram_quantile(0.9, &tail), Some(0.1));
        assert_eq!(
            histogram_quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]),
            None
        );
        assert_eq!(histogram_quantile(0.5, &[(0.1, 1.0), (0.2, 2.0)]), None);
        assert_eq!(parse_le("+Inf"), Some(f64::INFINITY));
        assert_eq!(parse_le("0.25"), Some(0.25));
        assert_eq!(parse_le("x"), None);
    }

    #[test]
    fn index_sums_label_sets() {
        let mut rec = Recording::default();
        let mut add = |id: u32, name: &str, labels: &[(&str, &str)], kind: &str| {
            rec.series.push(MetricSeries {
                id,
                engine: "engine0".into(),
                name: name.into(),
                labels: labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                kind: kind.into(),
            });
        };
        add(0, names::RUNNING, &[("model_name", "a")], "gauge");
        add(1, names::RUNNING, &[("model_name", "b")], "gauge");
        add(
            2,
            names::GENERATION_TOKENS,
            &[("model_name", "a")],
            "counter",
        );
        add(
            3,
            names::GENERATION_TOKENS,
            &[("model_name", "b")],
            "counter",
        );
        for t in 0..=4u64 {
            for (series, value) in [
                (0, 1.0),
                (1, 2.0),
                (2, 10.0 * t as f64),
                (3, 30.0 * t as f64),
            ] {
                rec.metrics.push(MetricPoint {
                    t_ns: t * S,
                    series,
                    value,
                });
            }
        }
        let ix = MetricIndex::new(&rec);
        assert_eq!(ix.engines().collect::<Vec<_>>(), ["engine0"]);
        assert_eq!(ix.scrapes("engine0"), 5);
        assert_eq!(
            ix.gauge("engine0", names::RUNNING, GaugeAgg::Sum)[0],
            (0, 3.0)
        );
        assert_eq!(
            ix.gauge("engine0", names::RUNNING, GaugeAgg::Mean)[0],
            (0, 1.5)
        );
        assert_eq!(
            ix.rate("engine0", names::GENERATION_TOKENS, 0, 4 * S),
            Some(40.0)
        );
        assert_eq!(ix.rate("engine0", names::PROMPT_TOKENS, 0, 4 * S), None);
        assert_eq!(ix.rate("engine1", names::GENERATION_TOKENS, 0, 4 * S), None);
    }
}
