//! Issue 11's table from a recording of a real `vllm serve` whose processes ran the test
//! harness's in-process timers (tests/fixtures/vllm_timers): per default probe and process,
//! calls and p50/p90 against the timers over the same window. Used by bench/vllm_probes.sh:
//!
//! `cargo run --release --example probe_truth RUN.esrec TIMERS_DIR CORE_PID WORKER_PID FROM_S TO_S`
//! (FROM_S/TO_S: seconds since the recording's start).

use std::path::Path;

#[path = "../tests/common/probe_truth.rs"]
mod probe_truth;

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
    let (table, failures) =
        probe_truth::probe_truth(&rec, Path::new(&a[2]), a[3].parse()?, a[4].parse()?, t0, t1);
    println!("{table}");
    for f in &failures {
        println!("FAIL: {f}");
    }
    let ok = failures.is_empty();
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
