//! Targets that misbehave while recorded (issue 25), four at once in one `record`: a healthy
//! one (the yardstick), one frozen with SIGSTOP for 1.5 s in the middle, one that exits, one
//! that `exec`s a new Python. enginescope must neither hang nor fail: the recording ends on
//! time and whole, says the exiting target went, attaches again to the one that exec'd (its new
//! program's Python read), takes no sample of the frozen one while it is stopped, and the
//! healthy target's samples match the CPU time it really used over the window
//! (from /proc, as its own truth). And scale: 50 busy processes in one recording. Cost: ~25 s.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// A process's user + system CPU time, ns (/proc/PID/stat, in clock ticks).
fn cpu_ns(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the command.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory arguments.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    ticks * 1_000_000_000 / hz
}

/// Processes' CPU times read every 20 ms on the wall clock (a recording's window is on it
/// too), until [`CpuReadings::over_window`].
struct CpuReadings {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(u64, Vec<u64>)>>,
}

impl CpuReadings {
    fn start(pid: i32) -> Self {
        Self::start_many(&[pid])
    }

    fn start_many(pids: &[i32]) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let pids = pids.to_vec();
        let thread = std::thread::spawn(move || {
            let mut v = Vec::new();
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                v.push((unix_now_ns(), pids.iter().map(|&p| cpu_ns(p)).collect()));
                std::thread::sleep(Duration::from_millis(20));
            }
            v
        });
        CpuReadings { stop, thread }
    }

    /// The CPU seconds the (first) process used over the recording's window.
    fn over_window(self, r: &enginescope::record::Recording) -> f64 {
        self.over_window_each(r)[0]
    }

    /// The CPU seconds each process used over the recording's window, from the readings at
    /// or just before its two ends.
    fn over_window_each(self, r: &enginescope::record::Recording) -> Vec<f64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let readings = self.thread.join().unwrap();
        let start = (r.meta.start_unix_s * 1e9) as u64;
        let end = start + r.end.as_ref().map_or(0, |e| e.duration_ns);
        let at = |t: u64| {
            readings
                .iter()
                .rev()
                .find(|(at, _)| *at <= t)
                .or(readings.first())
                .map(|r| r.1.clone())
                .unwrap_or_default()
        };
        let (a, b) = (at(start), at(end));
        a.iter()
            .zip(&b)
            .map(|(x, y)| y.saturating_sub(*x) as f64 / 1e9)
            .collect()
    }
}

/// CPU seconds sampled of process `pid` (each sample stands for its weight).
fn sampled_s(r: &enginescope::record::Recording, pid: i32) -> f64 {
    r.samples
        .iter()
        .filter(|s| s.pid == pid)
        .map(|s| s.weight_ns as f64)
        .sum::<f64>()
        / 1e9
}

fn unix_now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

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
    let readings = CpuReadings::start(healthy.pid);
    // The fault: 1 s into sampling the frozen target stops for 1.5 s.
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: kill(2) on a process we started.
    unsafe { libc::kill(frozen.pid, libc::SIGSTOP) };
    let stopped_at = unix_now_ns();
    std::thread::sleep(Duration::from_millis(1500));
    let resumed_at = unix_now_ns();
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
    let readings = CpuReadings::start(w.pid);
    let (ok, _, err) = rec.wait();
    let took = began.elapsed();
    assert!(ok, "record failed: {err}");
    assert!(took < Duration::from_secs(12), "record took {took:?}");
    let r = enginescope::record::read_recording(&out).unwrap();
    assert!(!r.truncated);
    assert_eq!(
        r.end.as_ref().map(|e| e.reason.as_str()),
        Some("duration reached")
    );
    let lost = r
        .counters
        .get("bpf_ringbuf_full_lost")
        .copied()
        .unwrap_or(0);
    assert_eq!(lost, 0, "events lost to a full ring");
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
    let targets: Vec<Workload> = (0..50)
        .map(|_| start(&i, "cpu_bound.py", &["--threads", "1", "--duration", "60"]))
        .collect();
    let pids: Vec<i32> = targets.iter().map(|w| w.pid).collect();
    let list = pids
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fifty.esrec");
    let out_s = out.to_string_lossy().into_owned();
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
    let readings = CpuReadings::start_many(&pids);
    let (ok, _, err) = rec.wait();
    let took = began.elapsed();
    assert!(ok, "record failed: {err}");
    assert!(
        took < Duration::from_secs(15),
        "record took {took:?} for 5 s"
    );
    let r = enginescope::record::read_recording(&out).unwrap();
    assert!(!r.truncated);
    assert_eq!(
        r.end.as_ref().map(|e| e.reason.as_str()),
        Some("duration reached")
    );
    let lost = r
        .counters
        .get("bpf_ringbuf_full_lost")
        .copied()
        .unwrap_or(0);
    assert_eq!(lost, 0, "events lost to a full ring");
    let truth = readings.over_window_each(&r);
    let sampled: Vec<f64> = pids.iter().map(|&p| sampled_s(&r, p)).collect();
    let (got, want): (f64, f64) = (sampled.iter().sum(), truth.iter().sum());
    eprintln!(
        "fifty: {got:.2} s sampled on CPU of 50 processes, /proc says {want:.2} s; per process {:.3}-{:.3} s sampled, {:.3}-{:.3} s used",
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
