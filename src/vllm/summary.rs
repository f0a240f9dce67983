//! Per-engine figures over a recording's scraped metrics: pure functions of a [`Recording`].
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use enginescope::vllm::summary::{summarize_all, imbalance, Window};
//! let rec = enginescope::record::read_recording("run.esrec".as_ref())?;
//! let all = summarize_all(&rec, Window::ALL);
//! for s in &all { println!("{}: {:?} gen tok/s", s.engine, s.gen_tok_s); }
//! for i in imbalance(&all) { println!("{}: max/mean {:?}", i.metric, i.max_over_mean); }
//! # Ok(()) }
//! ```
//!
//! How each figure is computed over a window (the points whose `t_ns` lies in it):
//! * counters (tokens): the increase between consecutive points, a drop counting as a reset
//!   (the new value is the increase since the reset, as Prometheus's `increase()`), divided
//!   by the time between the series' first and last point; summed over label sets (DP ranks).
//! * gauges: per scrape, running/waiting summed over label sets, KV usage averaged; then mean,
//!   max and last over the scrapes.
//! * latency quantiles: per bucket, its increase over the window (summed over label sets with
//!   the same `le`), then Prometheus's `histogram_quantile`: linear interpolation inside the
//!   bucket holding the rank; a rank in the `+Inf` bucket gives the highest finite bound.
//! * prefix-cache hit rate: increase of hits over increase of queries (tokens).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::record::{MetricSeries, Recording};

/// Which part of a recording, ns since its start (inclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Window {
    pub const ALL: Window = Window {
        start_ns: 0,
        end_ns: u64::MAX,
    };

    fn contains(&self, t: u64) -> bool {
        (self.start_ns..=self.end_ns).contains(&t)
    }
}

/// Mean, largest and last value of a gauge over the scrapes in a window.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GaugeStats {
    pub mean: f64,
    pub max: f64,
    pub last: f64,
}

/// Quantiles of a latency histogram over a window, seconds.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Quantiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    /// Observations in the window.
    pub count: f64,
}

/// One engine (or one DP rank of it) over a window. `None`: no data for that figure.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineSummary {
    /// `EngineInfo::id`, with `/engine=<rank>` for a DP rank.
    pub engine: String,
    /// Scrapes in the window.
    pub scrapes: usize,
    /// Time between the first and last scrape in the window, s.
    pub span_s: f64,
    pub gen_tok_s: Option<f64>,
    pub prompt_tok_s: Option<f64>,
    /// Fraction of the KV cache in use (1 = full).
    pub kv_usage: Option<GaugeStats>,
    pub running: Option<GaugeStats>,
    pub waiting: Option<GaugeStats>,
    pub ttft_s: Option<Quantiles>,
    pub itl_s: Option<Quantiles>,
    pub e2e_s: Option<Quantiles>,
    pub prefix_cache_hit_rate: Option<f64>,
}

/// Spread of one figure across engines.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Imbalance {
    /// "gen_tok_s", "running_mean", "waiting_mean", "kv_usage_mean".
    pub metric: String,
    pub max_engine: String,
    pub max: f64,
    pub min_engine: String,
    pub min: f64,
    pub mean: f64,
    /// max / mean: 1 is perfectly even; `None` when the mean is 0.
    pub max_over_mean: Option<f64>,
}

const GEN: &str = "vllm:generation_tokens_total";
const PROMPT: &str = "vllm:prompt_tokens_total";
const KV: &[&str] = &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"];
const RUNNING: &str = "vllm:num_requests_running";
const WAITING: &str = "vllm:num_requests_waiting";
const TTFT: &str = "vllm:time_to_first_token_seconds";
const ITL: &[&str] = &[
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
];
const E2E: &str = "vllm:e2e_request_latency_seconds";
const PC_HITS: &[&str] = &[
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total",
];
const PC_QUERIES: &[&str] = &[
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
];

/// The increase of a counter over points in time order; a drop is a reset.
pub fn increase(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut total = 0.0;
    let mut prev: Option<f64> = None;
    for v in values {
        if let Some(p) = prev {
            total += if v >= p { v - p } else { v };
        }
        prev = Some(v);
    }
    total
}

/// Prometheus's `histogram_quantile` over cumulative `(upper bound, count)` buckets, which must
/// include `+Inf`. `None` when there are no observations or no `+Inf` bucket.
pub fn histogram_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let mut b: Vec<(f64, f64)> = buckets.to_vec();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    if b.len() < 2 || b.last().map(|x| x.0) != Some(f64::INFINITY) {
        return None;
    }
    // Counts must not fall with the bound (they can after resets or torn scrapes).
    for i in 1..b.len() {
        if b[i].1 < b[i - 1].1 {
            b[i].1 = b[i - 1].1;
        }
    }
    let total = b.last()?.1;
    if total <= 0.0 || q.is_nan() {
        return None;
    }
    if q < 0.0 {
        return Some(f64::NEG_INFINITY);
    }
    if q > 1.0 {
        return Some(f64::INFINITY);
    }
    let mut rank = q * total;
    let i = b.iter().position(|x| x.1 >= rank)?;
    if i == b.len() - 1 {
        return Some(b[b.len() - 2].0);
    }
    if i == 0 && b[0].0 <= 0.0 {
        return Some(b[0].0);
    }
    let (start, mut count) = if i == 0 {
        (0.0, b[0].1)
    } else {
        rank -= b[i - 1].1;
        (b[i - 1].0, b[i].1 - b[i - 1].1)
    };
    let end = b[i].0;
    if count <= 0.0 {
        count = 1.0;
    }
    Some(start + (end - start) * (rank / count))
}

/// The points of each series, in time order, within a window.
struct Points<'a> {
    series: Vec<&'a MetricSeries>,
    by_series: HashMap<u32, Vec<(u64, f64)>>,
}

impl<'a> Points<'a> {
    fn new(rec: &'a Recording, keep: impl Fn(&MetricSeries) -> bool, w: Window) -> Self {
        let series: Vec<&MetricSeries> = rec.series.iter().filter(|s| keep(s)).collect();
        let ids: BTreeSet<u32> = series.iter().map(|s| s.id).collect();
        let mut by_series: HashMap<u32, Vec<(u64, f64)>> = HashMap::new();
        for p in &rec.metrics {
            if ids.contains(&p.series) && w.contains(p.t_ns) {
                by_series
                    .entry(p.series)
                    .or_default()
                    .push((p.t_ns, p.value));
            }
        }
        for v in by_series.values_mut() {
            v.sort_by_key(|x| x.0);
        }
        Points { series, by_series }
    }

    fn named<'s>(&'s self, name: &'s str) -> impl Iterator<Item = &'s MetricSeries> + 's {
        self.series.iter().copied().filter(move |s| s.name == name)
    }

    fn of(&self, s: &MetricSeries) -> &[(u64, f64)] {
        self.by_series
            .get(&s.id)
            .map(|v| v.as_slice())
            .unwrap_or(&[])
    }

    /// The first of `names` that has series.
    fn first_present<'n>(&self, names: &[&'n str]) -> Option<&'n str> {
        names
            .iter()
            .copied()
            .find(|n| self.named(n).next().is_some())
    }

    /// Summed per-series rates of a counter, per second.
    fn rate(&self, name: &str) -> Option<f64> {
        let mut any = false;
        let mut total = 0.0;
        for s in self.named(name) {
            let pts = self.of(s);
            let (Some(first), Some(last)) = (pts.first(), pts.last()) else {
                continue;
            };
            if last.0 <= first.0 {
                continue;
            }
            any = true;
            total += increase(pts.iter().map(|p| p.1)) / ((last.0 - first.0) as f64 / 1e9);
        }
        any.then_some(total)
    }

    /// Summed increase of a counter; `None` with fewer than two points.
    fn increase(&self, name: &str) -> Option<f64> {
        let mut any = false;
        let mut total = 0.0;
        for s in self.named(name) {
            let pts = self.of(s);
            if pts.len() >= 2 {
                any = true;
                total += increase(pts.iter().map(|p| p.1));
            }
        }
        any.then_some(total)
    }

    /// A gauge per scrape (summed or averaged over label sets), then its stats.
    fn gauge(&self, name: &str, average: bool) -> Option<GaugeStats> {
        let mut per_t: BTreeMap<u64, (f64, u32)> = BTreeMap::new();
        for s in self.named(name) {
            for &(t, v) in self.of(s) {
                if v.is_finite() {
                    let e = per_t.entry(t).or_default();
                    e.0 += v;
                    e.1 += 1;
                }
            }
        }
        let vals: Vec<f64> = per_t
            .values()
            .map(|(sum, n)| if average { sum / f64::from(*n) } else { *sum })
            .collect();
        let last = *vals.last()?;
        Some(GaugeStats {
            mean: vals.iter().sum::<f64>() / vals.len() as f64,
            max: vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            last,
        })
    }

    /// Quantiles from a histogram family's bucket increases.
    fn quantiles(&self, family: &str) -> Option<Quantiles> {
        let bucket = format!("{family}_bucket");
        let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for s in self.named(&bucket) {
            let Some(le) = s
                .labels
                .get("le")
                .and_then(|l| super::prom_text::parse_value(l))
            else {
                continue;
            };
            let pts = self.of(s);
            if pts.len() < 2 {
                continue;
            }
            // Keyed by the bound's bits: the same `le` from several label sets adds up.
            let e = by_le.entry(le.to_bits()).or_insert((le, 0.0));
            e.1 += increase(pts.iter().map(|p| p.1));
        }
        let buckets: Vec<(f64, f64)> = by_le.into_values().collect();
        let count = buckets.iter().find(|b| b.0 == f64::INFINITY)?.1;
        Some(Quantiles {
            p50: histogram_quantile(0.5, &buckets)?,
            p90: histogram_quantile(0.9, &buckets)?,
            p99: histogram_quantile(0.99, &buckets)?,
            count,
        })
    }
}

/// Summarize the series `keep` selects, naming the result `name`.
fn summarize_series(
    rec: &Recording,
    name: String,
    keep: impl Fn(&MetricSeries) -> bool,
    w: Window,
) -> EngineSummary {
    let pts = Points::new(rec, keep, w);
    let times: BTreeSet<u64> = pts.by_series.values().flatten().map(|p| p.0).collect();
    let span_s = match (times.first(), times.last()) {
        (Some(a), Some(b)) => (b - a) as f64 / 1e9,
        _ => 0.0,
    };
    let hit_rate = match (pts.first_present(PC_HITS), pts.first_present(PC_QUERIES)) {
        (Some(h), Some(q)) => match (pts.increase(h), pts.increase(q)) {
            (Some(h), Some(q)) if q > 0.0 => Some(h / q),
            _ => None,
        },
        _ => None,
    };
    EngineSummary {
        engine: name,
        scrapes: times.len(),
        span_s,
        gen_tok_s: pts.rate(GEN),
        prompt_tok_s: pts.rate(PROMPT),
        kv_usage: pts.first_present(KV).and_then(|n| pts.gauge(n, true)),
        running: pts.gauge(RUNNING, false),
        waiting: pts.gauge(WAITING, false),
        ttft_s: pts.quantiles(TTFT),
        itl_s: ITL.iter().find_map(|n| pts.quantiles(n)),
        e2e_s: pts.quantiles(E2E),
        prefix_cache_hit_rate: hit_rate,
    }
}

/// One engine over a window (all its DP ranks together).
pub fn engine_summary(rec: &Recording, engine: &str, w: Window) -> EngineSummary {
    summarize_series(rec, engine.to_string(), |s| s.engine == engine, w)
}

/// Engine ids that have metric series, in order of first appearance.
pub fn engines_with_metrics(rec: &Recording) -> Vec<String> {
    let mut seen = BTreeSet::new();
    rec.series
        .iter()
        .filter(|s| seen.insert(s.engine.clone()))
        .map(|s| s.engine.clone())
        .collect()
}

/// Every engine with metrics over a window.
pub fn summarize_all(rec: &Recording, w: Window) -> Vec<EngineSummary> {
    engines_with_metrics(rec)
        .iter()
        .map(|e| engine_summary(rec, e, w))
        .collect()
}

/// One engine's data-parallel ranks apart (vLLM's `engine` label), for imbalance inside one
/// API server. An engine without DP has one rank.
pub fn rank_summaries(rec: &Recording, engine: &str, w: Window) -> Vec<EngineSummary> {
    let ranks: BTreeSet<&str> = rec
        .series
        .iter()
        .filter(|s| s.engine == engine)
        .filter_map(|s| s.labels.get("engine").map(|r| r.as_str()))
        .collect();
    ranks
        .into_iter()
        .map(|r| {
            summarize_series(
                rec,
                format!("{engine}/engine={r}"),
                |s| s.engine == engine && s.labels.get("engine").map(|x| x.as_str()) == Some(r),
                w,
            )
        })
        .collect()
}

/// How unevenly load spreads across engines (or ranks): for gen tok/s and mean running,
/// waiting and KV usage. Figures only where at least two summaries have them.
pub fn imbalance(summaries: &[EngineSummary]) -> Vec<Imbalance> {
    type Get = fn(&EngineSummary) -> Option<f64>;
    let figures: [(&str, Get); 4] = [
        ("gen_tok_s", |s| s.gen_tok_s),
        ("running_mean", |s| s.running.map(|g| g.mean)),
        ("waiting_mean", |s| s.waiting.map(|g| g.mean)),
        ("kv_usage_mean", |s| s.kv_usage.map(|g| g.mean)),
    ];
    let mut out = Vec::new();
    for (metric, get) in figures {
        let vals: Vec<(&str, f64)> = summaries
            .iter()
            .filter_map(|s| Some((s.engine.as_str(), get(s)?)))
            .filter(|(_, v)| v.is_finite())
            .collect();
        if vals.len() < 2 {
            continue;
        }
        let max = vals
            .iter()
            .copied()
            .fold(vals[0], |a, b| if b.1 > a.1 { b } else { a });
        let min = vals
            .iter()
            .copied()
            .fold(vals[0], |a, b| if b.1 < a.1 { b } else { a });
        let mean = vals.iter().map(|v| v.1).sum::<f64>() / vals.len() as f64;
        out.push(Imbalance {
            metric: metric.into(),
            max_engine: max.0.into(),
            max: max.1,
            min_engine: min.0.into(),
            min: min.1,
            mean,
            max_over_mean: (mean > 0.0).then(|| max.1 / mean),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::MetricPoint;
    use crate::vllm::prom_text;

    const SAMPLE: &str = include_str!("testdata/metrics-sample.txt");

    /// Append one scrape of `text` for `engine` at `t_s`, creating series as needed.
    fn add_scrape(rec: &mut Recording, engine: &str, text: &str, t_s: f64) {
        let exp = prom_text::parse(text, crate::vllm::metrics::is_kept);
        assert_eq!(exp.bad_lines, 0);
        for s in exp.samples {
            let id = match rec
                .series
                .iter()
                .find(|x| x.engine == engine && x.name == s.name && x.labels == s.labels)
            {
                Some(x) => x.id,
                None => {
                    let id = rec.series.len() as u32;
                    rec.series.push(MetricSeries {
                        id,
                        engine: engine.into(),
                        name: s.name,
                        labels: s.labels,
                        kind: s.kind.as_str().into(),
                    });
                    id
                }
            };
            rec.metrics.push(MetricPoint {
                t_ns: (t_s * 1e9) as u64,
                series: id,
                value: s.value,
            });
        }
    }

    /// The sample with every sample value set to `v`.
    fn all_values(v: f64) -> String {
        SAMPLE
            .lines()
            .map(|l| {
                if l.starts_with('#') || l.is_empty() {
                    l.to_string()
                } else {
                    let (k, _) = l.rsplit_once(' ').unwrap();
                    format!("{k} {v}")
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn histogram_quantile_matches_prometheus() {
        // Hand-computed with Prometheus's algorithm.
        let b = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (f64::INFINITY, 40.0)];
        assert!(close(
            histogram_quantile(0.5, &b).unwrap(),
            0.1 + 0.4 * (10.0 / 20.0)
        ));
        assert!(close(
            histogram_quantile(0.25, &b).unwrap(),
            0.1 * (10.0 / 10.0)
        ));
        assert!(close(
            histogram_quantile(0.1, &b).unwrap(),
            0.1 * (4.0 / 10.0)
        ));
        assert!(close(
            histogram_quantile(0.9, &b).unwrap(),
            0.5 + 0.5 * (6.0 / 10.0)
        ));
        // Rank in +Inf: the highest finite bound.
        let b = [(0.1, 1.0), (1.0, 2.0), (f64::INFINITY, 10.0)];
        assert_eq!(histogram_quantile(0.99, &b), Some(1.0));
        // Unsorted input, non-monotonic counts coalesced.
        let b = [(f64::INFINITY, 4.0), (2.0, 3.0), (1.0, 4.0)];
        assert_eq!(histogram_quantile(0.5, &b), Some(0.5));
        assert_eq!(
            histogram_quantile(0.5, &[(1.0, 0.0), (f64::INFINITY, 0.0)]),
            None
        );
        assert_eq!(histogram_quantile(0.5, &[(1.0, 3.0), (2.0, 3.0)]), None);
        assert_eq!(
            histogram_quantile(1.5, &[(1.0, 3.0), (f64::INFINITY, 3.0)]),
            Some(f64::INFINITY)
        );
        // A first bucket with a negative bound.
        assert_eq!(
            histogram_quantile(0.1, &[(-1.0, 5.0), (f64::INFINITY, 10.0)]),
            Some(-1.0)
        );
    }

    #[test]
    fn counter_increase_with_resets() {
        assert_eq!(increase([100.0, 200.0, 50.0, 150.0]), 250.0);
        assert_eq!(increase([5.0]), 0.0);
        assert_eq!(increase([0.0, 0.0, 3.0]), 3.0);
    }

    /// A fresh server (all zeros) at t=0 s, then the harness's real scrape at t=10 s: the
    /// window's deltas are the sample's values, whose answers are computed by hand below.
    #[test]
    fn summary_of_the_real_sample() {
        let mut rec = Recording::default();
        add_scrape(&mut rec, "engine0", &all_values(0.0), 0.0);
        add_scrape(&mut rec, "engine0", SAMPLE, 10.0);
        let s = engine_summary(&rec, "engine0", Window::ALL);
        assert_eq!((s.scrapes, s.span_s), (2, 10.0));
        // generation_tokens_total 32, prompt_tokens_total 22, over 10 s.
        assert!(close(s.gen_tok_s.unwrap(), 3.2), "{s:?}");
        assert!(close(s.prompt_tok_s.unwrap(), 2.2));
        // prefix cache: 0 hits of 22 queried tokens.
        assert_eq!(s.prefix_cache_hit_rate, Some(0.0));
        // gauges are 0 in both scrapes.
        assert_eq!(
            s.kv_usage,
            Some(GaugeStats {
                mean: 0.0,
                max: 0.0,
                last: 0.0
            })
        );
        assert_eq!(s.running.unwrap().max, 0.0);
        // TTFT: 2 observations, le=0.02 -> 1, le=0.04 -> 2.
        let t = s.ttft_s.unwrap();
        assert_eq!(t.count, 2.0);
        assert!(close(t.p50, 0.02), "{t:?}");
        assert!(close(t.p90, 0.02 + 0.02 * 0.8), "{t:?}");
        assert!(close(t.p99, 0.02 + 0.02 * 0.98), "{t:?}");
        // ITL: 30 observations, 29 <= 0.01, 30 <= 0.025.
        let i = s.itl_s.unwrap();
        assert_eq!(i.count, 30.0);
        assert!(close(i.p50, 0.01 * 15.0 / 29.0), "{i:?}");
        assert!(close(i.p90, 0.01 * 27.0 / 29.0), "{i:?}");
        assert!(close(i.p99, 0.01 + 0.015 * 0.7), "{i:?}");
        // e2e: both <= 0.3.
        let e = s.e2e_s.unwrap();
        assert!(
            close(e.p50, 0.15) && close(e.p90, 0.27) && close(e.p99, 0.297),
            "{e:?}"
        );
        // The lone first scrape has no deltas.
        let one = engine_summary(
            &rec,
            "engine0",
            Window {
                start_ns: 0,
                end_ns: 1,
            },
        );
        assert_eq!((one.scrapes, one.gen_tok_s, one.ttft_s), (1, None, None));
        assert_eq!(engine_summary(&rec, "nope", Window::ALL).scrapes, 0);
    }

    /// Synthetic series with known answers: a counter reset inside the window, gauges summed
    /// over two DP ranks, a window that cuts off the start.
    #[test]
    fn synthetic_windows_resets_and_ranks() {
        let scrape = |gen0: f64, gen1: f64, run0: f64, run1: f64, kv0: f64, kv1: f64| {
            format!(
                "# TYPE vllm:generation_tokens_total counter\n\
                 vllm:generation_tokens_total{{engine=\"0\"}} {gen0}\n\
                 vllm:generation_tokens_total{{engine=\"1\"}} {gen1}\n\
                 # TYPE vllm:num_requests_running gauge\n\
                 vllm:num_requests_running{{engine=\"0\"}} {run0}\n\
                 vllm:num_requests_running{{engine=\"1\"}} {run1}\n\
                 # TYPE vllm:kv_cache_usage_perc gauge\n\
                 vllm:kv_cache_usage_perc{{engine=\"0\"}} {kv0}\n\
                 vllm:kv_cache_usage_perc{{engine=\"1\"}} {kv1}\n"
            )
        };
        let mut rec = Recording::default();
        // t=0..4 s. Rank 0: +100/s, restarted between t=2 and t=3 (1200 -> 50, of which 50
        // since the restart). Rank 1: +10/s.
        let gen0 = [1000.0, 1100.0, 1200.0, 50.0, 150.0];
        for (t, g) in gen0.into_iter().enumerate() {
            let tf = t as f64;
            add_scrape(
                &mut rec,
                "engine0",
                &scrape(g, 10.0 * tf, 4.0, 2.0 + tf, 0.5, 0.1 * tf),
                tf,
            );
        }
        let s = engine_summary(&rec, "engine0", Window::ALL);
        // Rank 0: 100+100+50(reset)+100 = 350 in 4 s; rank 1: 40 in 4 s.
        assert!(close(s.gen_tok_s.unwrap(), 350.0 / 4.0 + 10.0), "{s:?}");
        // running: per scrape 4 + (2+t) = 6..10 -> mean 8, max 10, last 10.
        assert_eq!(
            s.running,
            Some(GaugeStats {
                mean: 8.0,
                max: 10.0,
                last: 10.0
            })
        );
        // kv: per scrape mean of 0.5 and 0.1t -> 0.25 + 0.05t: mean 0.35, max 0.45.
        let kv = s.kv_usage.unwrap();
        assert!(
            close(kv.mean, 0.35) && close(kv.max, 0.45) && close(kv.last, 0.45),
            "{kv:?}"
        );
        // A window from t=1 s to t=2 s: 100 tok/s on rank 0, 10 on rank 1.
        let w = Window {
            start_ns: 1_000_000_000,
            end_ns: 2_000_000_000,
        };
        assert!(close(
            engine_summary(&rec, "engine0", w).gen_tok_s.unwrap(),
            110.0
        ));

        let ranks = rank_summaries(&rec, "engine0", Window::ALL);
        assert_eq!(
            ranks.iter().map(|r| r.engine.as_str()).collect::<Vec<_>>(),
            ["engine0/engine=0", "engine0/engine=1"]
        );
        assert!(
            close(ranks[0].gen_tok_s.unwrap(), 87.5) && close(ranks[1].gen_tok_s.unwrap(), 10.0)
        );
        let imb = imbalance(&ranks);
        let g = imb.iter().find(|i| i.metric == "gen_tok_s").unwrap();
        assert_eq!(
            (g.max_engine.as_str(), g.min_engine.as_str()),
            ("engine0/engine=0", "engine0/engine=1")
        );
        assert!(
            close(g.mean, 48.75) && close(g.max_over_mean.unwrap(), 87.5 / 48.75),
            "{g:?}"
        );
        let r = imb.iter().find(|i| i.metric == "running_mean").unwrap();
        assert_eq!((r.max, r.min), (4.0, 4.0));
        assert_eq!(r.max_over_mean, Some(1.0));
        // One summary: no imbalance to speak of.
        assert!(imbalance(&ranks[..1]).is_empty());
    }

    /// Histogram deltas: observations before the window do not count, and two label sets
    /// with the same buckets add up.
    #[test]
    fn histogram_window_deltas() {
        let h = |a: [f64; 3], b: [f64; 3]| {
            format!(
                "# TYPE vllm:e2e_request_latency_seconds histogram\n\
                 vllm:e2e_request_latency_seconds_bucket{{engine=\"0\",le=\"1.0\"}} {}\n\
                 vllm:e2e_request_latency_seconds_bucket{{engine=\"0\",le=\"2.0\"}} {}\n\
                 vllm:e2e_request_latency_seconds_bucket{{engine=\"0\",le=\"+Inf\"}} {}\n\
                 vllm:e2e_request_latency_seconds_bucket{{engine=\"1\",le=\"1.0\"}} {}\n\
                 vllm:e2e_request_latency_seconds_bucket{{engine=\"1\",le=\"2.0\"}} {}\n\
                 vllm:e2e_request_latency_seconds_bucket{{engine=\"1\",le=\"+Inf\"}} {}\n",
                a[0], a[1], a[2], b[0], b[1], b[2]
            )
        };
        let mut rec = Recording::default();
        // Before the window: 1000 fast requests (all <= 1 s) on rank 0.
        add_scrape(&mut rec, "e", &h([0.0; 3], [0.0; 3]), 0.0);
        add_scrape(&mut rec, "e", &h([1000.0, 1000.0, 1000.0], [0.0; 3]), 1.0);
        // In the window: rank 0 gets 2 requests in (1, 2]; rank 1 gets 2 in (1, 2], 1 > 2 s.
        add_scrape(
            &mut rec,
            "e",
            &h([1000.0, 1002.0, 1002.0], [0.0, 2.0, 3.0]),
            2.0,
        );
        let w = Window {
            start_ns: 1_000_000_000,
            end_ns: u64::MAX,
        };
        let e = engine_summary(&rec, "e", w).e2e_s.unwrap();
        // Deltas: le=1 -> 0, le=2 -> 4, +Inf -> 5. p50: rank 2.5 in (1,2]: 1 + 2.5/4.
        assert_eq!(e.count, 5.0);
        assert!(close(e.p50, 1.625), "{e:?}");
        // p90: rank 4.5 > 4: the +Inf bucket -> highest finite bound 2.
        assert_eq!(e.p90, 2.0);
        // Over all time the 1000 fast ones count: le=1 -> 1000, le=2 -> 1004, +Inf -> 1005;
        // p50: rank 502.5 in [0, 1].
        let all = engine_summary(&rec, "e", Window::ALL).e2e_s.unwrap();
        assert_eq!(all.count, 1005.0);
        assert!(close(all.p50, 502.5 / 1000.0), "{all:?}");
    }
}
