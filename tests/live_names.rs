//! Python thread names against the workload's own record, on every interpreter of the matrix:
//! `samples/named_threads.py` runs threads named by `threading` (three `engine-output-writer-N`
//! that share one OS name on every version, a GIL fight between `vllm-aux-output-writer` and
//! `vllm-step-launcher`), starts two more and renames one inside the window, and writes every
//! thread's names with when it got them, its ident, native id and OS name.
//!
//! * `dump --json` before the window: every thread's `name` is its Python name exactly,
//!   `python_name` the same, `os_name` its `comm`;
//! * `record --pid` over the window, then the recording: each thread's latest record carries
//!   its final Python name; the renamed thread has a record with each name, the new name
//!   written after the rename and within [`PICKED_UP_NS`] of it; the late threads' records
//!   within [`PICKED_UP_NS`] of their start;
//! * `report --format json`: `threads[].name` is the final Python name and `os_name` the OS
//!   name of every thread that ran; the GIL blame names the launcher as waiting on the writer
//!   (its largest pair).

mod common;

use common::*;
use serde_json::Value;

/// New threads are listed every 100 ms and Python names read again at least every second.
const PICKED_UP_NS: u64 = 2_000_000_000;

struct TruthThread {
    host_tid: i32,
    /// (CLOCK_MONOTONIC ns, name); the first at 0 for threads started before the window.
    names: Vec<(u64, String)>,
    os_name: String,
}

fn check(label: &str) {
    let i = interp(label);
    if !available(&i) {
        return;
    }
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let w = start(
        &i,
        "named_threads.py",
        &[
            "--truth",
            "{dir}/truth.json",
            "--duration",
            "6",
            "--go-fifo",
            "{dir}/go",
        ],
    );
    // Before the window: the threads started so far, by their Python names.
    let out = enginescope(&["dump", "--pid", &w.pid.to_string(), "--json"]);
    assert!(
        out.status.success(),
        "{label}: dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump: Value = serde_json::from_slice(&out.stdout).unwrap();
    let before: Vec<(i32, String, String)> = dump["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["tid"].as_i64().unwrap() as i32,
                t["name"].as_str().unwrap().to_string(),
                t["os_name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for t in dump["threads"].as_array().unwrap() {
        assert_eq!(t["python_name"], t["name"], "{label}: {t}");
    }
    // Namespace tid → host tid while the workload runs (in a container they differ).
    let host_of: std::collections::HashMap<i64, i32> = dump["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["ns_tid"].as_i64().unwrap(),
                t["tid"].as_i64().unwrap() as i32,
            )
        })
        .collect();

    let out_path = w.dir.join("run.esrec");
    let out_s = out_path.to_string_lossy().into_owned();
    let pid = w.pid.to_string();
    let rec = Recorder::start(&[
        "--rate",
        "199",
        "--duration",
        "60",
        "--pid",
        &pid,
        "-o",
        &out_s,
    ]);
    w.go();
    let (ok, _, err) = rec.wait();
    assert!(ok, "{label}: record failed: {err}");
    let truth = read_json(&w.dir.join("truth.json"));
    let r = enginescope::record::read_recording(&out_path).unwrap();
    let base = r.meta.start_mono_ns;
    let threads: Vec<TruthThread> = truth["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let ns = t["native_id"].as_i64().unwrap();
            let names: Vec<(u64, String)> = t["names"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| (n[0].as_u64().unwrap(), n[1].as_str().unwrap().to_string()))
                .collect();
            // Threads started inside the window (not in the dump) by their unique name.
            let host = host_of.get(&ns).copied().unwrap_or_else(|| {
                r.threads
                    .iter()
                    .find(|x| x.python_name.as_deref() == Some(names[0].1.as_str()))
                    .map_or(ns as i32, |x| x.tid)
            });
            TruthThread {
                host_tid: host,
                names,
                os_name: t["os_name"].as_str().unwrap().to_string(),
            }
        })
        .collect();

    // dump: every thread alive before the window, by its first name.
    for t in threads.iter().filter(|t| t.names[0].0 == 0) {
        let d = before
            .iter()
            .find(|d| d.0 == t.host_tid)
            .unwrap_or_else(|| panic!("{label}: tid {} not in dump: {before:?}", t.host_tid));
        assert_eq!(d.1, t.names[0].1, "{label}: dump name of {}", t.host_tid);
        assert_eq!(d.2, t.os_name, "{label}: dump OS name of {}", t.host_tid);
    }
    // Several threads share one OS name (the output writers, on every version).
    let writers_os: Vec<&str> = threads
        .iter()
        .filter(|t| t.names[0].1.starts_with("engine-output-writer-"))
        .map(|t| t.os_name.as_str())
        .collect();
    assert!(
        writers_os.len() == 3 && writers_os.iter().all(|n| *n == writers_os[0]),
        "{label}: the output writers share one OS name: {writers_os:?}"
    );

    // The recording: names as they changed.
    for t in &threads {
        let recs: Vec<&enginescope::record::ThreadInfo> = r
            .threads
            .iter()
            .filter(|x| x.pid == w.pid && x.tid == t.host_tid)
            .collect();
        let last = recs
            .last()
            .unwrap_or_else(|| panic!("{label}: no thread record for {}", t.host_tid));
        let final_name = &t.names.last().unwrap().1;
        assert_eq!(
            last.python_name.as_deref(),
            Some(final_name.as_str()),
            "{label}: final name of {}: {recs:?}",
            t.host_tid
        );
        assert_eq!(last.name, t.os_name, "{label}: OS name of {}", t.host_tid);
        for (at, name) in &t.names {
            let first = recs
                .iter()
                .find(|x| x.python_name.as_deref() == Some(name.as_str()))
                .unwrap_or_else(|| panic!("{label}: no record named {name}: {recs:?}"));
            if *at > base {
                let at_rec = at - base;
                assert!(
                    first.t_ns + 50_000_000 >= at_rec && first.t_ns <= at_rec + PICKED_UP_NS,
                    "{label}: {name} recorded at {:.3} s, given at {:.3} s",
                    first.t_ns as f64 / 1e9,
                    at_rec as f64 / 1e9
                );
            }
        }
    }
    assert!(
        threads.iter().any(|t| t.names.len() == 2) && threads.iter().any(|t| t.names[0].0 > 0),
        "{label}: the workload renamed a thread and started late ones"
    );

    // The report.
    let o = enginescope(&["report", &out_s, "--format", "json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rep: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = rep["threads"].as_array().unwrap();
    for t in &threads {
        let Some(row) = rows
            .iter()
            .find(|x| x["tid"].as_i64() == Some(i64::from(t.host_tid)))
        else {
            continue; // no sample and no off-CPU time: not in the table
        };
        assert_eq!(
            row["name"].as_str().unwrap(),
            t.names.last().unwrap().1,
            "{label}: report name of {}",
            t.host_tid
        );
        assert_eq!(row["os_name"].as_str().unwrap(), t.os_name, "{label}");
    }
    let named: Vec<&str> = rows.iter().filter_map(|x| x["name"].as_str()).collect();
    for n in [
        "vllm-aux-output-writer",
        "vllm-step-launcher",
        "late-joiner-0",
    ] {
        assert!(named.contains(&n), "{label}: {n} in the report: {named:?}");
    }
    // GIL blame: the launcher's largest wait is on the writer, both by their Python names.
    let pairs = rep["gil_blocking_pairs"].as_array().unwrap();
    let launcher = pairs
        .iter()
        .filter(|p| p["waiter_name"] == "vllm-step-launcher")
        .max_by(|a, b| {
            a["wait_s"]
                .as_f64()
                .unwrap()
                .total_cmp(&b["wait_s"].as_f64().unwrap())
        })
        .unwrap_or_else(|| panic!("{label}: no GIL wait of the launcher: {pairs:?}"));
    assert_eq!(
        launcher["holder_name"], "vllm-aux-output-writer",
        "{label}: {launcher}"
    );
    eprintln!(
        "{label}: {} threads named; launcher waited {:.3} s on {}",
        threads.len(),
        launcher["wait_s"].as_f64().unwrap(),
        launcher["holder_name"]
    );
}

#[test]
fn names_pyenv_310() {
    check("pyenv-3.10");
}

#[test]
fn names_pyenv_311() {
    check("pyenv-3.11");
}

#[test]
fn names_pyenv_312() {
    check("pyenv-3.12");
}

#[test]
fn names_pyenv_313() {
    check("pyenv-3.13");
}

#[test]
fn names_host_311() {
    check("host-3.11");
}

#[test]
fn names_sid_313() {
    check("sid-3.13");
}

#[test]
fn names_sid_314() {
    check("sid-3.14");
}

#[test]
fn names_sid_315() {
    check("sid-3.15");
}
