//! `record --probe` against ground truth: samples/mq_pipeline.py times the body of every call of
//! `MessageQueue.enqueue` (producer process), `MessageQueue.dequeue` (consumer process) and
//! `AuxStore._evict_to_fit` (the consumer's writer thread) with perf_counter_ns. The exact method
//! must count every call in the window and give per-call latency percentiles within ±10%
//! (all three are ≥ 200 µs per call here).

mod common;

use common::*;
use enginescope::record::Recording;

/// Calls of `function` in the truth: (start, dur), ns, CLOCK_MONOTONIC.
fn truth_calls(truth: &serde_json::Value, function: &str) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = truth["calls"][function]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| (c[1].as_u64().unwrap(), c[2].as_u64().unwrap()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Move `edge` into the middle of the gap between the truth calls around it, so that a call's
/// start measured a few µs apart by the two sides cannot fall on different sides of it.
fn quiet_edge(calls: &[(u64, u64)], edge: u64) -> u64 {
    let i = calls.partition_point(|c| c.0 <= edge);
    match (i.checked_sub(1).map(|j| calls[j]), calls.get(i)) {
        (Some((s, d)), Some((next, _))) => (s + d + next) / 2,
        _ => edge,
    }
}

fn pct(v: &mut [u64], q: f64) -> f64 {
    v.sort_unstable();
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i] as f64
}

/// Recorded calls of the probe on `function` (start, dur), absolute ns.
fn recorded_calls(r: &Recording, function: &str) -> (Vec<(u64, u64)>, String) {
    let probes: Vec<_> = r.probes.iter().filter(|p| p.function == function).collect();
    assert_eq!(probes.len(), 1, "one probe on {function}: {:?}", r.probes);
    let p = probes[0];
    let mut v: Vec<(u64, u64)> = r
        .calls
        .iter()
        .filter(|c| c.probe == p.id)
        .map(|c| (r.meta.start_mono_ns + c.start_ns, c.dur_ns))
        .collect();
    v.sort();
    (v, p.method.clone())
}

fn check(label: &str) {
    let i = interp(label);
    if !available(&i) {
        return;
    }
    let w = start(
        &i,
        "mq_pipeline.py",
        &[
            "--truth",
            "{dir}/truth.json",
            "--duration",
            "5",
            "--go-fifo",
            "{dir}/go",
        ],
    );
    let consumer = children_of(w.pid)
        .into_iter()
        .find(|&c| {
            std::fs::read(format!("/proc/{c}/cmdline"))
                .map(|b| String::from_utf8_lossy(&b).contains("mq_pipeline"))
                .unwrap_or(false)
        })
        .expect("consumer process");
    let out = w.dir.join("run.esrec");
    let out_s = out.to_string_lossy().into_owned();
    let pids = format!("{},{consumer}", w.pid);
    let mut rec = Recorder::start(&[
        "--rate",
        "1000",
        "--duration",
        "60",
        "--pid",
        &pids,
        "-o",
        &out_s,
        "--probe",
        "mq_pipeline.py:MessageQueue.enqueue",
        "--probe",
        "MessageQueue.dequeue",
        "--probe",
        "AuxStore._evict_to_fit",
    ]);
    // Probes attach when the sampler first meets the function: wait for all three.
    let lines = rec.wait_for_lines("enginescope: probe ", 3);
    for l in &lines {
        assert!(l.contains(": exact,"), "{label}: {l}");
    }
    w.go();
    let (ok, _, err) = rec.wait();
    assert!(ok, "{label}: record failed: {err}");
    let r = enginescope::record::read_recording(&out).unwrap();
    eprintln!(
        "{label}: trap cost {:?} ns; unfinished {:?}, unmatched pops {:?}, ambiguous {:?}",
        r.counters.get("probe_trap_cost_ns"),
        r.counters.get("probe_calls_unfinished"),
        r.counters.get("probe_unmatched_returns"),
        r.counters.get("probe_ambiguous_edges"),
    );
    let producer = read_json(&w.dir.join("truth.json"));
    let cons = read_json(&w.dir.join("truth.json.consumer.json"));
    for (truth, function) in [
        (&producer, "MessageQueue.enqueue"),
        (&cons, "MessageQueue.dequeue"),
        (&cons, "AuxStore._evict_to_fit"),
    ] {
        let tc = truth_calls(truth, function);
        let w0 = truth["window"]["start_mono_ns"].as_u64().unwrap();
        let w1 = truth["window"]["end_mono_ns"].as_u64().unwrap();
        // Leave the ends alone: the writer thread drains after the window.
        let e0 = quiet_edge(&tc, w0 + 200_000_000);
        let e1 = quiet_edge(&tc, w1 - 200_000_000);
        let inside = |c: &&(u64, u64)| c.0 >= e0 && c.0 < e1;
        let mut t: Vec<u64> = tc.iter().filter(inside).map(|c| c.1).collect();
        let (rc, method) = recorded_calls(&r, function);
        let mut m: Vec<u64> = rc.iter().filter(inside).map(|c| c.1).collect();
        assert_eq!(method, "exact");
        {
            // Per-call difference (recorded - truth) of calls matched by start time.
            let ti: Vec<&(u64, u64)> = tc.iter().filter(inside).collect();
            let mut diffs: Vec<i64> = rc
                .iter()
                .filter(inside)
                .filter_map(|c| {
                    let j = ti.partition_point(|t| t.0 < c.0.saturating_sub(1_000_000));
                    ti.get(j)
                        .filter(|t| t.0.abs_diff(c.0) < 1_000_000)
                        .map(|t| c.1 as i64 - t.1 as i64)
                })
                .collect();
            diffs.sort_unstable();
            if !diffs.is_empty() {
                let q = |x: f64| diffs[((diffs.len() - 1) as f64 * x) as usize];
                eprintln!(
                    "{label} {function}: per-call recorded-truth us: p10 {} p50 {} p90 {} ({} matched)",
                    q(0.1) / 1000,
                    q(0.5) / 1000,
                    q(0.9) / 1000,
                    diffs.len()
                );
            }
        }
        let (t50, t90, m50, m90) = (
            pct(&mut t, 0.5),
            pct(&mut t, 0.9),
            pct(&mut m, 0.5),
            pct(&mut m, 0.9),
        );
        eprintln!(
            "{label} {function}: calls truth {} recorded {}; p50 truth {:.3} ms recorded {:.3} ms; p90 truth {:.3} recorded {:.3}",
            t.len(),
            m.len(),
            t50 / 1e6,
            m50 / 1e6,
            t90 / 1e6,
            m90 / 1e6
        );
        assert!(
            t.len() >= 50,
            "{label} {function}: too few calls in the window"
        );
        // Equal, but for calls the recorder itself flagged: an edge it could not classify
        // (another reference to the code object changed its count between the traps), a pop
        // with no push, a push never popped. A call lost without a counted reason fails.
        let flagged = [
            "probe_ambiguous_edges",
            "probe_unmatched_returns",
            "probe_calls_unfinished",
        ]
        .iter()
        .map(|k| r.counters.get(*k).copied().unwrap_or(0) as usize)
        .sum::<usize>();
        assert!(
            m.len().abs_diff(t.len()) <= flagged,
            "{label} {function}: call count {} vs the truth's {} ({flagged} flagged)",
            m.len(),
            t.len()
        );
        // Issue 11's tolerance: within 10%, or 0.06 ms for sub-millisecond calls (how long
        // the workload's calls are depends on the machine's speed).
        let close = |m: f64, t: f64| (m - t).abs() <= (0.10 * t).max(60_000.0);
        assert!(close(m50, t50), "{label} {function}: p50 {m50} vs {t50}");
        assert!(close(m90, t90), "{label} {function}: p90 {m90} vs {t90}");
    }
}

#[test]
fn exact_probes_pyenv_311() {
    check("pyenv-3.11");
}

#[test]
fn exact_probes_pyenv_312() {
    check("pyenv-3.12");
}

#[test]
fn exact_probes_pyenv_313() {
    check("pyenv-3.13");
}

#[test]
fn exact_probes_sid_314() {
    check("sid-3.14");
}

#[test]
fn exact_probes_sid_315() {
    check("sid-3.15");
}
