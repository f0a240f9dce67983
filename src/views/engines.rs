//! The report's per-engine rows and the imbalance between engines, from the scrapes in a
//! recording (`Recording::series`, `Recording::metrics`) read through
//! [`crate::metrics::MetricIndex`] (names, counter increases, quantiles live there).

use serde::{Deserialize, Serialize};

use super::windows::Windows;
use crate::metrics::maths::mean_max;
pub use crate::metrics::LatencyQuantiles;
use crate::metrics::{names, Family, MetricIndex};
use crate::record::Recording;

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

/// One row per engine over `[0, end_ns)`; `min`/`max` rates are those of the report's
/// windows (the timeline's per-window rates).
pub fn engine_rows(
    rec: &Recording,
    ix: &MetricIndex,
    ids: &[String],
    windows: &Windows,
    end_ns: u64,
) -> Vec<EngineRow> {
    ids.iter()
        .map(|id| {
            let info = rec.engines.iter().rev().find(|e| &e.id == id);
            let per_window: Vec<f64> = (0..windows.count)
                .filter_map(|i| {
                    let (t0, t1) = windows.bounds(i);
                    ix.rate(id, &names::GENERATION_TOKENS, t0, t1)
                })
                .collect();
            let gauge = |family: &Family| {
                let (mean, max) = mean_max(ix.gauge(id, family).into_iter().map(|(_, v)| v))
                    .map_or((None, None), |(m, x)| (Some(m), Some(x)));
                GaugeStats { mean, max }
            };
            let latency = |family: &Family| {
                ix.histogram(id, family, 0, end_ns.max(1))
                    .map(|h| h.quantiles_ms())
                    .unwrap_or_default()
            };
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
                    mean: ix.rate(id, &names::GENERATION_TOKENS, 0, end_ns.max(1)),
                    min: per_window.iter().copied().reduce(f64::min),
                    max: per_window.iter().copied().reduce(f64::max),
                },
                prompt_tok_s: MeanRate {
                    mean: ix.rate(id, &names::PROMPT_TOKENS, 0, end_ns.max(1)),
                },
                kv_usage: gauge(&names::KV_CACHE_USAGE),
                running: gauge(&names::RUNNING),
                waiting: gauge(&names::WAITING),
                ttft_ms: latency(&names::TTFT),
                itl_ms: latency(&names::ITL),
                e2e_ms: latency(&names::E2E),
                prefix_cache_hit_rate: ix.prefix_cache_hit_rate(id, 0, end_ns.max(1)),
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
