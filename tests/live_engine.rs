//! End to end, through `enginescope demo` (the README's main command): the bundled vLLM-like
//! engine (samples/engine: API server, EngineCore, Worker) runs its three bugs, measures itself
//! (`--truth`), and enginescope must find all three from outside, with figures that agree with
//! the engine's own:
//!
//! 1. the Worker's main thread waits for the GIL, and at least 80% of that wait is while the
//!    `aux-output-writer` thread holds it inside `AuxOutputStore._evict_to_fit` / `put`;
//! 2. the exactly probed functions (`Worker.execute_model`, the EngineCore's
//!    `MessageQueue.enqueue`, `AuxOutputStore._evict_to_fit`): every call counted; p50 within
//!    ±10% of the engine's timers for the millisecond calls (the engine times around the call,
//!    so its figures also hold the two breakpoint traps, ~30 µs, that enginescope subtracts:
//!    allowed on top); the sub-millisecond `enqueue` is bounded (at most the engine's +10%, at
//!    least 60% of it), since a GIL hand-off between its return and the caller's clock read
//!    lands in the engine's figure only (tests/live_probes.rs times bodies: ±10% there);
//! 3. the EngineCore's generation-2 collections: every one counted (gc.callbacks), their time
//!    within ±10%;
//!
//! plus generated tokens/s from the scraped `/metrics` within ±10% of the engine's count. Then
//! `demo --fixed` and `diff`: the fixes show as changes beyond each run's own noise.
//! Cost: ~1 min (two 10 s windows plus engine start and shutdown).

mod common;

use common::*;
use enginescope::record::Recording;
use std::path::Path;
use std::process::Command;

fn truth(dir: &Path, role: &str) -> serde_json::Value {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with(&format!("{role}-")) && n.ends_with(".json") {
            return read_json(&e.path());
        }
    }
    panic!("no {role} truth in {}", dir.display());
}

fn demo(python: &str, out: &Path, extra: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_enginescope"))
        .args(["demo", "--no-tui", "--seconds", "10", "--python", python])
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .expect("run enginescope demo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "demo failed:\n{text}");
    text
}

/// Move `edge` into the gap between the truth calls around it.
fn quiet_edge(starts: &[(u64, u64)], edge: u64) -> u64 {
    let i = starts.partition_point(|c| c.0 <= edge);
    match (i.checked_sub(1).map(|j| starts[j]), starts.get(i)) {
        (Some((s, d)), Some((next, _))) => (s + d + next) / 2,
        _ => edge,
    }
}

fn p50(mut v: Vec<u64>) -> f64 {
    v.sort_unstable();
    v[v.len() / 2] as f64
}

fn check_slow(rec: &Recording, tdir: &Path) {
    let api = truth(tdir, "api_server");
    let core = truth(tdir, "engine_core");
    let worker = truth(tdir, "worker");
    let w0 = api["window"]["start_mono_ns"].as_u64().unwrap();
    let w1 = api["window"]["end_mono_ns"].as_u64().unwrap();
    let base = rec.meta.start_mono_ns;
    let wall = (w1 - w0) as f64 / 1e9;
    let (core_pid, worker_pid) = (
        core["pid"].as_i64().unwrap() as i32,
        worker["pid"].as_i64().unwrap() as i32,
    );
    for (pid, role) in [
        (api["pid"].as_i64().unwrap() as i32, "api_server"),
        (core_pid, "engine_core"),
        (worker_pid, "worker"),
    ] {
        assert!(
            rec.processes.iter().any(|p| p.pid == pid && p.role == role),
            "{role} {pid} recorded with its role: {:?}",
            rec.processes
        );
    }

    // 1. GIL blame.
    let writer_tid = worker["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "aux-output-writer")
        .and_then(|t| t["native_id"].as_i64())
        .expect("writer thread in the truth") as i32;
    let waits: Vec<_> = rec
        .gil_waits
        .iter()
        .filter(|g| {
            g.pid == worker_pid
                && g.tid == worker_pid
                && base + g.start_ns >= w0
                && base + g.start_ns < w1
        })
        .collect();
    let total: u64 = waits.iter().map(|g| g.dur_ns).sum();
    let by_writer_in_scan: u64 = waits
        .iter()
        .filter(|g| {
            g.holder_tid == writer_tid
                && rec.stack_frames(g.holder_stack).next().is_some_and(|f| {
                    f.function.ends_with("_evict_to_fit") || f.function.ends_with(".put")
                })
        })
        .map(|g| g.dur_ns)
        .sum();
    let share = by_writer_in_scan as f64 / total.max(1) as f64;
    eprintln!(
        "GIL: worker main waited {:.0} ms/s; {:.1}% held by aux-output-writer in _evict_to_fit/put",
        total as f64 / 1e6 / wall,
        100.0 * share
    );
    assert!(
        total as f64 / 1e9 / wall > 0.05,
        "the worker waits for the GIL"
    );
    assert!(share >= 0.8, "blame: {share}");

    // 2. Exact probes against the engine's own call logs.
    let trap = rec
        .counters
        .get("probe_trap_cost_ns")
        .copied()
        .unwrap_or(20_000) as f64;
    for (t, function) in [
        (&worker, "Worker.execute_model"),
        (&core, "MessageQueue.enqueue"),
        (&worker, "AuxOutputStore._evict_to_fit"),
    ] {
        let pid = t["pid"].as_i64().unwrap() as i32;
        // (start, wall, thread CPU) of each call, timed by the caller.
        let mut tc: Vec<(u64, u64, u64)> = t["functions"][function]["list"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r[0].as_u64().unwrap(),
                    r[1].as_u64().unwrap(),
                    r[2].as_u64().unwrap(),
                )
            })
            .collect();
        tc.sort();
        let starts: Vec<(u64, u64)> = tc.iter().map(|c| (c.0, c.1)).collect();
        let e0 = quiet_edge(&starts, w0 + 500_000_000);
        let e1 = quiet_edge(&starts, w1 - 500_000_000);
        let probes: Vec<_> = rec
            .probes
            .iter()
            .filter(|p| p.pid == pid && p.function == function)
            .collect();
        assert!(
            probes.iter().any(|p| p.method == "exact"),
            "{function} is probed exactly: {probes:?}"
        );
        let ids: Vec<u32> = probes
            .iter()
            .filter(|p| p.method == "exact")
            .map(|p| p.id)
            .collect();
        let ours: Vec<u64> = rec
            .calls
            .iter()
            .filter(|c| ids.contains(&c.probe) && base + c.start_ns >= e0 && base + c.start_ns < e1)
            .map(|c| c.dur_ns)
            .collect();
        let theirs: Vec<u64> = tc
            .iter()
            .filter(|c| c.0 >= e0 && c.0 < e1)
            .map(|c| c.1)
            .collect();
        let their_cpu: Vec<u64> = tc
            .iter()
            .filter(|c| c.0 >= e0 && c.0 < e1)
            .map(|c| c.2)
            .collect();
        let (n_ours, n_theirs) = (ours.len(), theirs.len());
        let (m, t50, c50) = (p50(ours), p50(theirs), p50(their_cpu));
        eprintln!(
            "{function}: calls {n_ours} vs engine's {n_theirs}; p50 {:.3} ms vs {:.3} ms",
            m / 1e6,
            t50 / 1e6
        );
        // Every call counted, but for calls the recorder itself flagged (an unclassifiable
        // edge, a pop without a push, a push never popped); a silent loss fails.
        let flagged = common::flagged_calls(rec);
        assert!(
            n_ours.abs_diff(n_theirs) as u64 <= flagged,
            "{function}: {n_ours} calls counted, the engine's {n_theirs} ({flagged} flagged; counters {:?})",
            rec.counters
        );
        // The engine times each call from the caller, so its wall time also holds the two
        // traps and any GIL hand-off between the return and the caller's clock read (the eval
        // breaker is checked at the next call): an upper bound. Under contention that is most
        // calls: Worker.execute_model read 4.9 ms in the body and 6.4 ms caller-side at load 10,
        // the EngineCore's enqueue 1.0 vs 2.1 ms. Its thread-CPU time is a lower bound: a call's
        // wall time is at least its CPU time (less the traps, which are on this thread's CPU).
        // In-body timing, tests/live_probes.rs, checks ±10%.
        assert!(
            m <= t50 * 1.10 + 2.0 * trap && m >= c50 * 0.9 - 2.0 * trap,
            "{function}: p50 {m} vs caller-side wall {t50}, CPU {c50} (trap {trap})"
        );
        // Where the engine also times the call inside it (MessageQueue's methods), the probe
        // times what that clock does, plus the frame's start and end: within 10% (or 0.06 ms)
        // and a trap.
        if let Some(b50) = t["functions"][function]["body_wall_ns"]["p50"].as_f64() {
            eprintln!(
                "{function}: p50 {:.3} ms vs {:.3} ms inside the call",
                m / 1e6,
                b50 / 1e6
            );
            assert!(
                (m - b50).abs() <= (0.10 * b50).max(60_000.0) + trap,
                "{function}: p50 {m} vs the engine's in-call clock {b50} (trap {trap})"
            );
        }
    }

    // 3. GC in the EngineCore.
    let pauses: Vec<(u64, u64, i64)> = core["gc"]["pauses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_u64().unwrap(),
                p[1].as_u64().unwrap(),
                p[2].as_i64().unwrap(),
            )
        })
        .collect();
    // Edges in quiet gaps between collections.
    let gaps: Vec<(u64, u64)> = pauses.iter().map(|p| (p.0, p.1)).collect();
    let (e0, e1) = (
        quiet_edge(&gaps, w0 + 500_000_000),
        quiet_edge(&gaps, w1 - 500_000_000),
    );
    let theirs: Vec<_> = pauses.iter().filter(|p| p.0 >= e0 && p.0 < e1).collect();
    let ours: Vec<_> = rec
        .gc_pauses
        .iter()
        .filter(|g| g.pid == core_pid && base + g.start_ns >= e0 && base + g.start_ns < e1)
        .collect();
    let g2_theirs: u64 = theirs.iter().filter(|p| p.2 == 2).map(|p| p.1).sum();
    let g2_ours: u64 = ours
        .iter()
        .filter(|g| g.generation == 2)
        .map(|g| g.dur_ns)
        .sum();
    eprintln!(
        "GC: {} collections vs engine's {}; gen-2 {:.1} ms vs {:.1} ms",
        ours.len(),
        theirs.len(),
        g2_ours as f64 / 1e6,
        g2_theirs as f64 / 1e6
    );
    // Generation-2 collections are the finding: every one counted. (All generations are
    // counted exactly against gc.callbacks in tests/live_gil_gc.rs; here the engine's truth
    // and the recording differ by a few percent in young collections, see the notes.)
    let g2_n_theirs = theirs.iter().filter(|p| p.2 == 2).count();
    let g2_n_ours = ours.iter().filter(|g| g.generation == 2).count();
    assert_eq!(
        g2_n_ours, g2_n_theirs,
        "every generation-2 collection counted"
    );
    assert!(g2_theirs > 0, "the slow engine has gen-2 collections");
    assert!(
        (g2_ours as f64 / g2_theirs as f64 - 1.0).abs() <= 0.10,
        "gen-2 time {g2_ours} vs {g2_theirs}"
    );

    // Throughput from the scraped metrics against the engine's count.
    let gen: Vec<u32> = rec
        .series
        .iter()
        .filter(|s| s.name == "vllm:generation_tokens_total")
        .map(|s| s.id)
        .collect();
    let pts: Vec<_> = rec
        .metrics
        .iter()
        .filter(|m| gen.contains(&m.series) && base + m.t_ns >= w0 && base + m.t_ns < w1)
        .collect();
    let (a, b) = (pts.first().unwrap(), pts.last().unwrap());
    let ours = (b.value - a.value) / ((b.t_ns - a.t_ns) as f64 / 1e9);
    let theirs = api["generation_tokens"]["per_s_window"].as_f64().unwrap();
    eprintln!("gen tok/s {ours:.0} vs engine's {theirs:.0}");
    assert!((ours / theirs - 1.0).abs() <= 0.10, "{ours} vs {theirs}");
}

/// Issue 13: the pickling inside the EngineCore's `MessageQueue.enqueue` (one `pickle.dumps`
/// per record on the slow path) is named: native frames of `_pickle` under the enqueue frame
/// in the EngineCore main thread's samples, in the flamegraph's stacks, and among the
/// report's top functions. (That native shares are right is tests/live_native.rs's part.)
fn check_pickling(rec: &Recording, slow: &Path) {
    let core = truth(&slow.join("truth"), "engine_core");
    let core_pid = core["pid"].as_i64().unwrap() as i32;
    let is_pickle = |f: u32| {
        rec.frame_native.get(&f).is_some_and(|n| {
            enginescope::native::short_module_name(&n.module).starts_with("_pickle")
                || rec.frames[f as usize].function.starts_with("_pickle")
        })
    };
    let (mut enqueue, mut pickling) = (0u64, 0u64);
    let mut leaves = std::collections::HashMap::new();
    for s in rec
        .samples
        .iter()
        .filter(|s| s.pid == core_pid && s.tid == core_pid)
    {
        let stack = &rec.stacks[s.stack as usize];
        // Innermost first: the pickling frames come before the enqueue frame.
        let Some(at) = stack.iter().position(|&f| {
            rec.frames[f as usize]
                .function
                .ends_with("MessageQueue.enqueue")
        }) else {
            continue;
        };
        enqueue += 1;
        *leaves
            .entry(enginescope::views::frame_label(
                &rec.frames[stack[0] as usize],
            ))
            .or_insert(0u64) += 1;
        if stack[..at].iter().any(|&f| is_pickle(f)) {
            pickling += 1;
        }
    }
    let mut leaves: Vec<_> = leaves.into_iter().collect();
    leaves.sort_by_key(|l| std::cmp::Reverse(l.1));
    eprintln!(
        "pickling: {pickling} of the EngineCore's {enqueue} samples in MessageQueue.enqueue; innermost frames: {:?}",
        &leaves[..leaves.len().min(8)]
    );
    // The demo's enqueue is mostly the generation-2 collections its allocations set off
    // (list_traverse, gc_collect_main): pickling is a few percent of it, so only its presence
    // is asserted (a few samples at 499 Hz over 10 s).
    assert!(
        pickling >= 3,
        "{pickling} of {enqueue} enqueue samples name _pickle frames"
    );
    let folded = enginescope(&[
        "export",
        &slow.join("demo.esrec").to_string_lossy(),
        "--format",
        "folded",
        "-o",
        "-",
    ]);
    assert!(folded.status.success());
    let folded = String::from_utf8_lossy(&folded.stdout);
    assert!(
        folded.lines().any(|l| l
            .split_once("MessageQueue.enqueue")
            .is_some_and(|(_, inner)| inner.contains("[_pickle] "))),
        "the flamegraph's stacks show [_pickle] frames under MessageQueue.enqueue"
    );
    let report = read_json(&slow.join("report.json"));
    let named = report["functions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|f| {
            f["pid"] == core_pid
                && f["function"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("[_pickle] "))
        });
    assert!(
        named,
        "the report lists a [_pickle] function of the EngineCore"
    );
}

/// The demo's GC finding for the EngineCore, from `report --from/--to` over the engine's own
/// window, against the engine's gc.callbacks over the same window. A collection as the
/// recorder sees it (the collector's function, entry to return) holds the engine's two
/// callbacks, and the stop callback's own calls are points where the interpreter hands the
/// GIL to a thread that asked for it: matched one to one in a run, generation-1 collections
/// read 116 µs longer at the median and up to 8.5 ms (the GIL's switch interval), so the share
/// over the recording read 8-18% above the callbacks' start-to-stop. The truth is that
/// bracket: from each start callback's clock read to its stop callback's first (at least) and
/// last (at most), clipped to the window as the report clips; the finding within 10% of it.
fn check_gc_share(rec: &Recording, core: &serde_json::Value, esrec: &Path) {
    let base = rec.meta.start_mono_ns;
    let (w0, w1) = (
        core["window"]["start_mono_ns"].as_u64().unwrap(),
        core["window"]["end_mono_ns"].as_u64().unwrap(),
    );
    assert_eq!(core["gc"]["pauses_truncated"], false, "every pause listed");
    let overlap = |a: u64, b: u64| b.min(w1).saturating_sub(a.max(w0));
    let (mut lo, mut hi) = (0u64, 0u64);
    for p in core["gc"]["pauses"].as_array().unwrap() {
        let (t0, dur, end) = (
            p[0].as_u64().unwrap(),
            p[1].as_u64().unwrap(),
            p[6].as_u64().unwrap(),
        );
        lo += overlap(t0, t0 + dur);
        hi += overlap(t0, end.max(t0 + dur));
    }
    let wall = (w1 - w0) as f64;
    let (lo, hi) = (lo as f64 / wall, hi as f64 / wall);
    let from = format!("{:.9}", w0.saturating_sub(base) as f64 / 1e9);
    let to = format!("{:.9}", w1.saturating_sub(base) as f64 / 1e9);
    let o = enginescope(&[
        "report",
        esrec.to_str().unwrap(),
        "--format",
        "json",
        "--from",
        &from,
        "--to",
        &to,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let windowed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let gc = windowed["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| f["kind"] == "gc_pressure" && f["pid"] == core["pid"])
        .unwrap_or_else(|| panic!("a GC finding for the EngineCore in its window"));
    let got = gc["score"].as_f64().unwrap();
    eprintln!(
        "GC finding {got:.4} of the engine's window; its callbacks {lo:.4} start to stop, {hi:.4} to the stop callback's end"
    );
    assert!(
        got >= 0.9 * lo && got <= 1.1 * hi,
        "GC finding {got:.4} of the engine's window, truth {lo:.4}-{hi:.4}"
    );
}

#[test]
fn demo_finds_the_three_problems_and_the_fix_shows() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let Launch::Host(python) = &i.launch else {
        panic!("pyenv-3.12 runs on the host");
    };
    let python = python.to_string_lossy().into_owned();
    let dir = tempfile::tempdir().unwrap();
    let slow = dir.path().join("slow");
    let out = demo(&python, &slow, &[]);
    eprintln!("{out}");
    let rec = enginescope::record::read_recording(&slow.join("demo.esrec")).unwrap();
    // Issue 11: every latency finding the demo prints beside the engine's own is exact (one
    // debug register per probed function leaves room for all of them next to GC), and every
    // probe of the vLLM default set that timed calls on the engine's threads did so exactly.
    let section: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("per-call latency"))
        .skip(1)
        .take_while(|l| l.starts_with("   "))
        // The closing note on what the engine's own timer holds.
        .filter(|l| !l.starts_with("   (the engine times"))
        .collect();
    assert!(section.len() >= 4, "demo's latency findings:\n{out}");
    for l in &section {
        assert!(
            l.contains("(exact)") && l.contains("engine's own"),
            "not exact: {l}"
        );
    }
    for p in &rec.probes {
        let timed = rec.calls.iter().any(|c| c.probe == p.id);
        assert!(
            !timed || p.method == "exact",
            "{} in {} timed by {}: {:?}",
            p.function,
            p.pid,
            p.method,
            rec.probes
        );
    }
    check_slow(&rec, &slow.join("truth"));
    check_pickling(&rec, &slow);
    // Issue 23: the general findings (report.json) name the seed's GIL fight and the
    // EngineCore's GC with its share of the engine's own wall time.
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(slow.join("report.json")).unwrap()).unwrap();
    let found = report["findings"]
        .as_array()
        .expect("findings[] in report.json");
    let (core, worker) = (
        truth(&slow.join("truth"), "engine_core"),
        truth(&slow.join("truth"), "worker"),
    );
    // The first three findings are the seed's three (issue 23): the worker's GIL fight
    // behind _evict_to_fit, the EngineCore's GC, and a MessageQueue call's per-request cost
    // (the demo's load sweeps its concurrency, so it shows). The EngineCore's output thread
    // also waits for the GIL behind the busy loop (8-24% of the recording over runs), but off
    // the step loop and busy a tenth of the time: it ranks after them. Only a stall of the API
    // server's event loop may come before them: on a loaded machine (a CPU hog beside the
    // test) the server really stalls, for longer than a seeded problem costs its thread (once
    // in 20 runs beside a hog).
    // The eviction scan's own growth with the requests a put carries is the first problem
    // seen from another side: beside two CPU hogs it outranked the queue's (10.9% of the
    // writer's time against 3.9% of the worker's), so it is neither one of the three nor an
    // intruder before them.
    let engine = |f: &&serde_json::Value| f["pid"] == core["pid"] || f["pid"] == worker["pid"];
    let eviction_growth = |f: &&serde_json::Value| {
        f["kind"] == "per_request_growth"
            && f["function"]
                .as_str()
                .is_some_and(|s| s.ends_with("_evict_to_fit"))
    };
    let first3: Vec<&serde_json::Value> = found
        .iter()
        .filter(engine)
        .filter(|f| !eviction_growth(f))
        .take(3)
        .collect();
    let third = first3
        .last()
        .and_then(|l| found.iter().position(|f| f == *l));
    for f in found.iter().take(third.unwrap_or(0)) {
        assert!(
            engine(&f) || f["kind"] == "event_loop_stall",
            "only the seed's three and a stall of the API server's loop before the third: {found:#?}"
        );
    }
    let is = |f: &serde_json::Value, kind: &str, pid: &serde_json::Value| {
        f["kind"] == kind && f["pid"] == *pid
    };
    let fight = first3
        .iter()
        .find(|f| is(f, "gil_contention", &worker["pid"]))
        .unwrap_or_else(|| panic!("the worker's GIL fight in the first three: {found:#?}"));
    assert_eq!(fight["tid"], worker["pid"], "{fight:#}");
    assert!(
        fight["function"]
            .as_str()
            .is_some_and(|f| f.ends_with("_evict_to_fit")),
        "{fight:#}"
    );
    assert!(
        first3.iter().any(|f| is(f, "gc_pressure", &core["pid"])),
        "the EngineCore's GC in the first three: {found:#?}"
    );
    let growth = first3
        .iter()
        .find(|f| f["kind"] == "per_request_growth")
        .unwrap_or_else(|| panic!("a per-request growth in the first three: {found:#?}"));
    // Its slope against the engine's own: CPU time per record a call handled, by least
    // squares over the window's calls (records per call = requests per step).
    let function = growth["function"].as_str().unwrap();
    assert!(function.starts_with("MessageQueue."), "{growth:#}");
    let own = [&core, &worker]
        .into_iter()
        .find(|t| t["pid"] == growth["pid"])
        .map(|t| {
            t["functions"][function]["per_item_cpu"]["slope_ns"]
                .as_f64()
                .unwrap()
        })
        .unwrap();
    let got = growth["evidence"]["slope_ms_per_request"].as_f64().unwrap() * 1e6;
    // The finding's slope is a line fitted over the window's scrape intervals (tens of points;
    // Theil-Sen, whose error is near least squares' on a clean line): its relative standard
    // error is about sqrt((1 - r²) / (n - 2)) / r, about 20% at r 0.78
    // over 19 intervals (CI on an AMD EPYC VM beside a parallel test read +31%). Held to three
    // of those, within 25% to 50%.
    let r = growth["evidence"]["r"].as_f64().unwrap_or(0.0);
    let n = growth["evidence"]["intervals"].as_f64().unwrap_or(0.0);
    let se = ((1.0 - r * r).max(0.0) / (n - 2.0).max(1.0)).sqrt() / r.abs().max(1e-9);
    let tol = (3.0 * se).clamp(0.25, 0.5);
    eprintln!(
        "per-request growth of {function}: {got:.0} ns per request (r {r:.2} over {n} intervals, \
         allowed {:.0}%), the engine's own {own:.0} ns per record",
        tol * 100.0
    );
    assert!(
        (got / own - 1.0).abs() <= tol,
        "{function}: {got:.0} ns per request against the engine's {own:.0} ns per record \
         (r {r:.2} over {n} intervals, allowed {:.0}%)",
        tol * 100.0
    );
    assert!(
        found
            .iter()
            .any(|f| f["kind"] == "gc_pressure" && f["pid"] == core["pid"]),
        "a GC finding for the EngineCore: {found:#?}"
    );
    check_gc_share(&rec, &core, &slow.join("demo.esrec"));
    for f in [
        "report.md",
        "report.json",
        "flame.svg",
        "flame-offcpu.svg",
        "gil-blame.svg",
    ] {
        assert!(slow.join(f).exists(), "{f} written");
    }

    let fixed = dir.path().join("fixed");
    let slow_rec = slow.join("demo.esrec");
    let out = demo(
        &python,
        &fixed,
        &["--fixed", "--baseline", &slow_rec.to_string_lossy()],
    );
    eprintln!("{out}");
    assert!(fixed.join("diff.md").exists() && fixed.join("diff-flame.svg").exists());
    let d = enginescope(&[
        "diff",
        &slow_rec.to_string_lossy(),
        &fixed.join("demo.esrec").to_string_lossy(),
        "--format",
        "json",
    ]);
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    let d: serde_json::Value = serde_json::from_slice(&d.stdout).unwrap();
    let fig = |v: &serde_json::Value| {
        (
            v["delta"].as_f64().unwrap_or(0.0),
            v["beyond_noise"].as_bool().unwrap_or(false),
        )
    };
    let gen = fig(&d["engines"][0]["gen_tok_s"]);
    assert!(
        gen.0 > 0.0 && gen.1,
        "throughput rises beyond noise: {gen:?}"
    );
    // Threads are matched across runs by their Python name (the main threads: MainThread).
    let thread = |process: &str, name: &str| {
        d["threads"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["process"] == process && t["thread"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{process}/{name} in the diff"))
    };
    let gil = fig(&thread("worker", "MainThread")["gil_wait_pct"]);
    assert!(gil.0 < 0.0 && gil.1, "the worker's GIL wait falls: {gil:?}");
    let gc = fig(&thread("engine_core", "MainThread")["gc_pct"]);
    assert!(gc.0 < 0.0 && gc.1, "the EngineCore's GC time falls: {gc:?}");
    let probe = |process: &str, probe: &str| {
        d["probes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["process"] == process && p["probe"] == probe)
            .cloned()
            .unwrap_or_else(|| panic!("{process}/{probe} in the diff: {}", d["probes"]))
    };
    // Worker.execute_model's p90 is not asserted to fall: on two cores the fixed engine runs
    // twice the steps per second, and its own timers had the p50 3.48 → 3.94 ms (slower) in
    // one run; that the figure is right in each run is checked above.
    let enq = fig(&probe("engine_core", "MessageQueue.enqueue")["p50_ms"]);
    assert!(enq.0 < 0.0 && enq.1, "enqueue p50 falls: {enq:?}");
    // The seed's three findings vanished with the fixes: the GIL fight, the EngineCore's GC,
    // and the per-request growth of the MessageQueue calls (the fixed queue sends one array a
    // step, packed by one C call: its own timers read ~0.1 µs of CPU per record against
    // ~6 µs slow).
    let finding = |kind: &str, process: &str, what: &dyn Fn(&serde_json::Value) -> bool| {
        d["findings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["kind"] == kind && f["process"] == process && what(f))
            .cloned()
            .unwrap_or_else(|| panic!("{kind} of {process} in the diff: {:#}", d["findings"]))
    };
    let seed = [
        finding("gil_contention", "worker", &|f| f["thread"] == "MainThread"),
        finding("gc_pressure", "engine_core", &|_| true),
        finding("per_request_growth", "engine_core", &|f| {
            f["function"] == "MessageQueue.enqueue"
        }),
    ];
    for f in &seed {
        assert_eq!(f["status"], "vanished", "{f:#}");
    }
}
