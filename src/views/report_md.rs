//! Markdown sections of the report for vLLM-aware recordings: flamegraph links, engines, the
//! per-window table with correlations and throughput drops, function latency and API-server
//! stalls. Each section is left out when the recording has nothing for it.

use crate::metrics::maths::LatencyQuantiles;
use std::fmt::Write;

use super::report::{md, Report};
use super::short_file;

/// Windows shown in the Markdown table (all are in the JSON).
pub(crate) const MD_WINDOWS: usize = 120;
/// Correlations shown.
pub(crate) const MD_CORRELATIONS: usize = 15;
/// Stalls shown.
pub(crate) const MD_STALLS: usize = 20;
/// Frames of a stall's dominant stack shown.
pub(crate) const MD_STALL_FRAMES: usize = 4;

/// A number with `prec` decimals, `-` when absent.
fn opt(v: Option<f64>, prec: usize) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{x:.prec$}"),
        _ => "-".into(),
    }
}

fn pct_opt(v: Option<f64>) -> String {
    match v {
        Some(x) if x.is_finite() => format!("{:.1}%", x * 100.0),
        _ => "-".into(),
    }
}

fn pids(v: &[i32]) -> String {
    if v.is_empty() {
        "-".into()
    } else {
        v.iter().map(i32::to_string).collect::<Vec<_>>().join(", ")
    }
}

/// A link target: spaces would end a Markdown link.
fn href(path: &str) -> String {
    path.replace(' ', "%20")
}

impl Report {
    /// The findings, first in the report: each a numbered verdict with its score and a link
    /// to the section that proves it.
    pub(super) fn findings_markdown(&self, s: &mut String) {
        let _ = writeln!(s, "\n## Findings\n");
        if self.findings.is_empty() {
            let _ = writeln!(
                s,
                "None passed its thresholds: no thread waited for the GIL {:.0}% of the recording \
                 or more, no process collected garbage {:.0}% of it or more, no thread spent {:.0}% \
                 of its CPU or more serializing or spun on a core polling, no probed function grew \
                 with running requests, and no event-loop stall or fleet situation was seen.",
                super::findings::GIL_MIN_SHARE * 100.0,
                super::findings::GC_MIN_SHARE * 100.0,
                super::findings::SERIAL_MIN_SHARE * 100.0
            );
            return;
        }
        let _ = writeln!(
            s,
            "Ranked by the share of the affected thread's or process's time each explains (all in the JSON, `findings`).\n"
        );
        for (i, f) in self.findings.iter().enumerate() {
            let _ = writeln!(
                s,
                "{}. **{}** ({:.1}%): {} ([{}](#{}))",
                i + 1,
                f.kind,
                f.score * 100.0,
                md(&f.verdict),
                md(&f.see),
                super::findings::anchor(&f.see)
            );
        }
    }

    pub(super) fn links_markdown(&self, s: &mut String) {
        if self.flamegraphs.is_empty() {
            return;
        }
        let _ = writeln!(s, "\n## Flamegraphs\n");
        for f in &self.flamegraphs {
            let name = f.rsplit('/').next().unwrap_or(f);
            let _ = writeln!(s, "- [{}]({})", md(name), href(f));
        }
    }

    pub(super) fn engines_markdown(&self, s: &mut String) {
        if self.engines.is_empty() {
            return;
        }
        self.engine_table_markdown(s);
        self.engine_load_markdown(s);
        self.request_time_markdown(s);
        self.spec_and_transfer_markdown(s);
        self.imbalance_markdown(s);
        self.ranks_markdown(s);
        self.fleet_findings_markdown(s);
    }

    /// The engines, their processes and scrapes, and what each engine's scrapes say of it.
    fn engine_table_markdown(&self, s: &mut String) {
        let _ = writeln!(s, "\n## Engines\n");
        let _ = writeln!(
            s,
            "| engine | API server | EngineCore | workers | metrics | scrapes | scrape errors | coverage | longest gap |"
        );
        let _ = writeln!(s, "|---|---:|---|---|---|---:|---:|---:|---:|");
        for e in &self.engines {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                md(&e.id),
                if e.api_server_pids.is_empty() {
                    pids(&[e.api_server_pid][..(e.api_server_pid != 0) as usize])
                } else {
                    pids(&e.api_server_pids)
                },
                pids(&e.engine_core_pids),
                pids(&e.worker_pids),
                if e.metrics_url.is_empty() {
                    "-".to_string()
                } else {
                    md(&e.metrics_url)
                },
                e.scrapes,
                e.scrape_errors,
                pct_opt(e.scrape_coverage),
                e.max_scrape_gap_s
                    .map_or("-".to_string(), |g| format!("{g:.1} s"))
            );
        }
        for e in &self.engines {
            if let Some(c) = e
                .scrape_coverage
                .filter(|&c| c < super::engines::LOW_COVERAGE)
            {
                let _ = writeln!(
                    s,
                    "\n**Warning: {} answered only {:.0}% of scrapes** ({} of {}; longest gap {}; last error: {}). \
                     Rates and quantiles span the gaps, but windows without two scrapes have no figures; \
                     a longer `--scrape-interval` loads a busy API server less.",
                    md(&e.id),
                    c * 100.0,
                    e.scrapes,
                    e.scrapes + e.scrape_failures,
                    e.max_scrape_gap_s
                        .map_or("-".to_string(), |g| format!("{g:.1} s")),
                    md(&e.last_scrape_error)
                );
            }
        }
    }

    /// Each engine's load and latency over the recording.
    fn engine_load_markdown(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "\n| engine | gen tok/s | min | max | prompt tok/s | KV mean | KV max | running | max | waiting | max | prefix-cache hits |"
        );
        let _ = writeln!(
            s,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for e in &self.engines {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                md(&e.id),
                opt(e.gen_tok_s.mean, 1),
                opt(e.gen_tok_s.min, 1),
                opt(e.gen_tok_s.max, 1),
                opt(e.prompt_tok_s.mean, 1),
                pct_opt(e.kv_usage.mean),
                pct_opt(e.kv_usage.max),
                opt(e.running.mean, 1),
                opt(e.running.max, 0),
                opt(e.waiting.mean, 1),
                opt(e.waiting.max, 0),
                pct_opt(e.prefix_cache_hit_rate)
            );
        }
        let _ = writeln!(
            s,
            "\nLatency over the recording, ms (from histogram bucket increases, as Prometheus's \
             `histogram_quantile`; `≤x`: inside the engine's first bucket, where only the bound \
             is known; `>x`: above its last; TPOT: time per output token per request, its mean \
             exact; requests: first tokens observed):\n"
        );
        let _ = writeln!(
            s,
            "| engine | TTFT p50 | p90 | p99 | TPOT mean | p50 | p90 | p99 | ITL p50 | p90 | p99 | E2E p50 | p90 | p99 | requests |"
        );
        let _ = writeln!(
            s,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for e in &self.engines {
            let q = |l: &LatencyQuantiles| l.shown(1).join(" | ");
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} |",
                md(&e.id),
                q(&e.ttft_ms),
                opt(e.tpot_ms.mean, 2),
                q(&e.tpot_ms),
                q(&e.itl_ms),
                q(&e.e2e_ms),
                e.ttft_ms.count.round()
            );
        }
    }

    /// Where the requests' time went, where the engine says so.
    fn request_time_markdown(&self, s: &mut String) {
        // Where the requests' time went, where the engine says (vLLM V1's request time
        // histograms): the means add up (queue + prefill is about TTFT; queue + inference
        // about E2E, the API server's own time apart).
        let decomposed: Vec<_> = self
            .engines
            .iter()
            .filter(|e| e.queue_ms.count > 0.0 || e.inference_ms.count > 0.0)
            .collect();
        if !decomposed.is_empty() {
            let _ = writeln!(
                s,
                "\nWhere finished requests' time went, ms (vLLM's request time histograms: \
                 mean, then p50 and p90 from the buckets; TTFT is about queue + prefill, E2E \
                 about queue + inference):\n"
            );
            let _ = writeln!(
                s,
                "| engine | requests | queue mean | p50 | p90 | prefill mean | p50 | p90 | decode mean | p50 | p90 | inference mean | TTFT mean | queue + prefill | E2E mean |"
            );
            let _ = writeln!(
                s,
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for e in decomposed {
                let two = |l: &LatencyQuantiles| {
                    let v = l.shown(1);
                    format!("{} | {}", v[0], v[1])
                };
                let sum = e.queue_ms.mean.zip(e.prefill_ms.mean).map(|(a, b)| a + b);
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    md(&e.id),
                    e.queue_ms.count.max(e.inference_ms.count).round(),
                    opt(e.queue_ms.mean, 1),
                    two(&e.queue_ms),
                    opt(e.prefill_ms.mean, 1),
                    two(&e.prefill_ms),
                    opt(e.decode_ms.mean, 1),
                    two(&e.decode_ms),
                    opt(e.inference_ms.mean, 1),
                    opt(e.ttft_ms.mean, 1),
                    opt(sum, 1),
                    opt(e.e2e_ms.mean, 1)
                );
            }
        }
    }

    /// Speculative decoding and disaggregated prefill's KV transfers, where engines export
    /// them.
    fn spec_and_transfer_markdown(&self, s: &mut String) {
        let spec: Vec<_> = self
            .engines
            .iter()
            .filter_map(|e| Some((e, e.spec_decode.as_ref()?)))
            .collect();
        if !spec.is_empty() {
            let _ = writeln!(
                s,
                "\nSpeculative decoding over the recording (vLLM's `spec_decode_*` counters; \
                 acceptance length = 1 + accepted / drafts, the tokens one verification step \
                 yields):\n"
            );
            let _ = writeln!(
                s,
                "| engine | drafts | draft tokens | accepted | acceptance rate | mean acceptance length |"
            );
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|");
            for (e, d) in spec {
                let _ = writeln!(
                    s,
                    "| {} | {} | {:.0} | {:.0} | {} | {} |",
                    md(&e.id),
                    opt(d.drafts, 0),
                    d.draft_tokens,
                    d.accepted_tokens,
                    d.acceptance_rate
                        .map_or("-".into(), |r| format!("{:.1}%", r * 100.0)),
                    opt(d.mean_acceptance_length, 2)
                );
            }
        }
        let kv: Vec<_> = self
            .engines
            .iter()
            .filter_map(|e| Some((e, e.kv_transfer.as_ref()?)))
            .collect();
        if !kv.is_empty() {
            let _ = writeln!(
                s,
                "\nKV-cache transfers of disaggregated prefill over the recording (vLLM's \
                 `nixl_*` series; MB/s is bytes over the transfers' summed time):\n"
            );
            let _ = writeln!(
                s,
                "| engine | transfers | time mean ms | p50 | p90 | MB | MB per transfer | MB/s | failed transfers | failed notifications |"
            );
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
            for (e, k) in kv {
                let v = k.xfer_ms.shown(2);
                let _ = writeln!(
                    s,
                    "| {} | {:.0} | {} | {} | {} | {:.1} | {} | {} | {} | {} |",
                    md(&e.id),
                    k.transfers,
                    opt(k.xfer_ms.mean, 2),
                    v[0],
                    v[1],
                    k.bytes / 1e6,
                    opt(k.bytes_per_transfer.map(|b| b / 1e6), 2),
                    opt(k.mb_per_s, 0),
                    opt(k.failed_transfers, 0),
                    opt(k.failed_notifications, 0)
                );
            }
        }
    }

    /// How unevenly the fleet's engines were loaded.
    fn imbalance_markdown(&self, s: &mut String) {
        if let Some(im) = &self.engine_imbalance {
            let mut parts = Vec::new();
            for (what, sp, prec) in [
                ("gen tok/s", &im.gen_tok_s, 1),
                ("TTFT p90 ms", &im.ttft_p90_ms, 1),
                ("running", &im.running, 1),
                ("waiting", &im.waiting, 1),
                ("KV usage", &im.kv_usage, 3),
            ] {
                let Some(sp) = sp else { continue };
                // A ratio only where the smaller value is not near zero; else the difference.
                let how = match sp.max_over_min {
                    Some(r) => format!("max/min {r:.2}"),
                    None if sp.spread > sp.near_zero => {
                        format!("difference {:.prec$}", sp.spread)
                    }
                    None => continue, // both near zero: nothing to say
                };
                parts.push(format!(
                    "{what} {how} ({} {:.prec$} vs {} {:.prec$})",
                    md(&sp.max_engine),
                    sp.max,
                    md(&sp.min_engine),
                    sp.min
                ));
            }
            if !parts.is_empty() {
                let _ = writeln!(
                    s,
                    "\n**Imbalance across {} engines:** {}.",
                    im.engines,
                    parts.join("; ")
                );
            }
        }
    }

    /// Data-parallel ranks (vLLM's `engine` label), one row each.
    fn ranks_markdown(&self, s: &mut String) {
        if !self.engine_ranks.is_empty() {
            let _ = writeln!(s, "\nData-parallel ranks (vLLM's `engine` label):\n");
            let _ = writeln!(
                s,
                "| rank | gen tok/s | KV mean | running | waiting | TTFT p90 | TPOT p90 | ITL p90 |"
            );
            let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
            for e in &self.engine_ranks {
                let p90 = |l: &LatencyQuantiles| l.shown(1)[1].clone();
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} | {} | {} |",
                    md(&e.id),
                    opt(e.gen_tok_s.mean, 1),
                    pct_opt(e.kv_usage.mean),
                    opt(e.running.mean, 1),
                    opt(e.waiting.mean, 1),
                    p90(&e.ttft_ms),
                    p90(&e.tpot_ms),
                    p90(&e.itl_ms)
                );
            }
            if let Some(g) = self
                .rank_imbalance
                .as_ref()
                .and_then(|i| i.gen_tok_s.as_ref())
            {
                let _ = writeln!(
                    s,
                    "\nRank gen tok/s: {} {:.1} vs {} {:.1} ({}).",
                    md(&g.max_engine),
                    g.max,
                    md(&g.min_engine),
                    g.min,
                    g.max_over_min
                        .map_or(format!("difference {:.1}", g.spread), |r| format!(
                            "max/min {r:.2}"
                        ))
                );
            }
        }
    }

    /// The fleet's findings.
    fn fleet_findings_markdown(&self, s: &mut String) {
        if !self.fleet_findings.is_empty() {
            let _ = writeln!(s, "\n### Fleet findings\n");
            for f in &self.fleet_findings {
                let core = match (f.engine_core_cpu_pct, f.engine_core_gil_wait_pct, f.engine_core_gc_pct) {
                    (Some(c), Some(g), Some(gc)) => format!(
                        "; its EngineCore main thread then: CPU {c:.0}%, GIL wait {g:.1}%, GC {gc:.1}%"
                    ),
                    _ => String::new(),
                };
                let _ = writeln!(
                    s,
                    "- **{}** `{}` {:.0}–{:.0} s: {}{core}.",
                    md(&f.engine),
                    f.kind,
                    f.start_s,
                    f.end_s,
                    md(&f.detail)
                );
            }
        }
    }

    pub(super) fn timeline_markdown(&self, s: &mut String) {
        if self.windows.len() < 2 {
            return;
        }
        let engines = !self.engines.is_empty();
        let _ = writeln!(s, "\n## Per-window timeline\n");
        let _ = writeln!(
            s,
            "{} windows of {} s. Thread cells: CPU % / GIL wait % / GC % of the window; probe \
             cells: p50 ms (calls).\n",
            self.windows.len(),
            self.window_s
        );
        let mut head = String::from("| window s |");
        let mut rule = String::from("|---:|");
        if engines {
            head.push_str(" gen tok/s | KV | running | waiting |");
            rule.push_str("---:|---:|---:|---:|");
        }
        for t in &self.key_threads {
            let _ = write!(head, " {} |", md(t));
            rule.push_str("---:|");
        }
        let probes: Vec<String> = self
            .windows
            .first()
            .map(|w| w.probes.iter().map(|p| p.probe.clone()).collect())
            .unwrap_or_default();
        for p in &probes {
            let _ = write!(head, " {} |", md(p));
            rule.push_str("---:|");
        }
        let _ = writeln!(s, "{head}\n{rule}");
        for w in self.windows.iter().take(MD_WINDOWS) {
            let mut row = format!("| {:.1} |", w.start_s);
            if engines {
                let _ = write!(
                    row,
                    " {} | {} | {} | {} |",
                    opt(w.gen_tok_s, 1),
                    pct_opt(w.kv_usage),
                    opt(w.running, 1),
                    opt(w.waiting, 1)
                );
            }
            for t in &w.threads {
                let _ = write!(
                    row,
                    " {:.1} / {:.1} / {:.1} |",
                    t.cpu_pct, t.gil_wait_pct, t.gc_pct
                );
            }
            for p in &w.probes {
                let _ = write!(row, " {} ({}) |", opt(p.p50_ms, 2), p.calls);
            }
            let _ = writeln!(s, "{row}");
        }
        if self.windows.len() > MD_WINDOWS {
            let _ = writeln!(
                s,
                "\n{} more windows in the JSON report.",
                self.windows.len() - MD_WINDOWS
            );
        }
        self.correlations_markdown(s);
        if engines {
            self.drops_markdown(s);
        }
    }

    /// Which signals moved with throughput over the windows.
    fn correlations_markdown(&self, s: &mut String) {
        // Only correlations over enough windows mean anything; with fewer, one line says so
        // instead of a table of r = ±1.00.
        let min_n = super::timeline::MIN_CORRELATION_WINDOWS;
        let meaningful: Vec<&super::timeline::Correlation> = self
            .correlations
            .iter()
            .filter(|c| c.n >= min_n && c.r.is_some())
            .collect();
        if !self.correlations.is_empty() && meaningful.is_empty() {
            let _ = writeln!(
                s,
                "\n### Correlation with gen tok/s\n\nNot computed: {} windows with throughput, \
                 fewer than {min_n}. A longer recording or a smaller `--window` gives more.",
                self.correlations.iter().map(|c| c.n).max().unwrap_or(0)
            );
        }
        if !meaningful.is_empty() {
            let _ = writeln!(s, "\n### Correlation with gen tok/s\n");
            let strong: Vec<String> = meaningful
                .iter()
                .filter(|c| c.r.is_some_and(|r| r.abs() >= 0.7))
                .take(3)
                .map(|c| format!("{} of {} (r = {})", c.signal, md(&c.subject), opt(c.r, 2)))
                .collect();
            let _ = writeln!(
                s,
                "{}\n",
                if strong.is_empty() {
                    "No profiler signal moves strongly (|r| ≥ 0.7) with throughput.".to_string()
                } else {
                    format!("Moving most with throughput: {}.", strong.join("; "))
                }
            );
            let _ = writeln!(
                s,
                "Pearson r over the windows (signals constant over the windows, and those with \
                 fewer than {min_n} windows, left out).\n"
            );
            let _ = writeln!(s, "| signal | of | r | windows | note |");
            let _ = writeln!(s, "|---|---|---:|---:|---|");
            for c in meaningful.iter().take(MD_CORRELATIONS) {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} |",
                    c.signal,
                    md(&c.subject),
                    opt(c.r, 2),
                    c.n,
                    md(&c.note)
                );
            }
        }
    }

    /// The windows whose throughput fell, and what changed there.
    fn drops_markdown(&self, s: &mut String) {
        let _ = writeln!(s, "\n### Throughput drops\n");
        match self.throughput_drops.first() {
            None => {
                let _ = writeln!(
                    s,
                    "No window's gen tok/s is more than {}% below the median window's.",
                    self.throughput_drop_pct
                );
            }
            Some(d0) => {
                let _ = writeln!(
                    s,
                    "Windows with gen tok/s more than {}% below the median ({:.1} tok/s), \
                     and the signals furthest from their own medians there.\n",
                    self.throughput_drop_pct, d0.median_gen_tok_s
                );
                let _ = writeln!(s, "| window s | gen tok/s | below median | what changed |");
                let _ = writeln!(s, "|---:|---:|---:|---|");
                for d in &self.throughput_drops {
                    let changed: Vec<String> = d
                        .changed
                        .iter()
                        .map(|c| {
                            format!(
                                "{} {}: {:.2} (median {:.2})",
                                c.signal, c.subject, c.value, c.median
                            )
                        })
                        .collect();
                    let _ = writeln!(
                        s,
                        "| {:.1}-{:.1} | {:.1} | {:.1}% | {} |",
                        d.start_s,
                        d.end_s,
                        d.gen_tok_s,
                        d.drop_pct,
                        md(&changed.join("; "))
                    );
                }
            }
        }
    }

    pub(super) fn latency_markdown(&self, s: &mut String) {
        if self.function_latency.is_empty() {
            return;
        }
        let _ = writeln!(s, "\n## Function latency\n");
        let _ = writeln!(
            s,
            "| probe | thread | calls | calls/s | p50 ms | p90 ms | p99 ms | max ms | mean ms | method | resolution ms |"
        );
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|");
        for f in &self.function_latency {
            let l = &f.latency_ms;
            // An estimate says how sure it is: ± the larger side of its 95% interval.
            let pm = |v: f64, ci: Option<[f64; 2]>, prec: usize| match ci {
                Some(ci) => format!("{v:.prec$} ±{:.prec$}", crate::estimate::larger_side(v, ci)),
                None => format!("{v:.prec$}"),
            };
            let u = f.uncertainty.as_ref();
            let calls = match u {
                Some(u) => format!(
                    "{} ±{:.0}",
                    f.calls,
                    crate::estimate::larger_side(f.calls as f64, u.calls)
                ),
                None => f.calls.to_string(),
            };
            let _ =
                writeln!(
                s,
                "| {} ({}) | {} | {}{} | {:.2} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {:.3} |",
                md(&f.function),
                md(short_file(&f.file)),
                md(&super::findings::thread_label(
                    if f.thread.is_empty() { "thread" } else { &f.thread },
                    f.tid,
                    self.process_name(f.pid),
                    f.pid
                )),
                // Not every call seen: the count is a lower bound (sampled) or an estimate
                // scaled from the share of the window an exact probe was watched.
                if f.estimated() {
                    "~ "
                } else if f.every_call() {
                    ""
                } else {
                    "≥ "
                },
                calls,
                f.calls_per_s,
                pm(l.p50, u.map(|u| u.p50_ms), 3),
                pm(l.p90, u.map(|u| u.p90_ms), 3),
                l.p99,
                l.max,
                l.mean,
                md(&f.method),
                f.resolution_ms
            );
        }
        if let Some(f) = self.function_latency.iter().find(|f| f.estimated()) {
            let _ = writeln!(
                s,
                "\nRows `exact, N% of the window` are probes watched for part of the window \
                 (the probe budget's on-phases, or turns with other probes for their thread's \
                 debug registers): every call was timed while the probe was \
                 watched ({} of {} here for {}), and counts marked ~ are estimates scaled to \
                 the whole window (longer calls, which straddle a switch more often, weigh \
                 more); percentiles are weighted the same way. ± is the 95% interval's larger \
                 side (a bootstrap over the watched phases, widened for few of them; with one or two, over the \
                 calls as independent draws): sampling error only, not the probe's own cost \
                 inside a call.",
                f.calls_observed.unwrap_or(0),
                f.calls,
                md(&f.function)
            );
        }
        if self
            .function_latency
            .iter()
            .any(|f| !f.every_call() && !f.estimated())
        {
            let _ = writeln!(
                s,
                "\nRows not `exact` are not comparable with per-call timers: `sampled` probes \
                 see only calls longer than their resolution and merge back-to-back calls, so \
                 their counts are lower bounds (≥) and their percentiles are in sampling \
                 periods; `exact, then sampled` rows switched method during the recording."
            );
        }
    }

    pub(super) fn stalls_markdown(&self, s: &mut String) {
        let st = &self.api_server_stalls;
        if st.servers.is_empty() {
            return;
        }
        let _ = writeln!(s, "\n## API-server stalls\n");
        let _ = writeln!(
            s,
            "The event loop (main thread) in Python code for more than {} ms without going \
             idle: on CPU, preempted, waiting for the GIL, or blocked in a callback (GIL wait \
             ms, blocked ms).\n",
            st.threshold_ms
        );
        let _ = writeln!(
            s,
            "| pid | CPU s | main thread CPU s | serialization | stalls | stalled s | longest ms |"
        );
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|");
        for r in &st.servers {
            let _ = writeln!(
                s,
                "| {} | {:.3} | {:.3} | {:.1}% | {} | {:.3} | {:.1} |",
                r.pid,
                r.cpu_s,
                r.main_thread_cpu_s,
                r.serialization_share * 100.0,
                r.stalls,
                r.stalled_s,
                r.longest_ms
            );
        }
        for r in st
            .servers
            .iter()
            .filter(|r| !r.serialization_top.is_empty())
        {
            let top: Vec<String> = r
                .serialization_top
                .iter()
                .map(|f| format!("{} ({}) {:.3} s", f.function, short_file(&f.file), f.cpu_s))
                .collect();
            let _ = writeln!(
                s,
                "\nSerialization in pid {}: {}.",
                r.pid,
                md(&top.join("; "))
            );
        }
        if st.stalls.is_empty() {
            return;
        }
        // The asyncio task column only when the recorder read tasks (record 18).
        let tasks = st.stalls.iter().any(|x| x.task.is_some());
        let _ = writeln!(
            s,
            "\n| pid | start s | duration ms | samples | GIL wait ms | blocked ms | serialization | dominant stack (innermost first) | share |{}",
            if tasks { " asyncio task (await chain) |" } else { "" }
        );
        let _ = writeln!(
            s,
            "|---:|---:|---:|---:|---:|---:|---:|---|---:|{}",
            if tasks { "---|" } else { "" }
        );
        for x in st.stalls.iter().take(MD_STALLS) {
            let mut frames: Vec<&str> = x
                .dominant_stack
                .iter()
                .take(MD_STALL_FRAMES)
                .map(String::as_str)
                .collect();
            if x.dominant_stack.len() > MD_STALL_FRAMES {
                frames.push("…");
            }
            let _ = writeln!(
                s,
                "| {} | {:.3} | {:.1} | {} | {:.1} | {:.1} | {:.1}% | {} | {:.1}% |{}",
                x.pid,
                x.start_s,
                x.duration_ms,
                x.samples,
                x.gil_wait_ms,
                x.blocked_ms,
                x.serialization_share * 100.0,
                md(&frames.join(" ← ")),
                x.dominant_share * 100.0,
                match (&x.task, tasks) {
                    (Some(t), _) => format!(
                        " {} ({}) |",
                        md(&t.name),
                        md(&if t.chain.is_empty() {
                            t.coro.clone()
                        } else {
                            t.chain.join(" → ")
                        })
                    ),
                    (None, true) => " |".to_string(),
                    (None, false) => String::new(),
                }
            );
        }
        if st.stalls.len() > MD_STALLS {
            let _ = writeln!(
                s,
                "\n{} more stalls in the JSON report.",
                st.stalls.len() - MD_STALLS
            );
        }
    }
}
