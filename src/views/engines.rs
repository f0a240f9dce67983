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
    /// The span `mean` covers: the first and last good scrape, s since the recording's
    /// start (a rate covers the time between scrapes, not the whole window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub covers_s: Option<[f64; 2]>,
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
    /// Every API server when there are several (`--api-server-count`), else empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub api_server_pids: Vec<i32>,
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
    /// Time per output token per finished request (decode time over output tokens less one;
    /// vLLM's `request_time_per_output_token_seconds`, V1 0.10+), ms.
    #[serde(default)]
    pub tpot_ms: LatencyQuantiles,
    /// Where finished requests' time went (vLLM V1's request time histograms), ms: waiting
    /// in the queue, prefill, decode, and inference (prefill + decode). Empty (null
    /// quantiles, count 0) where the engine does not export them.
    #[serde(default)]
    pub queue_ms: LatencyQuantiles,
    #[serde(default)]
    pub prefill_ms: LatencyQuantiles,
    #[serde(default)]
    pub decode_ms: LatencyQuantiles,
    #[serde(default)]
    pub inference_ms: LatencyQuantiles,
    /// Prefix-cache hits over queries (tokens) during the recording; null without queries.
    pub prefix_cache_hit_rate: Option<f64>,
    /// Failed scrapes.
    pub scrape_errors: u64,
    /// The last failure's message (empty when none).
    pub last_scrape_error: String,
    /// Scrapes that got no page (errors at times without points; notes such as the series
    /// limit, written next to a good scrape, do not count, nor failures after the last good
    /// scrape that end in a refused or reset connection: the engine had gone).
    #[serde(default)]
    pub scrape_failures: u64,
    /// Successful scrapes over attempts (`scrapes / (scrapes + scrape_failures)`); null
    /// without attempts. Rates and quantiles span the gaps (counter and bucket increases
    /// between the scrapes that succeeded), but a low coverage leaves short windows empty.
    #[serde(default)]
    pub scrape_coverage: Option<f64>,
    /// Longest time between consecutive successful scrapes, s; null with fewer than two.
    #[serde(default)]
    pub max_scrape_gap_s: Option<f64>,
    /// Preemptions during the recording (`vllm:num_preemptions_total` increase).
    #[serde(default)]
    pub preemptions: Option<f64>,
    /// Speculative decoding during the recording; absent where the engine does not export it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_decode: Option<SpecDecode>,
    /// KV-cache transfers of disaggregated prefill (NIXL) during the recording; absent where
    /// the engine does not export them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer: Option<KvTransfer>,
}

/// Speculative decoding over a recording (counter increases).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct SpecDecode {
    /// Draft tokens proposed and accepted.
    pub draft_tokens: f64,
    pub accepted_tokens: f64,
    /// Drafts (verification steps) proposed; null before vLLM V1.
    pub drafts: Option<f64>,
    /// `accepted_tokens / draft_tokens`; null without drafts.
    pub acceptance_rate: Option<f64>,
    /// `1 + accepted_tokens / drafts`: tokens a verification step yields; null without drafts.
    pub mean_acceptance_length: Option<f64>,
}

/// KV-cache transfers over NIXL over a recording (histogram and counter increases).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct KvTransfer {
    /// Transfers finished (the transfer-time histogram's count).
    pub transfers: f64,
    /// Time per transfer, ms.
    pub xfer_ms: LatencyQuantiles,
    /// Bytes moved, and per transfer on average.
    pub bytes: f64,
    pub bytes_per_transfer: Option<f64>,
    /// Bytes over the transfers' summed time, MB/s (the link as the transfers saw it).
    pub mb_per_s: Option<f64>,
    /// Failed transfers and failed notifications; null where not exported.
    pub failed_transfers: Option<f64>,
    pub failed_notifications: Option<f64>,
}

/// The speculative-decoding figures of `[t0, t1)`; None where the engine has no draft tokens.
fn spec_decode(ix: &MetricIndex, id: &str, t0: u64, t1: u64) -> Option<SpecDecode> {
    let inc = |f: &Family| ix.increase(id, f, t0, t1).map(|i| i.value);
    let draft_tokens = inc(&names::SPEC_DRAFT_TOKENS)?;
    let accepted_tokens = inc(&names::SPEC_ACCEPTED_TOKENS).unwrap_or(0.0);
    let drafts = inc(&names::SPEC_DRAFTS);
    Some(SpecDecode {
        draft_tokens,
        accepted_tokens,
        drafts,
        acceptance_rate: (draft_tokens > 0.0).then(|| accepted_tokens / draft_tokens),
        mean_acceptance_length: drafts
            .filter(|&d| d > 0.0)
            .map(|d| 1.0 + accepted_tokens / d),
    })
}

/// The NIXL transfer figures of `[t0, t1)`; None where the engine has no transfer histogram.
fn kv_transfer(ix: &MetricIndex, id: &str, t0: u64, t1: u64) -> Option<KvTransfer> {
    let time = ix.histogram(id, &names::NIXL_XFER_TIME, t0, t1)?;
    let bytes = ix
        .histogram(id, &names::NIXL_BYTES, t0, t1)
        .map_or(0.0, |h| h.sum);
    let failed = |f: &Family| ix.increase(id, f, t0, t1).map(|i| i.value);
    Some(KvTransfer {
        transfers: time.count,
        bytes,
        bytes_per_transfer: (time.count > 0.0).then(|| bytes / time.count),
        mb_per_s: (time.sum > 0.0).then(|| bytes / time.sum / 1e6),
        xfer_ms: time.quantiles_ms(),
        failed_transfers: failed(&names::NIXL_FAILED_TRANSFERS),
        failed_notifications: failed(&names::NIXL_FAILED_NOTIFICATIONS),
    })
}

/// Below this scrape coverage the report warns.
pub(crate) const LOW_COVERAGE: f64 = 0.95;

/// The highest and lowest engine by one figure.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Spread {
    pub max: f64,
    pub max_engine: String,
    pub min: f64,
    pub min_engine: String,
    /// `max / min`; null when `min` is below the figure's near-zero floor (`near_zero`),
    /// where a ratio means nothing (0.001 vs 0.0001 KV usage is not "10x").
    pub max_over_min: Option<f64>,
    /// `max - min`, in the figure's unit: what to read when `max_over_min` is null.
    #[serde(default)]
    pub spread: f64,
    /// Values at or below this count as zero for the ratio.
    #[serde(default)]
    pub near_zero: f64,
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
    /// Of `waiting.mean`.
    #[serde(default)]
    pub waiting: Option<Spread>,
    /// Of `ttft_ms.p90`.
    #[serde(default)]
    pub ttft_p90_ms: Option<Spread>,
}

/// Near-zero floors of the imbalance figures: below them a ratio is noise.
pub mod floors {
    /// Generated tokens per s.
    pub(crate) const GEN_TOK_S: f64 = 1.0;
    /// KV usage, a fraction (1%).
    pub(crate) const KV_USAGE: f64 = 0.01;
    /// Requests (mean over scrapes).
    pub(crate) const REQUESTS: f64 = 0.5;
    /// TTFT, ms.
    pub(crate) const TTFT_MS: f64 = 1.0;
}

fn spread<'a>(
    v: impl IntoIterator<Item = (&'a str, Option<f64>)>,
    near_zero: f64,
) -> Option<Spread> {
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
        max_over_min: (lo.1 > near_zero).then(|| hi.1 / lo.1),
        spread: hi.1 - lo.1,
        near_zero,
    })
}

/// Engine ids of a recording: described ones and any that only have metrics, sorted.
pub(crate) fn engine_ids(rec: &Recording, ix: &MetricIndex) -> Vec<String> {
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
            let times = ix.scrape_times(id);
            let last_good = times.last().copied().unwrap_or(0);
            let failed: Vec<&crate::record::ScrapeError> = rec
                .scrape_errors
                .iter()
                .filter(|e| &e.engine == id && times.binary_search(&e.t_ns).is_err())
                .collect();
            // Failures after the last good scrape that end in a refused or reset connection
            // are the engine going away (its server resets the requests in flight, then
            // nobody listens), not scrapes its API server failed to answer.
            let gone = failed.last().is_some_and(|e| {
                e.t_ns > last_good
                    && (e.error.contains("connection refused")
                        || e.error.contains("Connection reset"))
            });
            let failures = failed
                .iter()
                .filter(|e| !(gone && e.t_ns > last_good))
                .count() as u64;
            let attempts = times.len() as u64 + failures;
            let max_gap = times.windows(2).map(|w| w[1] - w[0]).max();
            let errors: Vec<&crate::record::ScrapeError> = rec
                .scrape_errors
                .iter()
                .filter(|e| &e.engine == id)
                .collect();
            EngineRow {
                id: id.clone(),
                api_server_pid: info.map_or(0, |e| e.api_server_pid),
                api_server_pids: info.map(|e| e.api_server_pids.clone()).unwrap_or_default(),
                engine_core_pids: info.map(|e| e.engine_core_pids.clone()).unwrap_or_default(),
                worker_pids: info.map(|e| e.worker_pids.clone()).unwrap_or_default(),
                metrics_url: info.map(|e| e.metrics_url.clone()).unwrap_or_default(),
                scrapes: ix.scrapes(id) as u64,
                gen_tok_s: RateStats {
                    mean: ix.rate(id, &names::GENERATION_TOKENS, 0, end_ns.max(1)),
                    min: per_window.iter().copied().reduce(f64::min),
                    max: per_window.iter().copied().reduce(f64::max),
                    covers_s: match (times.first(), times.last()) {
                        (Some(&a), Some(&b)) if b > a => Some([a as f64 / 1e9, b as f64 / 1e9]),
                        _ => None,
                    },
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
                tpot_ms: latency(&names::TPOT),
                queue_ms: latency(&names::QUEUE_TIME),
                prefill_ms: latency(&names::PREFILL_TIME),
                decode_ms: latency(&names::DECODE_TIME),
                inference_ms: latency(&names::INFERENCE_TIME),
                prefix_cache_hit_rate: ix.prefix_cache_hit_rate(id, 0, end_ns.max(1)),
                scrape_errors: errors.len() as u64,
                last_scrape_error: errors.last().map(|e| e.error.clone()).unwrap_or_default(),
                scrape_failures: failures,
                scrape_coverage: (attempts > 0).then(|| times.len() as f64 / attempts as f64),
                max_scrape_gap_s: max_gap.map(|g| g as f64 / 1e9),
                preemptions: ix
                    .increase(id, &names::PREEMPTIONS, 0, end_ns.max(1))
                    .map(|i| i.value),
                spec_decode: spec_decode(ix, id, 0, end_ns.max(1)),
                kv_transfer: kv_transfer(ix, id, 0, end_ns.max(1)),
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
        gen_tok_s: spread(
            rows.iter().map(|r| (r.id.as_str(), r.gen_tok_s.mean)),
            floors::GEN_TOK_S,
        ),
        kv_usage: spread(
            rows.iter().map(|r| (r.id.as_str(), r.kv_usage.mean)),
            floors::KV_USAGE,
        ),
        running: spread(
            rows.iter().map(|r| (r.id.as_str(), r.running.mean)),
            floors::REQUESTS,
        ),
        waiting: spread(
            rows.iter().map(|r| (r.id.as_str(), r.waiting.mean)),
            floors::REQUESTS,
        ),
        ttft_p90_ms: spread(
            rows.iter().map(|r| (r.id.as_str(), r.ttft_ms.p90)),
            floors::TTFT_MS,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, gen: f64, kv: f64, running: f64, waiting: f64, ttft_p90: f64) -> EngineRow {
        let g = |v: f64| GaugeStats {
            mean: Some(v),
            max: Some(v),
        };
        EngineRow {
            id: id.into(),
            gen_tok_s: RateStats {
                mean: Some(gen),
                ..Default::default()
            },
            kv_usage: g(kv),
            running: g(running),
            waiting: g(waiting),
            ttft_ms: LatencyQuantiles {
                p90: Some(ttft_p90),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// The case: KV usage 0.001 vs 0.0001 and running 0.1 vs 0 are not "10x"; the
    /// TTFT difference (320.7 vs 38.8 ms) is in it.
    #[test]
    fn near_zero_values_give_differences_not_ratios() {
        let rows = [
            row("engine0", 230.0, 0.001, 0.1, 0.0, 320.7),
            row("engine1", 30.0, 0.0001, 0.0, 0.0, 38.8),
        ];
        let im = imbalance(&rows).unwrap();
        let g = im.gen_tok_s.unwrap();
        assert_eq!(
            (g.max_over_min.map(|r| (r * 100.0).round()), g.spread),
            (Some(767.0), 200.0)
        );
        let kv = im.kv_usage.unwrap();
        assert_eq!(kv.max_over_min, None);
        assert!((kv.spread - 0.0009).abs() < 1e-12);
        assert_eq!(im.running.unwrap().max_over_min, None);
        assert_eq!(im.waiting.unwrap().spread, 0.0);
        let t = im.ttft_p90_ms.unwrap();
        assert_eq!(
            (t.max_engine.as_str(), t.min_engine.as_str()),
            ("engine0", "engine1")
        );
        assert!((t.max_over_min.unwrap() - 320.7 / 38.8).abs() < 1e-9);
        assert!(imbalance(&rows[..1]).is_none());
    }

    /// Coverage: failed scrapes in the middle count; those after the last good scrape that
    /// end in a refused or reset connection (the engine went away) do not.
    #[test]
    fn scrape_coverage_counts_failures_while_the_engine_lived() {
        use crate::record::{MetricPoint, MetricSeries, ScrapeError};
        const S: u64 = 1_000_000_000;
        let mut rec = Recording::default();
        rec.series.push(MetricSeries {
            id: 0,
            engine: "e".into(),
            name: names::GENERATION_TOKENS.name.into(),
            ..Default::default()
        });
        let err = |t: u64, m: &str| ScrapeError {
            t_ns: t,
            engine: "e".into(),
            url: "u".into(),
            error: m.into(),
        };
        // Good scrapes at 0..=9 s except 3 and 6 (timed out), then a reset and a refusal.
        for t in (0..=9u64).filter(|t| *t != 3 && *t != 6) {
            rec.metrics.push(MetricPoint {
                t_ns: t * S,
                series: 0,
                value: t as f64 * 10.0,
            });
        }
        rec.scrape_errors = vec![
            err(3 * S, "GET u: timed out"),
            err(6 * S, "GET u: timed out"),
            err(10 * S, "GET u: io: Connection reset by peer"),
            err(11 * S, "GET u: connection refused; is the engine running"),
        ];
        let ix = MetricIndex::new(&rec);
        let w = Windows::new(5 * S, 12 * S);
        let rows = engine_rows(&rec, &ix, &["e".to_string()], &w, 12 * S);
        let r = &rows[0];
        assert_eq!((r.scrapes, r.scrape_failures, r.scrape_errors), (8, 2, 4));
        assert_eq!(r.scrape_coverage, Some(0.8));
        assert_eq!(r.max_scrape_gap_s, Some(2.0));
        // The counter's rate spans the gaps: 10/s.
        assert_eq!(r.gen_tok_s.mean, Some(10.0));
        // Still failing at the end, but timing out: those count (a stuck API server).
        rec.scrape_errors.truncate(2);
        rec.scrape_errors.push(err(10 * S, "GET u: timed out"));
        let ix = MetricIndex::new(&rec);
        let r = &engine_rows(&rec, &ix, &["e".to_string()], &w, 12 * S)[0];
        assert_eq!(r.scrape_failures, 3);
    }
}
