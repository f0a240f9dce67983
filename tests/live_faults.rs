//! Targets that misbehave while recorded (issue 25), four at once in one `record`: a healthy
//! one (the yardstick), one frozen with SIGSTOP for 1.5 s in the middle, one that exits, one
//! that `exec`s a new Python through a shell. enginescope must neither hang nor fail: the recording ends on
//! time and whole, says the exiting target went, attaches again to the one that exec'd (its new
//! program's Python read), takes no sample of the frozen one while it is stopped, and the
//! healthy target's samples match the CPU time it really used over the window
//! (from /proc, as its own truth). Cost: ~12 s.

mod common;

use std::time::{Duration, Instant};

use common::cpu::*;
use common::*;

#[test]
fn frozen_exiting_and_execing_targets_leave_the_rest_whole() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let healthy = start(&i, "cpu_bound.py", &["--threads", "1", "--duration", "60"]);
    let frozen = start(&i, "cpu_bound.py", &["--threads", "1", "--duration", "60"]);
    let exiting = start(&i, "faults.py", &["--exit", "--after", "2"]);
    let execing = start(&i, "faults.py", &["--exec", "--after", "2", "--for", "8"]);
    let pids = format!(
        "{},{},{},{}",
        healthy.pid, frozen.pid, exiting.pid, execing.pid
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("faults.esrec");
    let out_s = out.to_string_lossy().into_owned();
    // Read from before the recording's window, which starts after the command.
    let readings = CpuReadings::start(healthy.pid);
    let began = Instant::now();
    let rec = Recorder::start(&[
        "--pid",
        &pids,
        "--duration",
        "5",
        "--rate",
        "199",
        "-o",
        &out_s,
    ]);
    // The fault: 1 s into sampling the frozen target stops for 1.5 s.
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: kill(2) on a process we started.
    unsafe { libc::kill(frozen.pid, libc::SIGSTOP) };
    let stopped_at = unix_now_ns();
    std::thread::sleep(Duration::from_millis(1500));
    let resumed_at = unix_now_ns();
    // SAFETY: kill(2) with plain integers.
    unsafe { libc::kill(frozen.pid, libc::SIGCONT) };
    let (ok, _, err) = rec.wait();
    let took = began.elapsed();
    assert!(ok, "record failed: {err}");
    assert!(
        took < Duration::from_secs(15),
        "record took {took:?} for a 5 s window"
    );
    assert!(
        err.contains(&format!("process {} exited", exiting.pid)),
        "{err}"
    );
    let r = enginescope::record::read_recording(&out).unwrap();
    assert!(!r.truncated);
    let end = r.end.as_ref().expect("an end record");
    assert_eq!(end.reason, "duration reached");
    // The healthy target: its samples against the CPU time it used. The recorder's start and
    // end lie a little outside the window; each sample stands for its weight.
    let sampled = sampled_s(&r, healthy.pid);
    let truth_s = readings.over_window(&r);
    eprintln!("healthy: {sampled:.2} s sampled on CPU; /proc says {truth_s:.2} s");
    assert!(
        (sampled - truth_s).abs() <= 0.1 * truth_s + 0.05,
        "healthy target: {sampled:.2} s sampled against {truth_s:.2} s used"
    );
    let start_unix_ns = (r.meta.start_unix_s * 1e9) as u64;
    // The frozen target: nothing sampled while it was stopped (50 ms of margin each side for
    // the clocks and the signal's delivery), and sampled again after.
    let at = |s: &enginescope::record::Sample| start_unix_ns + s.t_ns;
    let in_stop = r
        .samples
        .iter()
        .filter(|s| s.pid == frozen.pid)
        .filter(|s| at(s) > stopped_at + 50_000_000 && at(s) + 50_000_000 < resumed_at)
        .count();
    assert_eq!(
        in_stop, 0,
        "samples of the frozen target while it was stopped"
    );
    let after = r
        .samples
        .iter()
        .filter(|s| s.pid == frozen.pid && at(s) > resumed_at + 100_000_000)
        .count();
    assert!(
        after > 20,
        "{after} samples of the frozen target after SIGCONT"
    );
    // The target that exec'd: attached again, its new program's Python read (`after_exec`).
    assert!(
        err.contains(&format!("attached to exec'd process {}", execing.pid)),
        "{err}"
    );
    assert_eq!(r.counters.get("targets_reattached_after_exec"), Some(&1));
    let in_new_image = r
        .samples
        .iter()
        .filter(|s| s.pid == execing.pid)
        .filter(|s| {
            r.stacks[s.stack as usize]
                .iter()
                .any(|&f| r.frames[f as usize].function == "after_exec")
        })
        .count();
    assert!(
        in_new_image > 20,
        "{in_new_image} samples in the exec'd program's after_exec()"
    );
    // And the one that exited, up to its exit.
    let last_exiting = r
        .samples
        .iter()
        .filter(|s| s.pid == exiting.pid)
        .map(at)
        .max()
        .unwrap_or(0);
    assert!(last_exiting > 0, "no sample of the exiting target");
}

/// A target starting 1,000 short-lived threads a second (10 at a time, each living well under
/// a millisecond) while recorded for 4 s: the recording ends on time and whole, loses no event
/// to a full ring, and samples every CPU second the process spends, whichever thread spends
/// it, against /proc over the window; thread-state reads that lose the race with a thread's
/// exit are counted, not fatal.
#[test]
fn a_thousand_threads_a_second_do_not_stall_the_recording() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    let w = start(&i, "faults.py", &["--churn", "1000", "--for", "30"]);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("churn.esrec");
    let out_s = out.to_string_lossy().into_owned();
    let pid = w.pid.to_string();
    // Read from before the recording's window, which starts after the command.
    let readings = CpuReadings::start(w.pid);
    let began = Instant::now();
    // 999 Hz: the process spends ~0.3 s of CPU in the window, ~300 samples' worth.
    let rec = Recorder::start(&[
        "--pid",
        &pid,
        "--duration",
        "4",
        "--rate",
        "999",
        "-o",
        &out_s,
    ]);
    let (ok, _, err) = rec.wait();
    let took = began.elapsed();
    assert!(ok, "record failed: {err}");
    assert!(took < Duration::from_secs(12), "record took {took:?}");
    let r = read_whole(&out);
    // Every CPU second of the process is sampled, whichever thread spent it (most threads
    // live under a millisecond: gone before any thread scan, their CPU must not be).
    let sampled = sampled_s(&r, w.pid);
    let truth_s = readings.over_window(&r);
    eprintln!(
        "churn: {sampled:.2} s sampled on CPU; /proc says {truth_s:.2} s; read errors: tstate {:?}, GIL {:?}",
        r.counters.get("bpf_read_tstate_errors"),
        r.counters.get("bpf_gil_read_errors")
    );
    assert!(
        (sampled - truth_s).abs() <= 0.1 * truth_s + 0.05,
        "{sampled:.2} s sampled against {truth_s:.2} s used"
    );
}
