//! A process's CPU time from /proc, read on the wall clock a recording's window is on, and a
//! recording's samples and wholeness against it (tests/live_faults.rs, tests/live_scale.rs).

use std::time::Duration;

/// A process's user + system CPU time, ns (/proc/PID/stat, in clock ticks).
pub fn cpu_ns(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the command.
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory arguments.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    ticks * 1_000_000_000 / hz
}

/// The machine's steal time so far, all CPUs together, s (/proc/stat's `cpu` line, ticks): time
/// the hypervisor ran something else on our vCPUs. A thread's /proc CPU time leaves it out,
/// and a guest's scheduler sees none of it (no switch), so an off-CPU figure from the kernel's
/// switches and one from /proc CPU time differ by up to the steal in between.
pub fn steal_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: u64 = stat
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(8))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no memory arguments.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz
}

/// Processes' CPU times read every 20 ms on the wall clock (a recording's window is on it
/// too), until [`CpuReadings::over_window`]. The reading thread asks for real-time priority (the
/// tests run as root): among fifty busy processes on two CPUs a plain thread's readings came
/// late, and a window's end read from one taken long before it counted the processes' CPU time
/// short (6.76 s used against 8.57 s sampled in one CI run).
pub struct CpuReadings {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(u64, Vec<u64>)>>,
}

impl CpuReadings {
    pub fn start(pid: i32) -> Self {
        Self::start_many(&[pid])
    }

    /// Returns once the first reading is taken (at real-time priority where allowed): a
    /// window that starts after this call has a reading before it.
    pub fn start_many(pids: &[i32]) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let pids = pids.to_vec();
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let param = libc::sched_param { sched_priority: 1 };
            // SAFETY: the calling thread, a parameter on the stack; refused without privilege,
            // and the readings go on at normal priority (their gaps are checked when used).
            unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
            let mut v = Vec::new();
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                v.push((unix_now_ns(), pids.iter().map(|&p| cpu_ns(p)).collect()));
                if v.len() == 1 {
                    let _ = first_tx.send(());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            v
        });
        first_rx
            .recv()
            .expect("the CPU reading thread ended before its first reading");
        CpuReadings { stop, thread }
    }

    /// The CPU seconds the (first) process used over the recording's window.
    pub fn over_window(self, r: &enginescope::record::Recording) -> f64 {
        self.over_window_each(r)[0]
    }

    /// The CPU seconds each process used over the recording's window, from the readings on
    /// either side of its two ends.
    pub fn over_window_each(self, r: &enginescope::record::Recording) -> Vec<f64> {
        let start = (r.meta.start_unix_s * 1e9) as u64;
        let end = start + r.end.as_ref().map_or(0, |e| e.duration_ns);
        self.between(start, end)
    }

    /// The CPU seconds each process used over `[start, end)` (unix ns): each end's CPU time
    /// interpolated between the readings on either side of it, which must be at most 200 ms
    /// apart (a reading thread starved that long would make the truth up).
    pub fn between(self, start: u64, end: u64) -> Vec<f64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let readings = self.thread.join().unwrap();
        let at = |t: u64| -> Vec<f64> {
            let after = readings.iter().position(|(at, _)| *at >= t);
            let (a, b) = match after {
                Some(0) | None => {
                    let r = if after.is_none() {
                        readings.last()
                    } else {
                        readings.first()
                    };
                    let r = r.expect("no CPU readings");
                    let off = r.0.abs_diff(t);
                    assert!(
                        off <= 200_000_000,
                        "no CPU reading within 200 ms of {t} (nearest {} ms away)",
                        off / 1_000_000
                    );
                    return r.1.iter().map(|&x| x as f64).collect();
                }
                Some(i) => (&readings[i - 1], &readings[i]),
            };
            let gap = b.0 - a.0;
            assert!(
                gap <= 200_000_000,
                "CPU readings {} ms apart around {t}: the reading thread was starved",
                gap / 1_000_000
            );
            let f = if gap == 0 {
                0.0
            } else {
                (t - a.0) as f64 / gap as f64
            };
            a.1.iter()
                .zip(&b.1)
                .map(|(&x, &y)| x as f64 + f * (y as f64 - x as f64))
                .collect()
        };
        let (a, b) = (at(start), at(end));
        a.iter()
            .zip(&b)
            .map(|(x, y)| (y - x).max(0.0) / 1e9)
            .collect()
    }
}

/// CPU seconds sampled of process `pid` (each sample stands for its weight).
pub fn sampled_s(r: &enginescope::record::Recording, pid: i32) -> f64 {
    r.samples
        .iter()
        .filter(|s| s.pid == pid)
        .map(|s| s.weight_ns as f64)
        .sum::<f64>()
        / 1e9
}

/// The recording at `path`, checked whole: not cut short, ended by its duration, no event
/// lost to a full ring.
pub fn read_whole(path: &std::path::Path) -> enginescope::record::Recording {
    let r = enginescope::record::read_recording(path).unwrap();
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
    r
}

pub fn unix_now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}
