//! Issue 11's table from a recording of a real `vllm serve` whose processes ran the test
//! harness's in-process timers (tests/fixtures/vllm_timers): per default probe and process,
//! calls and p50/p90 against the timers over the same window. Used by bench/vllm_probes.sh:
//!
//! `cargo run --release --example probe_truth RUN.esrec TIMERS_DIR CORE_PID WORKER_PID FROM_S TO_S`
//! (FROM_S/TO_S: seconds since the recording's start).

use enginescope::record::Recording;
use std::path::Path;

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        a.len() == 7,
        "usage: probe_truth RUN.esrec TIMERS_DIR CORE_PID WORKER_PID FROM_S TO_S"
    );
    let rec = enginescope::record::read_recording(Path::new(&a[1]))?;
    let s = |x: &str| -> anyhow::Result<u64> { Ok((x.parse::<f64>()? * 1e9) as u64) };
    let (t0, t1) = (
        rec.meta.start_mono_ns + s(&a[5])?,
        rec.meta.start_mono_ns + s(&a[6])?,
    );
    let ok = probe_truth(&rec, Path::new(&a[2]), a[3].parse()?, a[4].parse()?, t0, t1);
    let c = |k: &str| rec.counters.get(k).copied().unwrap_or(0);
    println!(
        "trap cost {} ns; unfinished {}, unmatched pops {}, ambiguous edges {}, switched to sampling {}",
        c("probe_trap_cost_ns"),
        c("probe_calls_unfinished"),
        c("probe_unmatched_returns"),
        c("probe_ambiguous_edges"),
        c("probes_switched_to_sampling")
    );
    std::process::exit(if ok { 0 } else { 1 });
}

/// Calls of `label` in the harness's in-process timers of process `pid`: (start, dur), ns,
/// CLOCK_MONOTONIC.
fn timer_calls(dir: &Path, pid: i32, label: &str) -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string(dir.join(format!("timers-{pid}.jsonl"))).unwrap_or_default();
    let mut v: Vec<(u64, u64)> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|j| j[0] == label)
        .filter_map(|j| Some((j[1].as_u64()?, j[2].as_u64()?)))
        .collect();
    v.sort_unstable();
    v
}

fn pctl(v: &mut [u64], q: f64) -> f64 {
    v.sort_unstable();
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize] as f64
}

/// Issue 11: every default probe exact at once on the EngineCore and worker, against the
/// harness's in-process timers over the same window (from the probe's attach, or the load's
/// start, to the load's end; calls counted by start time).
fn probe_truth(rec: &Recording, timers: &Path, core: i32, worker: i32, t0: u64, t1: u64) -> bool {
    let mut table = String::from(
        "| probe | process | calls: truth → reported | p50 truth → reported | p90 truth → reported | method |\n|---|---|---|---|---|---|\n",
    );
    let mut failures = Vec::new();
    for (pid, role, function) in [
        (core, "EngineCore", "MessageQueue.enqueue"),
        (worker, "worker", "MessageQueue.enqueue"),
        (core, "EngineCore", "MessageQueue.dequeue"),
        (worker, "worker", "MessageQueue.dequeue"),
        (worker, "worker", "Worker.execute_model"),
        (core, "EngineCore", "EngineCore.step"),
    ] {
        let truth = timer_calls(timers, pid, function);
        let probes: Vec<_> = rec
            .probes
            .iter()
            .filter(|p| p.pid == pid && p.function.ends_with(function))
            .collect();
        let Some(first) = probes.iter().map(|p| p.t_ns).min() else {
            failures.push(format!("{role} {function}: not probed"));
            continue;
        };
        // From 0.5 s after the probe attached (threads it runs on are attached as they are
        // first seen running it), or the load's start.
        let w0 = t0.max(rec.meta.start_mono_ns + first + 500_000_000);
        let inside = |s: u64| s >= w0 && s < t1;
        let mut t: Vec<u64> = truth.iter().filter(|c| inside(c.0)).map(|c| c.1).collect();
        let ids: Vec<u32> = probes.iter().map(|p| p.id).collect();
        let mut m: Vec<u64> = rec
            .calls
            .iter()
            .filter(|c| ids.contains(&c.probe) && inside(rec.meta.start_mono_ns + c.start_ns))
            .map(|c| c.dur_ns)
            .collect();
        let methods: Vec<&str> = probes.iter().map(|p| p.method.as_str()).collect();
        let (t50, t90, m50, m90) = (
            pctl(&mut t, 0.5),
            pctl(&mut t, 0.9),
            pctl(&mut m, 0.5),
            pctl(&mut m, 0.9),
        );
        table.push_str(&format!(
            "| {function} | {role} | {} → {} | {:.3} → {:.3} ms | {:.3} → {:.3} ms | {} |\n",
            t.len(),
            m.len(),
            t50 / 1e6,
            m50 / 1e6,
            t90 / 1e6,
            m90 / 1e6,
            methods.join(", ")
        ));
        let close = |a: f64, b: f64| (a / b - 1.0).abs() <= 0.10 || (a - b).abs() <= 60_000.0;
        if methods != ["exact"] {
            failures.push(format!("{role} {function}: method {methods:?}"));
        } else if t.len() < 20 {
            failures.push(format!("{role} {function}: {} calls in the truth", t.len()));
        } else if (m.len() as f64 / t.len() as f64 - 1.0).abs() > 0.05 {
            failures.push(format!(
                "{role} {function}: calls {} vs {}",
                m.len(),
                t.len()
            ));
        } else if !close(m50, t50) || !close(m90, t90) {
            failures.push(format!(
                "{role} {function}: p50 {m50} vs {t50}, p90 {m90} vs {t90}"
            ));
        }
    }
    println!("{table}");
    for f in &failures {
        println!("FAIL: {f}");
    }
    failures.is_empty()
}
