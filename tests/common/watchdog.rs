//! A bound on how long a test waits for an enginescope process. A recorder that never ends
//! would otherwise hold the whole test run until CI's own timeout, which says nothing about
//! why (one such hang cost a CI run its 90 minutes). Past its limit the watchdog prints what
//! each of the process's threads is doing (state, wait channel, kernel stack: the first things
//! to read for a hang) and kills it, so that the waiting test fails with that in its output.
//! The limit is far beyond any test's own run: it never fires on a slow machine, only on a
//! process that stopped making progress.

use std::sync::mpsc;
use std::time::Duration;

/// The limit: 900 s, or `ES_TEST_HANG_S` seconds.
fn limit() -> Duration {
    let s = std::env::var("ES_TEST_HANG_S")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(900);
    Duration::from_secs(s)
}

/// Disarmed when dropped.
pub struct Watchdog {
    _disarm: mpsc::Sender<()>,
}

/// Watch `pid` (`what` names it in the message): past the limit, print its threads' state and
/// kernel stacks, then SIGKILL it.
pub fn watch(pid: u32, what: &str) -> Watchdog {
    let (tx, rx) = mpsc::channel::<()>();
    let what = what.to_string();
    let limit = limit();
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
            eprintln!(
                "watchdog: {what} (pid {pid}) still running after {limit:?}; its threads:\n{}",
                threads_report(pid)
            );
            // SAFETY: kill(2) on a process this test started.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
    });
    Watchdog { _disarm: tx }
}

/// Each thread's name, state, wait channel and kernel stack (`/proc/PID/task/TID/...`).
fn threads_report(pid: u32) -> String {
    let mut out = String::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("  (/proc/{pid}/task unreadable: the process is gone)\n");
    };
    let mut tids: Vec<String> = tasks
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    tids.sort();
    for tid in tids {
        let dir = format!("/proc/{pid}/task/{tid}");
        let read = |f: &str| std::fs::read_to_string(format!("{dir}/{f}")).unwrap_or_default();
        let comm = read("comm");
        let stat = read("stat");
        // The state is the field after the parenthesised name.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?");
        out.push_str(&format!(
            "  tid {tid} {} state {state} wchan {}\n",
            comm.trim(),
            read("wchan").trim()
        ));
        for line in read("stack").lines() {
            out.push_str(&format!("    {line}\n"));
        }
    }
    out
}
