//! `record --probe` against ground truth: samples/mq_pipeline.py times the body of every call of
//! `MessageQueue.enqueue` (producer process), `MessageQueue.dequeue` (consumer process) and
//! `AuxStore._evict_to_fit` (the consumer's writer thread) with perf_counter_ns, once in the body
//! and once around the call in its caller. The exact method must count every call in the window,
//! put every call's span between those two clocks, and give per-call latency percentiles within
//! ±10% or 0.06 ms (all three are ≥ 150 µs per call here).
//!
//! Why two clocks: a call holds time that its body's clocks do not see, and that a caller's timer
//! (the kind used on a real engine) does: set-up, the probe's traps, and now and then tens of µs
//! between the body's last clock read and the return (55–70 µs in ~3% of `enqueue`'s calls on
//! 3.12 here, with no collection in them). Against the body's clock alone, p90 missed by 10.6%
//! in one CI run where the distribution had a gap at its 90th percentile.

mod common;

use common::*;
use enginescope::record::Recording;
use std::time::Duration;

/// The same calls timed by their callers around the call expression ("outer_calls"): set-up,
/// return, the probe's own traps and a collection run on entry included. A recorded call's
/// span lies between its body's time and this one.
fn outer_calls(truth: &serde_json::Value, function: &str) -> Vec<(u64, u64)> {
    timed_calls(truth, "outer_calls", function)
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

/// Probes beyond the three defaults-like ones, all on the producer's main thread (with
/// `MessageQueue.enqueue` that makes five exact probes on one thread: more than its debug
/// registers, so they take turns).
const EXTRA: &[&str] = &[
    "Engine.step",
    "Engine.schedule",
    "Engine.update",
    "Engine.pace",
];

/// Recorded calls in `rc` (start, dur) that do not lie between the two clocks of their call:
/// no longer than the call seen from its caller (`oc`), and no shorter than its body (`tc`)
/// less `under` (the calibrated trap cost the recorder subtracts from every call: a trap can
/// cost less than calibrated; sid 3.15 read 1 µs under the body at p10 in one CI run); 2 µs for
/// the clocks' reads.
fn outside_clocks(rc: &[&(u64, u64)], tc: &[(u64, u64)], oc: &[(u64, u64)], under: u64) -> usize {
    rc.iter()
        .filter(|c| {
            let j = oc.partition_point(|x| x.0 + x.1 + SLACK < c.0 + c.1);
            let Some(&outer) = oc.get(j) else {
                return true;
            };
            let within_outer = outer.0 <= c.0 + SLACK && c.0 + c.1 <= outer.0 + outer.1 + SLACK;
            // Its body: the first to start inside that call (calls of one function do not
            // overlap on its thread).
            let k = tc.partition_point(|x| x.0 < outer.0);
            let holds_body = tc
                .get(k)
                .is_some_and(|x| x.1 <= c.1 + under && x.0 + x.1 <= c.0 + c.1 + under);
            !(within_outer && holds_body)
        })
        .count()
}

/// Clock-read slack (ns) of [`outside_clocks`] and the percentile bounds.
const SLACK: u64 = 2_000;

/// The caller's timing of each body in `bodies`: the last call started before it.
fn outer_of(bodies: &[&(u64, u64)], oc: &[(u64, u64)]) -> Vec<u64> {
    bodies
        .iter()
        .filter_map(|b| {
            let j = oc.partition_point(|x| x.0 <= b.0).checked_sub(1)?;
            let x = oc[j];
            (x.0 + x.1 >= b.0 + b.1).then_some(x.1)
        })
        .collect()
}

fn check(label: &str) {
    check_with(label, false, None, None);
}

/// A recorded call's (start, duration, weight), ns.
type WeightedCall = (u64, u64, f64);

/// Estimated calls and weights of the recorded calls of probe `probe` on `tid` inside
/// `[e0, e1)` (absolute ns), from the watch edges: each call stands for the window over the
/// time a call of its length could have started there and been watched whole.
fn window_weights(
    r: &Recording,
    probe: u32,
    tid: i32,
    e0: u64,
    e1: u64,
) -> Option<(f64, Vec<WeightedCall>)> {
    let t0 = r.meta.start_mono_ns;
    let end = r.end.as_ref().map_or(u64::MAX / 2, |e| e.duration_ns);
    let iv = enginescope::views::latency::watch_intervals(r, end);
    let v = iv.get(&(probe, tid))?;
    let clipped: Vec<(u64, u64)> = v
        .iter()
        .map(|&(a, b)| ((t0 + a).max(e0), (t0 + b).min(e1)))
        .filter(|(a, b)| b > a)
        .collect();
    let watched: u64 = clipped.iter().map(|(a, b)| b - a).sum();
    let span = e1 - e0;
    let calls: Vec<(u64, u64, f64)> = r
        .calls
        .iter()
        .filter(|c| c.probe == probe && c.tid == tid)
        .map(|c| (t0 + c.start_ns, c.dur_ns))
        .filter(|&(s, _)| s >= e0 && s < e1)
        .map(|(s, d)| {
            let room: u64 = clipped.iter().map(|(a, b)| (b - a).saturating_sub(d)).sum();
            let w = if room == 0 {
                span as f64 / watched.max(1) as f64
            } else {
                span as f64 / room as f64
            };
            (s, d, w)
        })
        .collect();
    Some((watched as f64 / span as f64, calls))
}

/// Weighted nearest-rank percentile.
fn wpct(v: &mut [(u64, f64)], q: f64) -> f64 {
    v.sort_by_key(|x| x.0);
    let total: f64 = v.iter().map(|x| x.1).sum();
    let mut acc = 0.0;
    for &(d, w) in v.iter() {
        acc += w;
        if acc >= q * total - 1e-9 {
            return d as f64;
        }
    }
    f64::NAN
}

/// `budget`: `--probe-budget` (percent), with a longer window; `share`: every budgeted thread
/// watched that share of the time instead (`ENGINESCOPE_PROBE_SHARE`, with a budget).
fn check_with(label: &str, extra: bool, budget: Option<&str>, share: Option<&str>) {
    let share_forced = share.is_some();
    let i = interp(label);
    if !available(&i) {
        return;
    }
    let mut args = vec![
        "--truth",
        "{dir}/truth.json",
        "--duration",
        // Taking turns (5 probes on 4 registers, a turn every 500 ms) gives each probe a
        // watched run every 2.5 s: in 5 s two or three, and an interval from three runs is
        // as wide as the t-distribution with two degrees of freedom makes it (+-51% for
        // `Engine.pace` in one run of twenty beside a CPU hog); 8 s gives four or five.
        if budget.is_some() || extra { "8" } else { "5" },
        "--go-fifo",
        "{dir}/go",
    ];
    if extra {
        args.push("--gc-truth");
    }
    let w = start(&i, "mq_pipeline.py", &args);
    let consumer = consumer_of(&w);
    let out = w.dir.join("run.esrec");
    let out_s = out.to_string_lossy().into_owned();
    let pids = format!("{},{consumer}", w.pid);
    let mut rargs = vec![
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
    ];
    if extra {
        for e in EXTRA {
            rargs.push("--probe");
            rargs.push(e);
        }
    }
    match budget {
        Some(b) => rargs.extend(["--probe-budget", b]),
        // Every call, as the truth counts them (the default is a budget).
        None => rargs.push("--exact-probes"),
    }
    let env: Vec<(&str, &str)> = share
        .map(|s| ("ENGINESCOPE_PROBE_SHARE", s))
        .into_iter()
        .collect();
    let mut rec = Recorder::start_env(&rargs, &env);
    // Probes attach when the sampler first meets the function: wait for all of them.
    let lines = rec.wait_for_lines(
        "enginescope: probe ",
        3 + if extra { EXTRA.len() } else { 0 },
    );
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
    eprintln!(
        "{label}: register rotations {:?}, calls dropped at a rotation {:?}, rotation attach failures {:?}; GC method {:?}",
        r.counters.get("probe_register_rotations"),
        r.counters.get("probe_calls_dropped_at_rotation"),
        r.counters.get("probe_rotation_attach_failures"),
        r.gc_methods.iter().map(|g| (g.pid, g.method.as_str())).collect::<Vec<_>>(),
    );
    let mut partial = 0;
    // Under a budget: the probes whose traps, every call watched, cost over a quarter more than
    // the budget (they must be watched part of the time: the budget's own cost adds the
    // watched context switches and a trap cost of at least this one), and those whose traps
    // cost under it (printed: the switches may still take them over). Which ones are which
    // depends on this machine's trap cost.
    let (mut over_budget, mut under_budget) = (Vec::new(), Vec::new());
    let mut functions = vec![
        (&producer, "MessageQueue.enqueue"),
        (&cons, "MessageQueue.dequeue"),
        (&cons, "AuxStore._evict_to_fit"),
    ];
    if extra {
        functions.extend(EXTRA.iter().map(|f| (&producer, *f)));
    }
    for (truth, function) in functions {
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
        let probe = r
            .probes
            .iter()
            .find(|p| p.function == function)
            .map(|p| p.id)
            .unwrap();
        let tid = r
            .calls
            .iter()
            .find(|c| c.probe == probe)
            .map(|c| c.tid)
            .unwrap_or(0);
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
        // Calls the recorder itself flagged: an edge it could not classify (another reference
        // to the code object changed its count between the traps), a pop with no push, a push
        // never popped. A call lost or mistimed without a counted reason fails.
        let flagged = common::flagged_calls(&r) as usize;
        let under = SLACK + r.counters.get("probe_trap_cost_ns").copied().unwrap_or(0);
        let oc = outer_calls(truth, function);
        let bodies: Vec<&(u64, u64)> = tc.iter().filter(inside).collect();
        let mut o = outer_of(&bodies, &oc);
        assert_eq!(
            o.len(),
            t.len(),
            "{label} {function}: outer and body timers disagree"
        );
        // Every recorded call lies between the two clocks of its call.
        let timed: Vec<&(u64, u64)> = rc.iter().filter(inside).collect();
        let outside = outside_clocks(&timed, &tc, &oc, under);
        assert!(
            outside <= flagged,
            "{label} {function}: {outside} recorded calls do not lie between their body's and their caller's clocks ({flagged} flagged)"
        );
        if let (Some(b), None) = (budget, share) {
            // What the budget bounds: the thread's debug traps (two per call watched) at the
            // calibrated trap cost, against the window's length. A quarter over for the
            // rounding of the ring and the first watched-all-the-time window (the test's
            // threads each run one probe, so the thread's traps are this probe's).
            let b: f64 = b.parse::<f64>().unwrap() / 100.0;
            let trap = r.counters.get("probe_trap_cost_ns").copied().unwrap_or(0) as f64;
            let took = 2.0 * rc.iter().filter(inside).count() as f64 * trap / (e1 - e0) as f64;
            let full = 2.0 * t.len() as f64 * trap / (e1 - e0) as f64;
            eprintln!(
                "{label} {function}: traps {:.3}% of the window (all calls watched: {:.3}%; budget {:.3}%)",
                took * 100.0,
                full * 100.0,
                b * 100.0
            );
            assert!(
                took <= (b * 1.25).max(full.min(b)),
                "{label} {function}: its traps took {:.3}% of the window, over the budget {:.3}%",
                took * 100.0,
                b * 100.0
            );
            if full > 1.25 * b {
                over_budget.push(function);
            } else if full < b {
                under_budget.push(function);
            }
        }
        // Watched for part of the window (registers rotated, or the budget's phases).
        let part = window_weights(&r, probe, tid, e0, e1).filter(|(s, _)| *s < 0.995);
        let watched_part = part.is_some();
        if over_budget.contains(&function) {
            assert!(
                watched_part,
                "{label} {function}: its traps cost over the budget watched all the time, yet it was"
            );
        }
        if let Some((share, wc)) = part {
            partial += 1;
            // Watched for part of the window (registers rotated): counts scaled, percentiles
            // weighted. Each timed call was checked above against its own clocks; what is left
            // is the estimate. The count, scaled by the watch edges, within 5% of the truth's.
            // A percentile comes from a subsample (the calls inside the watched time, `share`
            // of it in blocks of whole rotation periods, so the load can differ between what
            // was watched and what was not): the subsample's q-quantile can lie anywhere from
            // the window's (q * share)-quantile (every unwatched call above it) to its
            // (q * share + 1 - share)-quantile (every one below). The weighted percentile must
            // lie in that band, the body's clock below and the caller's above, 2 points of
            // rank for the weights. Printed beside it: the truth inside the watched time.
            let est: f64 = wc.iter().map(|c| c.2).sum();
            let t0 = r.meta.start_mono_ns;
            let end = r.end.as_ref().map_or(u64::MAX / 2, |e| e.duration_ns);
            let iv = enginescope::views::latency::watch_intervals(&r, end);
            let v = iv.get(&(probe, tid)).cloned().unwrap_or_default();
            eprintln!(
                "{label} {function}: watched intervals (ms from the window's start): {:?}",
                v.iter()
                    .map(|&(a, b)| (
                        (t0 + a) as i64 / 1_000_000 - e0 as i64 / 1_000_000,
                        (t0 + b) as i64 / 1_000_000 - e0 as i64 / 1_000_000
                    ))
                    .collect::<Vec<_>>()
            );
            let mut seen: Vec<u64> = tc
                .iter()
                .filter(inside)
                .filter(|c| v.iter().any(|&(a, b)| c.0 >= t0 + a && c.0 + c.1 <= t0 + b))
                .map(|c| c.1)
                .collect();
            // Recorded calls not wholly inside a watched interval: a watch edge stamped later
            // (or earlier) than the registers really changed would show here.
            let astray = wc
                .iter()
                .filter(|c| !v.iter().any(|&(a, b)| c.0 >= t0 + a && c.0 + c.1 <= t0 + b))
                .count();
            eprintln!(
                "{label} {function}: truth inside the watched time: {} calls, p50 {:.3} ms p90 {:.3} ms; {astray} recorded calls not wholly inside it",
                seen.len(),
                pct(&mut seen, 0.5) / 1e6,
                pct(&mut seen, 0.9) / 1e6
            );
            let mut wd: Vec<(u64, f64)> = wc.iter().map(|c| (c.1, c.2)).collect();
            let (t50, t90) = (pct(&mut t, 0.5), pct(&mut t, 0.9));
            let (m50, m90) = (wpct(&mut wd, 0.5), wpct(&mut wd, 0.9));
            eprintln!(
                "{label} {function}: watched {:.0}% of the window; calls truth {} estimated {est:.1} ({} timed); p50 body {:.3} ms recorded {:.3} ms whole call {:.3}; p90 body {:.3} recorded {:.3} whole call {:.3}",
                share * 100.0,
                t.len(),
                wc.len(),
                t50 / 1e6,
                m50 / 1e6,
                pct(&mut o, 0.5) / 1e6,
                t90 / 1e6,
                m90 / 1e6,
                pct(&mut o, 0.9) / 1e6,
            );
            assert!(
                t.len() >= 50,
                "{label} {function}: too few calls in the window"
            );
            // Within 5%, or within twice the half-width of the 95% interval the report prints
            // for this count (relative, as the test's window is a little shorter than the
            // report's): an estimate from a few rotation periods of a swinging load can be off
            // by more than 5% and say so, and that is what a user reads. The interval over the
            // test's window (the recording's first phase also holds the workload's wait for
            // its go, a phase with no call that widens the whole recording's interval).
            let cov = enginescope::views::latency::window_coverages(
                &r,
                e0.saturating_sub(t0),
                e1.saturating_sub(t0),
            );
            let u = enginescope::views::latency::estimate_intervals(&r, &cov).remove(&(probe, tid));
            let rel = u.as_ref().map_or(0.0, |u| {
                (u.calls[1] - u.calls[0]) / (u.calls[1] + u.calls[0]).max(1.0)
            });
            let tol = 0.05f64.max(2.0 * rel);
            eprintln!(
                "{label} {function}: report's calls interval {:?} ({} phases, {}): +-{:.1}%, tolerance {:.1}%",
                u.as_ref().map(|u| u.calls),
                u.as_ref().map_or(0, |u| u.phases),
                u.as_ref().map_or("none", |u| u.method.as_str()),
                rel * 100.0,
                tol * 100.0
            );
            assert!(
                share_forced || rel <= 0.5,
                "{label} {function}: the report's calls interval is +-{:.0}%: too few phases to say anything",
                rel * 100.0
            );
            if share_forced {
                // At a forced share the probe's own part is checked exactly: every truth call
                // wholly inside the watched time timed (a few at the watch edges aside). The
                // estimate, where at least 120 calls were timed (the queue's two ends at every
                // share): within 10%, or twice the printed interval's half-width. Printed only
                // for `_evict_to_fit` (14-137 timed): its estimate is the schedule's selection
                // among a few dozen calls, and read 26-35% low in about one run in six, once at
                // a 70% share beside a printed +-11% (not explained; docs/probes.md), as the
                // queue's `enqueue` once read 6.3% low beside +-0.8% at 30%.
                let timed = wc.len() as f64;
                let inside_watched = seen.len() as f64;
                assert!(
                    (timed - inside_watched).abs() <= 0.01 * inside_watched + 2.0,
                    "{label} {function}: {timed} calls timed of the {inside_watched} truth calls wholly inside the watched time"
                );
                assert!(
                    timed < 120.0 || (est - t.len() as f64).abs() <= 0.1f64.max(tol) * t.len() as f64,
                    "{label} {function}: estimated calls {est:.1} vs the truth's {} (tolerance {:.1}%)",
                    t.len(),
                    0.1f64.max(tol) * 100.0
                );
            } else {
                assert!(
                    (est - t.len() as f64).abs() <= tol * t.len() as f64,
                    "{label} {function}: estimated calls {est:.1} vs the truth's {} (tolerance {:.1}%)",
                    t.len(),
                    tol * 100.0
                );
            }
            // At a forced share, a probe that timed under 120 calls (`_evict_to_fit`) is
            // printed, not checked, as its count is: a call as long as the on-phases has little
            // room in them and weighs ten times a short one (span over room), so one such call
            // among a few dozen decides the p90 (54 ms for a truth p90 of 17 ms in one run of
            // twenty beside a CPU hog, whose preemptions make those calls).
            if share_forced && wc.len() < 120 {
                continue;
            }
            for (q, m) in [(0.5, m50), (0.9, m90)] {
                let lo_q = (q * share - 0.02).max(0.0);
                let hi_q = (q * share + 1.0 - share + 0.02).min(1.0);
                let (lo, hi) = (pct(&mut t, lo_q), pct(&mut o, hi_q));
                assert!(
                    m + under as f64 >= lo && m <= hi + SLACK as f64,
                    "{label} {function}: p{} {m} outside [{lo}, {hi}] (body's p{:.0}, whole call's p{:.0})",
                    q * 100.0,
                    lo_q * 100.0,
                    hi_q * 100.0
                );
            }
            continue;
        }
        let (t50, t90, o50, o90, m50, m90) = (
            pct(&mut t, 0.5),
            pct(&mut t, 0.9),
            pct(&mut o, 0.5),
            pct(&mut o, 0.9),
            pct(&mut m, 0.5),
            pct(&mut m, 0.9),
        );
        eprintln!(
            "{label} {function}: calls truth {} recorded {}; p50 body {:.3} ms recorded {:.3} ms whole call {:.3} ms; p90 body {:.3} recorded {:.3} whole call {:.3}",
            t.len(),
            m.len(),
            t50 / 1e6,
            m50 / 1e6,
            o50 / 1e6,
            t90 / 1e6,
            m90 / 1e6,
            o90 / 1e6
        );
        assert!(
            t.len() >= 50,
            "{label} {function}: too few calls in the window"
        );
        // Equal, but for calls the recorder flagged.
        assert!(
            m.len().abs_diff(t.len()) <= flagged,
            "{label} {function}: call count {} vs the truth's {} ({flagged} flagged)",
            m.len(),
            t.len()
        );
        // Its percentiles lie between the two clocks' too (order statistics keep per-call
        // bounds); and
        // issue 11's tolerance against the whole call as a caller's timer sees it, or against
        // the body: within 10%, or 0.06 ms for sub-millisecond calls (how long the workload's
        // calls are depends on the machine's speed).
        let close = |m: f64, t: f64| (m - t).abs() <= (0.10 * t).max(60_000.0);
        for (q, b, m, o) in [(50, t50, m50, o50), (90, t90, m90, o90)] {
            assert!(
                m + under as f64 >= b && m <= o + SLACK as f64,
                "{label} {function}: p{q} {m} outside [{b}, {o}]"
            );
            // Where the two clocks themselves are more than the tolerance apart (the caller
            // preempted or waiting for the GIL between its clock and the call: seen under load,
            // 0.81 vs 1.20 ms at a p90), a figure between them cannot be held to either; the
            // per-call bounds above are then the test, and this says so.
            if close(o, b) || close(b, o) {
                assert!(
                    close(m, o) || close(m, b),
                    "{label} {function}: p{q} {m} vs body {b}, whole call {o}"
                );
            } else {
                eprintln!(
                    "{label} {function}: p{q}: body {b} and whole call {o} are over 10% apart; only the per-call bounds hold it"
                );
            }
        }
    }
    if extra {
        check_gc(label, &r, &producer, w.pid);
    }
    if budget.is_some() && !over_budget.is_empty() {
        // Each thread over its budget was re-sized (the test's threads run one probe each).
        assert!(
            r.counters.get("probe_budget_resizes").copied().unwrap_or(0)
                >= over_budget.len() as u64,
            "{label}: {:?} re-sizings for {over_budget:?}",
            r.counters.get("probe_budget_resizes")
        );
    }
    if budget.is_some() {
        eprintln!(
            "{label}: over the budget watched all the time: {over_budget:?}; under it: {under_budget:?}; {partial} watched part of the time"
        );
    }
}

/// GC pauses of the producer beside the probes, against two clocks per collection (the
/// clocks `exact_probes` uses for calls): the callbacks' span (`gc.callbacks`, read inside the
/// collector) must lie inside every recorded pause, and an explicit `gc.collect(0)`'s recorded
/// pause inside its caller's clock. Counts within 1%. An automatic collection has no caller's
/// clock; what it spends outside its callbacks' span (the callback machinery: 15–30 µs a pause
/// on this machine's ~0.15 ms young collections, more on a slower or loaded one) is bounded
/// loosely: at most the span again plus 0.1 ms, plus what the process was switched out there
/// (a preemption at a loaded 2-CPU machine's edges took up to 4 ms), plus the machine's steal
/// in the window (a stolen vCPU stops the clock of no guest thread: one automatic pause read
/// 3.5 ms outside its span with nothing switched out, in CI on an Intel host). A fixed 30 µs
/// a pause failed in CI on an AMD host (6 pauses, +457 µs over the callbacks' spans).
fn check_gc(label: &str, r: &Recording, truth: &serde_json::Value, pid: i32) {
    // `pid` as the host sees it (the truth's is the container's own in a PID namespace).
    let w0 = truth["window"]["start_mono_ns"].as_u64().unwrap() + 200_000_000;
    let w1 = truth["window"]["end_mono_ns"].as_u64().unwrap() - 200_000_000;
    let t0 = r.meta.start_mono_ns;
    let spans = |key: &str| -> Vec<(u64, u64)> {
        truth[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p[0].as_u64().unwrap(),
                    p[0].as_u64().unwrap() + p[1].as_u64().unwrap(),
                )
            })
            .filter(|p| p.0 >= w0 && p.0 < w1)
            .collect()
    };
    let want = spans("gc_pauses");
    let callers = spans("gc_outer");
    let got: Vec<((u64, u64), i32)> = r
        .gc_pauses
        .iter()
        .filter(|g| g.pid == pid)
        .map(|g| ((t0 + g.start_ns, t0 + g.start_ns + g.dur_ns), g.tid))
        .filter(|p| p.0 .0 >= w0 && p.0 .0 < w1)
        .collect();
    // Thread `tid`'s time switched out (sched_switch, from the recording) inside `span`.
    let switched_out = |tid: i32, span: (u64, u64)| -> u64 {
        r.offcpu
            .iter()
            .filter(|o| o.pid == pid && o.tid == tid)
            .map(|o| {
                let s = t0 + o.start_ns;
                (s + o.dur_ns).min(span.1).saturating_sub(s.max(span.0))
            })
            .sum()
    };
    let method = r
        .gc_methods
        .iter()
        .find(|g| g.pid == pid)
        .map(|g| g.method.clone());
    let overlap = |a: (u64, u64), b: (u64, u64)| a.1.min(b.1).saturating_sub(a.0.max(b.0));
    // Time the hypervisor ran something else on this machine's vCPUs during the window (all
    // CPUs together): a vCPU stolen mid-collection stretches the pause with no switch-out the
    // guest can see, by at most all of it.
    let steal = truth["steal_ns"].as_u64().unwrap_or(0);
    let (mut explicit, mut automatic) = (0, 0);
    let mut bad: Vec<String> = Vec::new();
    let mut outside_span_ns: Vec<u64> = Vec::new();
    for &inner in &want {
        let Some(&(g, tid)) = got.iter().find(|&&(g, _)| overlap(g, inner) > 0) else {
            continue; // the count check below
        };
        if g.0 > inner.0 + SLACK || g.1 + SLACK < inner.1 {
            bad.push(format!("{g:?} does not hold its callbacks' span {inner:?}"));
        }
        let outside = (g.1 - g.0).saturating_sub(inner.1 - inner.0);
        if let Some(&c) = callers.iter().find(|&&c| c.0 <= inner.0 && inner.1 <= c.1) {
            explicit += 1;
            if g.0 + SLACK < c.0 || g.1 > c.1 + SLACK {
                bad.push(format!("explicit {g:?} outside its caller's clock {c:?}"));
            }
        } else {
            automatic += 1;
            outside_span_ns.push(outside);
            let preempted = switched_out(tid, (g.0, inner.0)) + switched_out(tid, (inner.1, g.1));
            if outside > (inner.1 - inner.0) + 100_000 + preempted + steal {
                bad.push(format!(
                    "automatic {g:?}: {outside} ns outside its callbacks' span {inner:?} \
                     ({preempted} ns of it switched out; machine steal in the window {steal} ns)"
                ));
            }
        }
    }
    outside_span_ns.sort_unstable();
    let q = |f: f64| {
        outside_span_ns
            .get(((outside_span_ns.len() as f64 - 1.0) * f).round() as usize)
            .map_or(0.0, |&n| n as f64 / 1e3)
    };
    let (tw, tg): (u64, u64) = (
        want.iter().map(|p| p.1 - p.0).sum(),
        got.iter().map(|(p, _)| p.1 - p.0).sum(),
    );
    eprintln!(
        "{label} GC (producer, {method:?}): pauses truth {} recorded {} ({explicit} explicit, {automatic} automatic); total truth {:.3} ms recorded {:.3} ms; automatic ones outside their callbacks' span: p50 {:.1} µs, max {:.1} µs",
        want.len(),
        got.len(),
        tw as f64 / 1e6,
        tg as f64 / 1e6,
        q(0.5),
        q(1.0)
    );
    assert!(
        method.is_some_and(|m| m == "uprobe" || m == "watchpoint"),
        "{label}: GC not exact"
    );
    assert!(
        got.len().abs_diff(want.len()) as f64 <= (0.01 * want.len() as f64).max(1.0),
        "{label}: GC pauses {} vs {}",
        got.len(),
        want.len()
    );
    assert!(
        explicit >= 2 && automatic >= 2,
        "{label}: {explicit} explicit and {automatic} automatic collections in the window"
    );
    assert!(bad.is_empty(), "{label}: {}", bad.join("; "));
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

// Two more probes than a thread has debug registers for (five on the producer's main thread,
// GC exact beside them by uprobes, so four registers): the registers rotate, each probe is
// watched ~80% of the window, every call it timed is checked against its two clocks, the
// counts are scaled, and the percentiles checked against what a subsample of that share can
// show (`check_with`). Before session 5 these were ignored: their percentiles were compared
// with the body's clock alone over the whole window (Engine.step's p50 read 0.476 ms against
// the window's 0.408: its body's clock misses its own set-up and traps, and a 55-80% subsample
// of a window under changing load is not the window).
#[test]
fn rotating_probes_pyenv_311() {
    check_with("pyenv-3.11", true, None, None);
}

#[test]
fn rotating_probes_pyenv_312() {
    check_with("pyenv-3.12", true, None, None);
}

#[test]
fn rotating_probes_pyenv_313() {
    check_with("pyenv-3.13", true, None, None);
}

#[test]
fn rotating_probes_sid_314() {
    check_with("sid-3.14", true, None, None);
}

#[test]
fn rotating_probes_sid_315() {
    check_with("sid-3.15", true, None, None);
}

// `--probe-budget 0.2`: the producer's and consumer's probes would cost ~0.4% of their
// threads' time watched all the time on a VM whose trap costs ~10 µs (200 calls/s, two traps
// each), so they are watched part of it (idle turns in the rotation); where a trap costs 3 µs
// (0.12%) their traps alone stay under it, and whether the watched context switches take them
// over is the machine's; the writer's stays under the budget. (`forced_shares_*` watch part of
// the time on any machine.) Every timed call checked against its clocks, counts scaled within 5%,
// percentiles within what the subsample can show, and each thread's trap time within the
// budget.
#[test]
fn budgeted_probes_pyenv_312() {
    check_with("pyenv-3.12", false, Some("0.2"), None);
}

#[test]
fn budgeted_probes_sid_315() {
    check_with("sid-3.15", false, Some("0.2"), None);
}

// Issue 35: the estimates at a chosen coverage. Every budgeted thread watched 10%, 30% and 70%
// of the time (`ENGINESCOPE_PROBE_SHARE`): each timed call checked against its clocks, every
// truth call wholly inside the watched time timed (the probe's own effect), the scaled counts
// of probes that timed 120 calls or more within 10% (the schedule's selection; most runs within
// 5%, docs/probes.md) and the percentiles within what the subsample can show, as under the
// budget.
fn forced_shares(label: &str) {
    for share in ["0.1", "0.3", "0.7"] {
        eprintln!("{label}: every budgeted thread watched {share} of the time");
        check_with(label, false, Some("0.2"), Some(share));
    }
}

#[test]
fn forced_shares_pyenv_312() {
    forced_shares("pyenv-3.12");
}

#[test]
fn forced_shares_sid_314() {
    forced_shares("sid-3.14");
}

/// The fleet's normal case: an always-on agent watches the pipeline's probes in on-phases,
/// with watchpoints on every CPU (which reserve a debug register on every CPU), and an
/// engineer runs `record --exact-probes` on the same processes. The recording must time every
/// call: the agent gives its registers back while the recording watches probes (both say
/// so). Before, the recording found one register per thread, and its
/// three probes on the producer's thread took turns ("exact, 33% of the window").
#[test]
fn an_agent_gives_a_recording_its_debug_registers_pyenv_312() {
    let label = "pyenv-3.12";
    let i = interp(label);
    if !available(&i) {
        return;
    }
    let mut w = start(
        &i,
        "mq_pipeline.py",
        &["--truth", "{dir}/truth.json", "--duration", "18"],
    );
    let consumer = consumer_of(&w);
    let pids = format!("{},{consumer}", w.pid);
    let functions = ["MessageQueue.enqueue", "Engine.step", "Engine.schedule"];
    let probe_args: Vec<&str> = functions.iter().flat_map(|f| ["--probe", *f]).collect();
    let adir = w.dir.join("agent");
    let adir_s = adir.to_string_lossy().into_owned();
    let mut aargs = vec![
        "--pid",
        &pids,
        "--backend",
        "bpf",
        "--listen",
        "127.0.0.1:0",
        "--dir",
        &adir_s,
        "--poll",
        "0.25",
    ];
    aargs.extend(probe_args.iter().copied());
    // Watched half the time on any machine (a budget's on-phases, on every CPU), whatever
    // its trap cost.
    let mut agent = common::agent::Agent::start_env(&aargs, &[("ENGINESCOPE_PROBE_SHARE", "0.5")]);
    for _ in 0..functions.len() {
        let l = agent.wait_line("enginescope: probe ", Duration::from_secs(30));
        assert!(l.contains(": exact,"), "{label}: agent: {l}");
    }
    // Its probes watched (the slots on every CPU opened) before the recording starts.
    common::agent::poll_until(Duration::from_secs(20), Duration::from_millis(100), || {
        let exp = common::agent::parse_exposition(&agent.metrics());
        let watched = functions
            .iter()
            .map(|f| {
                common::agent::sum_of(
                    &exp,
                    "enginescope_probe_watched_seconds_total",
                    &[("function", f)],
                )
            })
            .fold(f64::INFINITY, f64::min);
        (watched > 0.0, ())
    });
    let out = w.dir.join("run.esrec");
    let out_s = out.to_string_lossy().into_owned();
    let mut rargs = vec![
        "--duration",
        "5",
        "--pid",
        &pids,
        "-o",
        &out_s,
        "--exact-probes",
    ];
    rargs.extend(probe_args.iter().copied());
    let rec = Recorder::start(&rargs);
    let (ok, _, err) = rec.wait();
    assert!(ok, "{label}: record failed: {err}");
    let st = w.child.wait().unwrap();
    assert!(st.success(), "{label}: workload failed: {st:?}");
    let truth = read_json(&w.dir.join("truth.json"));
    let r = enginescope::record::read_recording(&out).unwrap();
    // What each said and did about the registers (printed first: the checks below fail on
    // what these explain).
    for l in err
        .lines()
        .filter(|l| l.contains("debug registers") || l.contains("take turns"))
    {
        eprintln!("{label}: record: {l}");
    }
    agent.drain_log();
    for l in agent
        .err
        .log
        .lines()
        .filter(|l| l.contains("debug registers") || l.contains("watched again"))
    {
        eprintln!("{label}: agent: {l}");
    }
    for k in [
        "step_wait_for_room_us",
        "probe_register_asks",
        "probe_registers_refused",
        "probe_watches_every_cpu",
        "probe_rotation_attach_failures",
    ] {
        eprintln!("{label}: record {k} {:?}", r.counters.get(k));
    }
    // From the last probe's placing on (a probe is placed when the sampler first meets its
    // function, which on a loaded host can be inside the window): no turns from there.
    let placed = r.probes.iter().map(|p| p.t_ns).max().unwrap_or(0);
    eprintln!(
        "{label}: the probes placed {:.3} s into the window",
        placed as f64 / 1e9
    );
    let r0 = r.meta.start_mono_ns + placed;
    let r1 = r.meta.start_mono_ns + r.end.as_ref().map_or(0, |e| e.duration_ns);
    assert!(
        r1 > r0 + 2_000_000_000,
        "{label}: the probes were placed {:.1} s into the window",
        placed as f64 / 1e9
    );
    for function in functions {
        let tc = truth_calls(&truth, function);
        let e0 = quiet_edge(&tc, r0 + 200_000_000);
        let e1 = quiet_edge(&tc, r1 - 200_000_000);
        let inside = |c: &&(u64, u64)| c.0 >= e0 && c.0 < e1;
        let (rc, method) = recorded_calls(&r, function);
        assert_eq!(method, "exact", "{label} {function}");
        let probe = r.probes.iter().find(|p| p.function == function).unwrap().id;
        let tid = r
            .calls
            .iter()
            .find(|c| c.probe == probe)
            .map(|c| c.tid)
            .unwrap_or(0);
        // Watched the whole window: no turns, no share.
        let part = window_weights(&r, probe, tid, e0, e1).map(|(s, _)| s);
        if part.is_some_and(|s| s < 0.995) {
            // Where the watch was off, relative to the compared span.
            let end = r.end.as_ref().map_or(u64::MAX / 2, |e| e.duration_ns);
            let iv = enginescope::views::latency::watch_intervals(&r, end);
            let ms = |t: u64| (t as f64 - (e0 - r.meta.start_mono_ns) as f64) / 1e6;
            let on: Vec<(f64, f64)> = iv
                .get(&(probe, tid))
                .map(|v| v.iter().map(|&(a, b)| (ms(a), ms(b))).collect())
                .unwrap_or_default();
            panic!(
                "{label} {function}: watched {part:?} of the window beside the agent; watched intervals (ms from the span's start, span {:.0} ms): {on:?}",
                (e1 - e0) as f64 / 1e6
            );
        }
        let (n_rec, n_truth) = (
            rc.iter().filter(inside).count(),
            tc.iter().filter(inside).count(),
        );
        eprintln!("{label} {function}: {n_rec} calls recorded, {n_truth} in the truth");
        assert!(n_truth > 100, "{label} {function}: {n_truth} calls");
        // Every call timed, but those the recorder itself flagged (an edge it could not
        // classify, a pop with no push, a push never popped), as the other tests here allow.
        let flagged = common::flagged_calls(&r) as usize;
        assert!(
            n_rec <= n_truth && n_rec + flagged >= n_truth,
            "{label} {function}: {n_rec} calls timed of {n_truth} ({flagged} flagged)"
        );
    }
    // Both said what they did.
    assert!(
        err.contains("watches probes too: it gives this recording its debug registers"),
        "{label}: the recording did not see the agent:\n{err}"
    );
    // (Whether it watches again after is not checked here: other tests' recordings, run
    // beside this one, keep it giving way.)
    assert!(
        agent
            .err
            .log
            .contains("this agent's probes give it their debug registers"),
        "{label}: the agent did not say it gave way:\n{}",
        agent.err.log
    );
    agent.stop();
}
