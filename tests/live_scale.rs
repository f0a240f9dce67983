//! Scale (issue 25): many targets in one recording. Its own test binary, so that the machine
//! is not shared with the timing-bound fault tests while 50 busy processes fill it (run beside
//! them, the exec'd target of `tests/live_faults.rs` was not attached again in its window).
//! Cost: ~20 s.

mod common;

use std::time::{Duration, Instant};

use common::cpu::*;
use common::*;

/// Scale (issue 25): 50 Python processes recorded at once by one `record --pid` list, all
/// busy (2 cores shared by 50): the recording ends on time, loses nothing, samples every
/// process, and the CPU it samples of them all matches what /proc says they used over the
/// window, in all and per process within its sampling error.
#[test]
fn fifty_processes_recorded_at_once() {
    let i = interp("pyenv-3.12");
    if !available(&i) {
        return;
    }
    // Each runs until the test kills it: starting fifty on two busy CPUs (each waits for the
    // one before it to be READY) took over the minute they used to run, and the first had
    // exited before the recorder attached to it ("process has exited").
    let starting = Instant::now();
    let targets: Vec<Workload> = (0..50)
        .map(|_| {
            start(
                &i,
                "cpu_bound.py",
                &["--threads", "1", "--duration", "3600"],
            )
        })
        .collect();
    eprintln!("fifty: started in {:?}", starting.elapsed());
    let pids: Vec<i32> = targets.iter().map(|w| w.pid).collect();
    let list = pids
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fifty.esrec");
    let out_s = out.to_string_lossy().into_owned();
    // Read from before the recording's window, which starts after the command.
    let readings = CpuReadings::start_many(&pids);
    let began = Instant::now();
    let rec = Recorder::start(&[
        "--pid",
        &list,
        "--duration",
        "5",
        "--rate",
        "499",
        "-o",
        &out_s,
    ]);
    let steal0 = steal_s();
    let (ok, _, err) = rec.wait();
    let stolen = steal_s() - steal0;
    let took = began.elapsed();
    assert!(ok, "record failed: {err}");
    assert!(
        took < Duration::from_secs(15),
        "record took {took:?} for 5 s"
    );
    let r = read_whole(&out);
    let truth = readings.over_window_each(&r);
    let sampled: Vec<f64> = pids.iter().map(|&p| sampled_s(&r, p)).collect();
    let (got, want): (f64, f64) = (sampled.iter().sum(), truth.iter().sum());
    eprintln!(
        "fifty: record took {took:?}; {got:.2} s sampled on CPU of 50 processes, /proc says {want:.2} s; per process {:.3}-{:.3} s sampled, {:.3}-{:.3} s used; the hypervisor stole {stolen:.2} s of both CPUs meanwhile",
        sampled.iter().cloned().fold(f64::INFINITY, f64::min),
        sampled.iter().cloned().fold(0.0, f64::max),
        truth.iter().cloned().fold(f64::INFINITY, f64::min),
        truth.iter().cloned().fold(0.0, f64::max),
    );
    assert!(
        (got - want).abs() <= 0.05 * want,
        "{got:.2} s sampled against {want:.2} s used"
    );
    // Each process: its samples are a count, with a Poisson error of sqrt(n) samples; within
    // four of those (and 2 ticks of /proc's clock) of its own CPU time.
    let tick = 2.0 / 100.0;
    for ((p, s), t) in pids.iter().zip(&sampled).zip(&truth) {
        let n = (s * 499.0).max(1.0);
        let err = 4.0 * n.sqrt() / 499.0 + tick;
        assert!(
            (s - t).abs() <= err,
            "process {p}: {s:.3} s sampled against {t:.3} s used (allowed {err:.3})"
        );
    }
}
