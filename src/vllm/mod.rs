//! vLLM awareness: which processes make up each engine, and the engine's own metrics.
//!
//! * [`discover`]: engines from `/proc` (API server, engine cores, workers, their roles and
//!   the metrics URL); [`discover::rediscover`] diffs against an earlier discovery.
//! * [`metrics`]: fetching `/metrics`, and a [`metrics::Scraper`] thread that sends series,
//!   points and errors over a channel for a recorder to write.
//! * [`prom_text`]: the Prometheus text format parser the scraper uses.
//! * [`probes`]: the functions probed by default, and how probe names match.
//! * [`tree`]: the `discover` command (engine tree, metrics URL, live check).
//!
//! Names and maths of the metrics live in [`crate::metrics`]. Those relied on, as vLLM 0.32
//! exposes them (every sample labelled
//! `engine="<dp rank>",model_name="…"`): `vllm:generation_tokens_total`,
//! `vllm:prompt_tokens_total`, `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`
//! (counters); `vllm:kv_cache_usage_perc` (a fraction, 1 = full), `vllm:num_requests_running`,
//! `vllm:num_requests_waiting` (gauges); `vllm:time_to_first_token_seconds`,
//! `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds` (histograms).

pub mod discover;
pub mod metrics;
pub mod probes;
pub mod prom_text;
pub mod tree;
