//! Findings against injected problems (issue 23): `samples/injected.py` runs one problem and
//! times it from inside (thread CPU clocks around the guilty calls); `record --pid` records it
//! and `report --from/--to` over the workload's window must put that problem first, naming
//! its kind, thread and function, with its figure within 10% of the truth:
//!
//! * `spin`: a reader busy-waiting in `poll_items()` (os.sched_yield until an item comes):
//!   `busy_spin` on `reader` in `poll_items`, its cores spent polling against the reader's CPU
//!   time inside poll_items() over the window (first when that is at least 0.2 of a core: on
//!   a machine with more runnable threads than CPUs the reader yields its CPU away and burns
//!   little; then only its figure is checked, if found);
//! * `serialize`: a sender encoding a batch of records to JSON in `send_batch()` each step:
//!   `serialization` on `sender` under `send_batch`, its seconds against the CPU time inside
//!   `json.dumps`;
//! * `lock`: a handler sleeping on a lock a flusher holds across a slow write:
//!   `lock_contention` on `handler` in `record_result`, released by `flusher` leaving
//!   `flush_store`, across `write_out`;
//! * `gc`: a gen-0/1 collection storm in `build_outputs()` (cycles that only the collector
//!   frees): `gc_pressure` interrupting `build_outputs`, its seconds and pauses against every
//!   collection timed by a gc.callbacks hook;
//! * `growth`: per-request pickling in `pack_requests()` on a batch that follows a staircase served
//!   as a running-requests gauge on the process's own /metrics (`record --pid --metrics-url`):
//!   `per_request_growth` of `pack_requests`, its slope against the least-squares slope of the
//!   call's CPU per request;
//! * a launcher thread losing the GIL to a writer scanning in `_evict_to_fit`
//!   (samples/gil_contention.py, the tokenizer-beside-the-loop shape): `gil_contention` on
//!   `launcher` behind `aux-writer` in `_evict_to_fit`, its wait within the truth's bracket;
//! * `none`: a thread computing in slices and one sleeping: no finding scores above 0.01 (the
//!   least score a finding is listed at).
//!
//! Other findings may follow the injected one (the spin's producer waits a little for the GIL
//! the reader takes back each turn). Cost: ~10 s per case (a 4 s window, the report).

mod common;

use common::*;

/// The window, s: long enough for ~4,000 samples at 999 Hz on a busy thread.
const WINDOW_S: &str = "4";

/// Record `injected.py --problem PROBLEM` on `label`'s interpreter; returns the report JSON over
/// the workload's window and the truth. None where the interpreter is missing.
fn run(label: &str, problem: &str) -> Option<(serde_json::Value, serde_json::Value)> {
    run_with(label, "injected.py", &["--problem", problem], WINDOW_S, &[])
}

/// [`run`] of any workload, with its own arguments and `record`'s extra ones.
fn run_with(
    label: &str,
    script: &str,
    extra: &[&str],
    window_s: &str,
    record_extra: &[&str],
) -> Option<(serde_json::Value, serde_json::Value)> {
    let problem = extra.get(1).copied().unwrap_or(script);
    let (r, truth, path) = record_workload_with(
        &interp(label),
        script,
        extra,
        window_s,
        "bpf",
        "999",
        record_extra,
    )?;
    let report = window_report(&path, &r, &truth);
    let _ = std::fs::remove_file(&path);
    for f in report["findings"].as_array().into_iter().flatten() {
        eprintln!(
            "{label} {problem}: {:.3} {} {}",
            f["score"].as_f64().unwrap_or(0.0),
            f["kind"],
            f["verdict"]
        );
    }
    Some((report, truth))
}

fn window_s(truth: &serde_json::Value) -> f64 {
    let w = &truth["window"];
    (w["end_mono_ns"].as_u64().unwrap() - w["start_mono_ns"].as_u64().unwrap()) as f64 / 1e9
}

/// The first finding, which must be `kind` on `thread` in a function containing `function`.
fn first<'a>(
    report: &'a serde_json::Value,
    kind: &str,
    thread: &str,
    function: &str,
) -> &'a serde_json::Value {
    let f = &report["findings"][0];
    assert_eq!(f["kind"], kind, "first finding: {f}");
    assert_eq!(f["thread"], thread, "first finding: {f}");
    assert!(
        f["function"].as_str().is_some_and(|x| x.contains(function)),
        "first finding's function: {f}"
    );
    f
}

fn within(label: &str, what: &str, got: f64, truth: f64, tol: f64) {
    eprintln!("{label}: {what} {got:.4} vs truth {truth:.4}");
    assert!(
        (got - truth).abs() <= tol * truth,
        "{label}: {what} {got:.4} vs truth {truth:.4} (±{:.0}%)",
        tol * 100.0
    );
}

/// The spin is the problem when the reader burnt at least this share of a core polling (by
/// its own CPU clock). Beside a CPU hog the reader's `sched_yield` gives the CPU away and it
/// burns 0.02-0.3 of a core (seen with two busy loops on 2 CPUs, one or two such tests at
/// once): runnable all the time, on CPU little of it.
const SPIN_RANKED_CORES: f64 = 0.2;

fn spin(label: &str) {
    let Some((report, truth)) = run(label, "spin") else {
        return;
    };
    let t = truth["poll_cpu_s"].as_f64().unwrap() / window_s(&truth);
    if t >= SPIN_RANKED_CORES {
        let f = first(&report, "busy_spin", "reader", "poll_items");
        let cores = f["evidence"]["cores_polling"].as_f64().unwrap();
        within(label, "cores polling", cores, t, 0.10);
        return;
    }
    // The machine let the reader spin too little to be the recording's main problem: a
    // busy_spin finding, if any, still says what it burnt (within 10% or 0.01 of a core:
    // a few dozen samples), and no finding claims more than the truth allows.
    eprintln!("{label}: the reader polled {t:.3} of a core (a busy machine): ranking not checked");
    for f in report["findings"].as_array().into_iter().flatten() {
        if f["kind"] == "busy_spin" && f["thread"] == "reader" {
            let cores = f["evidence"]["cores_polling"].as_f64().unwrap();
            eprintln!("{label}: cores polling {cores:.4} vs truth {t:.4}");
            assert!(
                (cores - t).abs() <= (0.10 * t).max(0.01),
                "{label}: cores polling {cores:.4} vs truth {t:.4}"
            );
        }
    }
}

fn serialize(label: &str) {
    let Some((report, truth)) = run(label, "serialize") else {
        return;
    };
    let f = first(&report, "serialization", "sender", "send_batch");
    let cpu = report["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "sender")
        .and_then(|t| t["cpu_s"].as_f64())
        .unwrap_or(0.0);
    eprintln!(
        "{label}: sender CPU {cpu:.4} s vs truth {}",
        truth["window_cpu_s"]["sender"]
    );
    let s = f["evidence"]["serialization_s"].as_f64().unwrap();
    within(
        label,
        "JSON encoding s",
        s,
        truth["dumps_cpu_s"].as_f64().unwrap(),
        0.10,
    );
}

fn none(label: &str) {
    let Some((report, truth)) = run(label, "none") else {
        return;
    };
    // The workload did run: the computing thread's CPU is in the report.
    assert!(truth["crunch_cpu_s"].as_f64().unwrap() > 0.5, "{truth}");
    let over: Vec<&serde_json::Value> = report["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["score"].as_f64().unwrap_or(1.0) > enginescope::views::findings::MIN_SCORE)
        .collect();
    assert!(
        over.is_empty(),
        "{label}: a healthy workload has findings: {over:#?}"
    );
}

#[test]
fn spin_pyenv_312() {
    spin("pyenv-3.12");
}

#[test]
fn spin_sid_314() {
    spin("sid-3.14");
}

#[test]
fn serialize_pyenv_312() {
    serialize("pyenv-3.12");
}

#[test]
fn serialize_sid_314() {
    serialize("sid-3.14");
}

#[test]
fn none_pyenv_312() {
    none("pyenv-3.12");
}

fn lock(label: &str) {
    let Some((report, truth)) = run(label, "lock") else {
        return;
    };
    let f = first(&report, "lock_contention", "handler", "record_result");
    let e = &f["evidence"];
    assert_eq!(e["waker"], "flusher", "{label}: the waker: {f}");
    assert!(
        e["waker_function"]
            .as_str()
            .is_some_and(|x| x.contains("flush_store")),
        "{label}: the function that held the lock: {f}"
    );
    assert!(
        e["waker_during"][0]["function"]
            .as_str()
            .is_some_and(|x| x.contains("write_out")),
        "{label}: the call the lock was held across: {f}"
    );
    within(
        label,
        "lock wait s",
        e["wait_s"].as_f64().unwrap(),
        truth["acquire_wait_s"].as_f64().unwrap(),
        0.10,
    );
    within(
        label,
        "waits",
        e["waits"].as_f64().unwrap(),
        truth["acquires_waited"].as_f64().unwrap(),
        0.10,
    );
    within(
        label,
        "the waker's time in write_out during the waits, against its time holding the lock",
        e["waker_during"][0]["s"].as_f64().unwrap(),
        truth["write_out_s"].as_f64().unwrap(),
        0.15,
    );
}

#[test]
fn lock_pyenv_312() {
    lock("pyenv-3.12");
}

#[test]
fn lock_sid_314() {
    lock("sid-3.14");
}

fn gc(label: &str) {
    let Some((report, truth)) = run(label, "gc") else {
        return;
    };
    let f = first(&report, "gc_pressure", "engine-loop", "build_outputs");
    let e = &f["evidence"];
    eprintln!(
        "{label}: by generation {} vs truth {}",
        e["by_generation"], truth["by_generation"]
    );
    within(
        label,
        "GC s",
        e["gc_s"].as_f64().unwrap(),
        truth["gc_s"].as_f64().unwrap(),
        0.10,
    );
    within(
        label,
        "pauses",
        e["pauses"].as_f64().unwrap(),
        truth["pauses"].as_f64().unwrap(),
        0.10,
    );
}

#[test]
fn gc_pyenv_312() {
    gc("pyenv-3.12");
}

#[test]
fn gc_sid_314() {
    gc("sid-3.14");
}

fn growth(label: &str) {
    let port = free_port().to_string();
    let url = format!("http://127.0.0.1:{port}/metrics");
    // 16 s: the staircase's eight 0.5 s levels four times; a scrape every 0.1 s (levels that
    // come back often, so that a busier second of the machine falls on several). Every call timed
    // (--exact-probes), as the truth times every call: on a VM whose speed varies by the
    // second (the calls' CPU per request moved between 1.3 and 2.3 µs from one second to the
    // next in one run), a budget's watched part and the whole would not be the same calls.
    let Some((report, truth)) = run_with(
        label,
        "injected.py",
        &["--problem", "growth", "--metrics-port", &port],
        "16",
        &[
            "--probe",
            "pack_requests",
            "--exact-probes",
            "--metrics-url",
            &url,
            "--scrape-interval",
            "0.1",
        ],
    ) else {
        return;
    };
    // The per-request pickling is the cause; a serialization finding under pack_requests names
    // the same cost, and may come first.
    let top = &report["findings"][0];
    assert!(
        ["per_request_growth", "serialization"].contains(&top["kind"].as_str().unwrap_or(""))
            && top["function"]
                .as_str()
                .is_some_and(|f| f.contains("pack_requests")),
        "{label}: first finding: {top}"
    );
    let f = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "per_request_growth")
        .unwrap_or_else(|| panic!("{label}: no per_request_growth: {}", report["findings"]));
    assert!(
        f["function"]
            .as_str()
            .is_some_and(|x| x.contains("pack_requests")),
        "{label}: {f}"
    );
    // Two truths. The slope the same calls give against the scrapes this process served (what
    // a perfect observer with those scrapes reads): the figure is held to it within 10%. And
    // the calls' CPU per request fitted by batch size: the same on a steady machine (within
    // 3% in quiet runs), but a machine whose speed moves by the second (a CPU hog beside it
    // made a request cost 1.1 to 3 µs) puts the two estimates of a moving figure up to ~10%
    // apart, so that one is held within 25%.
    let slope_ns = f["evidence"]["slope_ms_per_request"].as_f64().unwrap() * 1e6;
    eprintln!(
        "{label}: {} scrape intervals in the truth's fit",
        truth["scrape_intervals"]
    );
    within(
        label,
        "ns of CPU per request, against the calls fitted by the scrapes",
        slope_ns,
        truth["slope_by_scrape_ns"].as_f64().unwrap(),
        0.10,
    );
    within(
        label,
        "ns of CPU per request, against the calls fitted by batch size",
        slope_ns,
        truth["slope_ns_per_request"].as_f64().unwrap(),
        0.25,
    );
}

#[test]
fn growth_pyenv_312() {
    growth("pyenv-3.12");
}

#[test]
fn growth_sid_314() {
    growth("sid-3.14");
}

fn gil(label: &str) {
    let Some((report, truth)) = run_with(label, "gil_contention.py", &[], "5", &[]) else {
        return;
    };
    let f = first(&report, "gil_contention", "launcher", "_evict_to_fit");
    let e = &f["evidence"];
    assert_eq!(e["holder"], "aux-writer", "{label}: the holder: {f}");
    // The truth brackets the launcher's GIL wait: without any run-queue time, and with all of
    // it (a futex timing counts the wake-up latency after the hand-over).
    let l = &truth["launcher"];
    let (lo, hi) = (
        l["gil_wait_excl_runq_s"].as_f64().unwrap(),
        l["gil_wait_upper_s"].as_f64().unwrap(),
    );
    let got = e["gil_wait_s"].as_f64().unwrap();
    eprintln!("{label}: launcher GIL wait {got:.3} s, truth [{lo:.3}, {hi:.3}]");
    assert!(
        got >= 0.9 * lo && got <= 1.1 * hi,
        "{label}: launcher GIL wait {got:.3} s outside the truth's [{lo:.3}, {hi:.3}] ±10%"
    );
}

#[test]
fn gil_pyenv_312() {
    gil("pyenv-3.12");
}

#[test]
fn gil_sid_314() {
    gil("sid-3.14");
}
