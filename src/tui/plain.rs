//! Plain text for when stdout is not a terminal (a pipe, a log file): every 2 s, one line per
//! process, per active thread and per engine.

use super::model::{EngineMetrics, Snapshot, ThreadRow};
use super::render::pct;

/// `1 thread`, `3 threads`.
fn threads(n: usize) -> String {
    format!("{n} thread{}", if n == 1 { "" } else { "s" })
}

fn fmt_opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map(f).unwrap_or_else(|| "-".into())
}

/// A gauge's last value and, when the window has scrapes, its mean and max over it.
fn gauge(m: &super::model::MetricView) -> String {
    let now = fmt_opt(m.now, |v| format!("{v:.0}"));
    match m.window_mean_max() {
        Some((mean, max)) => format!("{now} (window mean {mean:.1}, max {max:.0})"),
        None => now,
    }
}

fn engine_line(e: &EngineMetrics) -> String {
    let mut s = format!(
        "engine {}: generation {} tokens/s, KV cache {}, running {}, waiting {}",
        e.engine,
        fmt_opt(e.gen_tokens_per_s.now, |v| format!("{v:.1}")),
        fmt_opt(e.kv_cache.now, pct),
        gauge(&e.running),
        gauge(&e.waiting),
    );
    if e.ttft.count > 0.0 {
        let [p50, p90, _] = e.ttft.shown(1);
        s.push_str(&format!(", TTFT p50 {p50} p90 {p90} ms"));
    }
    if let Some(m) = e.tpot.mean {
        s.push_str(&format!(", TPOT mean {m:.2} ms"));
    }
    if let Some(err) = &e.scrape_error {
        s.push_str(&format!(" (last scrape failed: {err})"));
    }
    s
}

fn thread_line(t: &ThreadRow) -> String {
    let s = &t.stats;
    let mut line = format!(
        "  {} (tid {}): CPU {}, GIL held {}, GIL wait {}, GC {}, off-CPU {}",
        t.name,
        t.tid,
        pct(s.cpu),
        pct(s.gil_held),
        pct(s.gil_wait),
        pct(s.gc),
        pct(s.offcpu)
    );
    if let Some(f) = t.top_self.first() {
        line.push_str(&format!(
            ", top {} ({}) {}",
            f.function,
            crate::views::short_file(&f.file),
            pct(f.self_share)
        ));
    }
    line
}

/// The lines for one snapshot: a time line, then per process its totals and its threads
/// (busiest first; quiet threads folded into one counted line, as in the dashboard), then
/// engines.
pub fn lines(snap: &Snapshot) -> Vec<String> {
    let mut out = vec![format!(
        "[t {:.1} s, window {:.1} s]{}",
        snap.now_ns as f64 / 1e9,
        snap.wall_ns as f64 / 1e9,
        snap.ended
            .as_ref()
            .map(|r| format!(" recording ended: {r}"))
            .unwrap_or_default()
    )];
    // The answer first, as in the report: what costs the targets their time in the window.
    for f in snap.findings.iter().take(crate::views::findings::TOP) {
        out.push(format!(
            "finding: {} {:.1}%: {}",
            f.kind,
            f.score * 100.0,
            f.verdict
        ));
    }
    for g in &snap.groups {
        if !g.label.is_empty() {
            out.push(g.label.clone());
        }
        for p in &g.processes {
            let s = &p.stats;
            out.push(format!(
                "{} (pid {}): {}, CPU {}, GIL held {}, GIL wait {}, GC {}{}",
                p.name,
                p.pid,
                threads(p.threads.len()),
                pct(s.cpu),
                pct(s.gil_held),
                pct(s.gil_wait),
                pct(s.gc),
                super::app::process_headline(p, snap, false)
                    .map(|h| format!(" | {h}"))
                    .unwrap_or_default()
            ));
            let mut ts: Vec<&ThreadRow> = p.threads.iter().collect();
            ts.sort_by(|a, b| b.stats.cpu.total_cmp(&a.stats.cpu).then(a.tid.cmp(&b.tid)));
            // As the dashboard: quiet threads folded into one line (the busiest one stays).
            let (shown, folded) = super::app::fold(ts);
            out.extend(shown.into_iter().map(thread_line));
            if let Some(f) = folded {
                out.push(format!("  {}", f.label(6)));
            }
        }
    }
    out.extend(snap.engines.iter().map(engine_line));
    for (k, v) in &snap.problems {
        out.push(format!("recorder counter {k} = {v}"));
    }
    if let Some(c) = &snap.cost {
        out.push(format!("what recording cost its targets: {}", c.headline()));
    }
    out
}
