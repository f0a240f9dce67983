//! vLLM's metric families, each with the spellings older vLLM versions used.
//!
//! vLLM has renamed several families; a version in transition exposes both names (0.11 and
//! 0.12 serve `time_per_output_token_seconds` next to `inter_token_latency_seconds`), so a
//! family reads the first of its names that an engine has, newest first:
//!
//! | family | current name | older names (versions) |
//! |---|---|---|
//! | KV-cache usage | `kv_cache_usage_perc` | `gpu_cache_usage_perc` (V0, V1 ≤ 0.10; hidden later) |
//! | inter-token latency | `inter_token_latency_seconds` | `time_per_output_token_seconds` (≤ 0.12, deprecated in 0.11, removed in 0.13) |
//! | time per output token, per request (TPOT: decode time / (tokens − 1)) | `request_time_per_output_token_seconds` | none (absent before V1 0.10: the older `time_per_output_token_seconds` was per token, the ITL above) |
//! | prefix-cache queries/hits | `prefix_cache_{queries,hits}_total` | `gpu_prefix_cache_{queries,hits}_total` (V1 0.8–0.10) |
//! | prefix-cache hit rate | (counters above) | `gpu_prefix_cache_hit_rate` gauge (V0; a fraction since the engine started, -1 without prefix caching) |
//!
//! Every sample is labelled `model_name`, and `engine="<dp rank>"` since data parallelism
//! (one API server in front of several engine cores).

/// How a gauge's label sets combine into one value per scrape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GaugeAgg {
    /// Counts (requests running, waiting): summed.
    Sum,
    /// Fractions of something each label set has its own of (KV-cache usage): averaged.
    Mean,
}

/// One metric family: its current sample name and the ones older vLLM versions used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    /// The sample name vLLM exposes today (a histogram's base name, without `_bucket`).
    pub name: &'static str,
    /// Earlier spellings, newest first.
    pub older: &'static [&'static str],
    /// For gauges: how label sets (DP ranks) combine.
    pub agg: GaugeAgg,
}

impl Family {
    const fn new(name: &'static str, older: &'static [&'static str], agg: GaugeAgg) -> Self {
        Family { name, older, agg }
    }

    /// Every spelling, newest first.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        std::iter::once(self.name).chain(self.older.iter().copied())
    }

    /// The first spelling `has` says is present.
    pub fn resolve(&self, mut has: impl FnMut(&str) -> bool) -> Option<&'static str> {
        self.names().find(|n| has(n))
    }
}

use GaugeAgg::{Mean, Sum};

pub const GENERATION_TOKENS: Family = Family::new("vllm:generation_tokens_total", &[], Sum);
pub const PROMPT_TOKENS: Family = Family::new("vllm:prompt_tokens_total", &[], Sum);
/// A fraction, 1 = full.
pub const KV_CACHE_USAGE: Family = Family::new(
    "vllm:kv_cache_usage_perc",
    &["vllm:gpu_cache_usage_perc"],
    Mean,
);
pub const RUNNING: Family = Family::new("vllm:num_requests_running", &[], Sum);
pub(crate) const WAITING: Family = Family::new("vllm:num_requests_waiting", &[], Sum);
pub(crate) const PREEMPTIONS: Family = Family::new("vllm:num_preemptions_total", &[], Sum);
/// Histograms, seconds.
pub const TTFT: Family = Family::new("vllm:time_to_first_token_seconds", &[], Sum);
pub const ITL: Family = Family::new(
    "vllm:inter_token_latency_seconds",
    &["vllm:time_per_output_token_seconds"],
    Sum,
);
pub const E2E: Family = Family::new("vllm:e2e_request_latency_seconds", &[], Sum);
/// Per finished request: its decode time over its output tokens less one (vLLM's TPOT).
pub const TPOT: Family = Family::new("vllm:request_time_per_output_token_seconds", &[], Sum);
/// Counters, in tokens.
pub(crate) const PREFIX_QUERIES: Family = Family::new(
    "vllm:prefix_cache_queries_total",
    &["vllm:gpu_prefix_cache_queries_total"],
    Sum,
);
pub(crate) const PREFIX_HITS: Family = Family::new(
    "vllm:prefix_cache_hits_total",
    &["vllm:gpu_prefix_cache_hits_total"],
    Sum,
);
/// Where a request's time goes (V1): waiting in the queue, prefill, decode, and prefill plus
/// decode (inference); histograms per finished request. TTFT is about queue + prefill, E2E
/// about queue + inference (plus the API server's own time).
pub const QUEUE_TIME: Family = Family::new("vllm:request_queue_time_seconds", &[], Sum);
pub const PREFILL_TIME: Family = Family::new("vllm:request_prefill_time_seconds", &[], Sum);
pub const DECODE_TIME: Family = Family::new("vllm:request_decode_time_seconds", &[], Sum);
pub const INFERENCE_TIME: Family = Family::new("vllm:request_inference_time_seconds", &[], Sum);
/// Speculative decoding, counters: drafts proposed (V1), draft tokens proposed, and draft
/// tokens the target model accepted (V0 and V1). Acceptance rate = accepted / draft tokens;
/// mean acceptance length = 1 + accepted / drafts (tokens a verification step yields).
pub(crate) const SPEC_DRAFTS: Family = Family::new("vllm:spec_decode_num_drafts_total", &[], Sum);
pub(crate) const SPEC_DRAFT_TOKENS: Family =
    Family::new("vllm:spec_decode_num_draft_tokens_total", &[], Sum);
pub(crate) const SPEC_ACCEPTED_TOKENS: Family =
    Family::new("vllm:spec_decode_num_accepted_tokens_total", &[], Sum);
/// Disaggregated prefill's KV-cache transfers through NIXL (`NixlConnector`): the time of
/// each transfer (histogram, s), the bytes of each (histogram), and failures (counters).
pub(crate) const NIXL_XFER_TIME: Family = Family::new("vllm:nixl_xfer_time_seconds", &[], Sum);
pub(crate) const NIXL_BYTES: Family = Family::new("vllm:nixl_bytes_transferred", &[], Sum);
pub(crate) const NIXL_FAILED_TRANSFERS: Family =
    Family::new("vllm:nixl_num_failed_transfers_total", &[], Sum);
pub(crate) const NIXL_FAILED_NOTIFICATIONS: Family =
    Family::new("vllm:nixl_num_failed_notifications_total", &[], Sum);
/// V0's hit-rate gauge, read only where the counters are absent.
pub(crate) const PREFIX_HIT_RATE_V0: Family =
    Family::new("vllm:gpu_prefix_cache_hit_rate", &[], Mean);

/// Families the summaries read, with the sample name a scrape must hold (histograms by their
/// `_bucket`); `discover --check` reports those an engine lacks under every spelling.
pub(crate) const RELIED_ON: [(Family, &str); 11] = [
    (GENERATION_TOKENS, ""),
    (PROMPT_TOKENS, ""),
    (KV_CACHE_USAGE, ""),
    (RUNNING, ""),
    (WAITING, ""),
    (TTFT, "_bucket"),
    (ITL, "_bucket"),
    (E2E, "_bucket"),
    (TPOT, "_bucket"),
    (PREFIX_QUERIES, ""),
    (PREFIX_HITS, ""),
];

/// Every family a view reads.
pub(crate) const ALL: [Family; 24] = [
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    KV_CACHE_USAGE,
    RUNNING,
    WAITING,
    PREEMPTIONS,
    TTFT,
    ITL,
    E2E,
    TPOT,
    PREFIX_QUERIES,
    PREFIX_HITS,
    PREFIX_HIT_RATE_V0,
    QUEUE_TIME,
    PREFILL_TIME,
    DECODE_TIME,
    INFERENCE_TIME,
    SPEC_DRAFTS,
    SPEC_DRAFT_TOKENS,
    SPEC_ACCEPTED_TOKENS,
    NIXL_XFER_TIME,
    NIXL_BYTES,
    NIXL_FAILED_TRANSFERS,
    NIXL_FAILED_NOTIFICATIONS,
];

/// Whether a view reads the sample `name` (a histogram's `_bucket`, `_sum`, `_count` by its
/// family): the series an aggregating recorder keeps of an engine's `/metrics`.
pub(crate) fn is_read(name: &str) -> bool {
    let base = ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name);
    ALL.iter()
        .any(|f| f.names().any(|n| n == base || n == name))
}

/// The families of [`RELIED_ON`] that none of `names` spells, by current name (with suffix).
pub fn missing(names: &std::collections::BTreeSet<&str>) -> Vec<String> {
    RELIED_ON
        .iter()
        .filter(|(f, suffix)| {
            !f.names()
                .any(|n| names.contains(format!("{n}{suffix}").as_str()))
        })
        .map(|(f, suffix)| format!("{}{suffix}", f.name))
        .collect()
}
