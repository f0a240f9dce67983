//! `enginescope dump` against every interpreter of the matrix: each thread's stack must equal
//! the workload's own `sys._current_frames()` snapshot exactly (function, file, line, every
//! frame), and the thread ids, names, GIL holder and GC flag must be right.

mod common;

use common::*;
use serde_json::Value;

fn check_dump(label: &str) {
    check_dump_with(label, 4, 0);
}

/// `threads` plain workers besides the named threads, each parked `depth` frames deep (0: one
/// frame); every thread's stack exact however many and however deep (issue 25's scale).
fn check_dump_with(label: &str, threads: usize, depth: usize) {
    let i = interp(label);
    if !available(&i) {
        return;
    }
    let (threads, depth) = (threads.to_string(), depth.to_string());
    let w = start(
        &i,
        "stacks.py",
        &[
            "--truth",
            "{dir}/truth.json",
            "--threads",
            &threads,
            "--depth",
            &depth,
            "--spin",
        ],
    );
    let out = enginescope(&["dump", "--pid", &w.pid.to_string(), "--json"]);
    assert!(
        out.status.success(),
        "{label}: dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump: Value = serde_json::from_slice(&out.stdout).expect("dump --json is JSON");
    let truth = read_json(&w.dir.join("truth.json"));

    let version = truth["version"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    assert_eq!(
        dump["python"]["version"].as_str().unwrap(),
        version,
        "{label}: version"
    );
    assert_eq!(dump["pid"].as_i64().unwrap(), w.pid as i64);

    let dthreads = dump["threads"].as_array().unwrap();
    let tthreads = truth["threads"].as_array().unwrap();
    assert_eq!(dthreads.len(), tthreads.len(), "{label}: thread count");
    let mut frames_checked = 0;
    for t in tthreads {
        let name = t["name"].as_str().unwrap();
        let ns_tid = t["native_id"].as_i64().unwrap() as i32;
        let host =
            host_tid(w.pid, ns_tid).unwrap_or_else(|| panic!("{label}: no host tid for {ns_tid}"));
        let d = dthreads
            .iter()
            .find(|d| d["tid"].as_i64() == Some(host as i64))
            .unwrap_or_else(|| panic!("{label}: thread {name} (tid {host}) missing from dump"));
        let comm = std::fs::read_to_string(format!("/proc/{}/task/{host}/comm", w.pid)).unwrap();
        assert_eq!(
            d["os_name"].as_str().unwrap(),
            comm.trim_end(),
            "{label}: comm of {host}"
        );
        assert_eq!(
            d["python_name"], d["name"],
            "{label}: Python name of {host}"
        );
        assert_eq!(d["name"].as_str().unwrap(), name, "{label}: thread name");
        assert_eq!(
            d["holds_gil"], t["holds_gil"],
            "{label}: holds_gil of {name}"
        );
        assert_eq!(
            d["gc_collecting"], t["gc_collecting"],
            "{label}: gc_collecting of {name}"
        );
        assert!(d.get("error").is_none(), "{label}: {name}: {}", d["error"]);
        let want: Vec<_> = t["frames"].as_array().unwrap().iter().collect();
        let got: Vec<_> = d["frames"].as_array().unwrap().iter().collect();
        if want != got {
            let fmt = |v: &[&Value]| {
                v.iter()
                    .map(|f| format!("  {} {}:{}", f["function"], f["file"], f["line"]))
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            panic!(
                "{label}: stack of {name} differs\nexpected:\n{}\ngot:\n{}",
                fmt(&want),
                fmt(&got)
            );
        }
        frames_checked += want.len();
    }
    eprintln!(
        "{label}: {} threads, {frames_checked} frames, all exact; dump took {:.1} ms",
        tthreads.len(),
        dump["elapsed_ms"].as_f64().unwrap_or(f64::NAN)
    );
}

crate::interpreter_tests!(check_dump {
    exact_pyenv_3_10: ("pyenv-3.10"),
    exact_pyenv_3_11: ("pyenv-3.11"),
    exact_pyenv_3_12: ("pyenv-3.12"),
    exact_pyenv_3_13: ("pyenv-3.13"),
    exact_host_3_11_stripped: ("host-3.11"),
    exact_sid_3_13_container: ("sid-3.13"),
    exact_sid_3_14_container: ("sid-3.14"),
    exact_sid_3_15_container: ("sid-3.15"),
});

crate::interpreter_tests!(check_dump_with {
    // Scale (issue 25): a process of 1,000 threads, and 200 threads 500 frames deep.
    exact_1000_threads_pyenv_3_12: ("pyenv-3.12", 1000, 0),
    exact_1000_threads_sid_3_14_container: ("sid-3.14", 1000, 0),
    exact_200_threads_500_deep_pyenv_3_12: ("pyenv-3.12", 200, 500),
    exact_200_threads_500_deep_sid_3_14_container: ("sid-3.14", 200, 500),
});
