//! The backend without BPF: poll each target from user space through the same CPython reader
//! (`process_vm_readv`), at a lower rate. A thread counts as on CPU at a tick when the kernel
//! reports it running (`/proc/PID/task/TID/stat` state `R`); between ticks where it was not
//! running, it was off CPU at the stack read then. Resolution is one tick.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::target::Target;
use super::{monotonic_ns, Pipeline};
use crate::record::{flags, ThreadInfo};

/// Highest rate the memory backend attempts; each tick reads every thread's stack.
pub const MAX_RATE_HZ: u32 = 250;

fn thread_state(pid: i32, tid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().next()?.chars().next()
}

pub fn run(
    targets: &mut [Target],
    pipe: &mut Pipeline,
    rate_hz: u32,
    deadline: Option<Instant>,
    stop: &AtomicBool,
) -> anyhow::Result<String> {
    let period = Duration::from_nanos(1_000_000_000 / rate_hz.max(1) as u64);
    let mut next = Instant::now();
    let mut known: HashMap<(i32, i32), String> = HashMap::new();
    let mut running_before: HashMap<(i32, i32), bool> = HashMap::new();
    let mut last_flush = Instant::now();
    loop {
        if stop.load(Ordering::SeqCst) {
            return Ok("stopped by signal".into());
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok("duration reached".into());
        }
        let mut any_alive = false;
        for t in targets.iter_mut() {
            let Ok(snap) = t.proc.snapshot() else {
                continue;
            };
            any_alive = true;
            let now = monotonic_ns();
            for th in snap.threads {
                let Some(tid) = th.tid else { continue };
                let key = (t.pid, tid);
                if known.get(&key) != Some(&th.name) {
                    known.insert(key, th.name.clone());
                    pipe.writer.thread(&ThreadInfo {
                        pid: t.pid,
                        tid,
                        name: th.name.clone(),
                        t_ns: now.saturating_sub(pipe.start_ns),
                    })?;
                }
                let stack = pipe.writer.intern_stack(&th.frames)?;
                let running = thread_state(t.pid, tid) == Some('R');
                let was = running_before.insert(key, running);
                if running {
                    if was == Some(false) {
                        pipe.switch_in(t.pid, tid, now)?;
                    }
                    let mut fl = 0;
                    if th.holds_gil {
                        fl |= flags::GIL;
                    }
                    if th.gc_collecting {
                        fl |= flags::GC;
                    }
                    if th.error.is_some() {
                        fl |= flags::PARTIAL;
                    }
                    pipe.sample(t.pid, tid, now, stack, fl)?;
                } else if was != Some(false) {
                    if was.is_none() {
                        pipe.initial_stack(t.pid, tid, stack);
                    } else {
                        pipe.switch_out(t.pid, tid, now, stack, false);
                    }
                }
            }
        }
        if !any_alive {
            return Ok("all targets exited".into());
        }
        if last_flush.elapsed() >= Duration::from_millis(200) {
            last_flush = Instant::now();
            pipe.writer.flush()?;
        }
        next += period;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
}
