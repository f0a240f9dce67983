//! Issue 35's selection effect, with no kernel: the in-process timers' calls of a recorded real
//! `vllm serve` (bench/vllm_probes.sh keeps them, tests/fixtures/vllm_timers) replayed through
//! the probe schedule (`sampler::probes::replay`) under many seeds of the on-phases' lengths:
//! per probe and thread, how far a perfect watcher's estimated count and p50 (weighted as
//! `report` weighs them) fall from every call's, and in how many seeds within the tolerances (calls 5%, p50 10% or 0.06 ms).
//!
//! `cargo run --release --example schedule_replay RUN.esrec TIMERS_DIR FROM_S TO_S [SEEDS]`
//! (FROM_S/TO_S: seconds since the recording's start). Env: `BUDGET` (the `--probe-budget`
//! share, default 0.0025), `TICK_MS` (the recording loop's period, 20), `TRAP_NS` (default the
//! recording's `probe_trap_cost_in_use_ns`), `MIN_CALLS` (rows with fewer truth calls in the
//! window are left out, 200); `ENGINESCOPE_PROBE_PHASE_MS` sets the on-phases' mean length as
//! it does for `record`.

use std::collections::BTreeMap;
use std::path::Path;

use enginescope::sampler::probes::replay::{replay, Call, Replay};

fn pctl(v: &mut [u64], q: f64) -> f64 {
    v.sort_unstable();
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize] as f64
}

fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// One probe on one thread over the seeds: its truth, and per seed the share watched and the
/// estimate's errors.
#[derive(Default)]
struct Row {
    calls: usize,
    p50: f64,
    share: Vec<f64>,
    count_err: Vec<f64>,
    p50_err: Vec<f64>,
    p50_ok: usize,
    /// Seeds whose printed 95% intervals held the truth's count, its p50.
    calls_held: usize,
    p50_held: usize,
}

/// Median, min and max.
fn spread(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        a.len() == 5 || a.len() == 6,
        "usage: schedule_replay RUN.esrec TIMERS_DIR FROM_S TO_S [SEEDS]"
    );
    let rec = enginescope::record::read_recording(Path::new(&a[1]))?;
    let s = |x: &str| -> anyhow::Result<u64> { Ok((x.parse::<f64>()? * 1e9) as u64) };
    let start = rec.meta.start_mono_ns;
    let (from, to) = (start + s(&a[3])?, start + s(&a[4])?);
    let seeds: u64 = a.get(5).map_or(Ok(20), |x| x.parse())?;
    let counter = |k: &str| rec.counters.get(k).copied().unwrap_or(0);
    let trap_ns = env_or(
        "TRAP_NS",
        counter("probe_trap_cost_in_use_ns").max(counter("probe_trap_cost_ns")),
    );
    let budget = env_or("BUDGET", 0.0025);
    let tick_ns = env_or("TICK_MS", 20u64) * 1_000_000;
    let min_calls = env_or("MIN_CALLS", 200usize);
    // Every timer file: (pid, function) is one probe.
    let mut probes: BTreeMap<(i32, String), usize> = BTreeMap::new();
    let mut calls = Vec::new();
    for e in std::fs::read_dir(&a[2])? {
        let path = e?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let Some(pid) = name
            .strip_prefix("timers-")
            .and_then(|n| n.strip_suffix(".jsonl"))
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        for line in std::fs::read_to_string(&path)?.lines() {
            let Ok(j) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let (Some(f), Some(t), Some(d), Some(tid)) =
                (j[0].as_str(), j[1].as_u64(), j[2].as_u64(), j[3].as_i64())
            else {
                continue;
            };
            let n = probes.len();
            let probe = *probes.entry((pid, f.to_string())).or_insert(n);
            calls.push(Call {
                probe,
                tid: tid as i32,
                start_ns: t,
                dur_ns: d,
            });
        }
    }
    calls.sort_unstable_by_key(|c| c.start_ns);
    let name: BTreeMap<usize, String> = probes
        .iter()
        .map(|((pid, f), &i)| (i, format!("{f} ({pid})")))
        .collect();
    let window = to - from;
    let mut acc: BTreeMap<(usize, i32), Row> = BTreeMap::new();
    for seed in 1..=seeds {
        let r = Replay {
            budget,
            trap_ns,
            tick_ns,
            seed: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            start_ns: start,
            from_ns: from,
            to_ns: to,
        };
        for mut w in replay(probes.len(), &calls, &r) {
            if w.all.len() < min_calls {
                continue;
            }
            let truth_p50 = pctl(&mut w.all, 0.5);
            let row = acc.entry((w.probe, w.tid)).or_insert_with(|| Row {
                calls: w.all.len(),
                p50: truth_p50,
                ..Row::default()
            });
            row.share.push(w.watched_ns as f64 / window as f64);
            let Some((est, lat)) = w.estimate(window) else {
                continue;
            };
            row.count_err.push(est / w.all.len() as f64 - 1.0);
            let p50 = lat.p50 * 1e6;
            row.p50_err.push(p50 / truth_p50 - 1.0);
            // Within 10% or 0.06 ms, as the acceptance.
            row.p50_ok += usize::from((p50 - truth_p50).abs() <= (0.1 * truth_p50).max(60_000.0));
            // Whether the intervals report prints hold the truth.
            if let Some(u) = w.intervals(window) {
                let n = w.all.len() as f64;
                row.calls_held += usize::from(u.calls[0] <= n && n <= u.calls[1]);
                let t = truth_p50 / 1e6;
                row.p50_held += usize::from(u.p50_ms[0] <= t && t <= u.p50_ms[1]);
            }
        }
    }
    println!(
        "Replay of {} calls ({} probes) through the schedule: --probe-budget {:.2}%, trap {} ns, loop every {} ms, {} seeds, window {:.1} s\n",
        calls.len(),
        probes.len(),
        budget * 100.0,
        trap_ns,
        tick_ns / 1_000_000,
        seeds,
        window as f64 / 1e9
    );
    println!("| probe | thread | truth calls | watched | count error: median [min, max] | seeds within 5% | truth p50 ms | p50 error: median [min, max] | seeds p50 within 10% or 0.06 ms | seeds whose 95% interval holds the count, the p50 |");
    println!("|---|---:|---:|---:|---|---:|---:|---|---:|---|");
    for ((probe, tid), mut r) in acc {
        let (sh, _, _) = spread(&mut r.share);
        let within = r.count_err.iter().filter(|e| e.abs() <= 0.05).count();
        let (em, elo, ehi) = spread(&mut r.count_err);
        let (pm, plo, phi) = spread(&mut r.p50_err);
        let (n, p50, p50_ok, err) = (r.calls, r.p50, r.p50_ok, r.count_err);
        let (ch, ph) = (r.calls_held, r.p50_held);
        println!(
            "| {} | {tid} | {n} | {:.1}% | {:+.1}% [{:+.1}, {:+.1}] | {within}/{} | {:.3} | {:+.1}% [{:+.1}, {:+.1}] | {p50_ok}/{} | {ch}, {ph} |",
            name[&probe],
            sh * 100.0,
            em * 100.0,
            elo * 100.0,
            ehi * 100.0,
            err.len(),
            p50 / 1e6,
            pm * 100.0,
            plo * 100.0,
            phi * 100.0,
            err.len()
        );
    }
    Ok(())
}
