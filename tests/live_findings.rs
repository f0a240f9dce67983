//! Findings against injected problems (issue 23): `samples/injected.py` runs one problem and
//! times it from inside (thread CPU clocks around the guilty calls); `record --pid` records it
//! and `report --from/--to` over the workload's window must put that problem first, naming
//! its kind, thread and function, with its figure within 10% of the truth:
//!
//! * `spin`: a reader busy-waiting in `poll_items()` (os.sched_yield until an item comes):
//!   `busy_spin` on `reader` in `poll_items`, its cores spent polling against the reader's CPU
//!   time inside poll_items() over the window;
//! * `serialize`: a sender encoding a batch of records to JSON in `send_batch()` each step:
//!   `serialization` on `sender` under `send_batch`, its seconds against the CPU time inside
//!   `json.dumps`;
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
    let (r, truth, path) = record_workload_at(
        &interp(label),
        "injected.py",
        &["--problem", problem],
        WINDOW_S,
        "bpf",
        "999",
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

fn spin(label: &str) {
    let Some((report, truth)) = run(label, "spin") else {
        return;
    };
    let f = first(&report, "busy_spin", "reader", "poll_items");
    let cores = f["evidence"]["cores_polling"].as_f64().unwrap();
    let t = truth["poll_cpu_s"].as_f64().unwrap() / window_s(&truth);
    within(label, "cores polling", cores, t, 0.10);
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
